"""The architectures ``model.arch`` selects from, and the calls that dispatch on it.

Each architecture has the same shard structure: shard 0 the input side, 1..L the blocks, L+1 the
head, each a module class built from the config (a block also from its index), an
``initialize_shard(module, seed, index)`` (deterministic per shard) in its module, and a
whole-model class with ``shards()`` and ``initialize_weights(seed)``. The rest of the system (the
parameter store, the compute actor, the planner, the baseline) calls the functions below and
never names an architecture.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn as nn

from megaslide_ray.config import Config
from megaslide_ray.models import videodit, wan
from megaslide_ray.models.attention import reset_temperatures


@dataclass(frozen=True)
class Architecture:
    module: ModuleType
    """Where its ``initialize_shard`` is."""
    model: type[nn.Module]
    """The whole model."""
    embed: type[nn.Module]
    """Shard 0: ``embed(cfg)``."""
    block: type[nn.Module]
    """Shards 1..L: ``block(cfg, index)``."""
    head: type[nn.Module]
    """Shard L+1: ``head(cfg)``."""


ARCHITECTURES: dict[str, Architecture] = {
    "videodit": Architecture(videodit, videodit.VideoDiT, videodit.InputEmbed, videodit.DiTBlock, videodit.FinalLayer),
    "wan": Architecture(wan, wan.WanTransformer, wan.WanEmbed, wan.WanBlock, wan.WanHead),
}
"""``model.arch`` -> its classes."""


def architecture(arch: str) -> Architecture:
    if arch not in ARCHITECTURES:
        raise ValueError(f"model.arch={arch!r} is not one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def build_shard(cfg: Config, index: int, device: str | torch.device = "cpu") -> nn.Module:
    """One shard module, alone (the store initialises a 105B model this way, a block at a time).
    With two experts (``num_experts``) shard ``index`` is shard ``index mod (depth + 2)`` of
    expert ``index // (depth + 2)``: both have the same modules."""
    arch, L = architecture(cfg.model.arch), cfg.model.depth
    if 0 <= index < num_shards(cfg):
        index %= L + 2
    with torch.device(device):
        if index == 0:
            return arch.embed(cfg)
        if index == L + 1:
            return arch.head(cfg)
        if 1 <= index <= L:
            return arch.block(cfg, index)
    raise IndexError(f"shard index {index} out of range 0..{L + 1}")


def num_experts(cfg: Config) -> int:
    """Transformers the store holds: 2 when both experts of a two-expert model train
    (``training.expert = both``), else 1."""
    return 2 if cfg.training.expert == "both" else 1


def expert_shards(cfg: Config) -> int:
    """Shards of one transformer: the input side, ``model.depth`` blocks and the head."""
    return cfg.model.depth + 2


def num_shards(cfg: Config) -> int:
    """Shards in the store: the input side, ``model.depth`` blocks and the head, of each expert
    (``num_experts``); expert e's shard i is shard ``e x (depth + 2) + i``."""
    return num_experts(cfg) * expert_shards(cfg)


def initialize_shard(module: nn.Module, seed: int, index: int) -> None:
    """Deterministic init of one shard from (seed, index) by its architecture's recipe (a shard
    module says its architecture in ``arch``; ``videodit`` when it does not); a learned attention
    temperature (``attention.learn_temperature``) starts at 0 in both."""
    architecture(getattr(module, "arch", "videodit")).module.initialize_shard(module, seed, index)
    reset_temperatures(module)


def param_count(cfg: Config) -> int:
    """Exact parameter count, from a model built on the meta device (no memory used)."""
    with torch.device("meta"):
        return sum(p.numel() for i in range(num_shards(cfg)) for p in build_shard(cfg, i, "meta").parameters())


def build_model(cfg: Config, seed: int | None = None, device: str = "cpu") -> nn.Module:
    """A whole, materialised model (for the in-process baseline and tests): ``VideoDiT``, or
    ``WanTransformer`` for ``model.arch = wan``; both have ``shards()``."""
    with torch.device(device):
        model = architecture(cfg.model.arch).model(cfg)
    model.initialize_weights(cfg.training.seed if seed is None else seed)
    return model


def distills(cfg: Config) -> bool:
    """Whether the run distils from a dense teacher (``training.distill_weight`` > 0)."""
    return cfg.training.distill_weight > 0


def teacher_config(cfg: Config) -> Config:
    """The config of the dense teacher ``training.distill_weight`` distils from: ``cfg`` with
    ``attention.kind = dense`` (its blocks have no offset heads; everything else, the token chunk
    included, is the student's), distillation off, and none of the student's own levers (no dense
    weights in its condition, no learned temperatures): the pretrained dense model as it is."""
    out = copy.deepcopy(cfg)
    a = out.attention
    a.kind, a.dense_blocks, a.dense_above_t, a.dense_warmup_steps, a.learn_temperature = "dense", (), 0.0, 0, False
    out.training.distill_weight = 0.0
    return out
