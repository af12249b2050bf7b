"""Room for the host state, checked in the driver before Ray starts.

The parameter store keeps every byte of model state in files under the state directory
(``runtime.state_dir``; ``/dev/shm`` by default). A user who points it at a filesystem that
is too small should hear so in one message before anything starts, not from an actor
traceback. Two things compete for that space on a single machine:

* the store's segments: ``w`` (bf16 on CUDA runs, fp32 on CPU runs) + fp32 ``master``, ``m``,
  ``v``, i.e. 14 (bf16) or 16 (fp32) bytes per parameter, plus the offloaded block inputs with
  ``runtime.offload_activations``;
* Ray's object store, which a local cluster keeps in ``/dev/shm`` when it fits there (and in
  the temp dir otherwise). Its pages are taken as objects arrive, so a reservation that
  overlaps the state would fill the filesystem later, in the middle of a run.

``plan_state_space`` measures both and answers with a refusal (exit 2, one message, including
how to enlarge ``/dev/shm``) or with the object-store size to start Ray with, so that the
reservation and the state fit together. The store itself reserves its segments' blocks when it
creates them (``posix_fallocate``), so a filesystem that fills up between this check and the
store's start gives a clear error then, never a SIGBUS on a page written later.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megaslide_ray.config import Config
from megaslide_ray.config.buckets import largest_bucket
from megaslide_ray.models.registry import build_shard, distills, num_shards, teacher_config
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.state.segments import default_state_root, state_key

SHM = Path("/dev/shm")
RAY_OBJECT_STORE_FRACTION = 0.3        # Ray's default share of memory for a local object store
RAY_OBJECT_STORE_CAP = 200 * 10**9     # and its default cap
MIN_OBJECT_STORE = 512 * 2**20         # below this, the object store goes to the temp dir instead
MARGIN_BYTES = 64 * 2**20              # slack for the control segments and file-system overhead


class StateSpaceError(RuntimeError):
    """The state directory has no room for the parameter store's state."""


@dataclass(frozen=True)
class SpacePlan:
    root: Path                  # where the state directory goes
    need_bytes: int             # state (+ offloaded block inputs)
    free_bytes: int             # free in root's filesystem (plus this run's old state, replaced)
    total_bytes: int            # size of root's filesystem
    on_shm: bool                # root is on the filesystem Ray's object store would use
    object_store_bytes: int     # what to start a local Ray with (0: Ray's own choice)
    plasma_dir: str             # "" or a directory for Ray's object store (when /dev/shm is full)


def state_root(cfg: Config) -> Path:
    if cfg.runtime.state_dir:
        return Path(cfg.runtime.state_dir)

    return default_state_root()


def w_dtype_bytes(cfg: Config) -> int:
    """Bytes of the compute copy ``w`` the store will use: bf16 when the run will take a GPU."""
    if cfg.runtime.device == "cpu":
        return 4
    try:
        import torch

        return 2 if torch.cuda.is_available() else 4
    except Exception:  # noqa: BLE001 - no usable torch CUDA: a CPU run
        return 4


def state_bytes(cfg: Config, wbytes: int) -> int:
    """The store's segments for ``cfg``: ``numel * (wbytes + 12)`` summed over shards (4 more per
    parameter with the moving average, ``training.ema_decay``), from the model built on the meta
    device (no memory)."""
    per_param = wbytes + 12 + (4 if cfg.training.ema_decay else 0)
    return sum(ShardLayout.of(build_shard(cfg, i, "meta"), i).numel for i in range(num_shards(cfg))) * per_param


def teacher_bytes(cfg: Config, wbytes: int) -> int:
    """The dense teacher's frozen weights beside the state (``training.distill_weight`` > 0; else 0)."""
    if not distills(cfg):
        return 0
    tcfg = teacher_config(cfg)
    return sum(ShardLayout.of(build_shard(tcfg, i, "meta"), i).numel for i in range(num_shards(tcfg))) * wbytes


def offload_bytes(cfg: Config, wbytes: int) -> int:
    """The host copy of the block inputs with ``runtime.offload_activations`` (0 without): one slot
    per block not kept on the device (``runtime.offload_keep``)."""
    if not cfg.runtime.offload_activations:
        return 0
    slots = max(0, cfg.model.depth - cfg.runtime.offload_keep)
    tokens = largest_bucket(cfg).tokens_per_sample  # data.buckets: the largest clip's
    return slots * cfg.data.batch_size * tokens * cfg.model.hidden_size * wbytes


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing parent (the filesystem it will be created on)."""
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _dir_bytes(d: Path) -> int:
    try:
        return sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    except OSError:
        return 0


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def ray_default_object_store(memory_bytes: int | None = None) -> int:
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(RAY_OBJECT_STORE_FRACTION * memory_bytes, RAY_OBJECT_STORE_CAP))


def shm_advice(root: Path, need: int, free: int, total: int) -> str:
    if _same_filesystem(_existing(root), SHM):
        gb = -(-int((total + need - free) * 1.05) // 10**9)  # today's size + what is missing, 5% headroom
        return (f"/dev/shm is a tmpfs that Linux sizes at half of RAM by default; enlarge it (it takes RAM only as "
                f"it is used): `sudo mount -o remount,size={gb}G /dev/shm` (in Docker: `--shm-size={gb}g`), "
                f"or set --runtime.state_dir to a disk path with room (slower; a disk lets state exceed RAM)")
    return "free space there, or set --runtime.state_dir to a filesystem with room (/dev/shm keeps state in RAM)"


def plan_state_space(cfg: Config, run_dir: str | None = None, local_ray: bool = True,
                     wbytes: int | None = None) -> SpacePlan:
    """Check that the state fits under its root; raise ``StateSpaceError`` (one message) if not.
    With ``local_ray`` (the driver starts its own cluster) and the state on ``/dev/shm``, size
    Ray's object store so that it and the state fit together."""
    wbytes = wbytes or w_dtype_bytes(cfg)
    root = state_root(cfg)
    need = state_bytes(cfg, wbytes) + offload_bytes(cfg, wbytes) + teacher_bytes(cfg, wbytes) + MARGIN_BYTES
    fs = _existing(root)
    usage = shutil.disk_usage(fs)
    free = usage.free
    if run_dir:  # a resumed run's old state under the same name is replaced, its room reused
        free += _dir_bytes(root / state_key(run_dir))
    if need > free:
        raise StateSpaceError(
            f"the parameter store needs {need / 1e9:.2f} GB for its state ({state_bytes(cfg, wbytes) / 1e9:.2f} GB of "
            f"weights, master copy and AdamW moments"
            + (f", {offload_bytes(cfg, wbytes) / 1e9:.2f} GB of offloaded block inputs" if cfg.runtime.offload_activations
               else "")
            + (f", {teacher_bytes(cfg, wbytes) / 1e9:.2f} GB of the dense teacher's weights" if distills(cfg) else "")
            + f") under {root}, but that filesystem ({usage.total / 1e9:.2f} GB) has {free / 1e9:.2f} GB free. "
            + shm_advice(root, need, free, usage.total))
    on_shm = local_ray and _same_filesystem(fs, SHM)
    osm, plasma = 0, ""
    if on_shm:
        default = ray_default_object_store()
        left = free - need
        if default > left:  # Ray would put its default object store here too: make them fit
            if left >= MIN_OBJECT_STORE:
                osm = int(left)
            else:
                osm, plasma = MIN_OBJECT_STORE, tempfile.gettempdir()
    return SpacePlan(root, need, free, usage.total, on_shm, osm, plasma)
