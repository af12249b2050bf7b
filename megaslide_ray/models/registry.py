"""The architectures ``model.arch`` selects from, and the calls that dispatch on it.

Each architecture is a module with the same shard interface: ``build_shard(cfg, index, device)``
(shard 0 the input side, 1..L the blocks, L+1 the head), ``initialize_shard(module, seed,
index)`` (deterministic per shard) and a whole-model class with ``shards()`` and
``initialize_weights(seed)``. The rest of the system (the parameter store, the compute actor,
the planner, the baseline) calls the functions below and never names an architecture.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn as nn

from megaslide_ray.config import Config
from megaslide_ray.models import videodit, wan

ARCHITECTURES: dict[str, tuple[ModuleType, type[nn.Module]]] = {
    "videodit": (videodit, videodit.VideoDiT),
    "wan": (wan, wan.WanTransformer),
}
"""``model.arch`` -> (the module with its shard functions, the whole-model class)."""


def architecture(arch: str) -> ModuleType:
    if arch not in ARCHITECTURES:
        raise ValueError(f"model.arch={arch!r} is not one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch][0]


def build_shard(cfg: Config, index: int, device: str | torch.device = "cpu") -> nn.Module:
    """One shard module, alone (the store initialises a 105B model this way, a block at a time)."""
    return architecture(cfg.model.arch).build_shard(cfg, index, device)


def num_shards(cfg: Config) -> int:
    """The input side, ``model.depth`` blocks and the head."""
    return cfg.model.depth + 2


def initialize_shard(module: nn.Module, seed: int, index: int) -> None:
    """Deterministic init of one shard from (seed, index) by its architecture's recipe (a shard
    module says its architecture in ``arch``; ``videodit`` when it does not)."""
    architecture(getattr(module, "arch", "videodit")).initialize_shard(module, seed, index)


def param_count(cfg: Config) -> int:
    """Exact parameter count, from a model built on the meta device (no memory used)."""
    with torch.device("meta"):
        return sum(p.numel() for i in range(num_shards(cfg)) for p in build_shard(cfg, i, "meta").parameters())


def build_model(cfg: Config, seed: int | None = None, device: str = "cpu") -> nn.Module:
    """A whole, materialised model (for the in-process baseline and tests): ``VideoDiT``, or
    ``WanTransformer`` for ``model.arch = wan``; both have ``shards()``."""
    with torch.device(device):
        model = ARCHITECTURES[cfg.model.arch][1](cfg)
    model.initialize_weights(cfg.training.seed if seed is None else seed)
    return model
