"""The dense teacher of ``training.distill_weight``: its weights read from ``training.init_from``.

The teacher is the model the adaptation starts from, run with dense attention
(``models.registry.teacher_config``: the student's shards without the DSA offset heads). It is
never trained and never saved: a fresh parameter store (a new run, or a ``--resume``) reads it
again from ``training.init_from`` (a checkpoint, a safetensors file or folder, a diffusers Wan
folder: every source ``--init-from`` reads), shard by shard, into its frozen ``teacher``
segments in the compute dtype. Every weight of the dense model must be in the source; a source
that also holds offset heads (a DSA checkpoint) gives its other weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from megaslide_ray.config import Config
from megaslide_ray.models.registry import num_experts, teacher_config
from megaslide_ray.state.checkpoint import CheckpointReader, is_checkpoint_dir
from megaslide_ray.state.pretrained_io import (
    Entry,
    PretrainedMismatchError,
    index_source,
    model_names,
    read_source,
    shard_prefix,
)

log = logging.getLogger(__name__)


def check_teacher(cfg: Config, path: str | Path) -> dict[str, Entry]:
    """The source's index, once every weight of ``cfg``'s dense teacher is in it with its shape;
    else one ``PretrainedMismatchError`` listing what is missing or misshapen and what to do."""
    tcfg = teacher_config(cfg)
    try:
        source = index_source(path, tcfg)
    except FileNotFoundError:
        raise PretrainedMismatchError(
            f"training.distill_weight={cfg.training.distill_weight}: the dense teacher is read from "
            f"training.init_from={str(path)!r}, which does not exist (a resumed run reads it again); put the "
            f"weights back there, or set training.distill_weight=0") from None
    model = model_names(tcfg)
    missing = [n for n in model if n not in source]
    wrong = [n for n in model if n in source and source[n].shape != model[n][0]]
    if missing or wrong:
        lines = [f"training.distill_weight={cfg.training.distill_weight}: training.init_from={str(path)!r} is not "
                 f"the dense teacher of this model (attention.kind dense, preset {cfg.preset}, depth "
                 f"{cfg.model.depth}, hidden size {cfg.model.hidden_size})"]
        if missing:
            lines.append(f"  missing from the source ({len(missing)}): " + ", ".join(missing[:8])
                         + (" ..." if len(missing) > 8 else ""))
        if wrong:
            lines += [f"  wrong shape: {n}: source {list(source[n].shape)}, model {list(model[n][0])}" for n in wrong]
        lines.append("Give the pretrained dense model the run adapts as --init-from, or set training.distill_weight=0.")
        raise PretrainedMismatchError("\n".join(lines))
    return source


@torch.no_grad()
def load_teacher_into(store, path: str | Path) -> None:
    """Fill ``store.teacher_seg`` (one flat segment per shard, ``store.teacher_layouts``, in the
    compute dtype) from ``path``, shard by shard through one fp32 buffer of the shard's size."""
    tcfg = teacher_config(store.cfg)
    source = check_teacher(store.cfg, path)
    model = model_names(tcfg)
    ckpt = CheckpointReader(path) if is_checkpoint_dir(path) else None
    n, arch, experts = len(store.teacher_layouts), tcfg.model.arch, num_experts(tcfg)
    try:
        for i, lay in enumerate(store.teacher_layouts):
            flat = torch.empty(lay.numel, dtype=torch.float32)
            views = lay.views(flat)
            prefix = shard_prefix(i, n, arch, experts)
            files: dict[str, list[str]] = {}
            for name, (_, shard, _) in model.items():
                if shard == i:
                    files.setdefault(source[name].file, []).append(name)
            for file, names in files.items():
                for name, t in zip(names, read_source(ckpt, file, [source[name] for name in names])):
                    views[name[len(prefix):]].copy_(t.reshape(source[name].shape).to(torch.float32))
            store.teacher_seg[i].copy_(flat)
            del flat, views
    finally:
        if ckpt is not None:
            ckpt.close()
    log.info("dense teacher of %d shards read from %s", n, path)
