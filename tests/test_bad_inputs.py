"""What goes wrong, as a user meets it: every case ends with one clear message (its first line is
checked), the documented exit code, nothing left in shared memory by the run (each run gets its
own ``runtime.state_dir``, checked afterwards) and no process left behind (each command runs in
a session of its own; the session must be empty once it returned).

The cases refused before Ray starts take a second or two each; the ones that need Ray share one
small failed run (``failed_run``). The slow ones (a second Ray run each) are marked slow."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import CLI_SMALL
from megaslide_ray.state.checkpoint import (
    check_checkpoint,
    newest_complete_checkpoint,
    read_checkpoint_shards,
    safetensors_problem,
)

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d |\x1b\[|\(\w+ pid=|\s*$|WARNING |INFO |Ray dashboard)")
"""Lines that are not the message: log records, Ray's own and its actors' output, blank lines."""


@dataclass
class Ran:
    rc: int
    out: str
    err: str
    left: list[str]           # processes still in the command's session after it returned

    @property
    def message(self) -> str:
        """The first line of the message: the first stderr line that is not a log record."""
        return next((line for line in self.err.splitlines() if not LOG_LINE.match(line)), "")


def _session_processes(sid: int) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == sid:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120]
                found.append(f"{pid}: {cmdline!r}")
        except OSError:
            pass
    return found


def run(args: list[str], env: dict, module: str = "megaslide_ray.train", timeout: float = 600,
        wait_left: float = 20.0) -> Ran:
    """``python -m MODULE ARGS`` in a session of its own, as a user runs it; then the processes
    left in that session (Ray's, the actors') once it returned, given ``wait_left`` s to go."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        raise
    deadline = time.monotonic() + wait_left
    while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        os.killpg(proc.pid, 9)  # the test fails below; the machine keeps no stray process
    return Ran(proc.returncode, out, err, left)


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of a run directory with its contents: what a refused command must not change."""
    return {str(f.relative_to(run_dir)): f.read_bytes() for f in sorted(run_dir.rglob("*")) if f.is_file()}


def _state(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


# ---------------------------------------------------------------------------------------------
# A run that fails after Ray started, with steps newer than its latest checkpoint
# ---------------------------------------------------------------------------------------------

STEPS = ["--steps", "6", "--training.checkpoint_every", "2", "--optim.schedule", "constant"]


@pytest.fixture(scope="module")
def failed_run(tmp_path_factory):
    """Six steps planned, checkpoints at 2 and 4, and step 6 fails (an error raised in the compute
    actor): steps 5 is newer than the checkpoint, so the state is kept. ``(root, Ran, env)``; the
    run directory and the state root are read-only to the tests (they copy them)."""
    root = tmp_path_factory.mktemp("failed")
    env = _env(root)
    ran = run([*CLI_SMALL, *STEPS, "--run-dir", str(root / "run"), "--runtime.state_dir", str(root / "shm"),
               "--inject-fault", "compute.mid_forward@6:raise"], env)
    return root, ran, env


def test_an_error_after_ray_started_is_one_message_and_the_newer_state_is_kept(failed_run):
    root, ran, _ = failed_run
    assert ran.rc == 1, ran.err[-3000:]
    assert ran.message == "error: FaultInjected: injected fault compute.mid_forward@6:raise"
    assert "raised in ComputeActor.train_step" in ran.err
    assert "Traceback" not in ran.err  # the traceback went to the log file, whose path is printed
    log_file = root / "run" / "error.log"
    assert f"full traceback: {log_file}" in ran.err and "Traceback" in log_file.read_text()
    [kept] = _state(root / "shm")
    path = root / "shm" / kept
    assert f"state kept: {path} (" in ran.err and f"rm -rf {path}" in ran.err
    assert f"--run-dir {root / 'run'} --resume" in ran.err
    doc = json.loads((path / "resume.json").read_text())
    assert doc["step"] == 5 and json.loads((path / "owner.json").read_text())["kept"]
    assert not ran.left, ran.left


def test_resume_continues_from_the_kept_state(failed_run, tmp_path):
    root, _, env = failed_run
    run_dir, shm = tmp_path / "run", tmp_path / "shm"
    shutil.copytree(root / "run", run_dir)
    [kept] = _state(root / "shm")
    # The state is named after its run dir: a copy of the run gets its state moved to its name.
    from megaslide_ray.state.segments import state_key

    shutil.copytree(root / "shm" / kept, shm / state_key(run_dir))
    ran = run([*CLI_SMALL, *STEPS, "--run-dir", str(run_dir), "--runtime.state_dir", str(shm), "--resume"], env)
    assert ran.rc == 0, ran.err[-3000:]
    assert "continuing from the shared-memory state a failed run kept" in ran.err
    assert "done: steps 5->6" in ran.out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert _state(shm) == [] and not ran.left, ran.left


@pytest.mark.slow  # 40 s: two more Ray runs
def test_resuming_the_kept_state_ends_bit_identical_to_an_uninterrupted_run(failed_run, tmp_path):
    root, _, env = failed_run
    straight = run([*CLI_SMALL, *STEPS, "--run-dir", str(tmp_path / "straight"), "--runtime.state_dir",
                    str(tmp_path / "shm")], env)
    assert straight.rc == 0, straight.err[-3000:]
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir)
    from megaslide_ray.state.segments import state_key

    [kept] = _state(root / "shm")
    shutil.copytree(root / "shm" / kept, tmp_path / "shm" / state_key(run_dir))
    resumed = run([*CLI_SMALL, *STEPS, "--run-dir", str(run_dir), "--runtime.state_dir", str(tmp_path / "shm"),
                   "--resume"], env)
    assert resumed.rc == 0, resumed.err[-3000:]
    for kind in ("master", "m", "v"):
        for a, b in zip(read_checkpoint_shards(tmp_path / "straight" / "checkpoints" / "step_6", kind),
                        read_checkpoint_shards(run_dir / "checkpoints" / "step_6", kind)):
            assert torch.equal(a, b)
    assert _state(tmp_path / "shm") == []


# ---------------------------------------------------------------------------------------------
# Damaged checkpoints: checked before Ray, the newest complete one used
# ---------------------------------------------------------------------------------------------


def _damaged_copy(failed_run, tmp_path) -> Path:
    """The failed run's directory with step_4 missing two of its three shard files (no kept state)."""
    root, _, _ = failed_run
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir)
    for i in (1, 2):
        (run_dir / "checkpoints" / "step_4" / f"shard_000{i}.safetensors").unlink()
    return run_dir


