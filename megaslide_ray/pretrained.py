"""Pretrained weights in and out: ``--init-from`` and the standard-named export.

Sources ``--init-from`` accepts:

* one of our checkpoints (``RUN/checkpoints/step_N/``): each shard's ``master`` is taken (the
  fp32 weights; ``w`` is rebuilt from it), the moments are not;
* a ``.safetensors`` file, or a directory of them, with the names of
  ``VideoDiT(cfg).state_dict()``: ``embed.*``, ``blocks.{i}.*``, ``head.*``. Floating-point
  tensors of any dtype are accepted and converted to fp32.

Everything goes through safetensors (no pickle is ever loaded); our checkpoints are read through
``megaslide_ray.checkpoint``, which owns their format. Only file headers are read to
check a source (``check_pretrained``): every missing name, unexpected name and wrong shape is
listed in ONE error before any actor starts. Loading then streams shard by shard: one shard's
tensors are read straight into the store's ``master`` segment, so a 105B model never exists
whole in one process's memory. Moments start at zero and the step at 0.

``export_state_dict`` writes a checkpoint's weights back out under the standard names, one
file (``OUT.safetensors``) or one file per shard (``OUT/`` directory):

    python -m megaslide_ray.pretrained RUN/checkpoints/step_30 weights.safetensors
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megaslide_ray.checkpoint import CheckpointReader, is_checkpoint_dir
from megaslide_ray.config import Config
from megaslide_ray.model import build_shard, num_shards
from megaslide_ray.shards import ShardLayout

log = logging.getLogger(__name__)

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


class PretrainedMismatchError(ValueError):
    """The pretrained weights do not fit the configured model."""


def shard_prefix(index: int, shards: int) -> str:
    """Standard state-dict prefix of shard ``index`` in a model of ``shards`` shards."""
    if index == 0:
        return "embed."
    if index == shards - 1:
        return "head."
    return f"blocks.{index - 1}."


def model_names(cfg: Config) -> dict[str, tuple[tuple[int, ...], int, int]]:
    """Standard name -> (shape, shard, offset in the shard's flat buffer), from meta shards."""
    n = num_shards(cfg)
    out = {}
    for i in range(n):
        lay = ShardLayout.of(build_shard(cfg, i, "meta"), i)
        for name, shape, off in zip(lay.names, lay.shapes, lay.offsets):
            out[shard_prefix(i, n) + name] = (tuple(shape), i, off)
    return out


# ---------------------------------------------------------------------------------------------
# Sources: name -> where the tensor is, read from headers only
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: str
    file: str
    key: str              # tensor name inside the file (checkpoint sources: inside the shard)
    shard: int = -1       # checkpoint sources: the checkpoint shard that holds it


def index_source(path: str | Path) -> dict[str, Entry]:
    """Standard name -> Entry for every tensor the source holds."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--init-from {path}: no such file or directory")
    if is_checkpoint_dir(path):
        return _index_checkpoint(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise PretrainedMismatchError(f"--init-from {path}: a directory with no .safetensors files and no "
                                      f"state.json; give a .safetensors file, a directory of them, or a "
                                      f"checkpoint directory (RUN/checkpoints/step_N)")
    if path.is_file() and path.suffix != ".safetensors":
        raise PretrainedMismatchError(f"--init-from {path}: only .safetensors files are read (never pickled "
                                      f"formats such as .pt/.bin); convert the weights to safetensors first")
    out: dict[str, Entry] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if key in out:
                    raise PretrainedMismatchError(f"--init-from {path}: tensor {key} is in both {out[key].file} "
                                                  f"and {file}")
                out[key] = Entry(tuple(sl.get_shape()), sl.get_dtype(), str(file), key)
    return out


def _index_checkpoint(path: Path) -> dict[str, Entry]:
    try:
        ckpt = CheckpointReader(path)
    except FileNotFoundError as e:  # a shard file is missing
        raise PretrainedMismatchError(f"--init-from {path}: {e}") from None
    out: dict[str, Entry] = {}
    with ckpt:
        n = ckpt.num_shards
        for i in range(n):
            lay, dtype = ckpt.layout(i), ckpt.dtype(i, "master")
            for name, shape in zip(lay.names, lay.shapes):
                out[shard_prefix(i, n) + name] = Entry(tuple(shape), dtype, str(ckpt.file(i)), name, i)
    return out


# ---------------------------------------------------------------------------------------------
# Check and load
# ---------------------------------------------------------------------------------------------


def check_pretrained(cfg: Config, path: str | Path) -> dict[str, Entry]:
    """Compare the source's names and shapes with the model's; raise one error listing every
    mismatch. Returns the source's index."""
    source = index_source(path)
    model = model_names(cfg)
    missing = [n for n in model if n not in source]
    unexpected = [n for n in source if n not in model]
    wrong_shape = [n for n in model if n in source and source[n].shape != model[n][0]]
    not_float = [n for n in model if n in source and source[n].dtype not in FLOAT_DTYPES]
    if missing or unexpected or wrong_shape or not_float:
        fmt = lambda s: "[" + ", ".join(str(d) for d in s) + "]"  # noqa: E731
        lines = [f"--init-from {path} does not match the model (preset {cfg.preset}, depth {cfg.model.depth}, "
                 f"hidden size {cfg.model.hidden_size}): {len(source)} tensors in the source, {len(model)} in the "
                 f"model"]
        if missing:
            lines.append(f"  missing from the source ({len(missing)}):")
            lines += [f"    {n} {fmt(model[n][0])}" for n in missing]
        if unexpected:
            lines.append(f"  unexpected in the source ({len(unexpected)}):")
            lines += [f"    {n} {fmt(source[n].shape)}" for n in unexpected]
        if wrong_shape:
            lines.append(f"  wrong shape ({len(wrong_shape)}):")
            lines += [f"    {n}: source {fmt(source[n].shape)}, model {fmt(model[n][0])}" for n in wrong_shape]
        if not_float:
            lines.append(f"  not floating point ({len(not_float)}):")
            lines += [f"    {n}: {source[n].dtype}" for n in not_float]
        lines.append("Use weights of the same model configuration (a run's config.toml: --config), or set "
                     "--model.* to match the weights.")
        raise PretrainedMismatchError("\n".join(lines))
    return source


@torch.no_grad()
def load_pretrained_into(store, path: str | Path) -> None:
    """Fill a fresh store's shards from ``path``: master and w from the weights, m = v = 0,
    versions 0. Shard by shard; each file is opened once per shard that needs it."""
    source = check_pretrained(store.cfg, path)
    model = model_names(store.cfg)
    by_shard: dict[int, list[str]] = {}
    for name, (_, shard, _) in model.items():
        by_shard.setdefault(shard, []).append(name)
    ckpt = CheckpointReader(path) if is_checkpoint_dir(path) else None
    for i, lay in enumerate(store.layouts):
        views = lay.views(store.seg[i]["master"])
        prefix = shard_prefix(i, store.n)
        files: dict[str, list[str]] = {}
        for name in by_shard[i]:
            files.setdefault(source[name].file, []).append(name)
        for file, names in files.items():
            for name, t in zip(names, _read_source(ckpt, file, [source[name] for name in names])):
                views[name[len(prefix):]].copy_(t.reshape(source[name].shape).to(torch.float32))
        store.seg[i]["w"].copy_(store.seg[i]["master"])
        store.seg[i]["m"].zero_()
        store.seg[i]["v"].zero_()
    if ckpt is not None:
        ckpt.close()
    store.versions.fill_(0)
    log.info("initialised %d shards from %s", store.n, path)


def _read_source(ckpt: CheckpointReader | None, file: str, entries: list[Entry]):
    """The tensors of ``entries``, all in ``file``, one at a time. From our checkpoint (``ckpt``)
    one shard's flat ``master`` is read once and served by parameter name."""
    if ckpt is not None:
        tensors = ckpt.tensors(entries[0].shard, "master")
        for e in entries:
            yield tensors[e.key]
        return
    with safe_open(file, framework="pt") as f:
        for e in entries:
            yield f.get_tensor(e.key)


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


def export_state_dict(checkpoint: str | Path, out: str | Path, kind: str = "master",
                      dtype: torch.dtype | None = None) -> list[str]:
    """Write a checkpoint's ``kind`` tensors (``master`` or ``w``) under the standard model
    names: one file if ``out`` ends in ``.safetensors``, else one file per shard in the
    directory ``out``. Returns the files written."""
    checkpoint, out = Path(checkpoint), Path(out)
    if kind not in ("master", "w"):
        raise ValueError(f"kind={kind!r}; use 'master' or 'w'")
    ckpt = CheckpointReader(checkpoint)
    n = ckpt.num_shards
    one_file = out.suffix == ".safetensors"
    if not one_file:
        out.mkdir(parents=True, exist_ok=True)
    written, together = [], {}
    for i in range(n):
        tensors = {shard_prefix(i, n) + name: (t.to(dtype) if dtype else t).clone()
                   for name, t in ckpt.tensors(i, kind).items()}
        if one_file:
            together.update(tensors)
        else:
            path = out / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            save_file(tensors, str(path), metadata={"format": "pt"})
            written.append(str(path))
    if one_file:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(together, str(out), metadata={"format": "pt"})
        written.append(str(out))
    ckpt.close()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.pretrained",
                                description="Export a checkpoint's weights as a standard-named safetensors "
                                            "state dict (loadable by VideoDiT(cfg).load_state_dict and --init-from).")
    p.add_argument("checkpoint", help="RUN/checkpoints/step_N")
    p.add_argument("out", help="OUT.safetensors (one file) or a directory (one file per shard)")
    p.add_argument("--kind", default="master", choices=["master", "w"], help="which weights (default master)")
    args = p.parse_args(argv)
    for path in export_state_dict(args.checkpoint, args.out, args.kind):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
