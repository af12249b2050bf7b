"""Refusals a user meets before anything starts, and the documented commands as written.

A run directory belongs to one run, and the main job refuses before Ray starts what cannot
work: a new run into an earlier run's directory (without ``--resume`` or ``--overwrite``), a
``--run-dir`` that is a file, ``--resume`` with another model than the checkpoint's, more compute
actors than the machine has CPUs. Each refusal is one message, exit 2, nothing changed and no
process left (``test_bad_inputs.run_here``). ``--overwrite`` removes the earlier run's files (and
only those) once every other check passed; the slow test replaces a real run with it. Exports
never overwrite without ``--overwrite``; ``sample`` refuses a ``--model-dir`` it would not use;
README's planner examples and docs/cli.md's demo defaults say what the code does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import CLI_SMALL, run_cli
from test_bad_inputs import _files, _state, run_here

from megaslide_ray.config import build_config, to_toml
from megaslide_ray.driver import launch as launch_module
from megaslide_ray.driver.preflight import RUN_ENTRIES, clear_run_dir

SMALL_OVERRIDES = {"model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "data.num_frames": 6,
                   "data.height": 16, "data.width": 16}
"""``CLI_SMALL``'s model as config overrides."""


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A run directory as a finished run leaves it, made without Ray: a step-0 checkpoint written
    by an in-process parameter store, config.toml and a metrics.jsonl line. Read-only to the tests."""
    from actors.param_store import ParameterStore

    root = tmp_path_factory.mktemp("earlier")
    run_dir = root / "run"
    cfg = build_config("tiny", None, {**SMALL_OVERRIDES, "runtime.state_dir": str(root / "shm"),
                                      "training.run_dir": str(run_dir)})
    store = ParameterStore(cfg, str(run_dir))
    try:
        store.save_checkpoint(str(run_dir), 0, {"data_position": 0})
    finally:
        store.close()
    (run_dir / "config.toml").write_text(to_toml(cfg))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    return run_dir


def _copy(earlier_run: Path, tmp_path: Path) -> Path:
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(earlier_run, run_dir)
    return run_dir


def _main(args, tmp_path, capsys):
    from megaslide_ray.train import main

    return run_here(main, [*CLI_SMALL, "--steps", "2", "--runtime.state_dir", str(tmp_path / "shm"), *args], capsys)


def test_a_new_run_into_an_earlier_runs_directory_is_refused_and_changes_nothing(earlier_run, tmp_path, capsys):
    run_dir = _copy(earlier_run, tmp_path)
    before = _files(run_dir)
    ran = _main(["--run-dir", str(run_dir)], tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == (f"run dir error: --run-dir {run_dir} already holds checkpoints, config.toml, metrics.jsonl: "
                           f"a run directory belongs to one run. Continue that run with --resume, replace it with "
                           f"--overwrite, or give a new --run-dir")
    assert _files(run_dir) == before and _state(tmp_path / "shm") == [] and not ran.left


def test_overwrite_never_removes_files_no_run_writes(earlier_run, tmp_path, capsys):
    run_dir = _copy(earlier_run, tmp_path)
    (run_dir / "notes.txt").write_text("mine")
    before = _files(run_dir)
    ran = _main(["--run-dir", str(run_dir), "--overwrite"], tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == (f"run dir error: --overwrite: --run-dir {run_dir} holds notes.txt, which no run writes; "
                           f"nothing was removed. Give a run's directory or a new --run-dir")
    assert _files(run_dir) == before and not ran.left


def test_resume_and_overwrite_together_are_refused(earlier_run, tmp_path, capsys):
    run_dir = _copy(earlier_run, tmp_path)
    before = _files(run_dir)
    ran = _main(["--run-dir", str(run_dir), "--resume", "--overwrite"], tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == (f"run dir error: --resume continues the run in {run_dir} and --overwrite replaces it: "
                           f"give one of them")
    assert _files(run_dir) == before and not ran.left


def test_a_run_dir_that_is_a_file_is_refused_before_ray(tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_text("not a directory")
    for extra in ([], ["--resume"]):
        ran = _main(["--run-dir", str(target), *extra], tmp_path, capsys)
        assert ran.rc == 2
        assert ran.message == (f"run dir error: --run-dir {target} is an existing file, not a directory: give the "
                               f"path of a directory (a new one, or an earlier run's with --resume)")
        assert target.read_text() == "not a directory" and not ran.left


def test_resume_with_another_model_names_the_field_before_ray(earlier_run, tmp_path, capsys):
    run_dir = _copy(earlier_run, tmp_path)
    before = _files(run_dir)
    ckpt = run_dir / "checkpoints" / "step_0"
    ran = _main(["--run-dir", str(run_dir), "--resume", "--model.depth", "8", "--attention.kind", "swin"],
                tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == (f"resume error: --resume: {ckpt} was trained with another model than this config's: "
                           f"model.depth 1 -> 8; attention.kind 'dsa' -> 'swin' (checkpoint -> this config). Leave "
                           f"these fields as the run had them to continue it, or start a new run in a new --run-dir "
                           f"(--init-from {ckpt} starts from its weights)")
    assert _files(run_dir) == before and _state(tmp_path / "shm") == [] and not ran.left


def test_resume_may_change_the_attention_backend(earlier_run, tmp_path, capsys, monkeypatch):
    # Same model, another kernel: accepted (``_run``, where Ray would start, is reached).
    run_dir = _copy(earlier_run, tmp_path)
    reached = []
    monkeypatch.setattr(launch_module, "_run", lambda cfg, run_dir_, point, *args: reached.append(point.step) or 0)
    ran = _main(["--run-dir", str(run_dir), "--resume", "--attention.backend", "reference"], tmp_path, capsys)
    assert ran.rc == 0, ran.err
    assert reached == [0] and not ran.left


def test_more_compute_actors_than_cpus_is_refused_with_what_was_found(tmp_path, capsys):
    ran = _main(["--run-dir", str(tmp_path / "run"), "--runtime.compute_actors", "99", "--runtime.device", "cpu"],
                tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == ("config error: runtime.compute_actors=99 asks for 99 CPU compute actors, but this machine "
                           "has 2 CPU(s) and no GPU: use at most 2 (each holds its own copy of a block's weights and "
                           "activations), or raise ray.num_cpus on a machine that has them")
    assert not (tmp_path / "run").exists() and not ran.left


def test_cuda_asked_for_on_a_machine_without_one_is_refused_before_ray(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    ran = _main(["--run-dir", str(tmp_path / "run"), "--runtime.device", "cuda"], tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == ("config error: runtime.device='cuda' but this machine has no GPU (found 2 CPUs and no CUDA "
                           "device); use --runtime.device auto or cpu")
    assert not ran.left


def test_overwrite_clears_the_earlier_run_once_every_check_passed(earlier_run, tmp_path, capsys, monkeypatch):
    run_dir = _copy(earlier_run, tmp_path)
    kept = tmp_path / "shm"
    seen = {}

    def started(cfg, run_dir_, *args):  # where Ray would start: what is left of the earlier run
        seen["entries"] = sorted(p.name for p in Path(run_dir_).iterdir())
        return 0

    monkeypatch.setattr(launch_module, "_run", started)
    ran = _main(["--run-dir", str(run_dir), "--overwrite"], tmp_path, capsys)
    assert ran.rc == 0 and seen["entries"] == [] and not ran.left
    # Refused by the last check before Ray (a bad fault spec): nothing removed.
    run_dir2 = _copy(earlier_run, tmp_path / "second")
    before = _files(run_dir2)
    ran = _main(["--run-dir", str(run_dir2), "--overwrite", "--inject-fault", "no-such-point"], tmp_path, capsys)
    assert ran.rc == 2 and ran.message.startswith("--inject-fault error:") and _files(run_dir2) == before
    assert not kept.exists() or _state(kept) == []


def test_clear_run_dir_removes_the_run_files_and_its_kept_state(earlier_run, tmp_path):
    run_dir = _copy(earlier_run, tmp_path)
    (run_dir / "samples").mkdir()
    (run_dir / "error.log").write_text("x")
    cfg = build_config("tiny", None, {**SMALL_OVERRIDES, "runtime.state_dir": str(tmp_path / "shm")})
    from megaslide_ray.state.kept import RESUME_FILE, state_path

    state = state_path(cfg, run_dir)
    state.mkdir(parents=True)
    (state / RESUME_FILE).write_text(json.dumps({"step": 3}))
    removed = clear_run_dir(cfg, str(run_dir))
    assert sorted(Path(p).name for p in removed) == sorted(["checkpoints", "config.toml", "error.log",
                                                             "metrics.jsonl", "samples", state.name])
    assert list(run_dir.iterdir()) == [] and not state.exists()
    assert set(RUN_ENTRIES) >= {"checkpoints", "config.toml", "metrics.jsonl", "samples", "tensorboard", "wandb"}


@pytest.mark.slow  # one 1-step run through Ray over the session's run
def test_overwrite_replaces_a_finished_run(cli_run, tmp_path):
    import shutil

    first_dir, _, env = cli_run
    run_dir = tmp_path / "run"
    shutil.copytree(first_dir, run_dir)
    proc = run_cli([*CLI_SMALL, "--steps", "1", "--run-dir", str(run_dir), "--overwrite", "--model.depth", "2"],
                   {**env, "MEGASLIDE_CACHE": env["MEGASLIDE_CACHE"]})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1"]
    assert "depth = 2" in (run_dir / "config.toml").read_text()
    assert os.path.isfile(run_dir / "checkpoints" / "step_1" / "state.json")


# ---------------------------------------------------------------------------------------------
# Exports never overwrite without --overwrite
# ---------------------------------------------------------------------------------------------


def _export(args, capsys):
    from megaslide_ray.pretrained import main

    return run_here(main, args, capsys)


def test_export_to_an_existing_file_that_is_not_safetensors_is_one_message(earlier_run, tmp_path, capsys):
    ckpt = earlier_run / "checkpoints" / "step_0"
    out = tmp_path / "weights.pt"
    out.write_text("earlier")
    for extra in ([], ["--overwrite"]):
        ran = _export([str(ckpt), str(out), *extra], capsys)
        assert ran.rc == 2
        assert ran.message == (f"error: {out} is an existing file and does not end in .safetensors: give "
                               f"OUT.safetensors for one file, or the path of a directory (new or empty) for one "
                               f"file per shard")
        assert out.read_text() == "earlier"


def test_export_never_overwrites_without_overwrite(earlier_run, tmp_path, capsys):
    from safetensors.torch import load_file

    ckpt = earlier_run / "checkpoints" / "step_0"
    one = tmp_path / "model.safetensors"
    one.write_bytes(b"earlier")
    ran = _export([str(ckpt), str(one)], capsys)
    assert ran.rc == 2
    assert ran.message == f"error: {one} exists: pass --overwrite to replace it, or give a new path"
    assert one.read_bytes() == b"earlier"
    ran = _export([str(ckpt), str(one), "--overwrite"], capsys)
    assert ran.rc == 0 and ran.out.split() == [str(one)]
    fresh = tmp_path / "fresh.safetensors"
    assert _export([str(ckpt), str(fresh)], capsys).rc == 0
    got, want = load_file(str(one)), load_file(str(fresh))
    assert sorted(got) == sorted(want) and all(got[k].equal(want[k]) for k in want)

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "model-00001-of-00009.safetensors").write_bytes(b"an earlier export of 9 shards")
    ran = _export([str(ckpt), str(shards)], capsys)
    assert ran.rc == 2
    assert ran.message == (f"error: {shards} is a directory with files in it: pass --overwrite to replace the export "
                           f"there, or give a new or empty directory")
    ran = _export([str(ckpt), str(shards), "--overwrite"], capsys)
    assert ran.rc == 0
    assert sorted(p.name for p in shards.iterdir()) == sorted(Path(p).name for p in ran.out.split())


def test_sample_refuses_a_model_dir_for_a_pixel_checkpoint(earlier_run, tmp_path, capsys):
    from megaslide_ray.sample import main

    ckpt = earlier_run / "checkpoints" / "step_0"
    for model_dir in ("/nonexistent", str(tmp_path)):
        ran = run_here(main, ["--checkpoint", str(ckpt), "--model-dir", model_dir, "--steps", "1", "--device", "cpu",
                              "--out", str(tmp_path / "x.mp4")], capsys)
        assert ran.rc == 2
        assert ran.message == (f"error: --model-dir {model_dir}: this checkpoint's model draws pixels "
                               f"(model.inputs='pixels'), so no model folder encodes its prompt or decodes its video; "
                               f"leave out --model-dir")
        assert not (tmp_path / "x.mp4").exists() and not ran.left


# ---------------------------------------------------------------------------------------------
# The documented commands say what the code does
# ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent


def test_readme_max_frames_example_runs_for_training_and_with_generate(capsys):
    import re
    import shlex

    from megaslide_ray.plan import main

    readme = (ROOT / "README.md").read_text()
    said = re.search(r"the longest 1080p clip that fits: (\d+) frames for training, (\d+) for sampling \(--generate\)",
                     readme)
    command = re.search(r"\n(python -m megaslide_ray\.plan [^\n]*\\\n[^\n]*--max-frames)\n", readme)
    assert said and command, "README's --max-frames example moved: update this test"
    args = shlex.split(command.group(1).replace("\\\n", " "))[3:]
    for extra, frames in (([], said.group(1)), (["--generate"], said.group(2))):
        assert main([*args, *extra]) == 0, capsys.readouterr().err
        assert f"longest clip that fits: {frames} frames" in capsys.readouterr().out


def test_docs_give_the_motion_demos_eval_every_the_code_uses():
    from megaslide_ray.train import DEMO_EVAL_EVERY

    cli = (ROOT / "docs" / "cli.md").read_text()
    assert f"`training.eval_every` defaults to {DEMO_EVAL_EVERY['motion']})" in cli
    assert f"`training.eval_every` defaulting to {DEMO_EVAL_EVERY['motion-simple']};" in cli


# ---------------------------------------------------------------------------------------------
# Joining a cluster that does not answer, and signals while Ray starts
# ---------------------------------------------------------------------------------------------


def test_an_address_where_nothing_listens_is_refused_at_once(tmp_path, capsys):
    import time

    started = time.monotonic()
    ran = _main(["--run-dir", str(tmp_path / "run"), "--ray-address", "127.0.0.1:1"], tmp_path, capsys)
    assert ran.rc == 2
    assert ran.message == ("ray error: nothing answers at --ray-address 127.0.0.1:1 (Connection refused): start the "
                           "cluster's head there (`ray start --head --port 1`) or give the address `ray start --head` "
                           "printed")
    assert time.monotonic() - started < 30 and not (tmp_path / "run").exists() and not ran.left


def _signal_when(proc, ready, sig, timeout=120.0) -> None:
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the command ended before the moment the test waits for"
    proc.send_signal(getattr(signal, sig))


def _session_left(sid: int, wait_s: float = 20.0) -> list[str]:
    import time

    from test_bad_inputs import _session_processes

    deadline = time.monotonic() + wait_s
    while (left := _session_processes(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _start_train(args, env):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "megaslide_ray.train", *CLI_SMALL, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _maps(proc, name: str) -> bool:
    try:
        return name in Path(f"/proc/{proc.pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_while_the_imports_load_is_one_line_and_130(tmp_path):
    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    proc = _start_train(["--run-dir", str(tmp_path / "run")], env)
    _signal_when(proc, lambda: _maps(proc, "libtorch"), "SIGINT")  # torch is loading: seconds of imports
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(("interrupted", "SIGINT: interrupted"))
    assert not (tmp_path / "run").exists() and not _session_left(proc.pid)


@pytest.mark.slow  # Ray starts: a local cluster's processes, then none
def test_ctrl_c_while_a_local_ray_starts_is_one_line_130_and_leaves_nothing(tmp_path):
    from test_bad_inputs import LOG_LINE

    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    shm_before = set(os.listdir("/dev/shm"))
    proc = _start_train(["--steps", "2", "--run-dir", str(tmp_path / "run"), "--runtime.state_dir",
                         str(tmp_path / "shm")], env)

    def gcs_started():  # ray.init is under way: its GCS server runs, the driver is not connected yet
        from test_bad_inputs import _session_processes

        return any("gcs_server" in p for p in _session_processes(proc.pid))

    _signal_when(proc, gcs_started, "SIGINT")
    out, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if not LOG_LINE.match(line)]
    assert proc.returncode == 130, err[-3000:]
    assert lines == ["SIGINT: interrupted while Ray was starting; nothing was started or written"] or lines == [
        "SIGINT: interrupted while Ray was starting; nothing was started or written (Ray's processes stopped)"], err
    assert not _session_left(proc.pid)
    assert _state(tmp_path / "shm") == [] and set(os.listdir("/dev/shm")) - shm_before == set()


@pytest.mark.slow  # a Ray driver that tries to connect (no cluster is started)
def test_an_address_that_does_not_answer_stops_in_time_and_obeys_sigterm(tmp_path):
    import socket
    import time

    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}
    with socket.socket() as listener:  # accepts TCP connections, speaks no Ray
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        started = time.monotonic()
        waits = _start_train(["--run-dir", str(tmp_path / "a"), "--ray-address", address,
                              "--ray.connect_timeout_s", "10"], env)
        stopped = _start_train(["--run-dir", str(tmp_path / "b"), "--ray-address", address], env)
        ray_loaded = time.monotonic() + 600.0

        def connecting():  # Ray's core loaded, then 4 s: inside ray.init's connection attempts
            nonlocal ray_loaded
            if ray_loaded > time.monotonic() + 60 and _maps(stopped, "_raylet"):
                ray_loaded = time.monotonic() + 4
            return time.monotonic() >= ray_loaded

        _signal_when(stopped, connecting, "SIGTERM")
        _, err_b = stopped.communicate(timeout=60)
        _, err_a = waits.communicate(timeout=120)
        took = time.monotonic() - started
    assert stopped.returncode == 130, err_b[-3000:]
    assert "SIGTERM: interrupted while Ray was starting" in err_b and "Traceback" not in err_b
    assert waits.returncode == 2 and took < 60, err_a[-3000:]
    assert err_a.strip().splitlines()[-1].startswith(f"ray error: the Ray cluster at --ray-address {address} did not "
                                                     f"answer within 10 s")
    assert not _session_left(waits.pid) and not _session_left(stopped.pid)