def test_resume_falls_back_past_a_damaged_checkpoint_before_ray(failed_run, tmp_path):
    run_dir = _damaged_copy(failed_run, tmp_path)
    before = _files(run_dir)
    # --steps 2: the fallback (step_2) has nothing left to do, so the run ends before Ray starts.
    ran = run([*CLI_SMALL, "--steps", "2", "--run-dir", str(run_dir), "--runtime.state_dir", str(tmp_path / "shm"),
               "--resume"], _env(tmp_path))
    assert ran.rc == 0, ran.err[-3000:]
    assert ("--resume: step_4 is damaged (shard_0001.safetensors is missing, shard_0002.safetensors is missing); "
            f"falling back to {run_dir / 'checkpoints' / 'step_2'}") in ran.err
    assert ran.out.startswith("nothing to do:") and "Ray dashboard" not in ran.out
    assert _files(run_dir) == before  # nothing written
    assert _state(tmp_path / "shm") == [] and not ran.left


def test_resume_with_no_complete_checkpoint_names_each_damaged_one(failed_run, tmp_path):
    run_dir = _damaged_copy(failed_run, tmp_path)
    (run_dir / "checkpoints" / "step_4" / "state.json").unlink()
    with open(run_dir / "checkpoints" / "step_2" / "shard_0002.safetensors", "r+b") as f:
        f.truncate(1000)
    before = _files(run_dir)
    ran = run([*CLI_SMALL, "--steps", "8", "--run-dir", str(run_dir), "--runtime.state_dir", str(tmp_path / "shm"),
               "--resume"], _env(tmp_path))
    assert ran.rc == 2
    assert ran.message.startswith(f"resume error: --resume: no complete checkpoint under {run_dir / 'checkpoints'} "
                                  f"(step_4 is damaged (state.json is missing); step_2 is damaged "
                                  f"(shard_0002.safetensors has 1000 bytes")
    assert _files(run_dir) == before  # nothing written
    assert _state(tmp_path / "shm") == [] and not ran.left


def test_checkpoint_checks_read_headers_and_sizes(failed_run, tmp_path):
    root, _, _ = failed_run
    run_dir = tmp_path / "run"
    shutil.copytree(root / "run", run_dir)
    ckpt = run_dir / "checkpoints" / "step_4"
    assert check_checkpoint(ckpt) == [] and newest_complete_checkpoint(run_dir) == (ckpt, [])
    shard = ckpt / "shard_0001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data + b"\0")  # one byte more than written
    assert check_checkpoint(ckpt) == [f"shard_0001.safetensors has {len(data) + 1} bytes, its header lists "
                                      f"{len(data)} (truncated or overwritten)"]
    state = json.loads((ckpt / "state.json").read_text())
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"master"', b'"mastex"')  # same size, another header
    shard.write_bytes(data[:8] + header + data[8 + n:])
    assert check_checkpoint(ckpt) == ["shard_0001.safetensors has another header than when it was written"]
    assert state["files"]["shard_0001.safetensors"]["bytes"] == len(data)
    shard.write_bytes(b"not safetensors")
    assert "not a readable safetensors file" in safetensors_problem(shard)
    assert newest_complete_checkpoint(run_dir)[0] == run_dir / "checkpoints" / "step_2"
