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
``m`` and ``v`` (float32 AdamW moments), and with ``training.ema_decay`` ``ema`` (the float32
moving average of the weights, ``OPTIONAL_KINDS``). The compute copy ``w`` is not saved: at a checkpoint it
is exactly ``master`` cast to ``w_dtype`` (state.json), so a reader asked for ``w`` casts
``master`` (12 instead of 14 bytes per parameter on disk for bf16 runs, 12 instead of 16 for
fp32). Checkpoints written before that hold a
``w`` tensor too; it is read when present. The safetensors metadata (strings) describes the
flat layout, so a reader can rebuild the named tensors without building the model:
``names``, ``shapes``, ``offsets`` (JSON lists: parameter names inside the shard, their shapes,
their element offsets in the flat tensors) and ``shard`` (the shard's index).

``state.json`` holds ``format`` (``FORMAT_VERSION``), ``step``, ``num_shards``, ``files``
(per shard file: its size in ``bytes``, the ``header_sha256`` of its safetensors header and the
``crc32`` of each tensor's bytes, see Checksums), ``checksum`` (``CHECKSUM``: how those were
computed), ``w_dtype``, ``config`` (the run's ``Config.to_dict()``: sampling and ``--resume`` rebuild the
model from it) and whatever else the writer adds (the data cursor: ``data_positions``,
``data_skipped``, ``data_bad_rows``, ...).

Checking
--------
``check_checkpoint`` lists what is wrong with a checkpoint without reading its tensors: a shard
file missing, of another size than ``files`` records, with another header (the checksum of the
header is cheap; one of the whole file is not, at 12 bytes per parameter), or shorter than its
own header says (checkpoints written before ``files`` was recorded). ``newest_complete_checkpoint``
takes the newest ``step_N`` that passes, naming every newer one that does not: ``--resume``
falls back to it (``latest`` is not needed: a ``step_N`` with its ``state.json`` was renamed into
place whole).

Checksums
---------
``write_checkpoint`` records a checksum of every tensor it writes (``tensor_checksum``: CRC-32 of
each 64 MiB piece, the pieces computed on several threads, then CRC-32 of those CRCs) and refuses
to write a tensor holding NaN or Inf (``NonFiniteStateError``: nothing is written, the previous
checkpoint stays ``latest``). ``CheckpointReader.tensor`` checks the checksum of every tensor it
reads (the parameter store's resume and rollback, ``--init-from``, the export, sampling): a
mismatch is a ``CheckpointDamagedError`` naming the file and the tensor. The check costs no extra
read (the bytes are read anyway), only the CRC. A checkpoint
written before checksums were recorded loads unchecked, with one log line saying so.

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

import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megaslide_ray.models.shards import ShardLayout

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CHECKPOINT_KINDS = ("master", "m", "v")      # what a checkpoint stores per shard
OPTIONAL_KINDS = ("ema",)                    # stored when the state has it (training.ema_decay)
READABLE_KINDS = ("w",) + CHECKPOINT_KINDS + OPTIONAL_KINDS  # what a reader serves (w: master cast to w_dtype)
STATE_FILE = "state.json"
LATEST = "latest"
_RESERVED = ("format", "step", "num_shards", "files", "checksum")  # written by write_checkpoint itself
CHECKSUM = "crc32-64MiB"
"""How ``files[...]["crc32"]`` was computed (``tensor_checksum``)."""
CHECKSUM_PIECE = 64 * 2**20
CHECKSUM_THREADS = max(1, min(8, os.cpu_count() or 1))


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, unwritable directory); the previous one is intact."""


class NonFiniteStateError(RuntimeError):
    """A checkpoint was asked for while a tensor of the state holds NaN or Inf: nothing was written."""


def tensor_checksum(t: torch.Tensor) -> str:
    """The checksum of a tensor's bytes (8 hex digits): CRC-32 of each ``CHECKSUM_PIECE`` bytes,
    computed on up to ``CHECKSUM_THREADS`` threads (zlib releases the GIL), then CRC-32 of those
    CRCs (4 bytes each, big-endian). Depends on the bytes only, not on the thread count."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    pieces = [raw[i:i + CHECKSUM_PIECE] for i in range(0, len(raw), CHECKSUM_PIECE)] or [raw]
    if len(pieces) == 1:
        crcs = [zlib.crc32(pieces[0])]
    else:
        with ThreadPoolExecutor(min(CHECKSUM_THREADS, len(pieces))) as pool:
            crcs = list(pool.map(zlib.crc32, pieces))
    return f"{zlib.crc32(b''.join(c.to_bytes(4, 'big') for c in crcs)):08x}"


def nonfinite_kinds(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The kinds among ``tensors`` that hold a NaN or an Inf. One ``aminmax`` pass per tensor (a
    NaN makes both NaN, an Inf one of them infinite): ~9 GB/s here, where ``isfinite().all()``,
    which writes a mask first, ran at 0.23 GB/s."""
    bad = []
    for kind, t in tensors.items():
        if t.is_floating_point() and t.numel():
            lo, hi = torch.aminmax(t.detach().reshape(-1))
            if not (math.isfinite(float(lo)) and math.isfinite(float(hi))):
                bad.append(kind)
    return bad


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
    kind of ``CHECKPOINT_KINDS``, and those of ``OPTIONAL_KINDS`` it has). It is consumed while writing, so a caller can hand over one
    shard at a time (or stop in the middle: the parameter store's ``store.mid_checkpoint``
    fault point fires from its generator). ``doc`` goes into ``state.json`` beside ``format``,
    ``step`` and ``num_shards``, which this function writes and ``doc`` may not hold.

    Any ``OSError`` (full disk, unwritable directory) becomes a ``CheckpointWriteError`` naming
    the directory, the reason and the checkpoint that is still complete; the temporary
    directory is removed and ``latest`` is left as it was. A tensor holding NaN or Inf is a
    ``NonFiniteStateError`` naming the step, the shard and the latest checkpoint, with the same
    clean-up: a state that is not finite is never saved."""
    clash = [k for k in _RESERVED if k in doc]
    if clash:
        raise ValueError(f"checkpoint fields {clash} are written by write_checkpoint; leave them out of doc")
    root = checkpoints_dir(run_dir)
    try:
        final = _write_step_dir(root, step, shards, doc)
        _point_latest(root, final)
    except NonFiniteStateError as e:
        raise NonFiniteStateError(f"{e}; no checkpoint of step {step} was written. The latest good checkpoint is "
                                  f"{latest_checkpoint(run_dir) or 'none (no checkpoint yet)'}: resume from it "
                                  f"(--resume) with a lower optim.lr, or check the data") from None
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
        n, files = 0, {}
        for i, (lay, tensors) in enumerate(shards):
            meta = {"names": json.dumps(lay.names), "shapes": json.dumps(lay.shapes),
                    "offsets": json.dumps(lay.offsets), "shard": str(i)}
            path = tmp / shard_file(i)
            kinds = {kind: tensors[kind] for kind in CHECKPOINT_KINDS + OPTIONAL_KINDS if kind in tensors}
            bad = nonfinite_kinds(kinds)
            if bad:
                raise NonFiniteStateError(f"step {step}: shard {i}'s {'/'.join(bad)} hold(s) NaN or Inf values")
            save_file(kinds, str(path), metadata=meta)
            _fsync(path)
            files[path.name] = {"bytes": path.stat().st_size,
                                "header_sha256": hashlib.sha256(_header_bytes(path)).hexdigest(),
                                "crc32": {kind: tensor_checksum(t) for kind, t in kinds.items()}}
            n = i + 1
        state = {"format": FORMAT_VERSION, "step": step, "num_shards": n, "files": files, "checksum": CHECKSUM,
                 **doc}
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
    """A checkpoint directory as is (checked: ``CheckpointDamagedError`` names what is wrong), or
    a run directory's newest complete checkpoint (a damaged newer one is named in a warning)."""
    p = Path(path)
    if is_checkpoint_dir(p):
        problems = check_checkpoint(p)
        if problems:
            raise CheckpointDamagedError(f"checkpoint {p} is damaged: {'; '.join(problems)}. Use another checkpoint "
                                         f"(e.g. the run directory: its newest complete one)")
        return p
    if checkpoints_dir(p).is_dir():
        ckpt, damaged = newest_complete_checkpoint(p)
        if ckpt is not None:
            warn_damaged(damaged, ckpt)
            return ckpt
        if damaged:
            raise CheckpointDamagedError(f"{p}: no complete checkpoint; " + describe_damaged(damaged))
    raise FileNotFoundError(f"{str(p)!r}: neither a checkpoint directory (with {STATE_FILE}) nor a run directory "
                            f"with checkpoints/step_N; pass e.g. runs/NAME or runs/NAME/checkpoints/step_N")


# ---------------------------------------------------------------------------------------------
# Checking (headers and sizes only: no tensor is read)
# ---------------------------------------------------------------------------------------------


class CheckpointDamagedError(RuntimeError):
    """A checkpoint's files are missing, truncated or changed since it was written."""


_STEP_DIR = re.compile(r"step_(\d+)")


def _header_bytes(path: Path) -> bytes:
    """A safetensors file's header: its 8-byte length and the JSON that follows."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{len(head)} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise ValueError(f"a header length of {n} bytes: not a safetensors file")
        body = f.read(n)
        if len(body) < n:
            raise ValueError(f"cut inside its header ({8 + len(body)} of {8 + n} bytes)")
    return head + body


def safetensors_problem(path: str | Path) -> str:
    """What is wrong with a safetensors file, judged from its header and size ("" when nothing):
    missing, not safetensors, or shorter (longer) than the tensors its header lists."""
    path = Path(path)
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        raw = _header_bytes(path)
        header = json.loads(raw[8:])
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} is not a readable safetensors file ({e})"
    size = path.stat().st_size
    if size != len(raw) + end:
        return f"{path.name} has {size} bytes, its header lists {len(raw) + end} (truncated or overwritten)"
    return ""


def check_checkpoint(path: str | Path) -> list[str]:
    """What is wrong with checkpoint ``path`` (an empty list when nothing): ``state.json``
    missing or unreadable; a shard file missing, of another size than ``state.json`` records,
    with another header, or not matching its own header. Reads headers only."""
    path = Path(path)
    try:
        state = read_checkpoint_state(path)
        n = int(state["num_shards"])
        int(state["step"])
    except FileNotFoundError:
        return [f"{STATE_FILE} is missing"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{STATE_FILE} is unreadable ({e})"]
    recorded = state.get("files") or {}
    problems = []
    for i in range(n):
        file = path / shard_file(i)
        problem = safetensors_problem(file)
        if not problem and file.name in recorded:
            rec = recorded[file.name]
            if file.stat().st_size != rec.get("bytes"):
                problem = f"{file.name} has {file.stat().st_size} bytes, {STATE_FILE} records {rec.get('bytes')}"
            elif hashlib.sha256(_header_bytes(file)).hexdigest() != rec.get("header_sha256"):
                problem = f"{file.name} has another header than when it was written"
        if problem:
            problems.append(problem)
    return problems


def step_dirs(run_dir: str | Path) -> list[Path]:
    """The run's ``checkpoints/step_N`` directories, newest (highest N) first."""
    root = checkpoints_dir(run_dir)
    found = [(int(m.group(1)), d) for d in root.iterdir() if d.is_dir() and (m := _STEP_DIR.fullmatch(d.name))] \
        if root.is_dir() else []
    return [d for _, d in sorted(found, reverse=True)]


def newest_complete_checkpoint(run_dir: str | Path, known_damaged: dict[Path, str] | None = None,
                               ) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """(the newest checkpoint of ``run_dir`` that ``check_checkpoint`` passes, or None; the newer
    ones that fail, each with its problems). ``latest`` is not consulted: it may name a damaged
    checkpoint, or be gone itself. ``known_damaged``: checkpoints already found damaged (a
    checksum that did not match when they were read), each with what was wrong: passed over."""
    damaged = []
    known = {Path(k): v for k, v in (known_damaged or {}).items()}
    for d in step_dirs(run_dir):
        problems = [known[d]] if d in known else check_checkpoint(d)
        if not problems:
            return d, damaged
        damaged.append((d, problems))
    return None, damaged


def describe_damaged(damaged: list[tuple[Path, list[str]]]) -> str:
    return "; ".join(f"{d.name} is damaged ({', '.join(p)})" for d, p in damaged)


def warn_damaged(damaged: list[tuple[Path, list[str]]], used: Path) -> None:
    if damaged:
        log.warning("%s: using %s, the newest complete checkpoint", describe_damaged(damaged), used)


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
        self._sums = {name: rec.get("crc32") for name, rec in (self.state.get("files") or {}).items()}
        if not any(self._sums.values()):
            log.warning("checkpoint %s has no checksums (written by an older version of megaslide_ray): its tensors "
                        "are read without checking them against bit rot", self.path)
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
        if kind in OPTIONAL_KINDS and not self.has(shard, kind):
            raise ValueError(f"checkpoint {self.path} holds no {kind!r} weights (shard {shard}): it was written by a "
                             f"run without training.ema_decay; use its trained weights (master) instead")
        if kind == "w" and "w" not in self._files[shard].keys():
            t = self._verified(shard, "master").to(self.w_dtype)
        else:
            t = self._verified(shard, kind)
        if numel is not None and t.numel() != numel:
            raise RuntimeError(f"checkpoint {self.path} shard {shard} {kind} has {t.numel()} values, the model "
                               f"needs {numel}: the checkpoint and the model's configuration disagree")
        return t

    def has(self, shard: int, kind: str) -> bool:
        """Whether the shard's file stores ``kind`` (``ema`` only where the run kept the average)."""
        return kind in self._files[shard].keys() or (kind == "w" and "master" in self._files[shard].keys())

    def _verified(self, shard: int, kind: str) -> torch.Tensor:
        """The stored ``kind`` tensor of ``shard``, its checksum checked against ``state.json``
        (``CheckpointDamagedError`` on a mismatch; unchecked where none was recorded)."""
        t = self._files[shard].get_tensor(kind)
        want = (self._sums.get(shard_file(shard)) or {}).get(kind)
        if want is not None and (got := tensor_checksum(t)) != want:
            raise CheckpointDamagedError(
                f"checkpoint {self.path} is damaged: {shard_file(shard)} tensor {kind} has checksum {got}, "
                f"{STATE_FILE} recorded {want} when it was written (its bytes changed since: disk or copy "
                f"error). Use an older checkpoint (--resume falls back to it by itself), or copy the file again")
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
