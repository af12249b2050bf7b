"""The main job as a user runs it: `python -m megaslide_ray.train`, then `--resume`."""

import json
import os
import subprocess
import sys

SMALL = ["--model.depth", "1", "--model.hidden_size", "32", "--model.num_heads", "2", "--data.num_frames", "6",
         "--data.height", "16", "--data.width", "16", "--ray.num_cpus", "2", "--no-progress"]


def _train(args, env):
    return subprocess.run([sys.executable, "-m", "megaslide_ray.train", *SMALL, *args], capture_output=True,
                          text=True, timeout=600, env=env)


def test_train_then_resume_continues_the_step_count(tmp_path):
    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    run_dir = tmp_path / "run"
    first = _train(["--steps", "2", "--run-dir", str(run_dir)], env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Ray dashboard" in first.stdout and "done: steps 0->2" in first.stdout
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_2"
    manifest = tmp_path / "cache" / "demo-v1" / "manifest.parquet"
    assert manifest.is_file(), "the demo dataset is generated on first use"

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
