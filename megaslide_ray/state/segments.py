"""The parameter store's shared-memory segments: where they live, what they are called, who owns
them.

Each shard's ``w``, ``master``, ``m`` and ``v`` is one file under the state directory
(``runtime.state_dir``; ``/dev/shm`` by default), mapped by the store and by a compute actor on
the same node. A run's state sits in ``<root>/megaslide-<key>`` with an owner file (pid and
machine); ``sweep_stale_states`` removes the state of runs whose owner is gone."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


KINDS = ("w", "master", "m", "v")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_state_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def state_key(run_dir: str | Path) -> str:
    """Stable name of a run's segments, so a restarted store finds them again."""
    return "megaslide-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def node_state_key(run_dir: str | Path, nodes: int = 1, node: int = 0) -> str:
    """The state's name on node ``node`` of a run on ``nodes`` nodes (``runtime.nodes``): each
    node's store has its own directory, so nodes that share a filesystem never share segments."""
    return state_key(run_dir) + (f"-node{node}" if nodes > 1 else "")


def map_segment(path: str | Path, numel: int, dtype: torch.dtype, create: bool = False) -> torch.Tensor:
    """Map a segment file as a flat tensor shared by every process that maps it."""
    path = Path(path)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if create:
        # Private to the user who runs the job (the weights and moments are theirs), and every
        # block reserved now: a sparse file on a filesystem that fills up later would SIGBUS the
        # process that first writes a page; a reservation fails here, with ENOSPC.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
    elif path.stat().st_size != nbytes:
        raise RuntimeError(f"segment {path} has {path.stat().st_size} bytes, expected {nbytes}; the state "
                           f"directory belongs to a different model: remove it or choose another runtime.state_dir")
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def this_machine() -> dict:
    """The calling process's machine: host name and boot id (a pid means something only there)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return {"host": socket.gethostname(), "boot_id": boot.read_text().strip() if boot.is_file() else ""}


def run_owner() -> dict:
    """The owner record of a run: the calling process (the driver) and its machine. Taken where
    the driver runs and handed to every store, so that the state of a store on another machine
    names the driver's machine, not its own."""
    return {**this_machine(), "pid": os.getpid()}


def write_owner(state: Path, owner: dict) -> None:
    """Record which process's run the state belongs to (``run_owner()`` of the driver), for
    ``sweep_stale_states``."""
    tmp = state / "owner.json.tmp"
    tmp.write_text(json.dumps({"host": str(owner["host"]), "boot_id": str(owner.get("boot_id", "")),
                               "pid": int(owner["pid"])}))
    os.replace(tmp, state / "owner.json")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        return True
    return True


def sweep_stale_states(root: Path, keep: Path | None = None) -> list[Path]:
    """Remove the state directories under ``root`` left by runs that ended without cleaning up
    (a driver killed with SIGKILL, a machine reset): those whose owner, a process of this machine,
    is no longer running (or ran before the last boot). A state without an owner record, one
    whose owner runs on another machine (a store of a run on several nodes whose driver is
    elsewhere: its pid cannot be checked here), or one a failed run kept on purpose (its owner
    record says ``kept``: ``megaslide_ray.state.kept``) is left alone. Returns what was removed."""
    me, removed = this_machine(), []
    for d in sorted(root.glob("megaslide-*")):
        if d == keep or not d.is_dir():
            continue
        try:
            owner = json.loads((d / "owner.json").read_text())
            pid = int(owner["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner.get("host") != me["host"] or pid <= 0 or owner.get("kept"):
            continue
        if owner.get("boot_id") == me["boot_id"] and _running(pid):
            continue
        size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
        shutil.rmtree(d, ignore_errors=True)
        log.warning("removed %s (%.2f GB): the state of a run whose driver (pid %d) ended without cleaning up",
                    d, size / 1e9, pid)
        removed.append(d)
    return removed
