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
        wait_left: float = 20.0, cwd: Path | None = None) -> Ran:
    """``python -m MODULE ARGS`` in a session of its own, as a user runs it; then the processes
    left in that session (Ray's, the actors') once it returned, given ``wait_left`` s to go."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True, cwd=cwd)
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


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                found.add(int(pid))
        except (OSError, IndexError):
            pass
    return found


def run_here(main, args: list[str], capsys, cwd: Path | None = None, monkeypatch=None) -> Ran:
    """A command refused before it starts anything, run in this process (a second, not five):
    ``main(args)``, its output, and any child process it left (there must be none, and no Ray)."""
    import ray

    before = _children()
    if cwd is not None:
        monkeypatch.chdir(cwd)
    rc = main(args)
    out, err = capsys.readouterr()
    left = [f"{pid}" for pid in _children() - before] + (["ray is initialised"] if ray.is_initialized() else [])
    return Ran(rc, out, err, left)


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


@pytest.mark.slow  # 38 s: a CLI run that fails at step 6, run by CI every time (core); the refusals before Ray stay in the default run
@pytest.mark.core
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


@pytest.mark.slow  # 25 s: a Ray run (the bit-identical test below resumes the same way)
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
    # One s/step figure: the step line's and the summary's are the same number.
    step_line = re.search(r"step 6/6 \|.*\| ([0-9.]+) s/step", ran.err).group(1)
    assert f", {step_line} s/step," in ran.out
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


def test_resume_falls_back_past_a_damaged_checkpoint_before_ray(failed_run, tmp_path, capsys, caplog):
    from megaslide_ray.train import main

    run_dir = _damaged_copy(failed_run, tmp_path)
    before = _files(run_dir)
    # --steps 2: the fallback (step_2) has nothing left to do, so the run ends before Ray starts.
    ran = run_here(main, [*CLI_SMALL, "--steps", "2", "--run-dir", str(run_dir), "--runtime.state_dir",
                          str(tmp_path / "shm"), "--resume"], capsys)
    ran.err += caplog.text
    assert ran.rc == 0, ran.err[-3000:]
    assert ("--resume: step_4 is damaged (shard_0001.safetensors is missing, shard_0002.safetensors is missing); "
            f"falling back to {run_dir / 'checkpoints' / 'step_2'}") in ran.err
    assert ran.out.startswith("nothing to do:") and "Ray dashboard" not in ran.out
    assert _files(run_dir) == before  # nothing written
    assert _state(tmp_path / "shm") == [] and not ran.left


def test_resume_with_no_complete_checkpoint_names_each_damaged_one(failed_run, tmp_path, capsys):
    from megaslide_ray.train import main

    run_dir = _damaged_copy(failed_run, tmp_path)
    (run_dir / "checkpoints" / "step_4" / "state.json").unlink()
    with open(run_dir / "checkpoints" / "step_2" / "shard_0002.safetensors", "r+b") as f:
        f.truncate(1000)
    before = _files(run_dir)
    ran = run_here(main, [*CLI_SMALL, "--steps", "8", "--run-dir", str(run_dir), "--runtime.state_dir",
                          str(tmp_path / "shm"), "--resume"], capsys)
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
    # Neither latest nor the damaged checkpoint's state.json is needed to find the complete one.
    (ckpt / "state.json").unlink()
    (run_dir / "checkpoints" / "latest").unlink()
    assert newest_complete_checkpoint(run_dir) == (run_dir / "checkpoints" / "step_2",
                                                   [(ckpt, ["state.json is missing"])])


# ---------------------------------------------------------------------------------------------
# The Wan flow: a tiny random diffusers folder, its latents, a step-0 checkpoint
# ---------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                   text_dim=16, freq_dim=16, ffn_dim=24, num_layers=2)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """``(root, wan_dir, latent manifest, wan checkpoint)``: a tiny random Wan folder (as in
    test_wan_e2e), three demo clips precomputed in this process, and a step-0 checkpoint of the
    model --init-from the folder with 3D-DSA (written by an in-process store, no Ray)."""
    from diffusers import WanTransformer3DModel
    from wan_models import FRAMES, SIZE, make_wan_dir

    from actors.param_store import ParameterStore
    from megaslide_ray.data.demo import ensure_demo_dataset
    from megaslide_ray.state.pretrained_io import config_for_diffusers_dir
    from pipelines.latent_precompute import precompute

    root = tmp_path_factory.mktemp("wan")
    wan_dir = make_wan_dir(root / "Wan-Tiny")
    torch.manual_seed(3)
    WanTransformer3DModel(**TRANSFORMER).save_pretrained(wan_dir / "transformer")
    videos = ensure_demo_dataset(root / "videos", num_videos=3)
    precompute(wan_dir, videos, root / "latents", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32", num_encoders=0,
               progress=False)
    cfg = config_for_diffusers_dir(wan_dir, None, None, {**WAN_DATA_OVERRIDES, "runtime.state_dir": str(root / "shm"),
                                                         "data.manifest": str(root / "latents" / "manifest.parquet")})
    store = ParameterStore(cfg, str(root / "run"), init_from=str(wan_dir))
    try:
        ckpt = store.save_checkpoint(str(root / "run"), 0, {"data_position": 0})
    finally:
        store.close()
    return root, wan_dir, root / "latents" / "manifest.parquet", Path(ckpt)


WAN_DATA = ["--data.num_frames", "9", "--data.height", "32", "--data.width", "32", "--data.batch_size", "1",
            "--ray.num_cpus", "2", "--no-progress"]
WAN_DATA_OVERRIDES = {"data.num_frames": 9, "data.height": 32, "data.width": 32, "data.batch_size": 1,
                      "attention.window": "3,1,1"}


def _wan_env(tmp_path: Path) -> dict:
    """For commands run from another folder: the repository's packages first (as from its root)."""
    return {**_env(tmp_path), "PYTHONPATH": str(ROOT)}


