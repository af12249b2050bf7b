"""A run's shared-memory state kept after a failure, because it holds steps newer than the
latest checkpoint.

A run that fails after Ray started releases its state (``runtime.state_dir``, ``/dev/shm`` by
default) unless the store answered, every shard is at the step the driver last completed, and
that step is newer than the latest checkpoint: then the state is **kept** (it would cost the
steps since the checkpoint to drop it). A kept state is the store's directory with one more
file, ``resume.json``: the step and where the data continues (the same fields a checkpoint's
``state.json`` holds), and its owner record says ``kept``, so no later run sweeps it as stale
(``segments.sweep_stale_states``). The driver prints its path, its size, the command that frees
it and the one that continues from it.

``--resume`` continues from a kept state when it is newer than the newest complete checkpoint
and still fits the run (``check_kept_state``: layout, compute dtype, every shard at its step,
no update cut half way); a kept state that does not fit is named and replaced."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from megaslide_ray.config import Config
from megaslide_ray.models.registry import build_shard, num_shards
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.state.preflight import state_root
from megaslide_ray.state.segments import state_key

RESUME_FILE = "resume.json"


@dataclass(frozen=True)
class KeptState:
    path: Path      # the state directory
    step: int       # every shard's version: the steps completed
    doc: dict       # resume.json: step and the data cursor (as a checkpoint's state.json)
    bytes: int      # what it holds in the state root (RAM when /dev/shm)

    def describe(self) -> str:
        return f"{self.path} ({human_bytes(self.bytes)}, step {self.step})"


def human_bytes(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def state_path(cfg: Config, run_dir: str | Path) -> Path:
    """Where the store of ``run_dir`` keeps its state."""
    return state_root(cfg) / state_key(run_dir)


def dir_bytes(path: Path) -> int:
    try:
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    except OSError:
        return 0


def keep_state(path: Path, doc: dict) -> None:
    """Mark the state at ``path`` as kept, resumable from ``doc`` (``step`` and the data cursor)."""
    tmp = path / (RESUME_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path / RESUME_FILE)
    owner = path / "owner.json"
    try:
        rec = json.loads(owner.read_text())
    except (OSError, ValueError):
        rec = {}
    rec["kept"] = True
    owner.write_text(json.dumps(rec))


def unkeep_state(path: Path) -> None:
    """A store attached to a kept state: it is the run's live state again (swept if its driver dies)."""
    (path / RESUME_FILE).unlink(missing_ok=True)


def is_kept(path: Path) -> bool:
    return (path / RESUME_FILE).is_file()


def find_kept_state(cfg: Config, run_dir: str | Path) -> KeptState | None:
    """The kept state of ``run_dir`` under the configured state root, or None."""
    path = state_path(cfg, run_dir)
    try:
        doc = json.loads((path / RESUME_FILE).read_text())
        step = int(doc["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return KeptState(path, step, doc, dir_bytes(path))


def check_kept_state(kept: KeptState, cfg: Config, w_dtype: str) -> list[str]:
    """Why ``kept`` cannot continue a run of ``cfg`` with compute dtype ``w_dtype`` (empty: it can):
    another model or dtype, a shard not at the kept step, or an update cut inside a shard."""
    try:
        layout = json.loads((kept.path / "layout.json").read_text())
    except (OSError, ValueError) as e:
        return [f"its layout.json is unreadable ({e})"]
    numels = [ShardLayout.of(build_shard(cfg, i, "meta"), i).numel for i in range(num_shards(cfg))]
    problems = []
    if layout.get("numels") != numels:
        problems.append(f"it holds another model ({len(layout.get('numels', []))} shards of "
                        f"{sum(layout.get('numels', []))} parameters; this run's model has {len(numels)} of {sum(numels)})")
    if layout.get("w_dtype") != w_dtype:
        problems.append(f"its compute copy is {layout.get('w_dtype')}, this run computes in {w_dtype} "
                        f"(a {'GPU' if w_dtype == 'bfloat16' else 'CPU'} run)")
    if problems:
        return problems
    n = len(numels)
    try:
        versions = _read_i64(kept.path / "versions.i64", n)
        updating = _read_i64(kept.path / "updating.i64", n)
    except (OSError, RuntimeError) as e:
        return [f"its control segments are unreadable ({e})"]
    if any(v != kept.step for v in versions):
        problems.append(f"its shards are at versions {versions}, not all at step {kept.step}")
    if any(u >= 0 for u in updating):
        problems.append("an update was cut inside a shard")
    return problems


def _read_i64(path: Path, n: int) -> list[int]:
    if path.stat().st_size != 8 * n:
        raise RuntimeError(f"{path.name} has {path.stat().st_size} bytes, expected {8 * n}")
    return torch.from_file(str(path), shared=False, size=n, dtype=torch.int64).tolist()


def release_state(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
