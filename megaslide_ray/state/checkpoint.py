"""The checkpoint format: the one module that writes it and reads it.

The parameter store writes checkpoints, resumes from them, ``--init-from`` and the export read
their weights, and sampling serves them to the compute actor; all of them go through here, so
the layout below is defined in one place.

Layout on disk
--------------
::

    RUN/checkpoints/
        latest                      text: the name of the newest complete checkpoint ("step_4\\n")
        step_N/                     one checkpoint: the state after N optimizer steps
            state.json
            shard_0000.safetensors  one file per model shard (``shard_file(i)``)
            shard_0001.safetensors
            ...

Each shard file holds three flat 1-D tensors, the shard's parameters laid end to end as in
``megaslide_ray.models.shards.ShardLayout`` (``CHECKPOINT_KINDS``): ``master`` (float32 weights),
``m`` and ``v`` (float32 AdamW moments). The compute copy ``w`` is not saved: at a checkpoint it
is exactly ``master`` cast to ``w_dtype`` (state.json), so a reader asked for ``w`` casts
``master`` (12 instead of 14 bytes per parameter on disk for bf16 runs, 12 instead of 16 for
fp32; benchmarks/RESULTS.md has the write times). Checkpoints written before that hold a
``w`` tensor too; it is read when present. The safetensors metadata (strings) describes the
flat layout, so a reader can rebuild the named tensors without building the model:
``names``, ``shapes``, ``offsets`` (JSON lists: parameter names inside the shard, their shapes,
their element offsets in the flat tensors) and ``shard`` (the shard's index).

``state.json`` holds ``format`` (``FORMAT_VERSION``), ``step``, ``num_shards``, ``w_dtype``,
``config`` (the run's ``Config.to_dict()``: sampling and ``--resume`` rebuild the model from
it) and whatever else the writer adds (the data cursor: ``data_positions``, ``data_skipped``,
``data_bad_rows``, ...).

Atomic writes
-------------
``write_checkpoint`` writes every file into a temporary directory ``checkpoints/.step_N.*``,
fsyncs each file and the directory, renames it to ``step_N`` and fsyncs ``checkpoints/``; only
then it replaces ``latest`` (written to ``.latest.tmp``, fsynced, renamed). A crash or a full
disk at any point leaves the previous ``latest`` pointing at a complete checkpoint, and a
reader never sees a half-written ``step_N`` (``latest_checkpoint`` also checks that the target
has its ``state.json``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megaslide_ray.models.shards import ShardLayout

FORMAT_VERSION = 1
CHECKPOINT_KINDS = ("master", "m", "v")      # what a checkpoint stores per shard
READABLE_KINDS = ("w",) + CHECKPOINT_KINDS   # what a reader serves (w: master cast to w_dtype)
STATE_FILE = "state.json"
LATEST = "latest"
_RESERVED = ("format", "step", "num_shards")  # written by write_checkpoint itself


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory); the previous one is intact."""


def shard_file(index: int) -> str:
    """File name of shard ``index`` inside a checkpoint directory."""
    return f"shard_{index:04d}.safetensors"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_checkpoint(run_dir: str | Path, step: int, shards: Iterable[tuple[ShardLayout, dict[str, torch.Tensor]]],
                     doc: dict) -> str:
    """Write ``run_dir/checkpoints/step_<step>`` atomically (see the module docstring) and point
    ``latest`` at it; returns its path.

    ``shards`` yields, in shard order, each shard's layout and its flat tensors by kind (every
    kind of ``CHECKPOINT_KINDS``). It is consumed while writing, so a caller can hand over one
    shard at a time (or stop in the middle: the parameter store's ``store.mid_checkpoint``
    fault point fires from its generator). ``doc`` goes into ``state.json`` beside ``format``,
    ``step`` and ``num_shards``, which this function writes and ``doc`` may not hold.

    Any ``OSError`` (full disk, unwritable directory) becomes a ``CheckpointWriteError`` naming
    the directory, the reason and the checkpoint that is still complete; the temporary
    directory is removed and ``latest`` is left as it was."""
    clash = [k for k in _RESERVED if k in doc]
    if clash:
        raise ValueError(f"checkpoint fields {clash} are written by write_checkpoint; leave them out of doc")
    root = checkpoints_dir(run_dir)
    try:
        final = _write_step_dir(root, step, shards, doc)
        _point_latest(root, final)
    except OSError as e:
        raise CheckpointWriteError(
            f"could not write the step-{step} checkpoint under {root}: {e.strerror or e}. "
            f"The previous checkpoint ({latest_checkpoint(run_dir) or 'none yet'}) is complete and loadable; "
            f"free space or fix the directory's permissions, then resume from it with --resume") from e
    return str(final)