def test_a_window_larger_than_the_token_grid_is_refused_with_one_that_fits(wan, tmp_path, capsys):
    from megaslide_ray.train import main

    _, wan_dir, manifest, _ = wan
    ran = run_here(main, ["--init-from", str(wan_dir), "--data", str(manifest), *WAN_DATA, "--run-dir",
                          str(tmp_path / "run"), "--runtime.state_dir", str(tmp_path / "shm")], capsys)
    assert ran.rc == 2
    assert ran.message == ("config error: attention.window=(3, 7, 7): the height size 7 exceeds the token grid's 2 "
                           "height (grid (3, 2, 2) = latent size / model.patch_size); a window that fits: "
                           "--attention.window 3,1,1")
    assert not (tmp_path / "run").exists() and _state(tmp_path / "shm") == [] and not ran.left


def test_a_latent_manifest_with_no_latent_file_left_is_refused_before_ray(wan, tmp_path):
    # As a user runs it (a subprocess in its own session): the refusals before Ray start nothing.
    _, wan_dir, manifest, _ = wan
    cache = tmp_path / "latents"
    shutil.copytree(manifest.parent, cache)
    shutil.rmtree(cache / "latents")
    ran = run(["--init-from", str(wan_dir), "--data", str(cache / "manifest.parquet"), *WAN_DATA,
               "--attention.window", "3,1,1", "--run-dir", str(tmp_path / "run"), "--runtime.state_dir",
               str(tmp_path / "shm")], _env(tmp_path))
    assert ran.rc == 2
    assert ran.message.startswith(f"data error: data.manifest='{cache / 'manifest.parquet'}': none of its 3 latent "
                                  f"files exists (e.g. {cache / 'latents'}")
    assert "Ray dashboard" not in ran.out and not (tmp_path / "run").exists()
    assert _state(tmp_path / "shm") == [] and not ran.left


def test_samples_without_their_model_folder_are_refused_before_ray(wan, tmp_path, capsys):
    from megaslide_ray.train import main

    _, wan_dir, manifest, _ = wan
    common = ["--data", str(manifest), *WAN_DATA, "--attention.window", "3,1,1", "--sample-every", "2",
              "--run-dir", str(tmp_path / "run"), "--runtime.state_dir", str(tmp_path / "shm")]
    ran = run_here(main, ["--init-from", str(wan_dir), *common, "--training.sample_model_dir",
                          str(tmp_path / "nowhere")], capsys)
    assert ran.rc == 2
    assert ran.message.startswith(f"config error: training.sample_model_dir '{tmp_path / 'nowhere'}': no such local "
                                  f"folder")
    parts = tmp_path / "no-vae"  # the transformer alone: it trains, but its samples cannot be decoded
    shutil.copytree(wan_dir / "transformer", parts / "transformer")
    ran = run_here(main, ["--init-from", str(parts / "transformer"), *common], capsys)
    assert ran.rc == 2
    assert ran.message == (f"config error: training.sample_every=2 with model.arch='wan' on latents: the samples need "
                           f"a local diffusers model folder, its text_encoder/, tokenizer/ and vae/; the init_from "
                           f"source {parts / 'transformer'} has no vae/ beside it; give --training.sample_model_dir "
                           f"DIR (or set training.sample_every=0)")
    assert not (tmp_path / "run").exists() and _state(tmp_path / "shm") == [] and not ran.left


