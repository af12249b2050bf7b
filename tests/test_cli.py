"""The main job as a user runs it: `python -m megaslide_ray.train`, then `--resume`."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import CLI_SMALL as SMALL
from conftest import run_cli


def _train(args, env):
    return run_cli([*SMALL, *args], env)


@pytest.mark.core  # CI runs it every time: the user's own train-then-resume
@pytest.mark.slow  # 40 s: a second CLI run on top of the shared one; the default run keeps to 10 minutes
def test_train_then_resume_continues_the_step_count(cli_run, tmp_path):
    first_dir, first, env = cli_run
    assert "Ray dashboard" in first.stdout and "done: steps 0->2" in first.stdout
    assert (first_dir / "config.toml").is_file()
    assert (first_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    manifest = first_dir.parent / "cache" / "demo-v1" / "manifest.parquet"
    assert manifest.is_file(), "the demo dataset is generated on first use"
    run_dir = tmp_path / "run"
    shutil.copytree(first_dir, run_dir)  # the session's run stays as it was for other tests

    other_pool = _train(["--steps", "3", "--run-dir", str(run_dir), "--resume", "--data.num_decoders", "2"], env)
    assert other_pool.returncode == 2  # refused before Ray starts: the data order would not continue
    assert "data.num_decoders=1" in other_pool.stderr and "Ray dashboard" not in other_pool.stdout

    second = _train(["--steps", "3", "--run-dir", str(run_dir), "--resume"], env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "done: steps 2->3" in second.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["loss"] > 0 for r in rows)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
    state = json.loads((run_dir / "checkpoints" / "step_3" / "state.json").read_text())
    assert state["step"] == 3 and state["config"]["model"]["depth"] == 1


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    proc = _train(["--steps", "2", "--run-dir", str(tmp_path / "empty"), "--resume"], env)
    assert proc.returncode != 0
    assert "no complete checkpoint" in proc.stderr


# -- interrupted runs ---------------------------------------------------------------------------

CONSTANT_LR = ["--optim.schedule", "constant", "--training.log_every", "1"]


def _start(args, env):
    return subprocess.Popen([sys.executable, "-m", "megaslide_ray.train", *SMALL, *CONSTANT_LR, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_steps(proc, metrics, n, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {n} steps after {timeout} s")


@pytest.mark.core
@pytest.mark.slow
def test_sigterm_checkpoints_exits_0_and_resume_matches_an_uninterrupted_run(tmp_path):
    from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_shards

    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    stopped = tmp_path / "stopped"
    proc = _start(["--steps", "200", "--run-dir", str(stopped)], env)
    _wait_for_steps(proc, stopped / "metrics.jsonl", 1)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGTERM" in out and f"--run-dir {stopped} --resume" in out
    ckpt = latest_checkpoint(stopped)
    assert ckpt is not None
    done = json.loads((ckpt / "state.json").read_text())["step"]
    assert 1 <= done < 200
    assert len((stopped / "metrics.jsonl").read_text().splitlines()) == done

    resumed = _train([*CONSTANT_LR, "--steps", str(done + 1), "--run-dir", str(stopped), "--resume"], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = _train([*CONSTANT_LR, "--steps", str(done + 1), "--run-dir", str(tmp_path / "straight")], env)
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = read_checkpoint_shards(latest_checkpoint(stopped))
    b = read_checkpoint_shards(latest_checkpoint(tmp_path / "straight"))
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_second_ctrl_c_quits_at_once_and_keeps_the_latest_checkpoint(tmp_path):
    from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_shards
    from megaslide_ray.state.segments import default_state_root, state_key

    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    run_dir = tmp_path / "run"
    # A simulated slow link (seconds per step) so that the second Ctrl-C lands before the stop is done.
    proc = _start(["--steps", "200", "--run-dir", str(run_dir), "--training.checkpoint_every", "1",
                   "--runtime.link_gbps", "0.0002"], env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    _wait_for_steps(proc, run_dir / "metrics.jsonl", 1)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while not any("stopping after the current step" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)  # the first Ctrl-C was taken: now the second
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=120)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode == 130, err[-3000:]
    assert "quitting at once" in err
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None and len(read_checkpoint_shards(ckpt)) == 3  # complete and loadable
    assert not (default_state_root() / state_key(str(run_dir))).exists(), "shared-memory state left behind"