def _write_step_dir(root: Path, step: int, shards: Iterable, doc: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=root))
    try:
        n = 0
        for i, (lay, tensors) in enumerate(shards):
            meta = {"names": json.dumps(lay.names), "shapes": json.dumps(lay.shapes),
                    "offsets": json.dumps(lay.offsets), "shard": str(i)}
            path = tmp / shard_file(i)
            save_file({kind: tensors[kind] for kind in CHECKPOINT_KINDS}, str(path), metadata=meta)
            _fsync(path)
            n = i + 1
        state = {"format": FORMAT_VERSION, "step": step, "num_shards": n, **doc}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1))
        _fsync(tmp / STATE_FILE)
        _fsync(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _point_latest(root: Path, final: Path) -> None:
    tmp = root / ".latest.tmp"
    tmp.write_text(final.name + "\n")
    _fsync(tmp)
    os.replace(tmp, root / LATEST)
    _fsync(root)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Finding
# ---------------------------------------------------------------------------------------------


def is_checkpoint_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / STATE_FILE).is_file()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``run_dir/checkpoints/latest`` names, or None (no pointer, or its target
    is not a complete checkpoint)."""
    pointer = checkpoints_dir(run_dir) / LATEST
    if not pointer.is_file():
        return None
    ckpt = pointer.parent / pointer.read_text().strip()
    return ckpt if is_checkpoint_dir(ckpt) else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory as is, or a run directory's latest checkpoint."""
    p = Path(path)
    if is_checkpoint_dir(p):
        return p
    ckpt = latest_checkpoint(p)
    if ckpt is not None:
        return ckpt
    raise FileNotFoundError(f"{str(p)!r}: neither a checkpoint directory (with {STATE_FILE}) nor a run directory "
                            f"with checkpoints/{LATEST}; pass e.g. runs/NAME or runs/NAME/checkpoints/step_N")


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_checkpoint_state(path: str | Path) -> dict:
    """A checkpoint's ``state.json``."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint directory (no {STATE_FILE}); a checkpoint is "
                                f"RUN/checkpoints/step_N")
    return json.loads(file.read_text())


def read_checkpoint_shards(path: str | Path, kind: str = "master") -> list[torch.Tensor]:
    """Each shard's flat ``kind`` tensor (``w``, ``master``, ``m`` or ``v``) from a checkpoint."""
    with CheckpointReader(path) as ckpt:
        return [ckpt.tensor(i, kind) for i in range(ckpt.num_shards)]


class CheckpointReader:
    """One checkpoint, opened for reading: ``state.json`` is read and every shard file opened
    (headers only) at construction, so a missing file is reported before any tensor is read;
    tensors are read on request, one shard at a time.

    ``num_shards``: the shard count of the model the caller will fill; a checkpoint of another
    count is refused here, before anything is read."""

    def __init__(self, path: str | Path, num_shards: int | None = None):
        self.path = Path(path)
        self.state = read_checkpoint_state(self.path)
        self.step = int(self.state["step"])
        self.num_shards = int(self.state["num_shards"])
        if num_shards is not None and num_shards != self.num_shards:
            raise RuntimeError(f"checkpoint {self.path} has {self.num_shards} shards, the model needs {num_shards}: "
                               f"the checkpoint and the model's configuration disagree")
        self._files = []
        for i in range(self.num_shards):
            file = self.path / shard_file(i)
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint {self.path} is missing {file.name} ({STATE_FILE} says "
                                        f"{self.num_shards} shards): copy the whole directory, or use another "
                                        f"checkpoint")
            self._files.append(safe_open(str(file), framework="pt"))
        self._layouts: dict[int, ShardLayout] = {}

    def file(self, shard: int) -> Path:
        return self.path / shard_file(shard)

    def layout(self, shard: int) -> ShardLayout:
        """The shard's flat layout as its metadata records it (names, shapes, offsets)."""
        if shard not in self._layouts:
            meta = self._files[shard].metadata() or {}
            missing = [k for k in ("names", "shapes", "offsets") if k not in meta]
            if missing:
                raise RuntimeError(f"checkpoint {self.path} shard {shard} has no {'/'.join(missing)} metadata: "
                                   f"{shard_file(shard)} was not written by megaslide_ray")
            names, shapes, offsets = (json.loads(meta[k]) for k in ("names", "shapes", "offsets"))
            shapes = tuple(tuple(s) for s in shapes)
            numel = max((o + math.prod(s) for o, s in zip(offsets, shapes)), default=0)
            self._layouts[shard] = ShardLayout(shard, tuple(names), shapes, tuple(offsets), numel)
        return self._layouts[shard]

    @property
    def w_dtype(self) -> torch.dtype:
        """The compute copy's dtype (state.json ``w_dtype``; float32 when absent)."""
        name = self.state.get("w_dtype", "float32")
        if name not in ("float32", "bfloat16"):
            raise RuntimeError(f"checkpoint {self.path} has w_dtype={name!r}; expected float32 or bfloat16")
        return getattr(torch, name)

    def dtype(self, shard: int, kind: str) -> str:
        """The safetensors dtype name (``F32``, ``BF16``) of the shard's ``kind`` tensor, from its
        header (``w`` of a checkpoint that does not store it: its ``w_dtype``)."""
        if kind == "w" and "w" not in self._files[shard].keys():
            return {torch.float32: "F32", torch.bfloat16: "BF16"}[self.w_dtype]
        return self._files[shard].get_slice(kind).get_dtype()

    def tensor(self, shard: int, kind: str, numel: int | None = None) -> torch.Tensor:
        """The shard's flat ``kind`` tensor. ``numel``: the size the caller's model needs; a
        tensor of another size is refused (the checkpoint is of another configuration)."""
        if kind not in READABLE_KINDS:
            raise ValueError(f"kind={kind!r}; a checkpoint serves {list(READABLE_KINDS)}")
        if kind == "w" and "w" not in self._files[shard].keys():
            t = self._files[shard].get_tensor("master").to(self.w_dtype)
        else:
            t = self._files[shard].get_tensor(kind)
        if numel is not None and t.numel() != numel:
            raise RuntimeError(f"checkpoint {self.path} shard {shard} {kind} has {t.numel()} values, the model "
                               f"needs {numel}: the checkpoint and the model's configuration disagree")
        return t

    def tensors(self, shard: int, kind: str) -> dict[str, torch.Tensor]:
        """The shard's ``kind`` tensors by parameter name (views into one flat tensor)."""
        return self.layout(shard).views(self.tensor(shard, kind))

    def close(self) -> None:
        self._files = []

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