def test_init_from_a_cut_safetensors_file_names_it(wan, tmp_path, capsys):
    from megaslide_ray.train import main

    _, wan_dir, manifest, _ = wan
    cut = tmp_path / "Wan-Cut"
    shutil.copytree(wan_dir, cut)
    weights = cut / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    ran = run_here(main, ["--init-from", str(cut), "--data", str(manifest), *WAN_DATA, "--attention.window", "3,1,1",
                          "--run-dir", str(tmp_path / "run"), "--runtime.state_dir", str(tmp_path / "shm")], capsys)
    assert ran.rc == 2
    assert ran.message == (f"init-from error: --init-from {cut / 'transformer'}: 1 of its 1 safetensors files cannot "
                           f"be read:")
    assert f"{weights}: has {weights.stat().st_size} bytes, its header lists" in ran.err
    assert not (tmp_path / "run").exists() and _state(tmp_path / "shm") == [] and not ran.left


def test_sample_checks_the_model_folder_before_denoising_and_never_asks_a_hub(wan, tmp_path, capsys, monkeypatch):
    from megaslide_ray.sample import main

    _, wan_dir, _, ckpt = wan
    shutil.copytree(wan_dir, tmp_path / "Wan-NoVae", ignore=shutil.ignore_patterns("vae"))
    started = time.monotonic()
    # A relative folder without vae/ once went to a model hub, five times, after the whole denoising.
    ran = run_here(main, ["--checkpoint", str(ckpt), "--model-dir", "Wan-NoVae", "--prompt", "a red circle",
                          "--steps", "50", "--device", "cpu", "--out", str(tmp_path / "x.mp4")], capsys, cwd=tmp_path,
                   monkeypatch=monkeypatch)
    assert ran.rc == 2
    assert ran.message == (f"error: --model-dir 'Wan-NoVae' ({tmp_path / 'Wan-NoVae'}) lacks vae/: it must be a local "
                           f"diffusers-format Wan folder with text_encoder/, tokenizer/, vae/")
    assert time.monotonic() - started < 10 and not (tmp_path / "x.mp4").exists() and not ran.left


@pytest.mark.slow  # 15 s: a whole sample through the VAE
def test_sample_from_a_relative_model_folder_warns_on_an_empty_prompt(wan, tmp_path):
    _, wan_dir, _, ckpt = wan
    shutil.copytree(wan_dir, tmp_path / "Wan-Tiny")
    ran = run(["--checkpoint", str(ckpt), "--model-dir", "Wan-Tiny", "--prompt", "", "--steps", "1", "--device",
               "cpu", "--out", "x.mp4"], _wan_env(tmp_path), module="megaslide_ray.sample", cwd=tmp_path)
    assert ran.rc == 0, ran.err[-3000:]
    assert "WARNING megaslide_ray.evaluation.sampling: the prompt is empty" in ran.err
    assert (tmp_path / "x.mp4").is_file() and not ran.left


def test_precompute_interrupted_says_how_to_continue_and_continuing_works(wan, tmp_path, monkeypatch, capsys):
    from megaslide_ray import precompute as cli
    from megaslide_ray.data import encoders as E
    from megaslide_ray.data.demo import ensure_demo_dataset

    root, wan_dir, _, _ = wan
    videos = ensure_demo_dataset(root / "videos", num_videos=3)
    real, calls = E.Encoder.encode_clips, []

    def interrupted(self, tasks):  # Ctrl-C arrives while the second call encodes
        calls.append(len(tasks))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, tasks)

    monkeypatch.setattr(E.Encoder, "encode_clips", interrupted)
    args = ["--model-dir", str(wan_dir), "--data", str(videos), "--out", str(tmp_path / "out"), "--frames", "9",
            "--height", "32", "--width", "32", "--dtype", "fp32", "--num-encoders", "0", "--device", "cpu",
            "--no-progress"]
    ran = run_here(cli.main, args, capsys)
    assert ran.rc == 130 and not ran.left
    assert ran.message.startswith(f"interrupted: the 2 clip(s) already encoded are kept in "
                                  f"{tmp_path / 'out' / 'latents'}; run the same command again to continue")
    monkeypatch.setattr(E.Encoder, "encode_clips", real)
    assert cli.main(args) == 0  # the same command continues: only the clip not written yet is encoded
    assert ": 1 encoded, 2 already done, 0 skipped" in capsys.readouterr().out


def test_index_keeps_the_captions_of_a_folder_that_has_a_manifest(manifest):
    from megaslide_ray.data.manifest import read_manifest
    from megaslide_ray.data.video_index import index_videos

    rows, problems = index_videos(Path(manifest).parent)
    assert not problems
    want = {Path(e.path).resolve(): e.caption for e in read_manifest(manifest)}
    assert {Path(r.path).resolve(): r.caption for r in rows} == want and all(want.values())


# ---------------------------------------------------------------------------------------------
# What a run says: validation and samples that fail, what --init-from loaded, config.toml, s/step
# ---------------------------------------------------------------------------------------------


class _BrokenPipeline:
    """A pipeline whose forward passes fail (as a validation clip or a sample may)."""

    def status(self):
        raise RuntimeError("the compute actor could not run the validation batch")

    def predict(self, *args):
        raise RuntimeError("sampling failed in the compute actor")


def test_a_failing_validation_or_sample_is_logged_and_counted_and_training_goes_on(small_config, tmp_path, caplog,
                                                                                   monkeypatch):
    from megaslide_ray.driver import components
    from megaslide_ray.driver.components import Sampler, Validator

    monkeypatch.setattr(components, "start_sample_writer", lambda *args: None)  # never reached: no Ray here
    cfg = small_config(**{"training.sample_steps": 1, "training.sample_every": 3})
    validator, sampler = Validator(cfg, _BrokenPipeline(), None, tmp_path), Sampler(cfg, _BrokenPipeline(), tmp_path)
    assert validator.run(3) == {"val_failures": 1} and validator.run(6) == {"val_failures": 2}
    row = sampler.run(3)
    assert row.keys() == {"sample_seconds", "sample_failures"} and row["sample_failures"] == 1
    assert "validation after step 3 failed, training goes on: the compute actor could not run the validation " \
           "batch" in caplog.text
    assert "sampling after step 3 failed, training goes on: sampling failed in the compute actor" in caplog.text
    log_text = (tmp_path / "error.log").read_text()
    assert log_text.count("Traceback") == 3 and "validation after step 6 failed (training went on)" in log_text


def test_init_from_is_described_and_recorded(wan, tmp_path):
    from megaslide_ray.config import to_toml
    from megaslide_ray.state.pretrained_io import check_pretrained, describe_init
    from megaslide_ray.train import build_parser, config_from_args

    _, wan_dir, manifest, _ = wan
    args, extra = build_parser().parse_known_args(["--init-from", str(wan_dir), "--data", str(manifest),
                                                   *WAN_DATA[:-3], "--attention.window", "3,1,1"])
    cfg = config_from_args(args, extra)
    line = describe_init(cfg, str(wan_dir), check_pretrained(cfg, str(wan_dir)))
    assert line.startswith(f"init-from: 69 tensors (9,648 parameters) from {wan_dir / 'transformer'} (1 file); 8 "
                           f"tensors (1,508 parameters) start fresh: the DSA offset heads (blocks.0.attn1.offsets.*, "
                           f"blocks.1.attn1.offsets.*)")
    toml = to_toml(cfg)
    assert toml.splitlines()[1] == ("# [model] below is this run's own, not preset wan2.1-t2v-1.3b's (the preset is "
                                    "where the other fields started)")
    assert 'inputs = "latents"' in toml and f'init_from = "{wan_dir}"' in toml


def test_one_seconds_per_step_figure():
    from megaslide_ray.driver.loop import seconds_per_step

    rows = [{"step_seconds": s} for s in (9.0, 1.0, 2.0)]
    assert seconds_per_step(rows) == 1.5 and seconds_per_step(rows[:1]) == 9.0 and seconds_per_step([]) == 0.0


# ---------------------------------------------------------------------------------------------
# Hangs become faults; an error after Ray with nothing newer than a checkpoint (slow: Ray runs)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # 60 s: the step waits out the store's bound, the store is killed and restarted
def test_a_store_that_hangs_on_a_gradient_report_is_recovered_like_a_dead_one(failed_run, tmp_path):
    root, _, env = failed_run
    ran = run([*CLI_SMALL, *STEPS, "--run-dir", str(tmp_path / "run"), "--runtime.state_dir", str(tmp_path / "shm"),
               "--runtime.store_timeout_s", "5", "--inject-fault", "store.after_last_report@3:hang"], env)
    assert ran.rc == 0, ran.err[-3000:]
    assert "did not answer 1 of this step's" in ran.err and "killing the parameter store" in ran.err
    assert "recovered from 1 actor failure(s)" in ran.out
    # The run goes on exactly: its checkpoint at step 4 is the failed run's (the same six steps).
    for a, b in zip(read_checkpoint_shards(root / "run" / "checkpoints" / "step_4"),
                    read_checkpoint_shards(tmp_path / "run" / "checkpoints" / "step_4")):
        assert torch.equal(a, b)
    assert _state(tmp_path / "shm") == [] and not ran.left


def _hanging_encoder():
    from megaslide_ray.data.encoders import Encoder

    class HangingEncoder(Encoder):
        """Its call on a clip of a file named hang* never returns (a codec stuck on a file)."""

        def encode_clips(self, tasks):
            if any(Path(t["source"]).name.startswith("hang") for t in tasks):
                time.sleep(3600)
            return super().encode_clips(tasks)

    return HangingEncoder


@pytest.mark.slow  # 45 s: an encoder actor is started three times
def test_an_encoder_that_hangs_is_killed_replaced_and_the_clip_listed(wan, tmp_path, monkeypatch):
    import ray
    import ray.cloudpickle
    from wan_models import FRAMES, SIZE

    from megaslide_ray.data.manifest import ManifestEntry, read_manifest, write_manifest
    from pipelines.encoder_pool import EncoderPool
    from pipelines.latent_precompute import precompute

    root, wan_dir, _, _ = wan
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    entries = read_manifest(next((root / "videos").rglob("manifest.parquet")))
    hang = tmp_path / "hang.mp4"
    shutil.copy(entries[0].path, hang)
    manifest = write_manifest([entries[0], ManifestEntry(path=str(hang), caption="x"), entries[1]],
                              tmp_path / "m.parquet")
    monkeypatch.setattr(EncoderPool, "encoder_cls", _hanging_encoder())
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="megaslide", logging_level="ERROR")
    try:
        rep = precompute(wan_dir, manifest, tmp_path / "out", frames=FRAMES, height=SIZE, width=SIZE, num_encoders=1,
                         progress=False, hang_timeout_s=15)
    finally:
        ray.shutdown()
    assert rep.clips == 2 and rep.encoded == 2
    assert [p for p, _ in rep.skipped] == [str(hang)] and "hung on it twice (no answer in 15 s)" in rep.skipped[0][1]


@pytest.mark.slow  # 25 s: a Ray run
def test_unreadable_data_found_after_ray_started_releases_the_state(wan, tmp_path):
    _, wan_dir, manifest, _ = wan
    cache = tmp_path / "latents"
    shutil.copytree(manifest.parent, cache)
    for f in (cache / "latents").iterdir():
        f.write_bytes(b"not safetensors")
    ran = run(["--init-from", str(wan_dir), "--data", str(cache / "manifest.parquet"), *WAN_DATA,
               "--attention.window", "3,1,1", "--steps", "2", "--run-dir", str(tmp_path / "run"),
               "--runtime.state_dir", str(tmp_path / "shm")], _env(tmp_path))
    assert ran.rc == 1
    assert ran.message.startswith(f"error: no row of manifest '{cache / 'manifest.parquet'}' decodes (all 3 failed)")
    assert "(raised in VideoDecoder.next_batch_and_info" in ran.err
    assert "state released: nothing was left in shared memory; no checkpoint was written" in ran.err
    assert (tmp_path / "run" / "error.log").is_file() and "Traceback" not in ran.err
    assert _state(tmp_path / "shm") == [] and not ran.left
