"""The streamed trainer through real Ray actors: equivalence with plain torch.optim.AdamW,
bit-identical resume, bad files skipped and counted."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.decoder import VideoDecoder
from megaslide_ray.data.manifest import read_manifest, write_manifest
from megaslide_ray.driver import Trainer
from megaslide_ray.state.checkpoint import read_checkpoint_shards
from megaslide_ray.training.baseline import InProcessTrainer


def run(cfg, run_dir, steps=None, resume=False):
    trainer = Trainer(cfg, run_dir=str(run_dir), resume=resume, progress=False)
    try:
        if steps is None:
            return trainer.train()
        for step in range(trainer.start_step, steps):
            trainer.train_step(step)
        return None
    finally:
        trainer.close()


def test_streamed_trainer_equals_in_process_adamw(ray_session, manifest, small_config, tmp_path):
    # Clipping active, weight decay and a warm-up + cosine schedule: all of the step semantics.
    cfg = small_config(**{"training.steps": 5, "optim.grad_clip": 0.05, "optim.weight_decay": 0.05,
                                    "optim.warmup_steps": 2, "optim.lr": 3e-3})
    summary = run(cfg, tmp_path / "run")
    streamed = read_checkpoint_shards(Path(summary.checkpoint))

    baseline = InProcessTrainer(cfg)
    initial = [torch.cat([p.detach().reshape(-1) for p in s.parameters()]).clone() for s in baseline.model.shards()]
    decoder = VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes)
    losses = [baseline.train_step(decoder.next_batch()).loss for _ in range(5)]
    decoder.close()
    reference = [torch.cat([p.detach().reshape(-1) for p in s.parameters()]) for s in baseline.model.shards()]

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert np.allclose([r["loss"] for r in rows], losses, rtol=1e-5)
    assert any(r["clip_coef"] < 1 for r in rows), "the test must exercise clipping"
    moved = 0.0
    for i, (a, b, init) in enumerate(zip(streamed, reference, initial)):
        rel = float((a - b).norm() / b.norm().clamp_min(1e-12))
        assert rel < 1e-5, f"shard {i}: relative error {rel:.2e}"
        moved = max(moved, float((b - init).norm() / b.norm()))
    assert moved > 1e-3  # the parameters really changed, so agreement means something


@pytest.mark.core
@pytest.mark.slow  # 25 s; a core drill, as test_cli's train-then-resume is (CI runs both every time)
def test_resume_continues_bit_identical(ray_session, manifest, small_config, tmp_path):
    cfg = small_config(**{"training.steps": 4, "training.checkpoint_every": 2})
    run(cfg, tmp_path / "a", steps=2)  # interrupted after the step-2 checkpoint
    assert (tmp_path / "a" / "checkpoints" / "latest").read_text().strip() == "step_2"
    resumed = run(cfg, tmp_path / "a", resume=True)
    assert resumed.first_step == 2 and resumed.last_step == 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]

    straight = run(cfg, tmp_path / "b")
    for i, (x, y) in enumerate(zip(read_checkpoint_shards(Path(resumed.checkpoint)),
                                   read_checkpoint_shards(Path(straight.checkpoint)))):
        assert torch.equal(x, y), f"shard {i} differs after resume"


@pytest.mark.slow  # 30 s; tests/test_attention_levers.py holds each lever to the in-process trainer by default
def test_dense_attention_levers_through_ray_and_a_resume(ray_session, manifest, small_config, tmp_path):
    """A dense block, dense samples above t = 0.5 and a 4-step dense-to-sparse curriculum, run
    through the Trainer, interrupted after step 2 and resumed: the curriculum continues from the
    checkpoint's step, so the parameters are the in-process trainer's after 4 straight steps."""
    cfg = small_config(**{"training.steps": 4, "training.checkpoint_every": 2, "attention.dense_blocks": "1",
                          "attention.dense_above_t": 0.5, "attention.dense_warmup_steps": 4})
    run(cfg, tmp_path / "a", steps=2)
    resumed = run(cfg, tmp_path / "a", resume=True)
    assert resumed.first_step == 2 and resumed.last_step == 4
    baseline = InProcessTrainer(cfg)
    decoder = VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes)
    for _ in range(4):
        baseline.train_step(decoder.next_batch())
    decoder.close()
    for i, (a, shard) in enumerate(zip(read_checkpoint_shards(Path(resumed.checkpoint)), baseline.model.shards())):
        b = torch.cat([p.detach().reshape(-1) for p in shard.parameters()])
        assert float((a - b).norm() / b.norm()) < 1e-5, f"shard {i}"


def test_bad_files_are_skipped_and_counted(ray_session, manifest, small_config, tmp_path):
    rows = read_manifest(manifest)
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "garbage.mp4").write_bytes(b"this is not a video" * 100)
    bad = [str(tmp_path / "zero.mp4"), str(tmp_path / "garbage.mp4"), str(tmp_path / "missing.mp4")]
    entries = [{"path": r.path, "caption": r.caption} for r in rows] + [{"path": p, "caption": "bad"} for p in bad]
    path = write_manifest(entries, tmp_path / "manifest.parquet")
    cfg = small_config(**{"data.manifest": str(path), "training.steps": 4})
    run(cfg, tmp_path / "run")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4 and all(np.isfinite(m["loss"]) for m in metrics)
    # Count the bad rows among the positions drawn, from the documented sample order.
    n, seed = len(entries), cfg.training.seed
    drawn = [int(np.random.default_rng([seed, p // n]).permutation(n)[p % n]) for p in range(metrics[-1]["data_position"])]
    expected = sum(1 for row in drawn if row >= len(rows))
    assert expected > 0, "the seed must draw at least one bad file for this test to mean anything"
    assert metrics[-1]["skipped_files"] == expected


def test_samples_during_training(ray_session, small_config, tmp_path):
    import decord

    from megaslide_ray.data.clips import read_frames

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# the samples\na red circle moving right\n\nA Blue Square, moving up!\n")
    cfg = small_config(**{"training.steps": 4, "training.sample_every": 2, "training.sample_steps": 2,
                          "training.sample_prompts_file": str(prompts)})
    run(cfg, tmp_path / "run")
    samples = tmp_path / "run" / "samples"
    names = [f"step_{s:06d}_{i:02d}_{slug}.mp4" for s in (2, 4)
             for i, slug in enumerate(("a-red-circle-moving-right", "a-blue-square-moving-up"))]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the row of the step that sampled names its videos and what the sampling held the step up by
    assert [r.get("sample") for r in rows] == [None, [str(samples / n) for n in names[:2]], None,
                                               [str(samples / n) for n in names[2:]]]
    assert rows[1]["sample_seconds"] > 0 and rows[1]["sample_failures"] == 0
    index = [json.loads(line) for line in (samples / "samples.jsonl").read_text().splitlines()]
    assert sorted(Path(e["video"]).name for e in index) == names
    assert {(e["step"], e["index"], e["prompt"], e["seed"]) for e in index} == {
        (s, i, p, i) for s in (2, 4) for i, p in enumerate(("a red circle moving right", "A Blue Square, moving up!"))}
    videos = {}
    for name in names:
        video = samples / name
        assert video.with_suffix(".png").is_file()
        reader = decord.VideoReader(str(video))
        videos[name] = read_frames(reader, list(range(len(reader))))
        assert videos[name].shape == (cfg.data.num_frames, cfg.data.height, cfg.data.width, 3)
    # the two prompts differ (caption and noise), the same prompt after another step differs (weights)
    assert not np.array_equal(videos[names[0]], videos[names[1]])
    assert not np.array_equal(videos[names[0]], videos[names[2]])


def test_the_sampler_waits_only_for_a_writer_two_samplings_behind(ray_session, small_config, tmp_path, monkeypatch):
    """Sampling hands each video to the writer and returns; with two samplings still being
    written the next one waits for the oldest, and ``collect`` returns what was written, in step
    order, without waiting."""
    import threading

    import ray

    from megaslide_ray.driver import components

    @ray.remote(num_cpus=0, max_concurrency=4)
    class GatedWriter:
        def __init__(self):
            self.gate = threading.Event()

        def open(self):
            self.gate.set()

        def write(self, x, step, index, prompt, seed, path):
            self.gate.wait()
            return (step, index, x.shape)

    class Predictor:  # the pipeline's predict: a zero velocity
        def predict(self, x, t, cond, cond_len, version):
            return torch.zeros_like(x)

    writer = GatedWriter.remote()
    monkeypatch.setattr(components, "start_sample_writer", lambda cfg, run_dir, model_dir: writer)
    cfg = small_config(**{"training.sample_every": 1, "training.sample_steps": 1})
    sampler = components.Sampler(cfg, Predictor(), tmp_path)
    for step in (1, 2):
        # the default prompt's slug: its words up to 40 characters
        assert sampler.run(step)["sample"] == [str(tmp_path / "samples" / f"step_{step:06d}_00_a-red-circle-moving-"
                                                                           f"right-on-a-dark-blue.mp4")]
        assert sampler.collect() == []
    third = threading.Thread(target=sampler.run, args=(3,))
    third.start()
    third.join(timeout=2.0)
    assert third.is_alive()  # two samplings in flight: the third waits for the oldest
    writer.open.remote()
    third.join(timeout=60)
    assert not third.is_alive()
    shape = (1, *cfg.latent_grid, cfg.model.in_channels)
    assert sampler.collect(wait_s=60) == [(1, 0, shape), (2, 0, shape), (3, 0, shape)]
    assert sampler.failures == 0
    sampler.abort()


def test_each_prompt_starts_from_its_own_fixed_noise_whatever_the_training_seed(small_config, tmp_path, monkeypatch):
    """Prompt i's samples start from the noise of seed ``training.sample_seed + i``: the same in
    runs of different ``training.seed``, so their samples compare."""
    import types

    from megaslide_ray.driver import components
    from megaslide_ray.evaluation.sampling import initial_noise

    handed = []
    writer = types.SimpleNamespace(write=types.SimpleNamespace(remote=lambda *args: handed.append(args)))
    monkeypatch.setattr(components, "start_sample_writer", lambda *args: writer)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    starts = {}
    for seed in (5, 9):
        seen = []

        class Predictor:  # records where each sample starts; a zero velocity keeps it there
            def predict(self, x, t, cond, cond_len, version):
                seen.append(x.clone())
                return torch.zeros_like(x)

        cfg = small_config(**{"training.seed": seed, "training.sample_every": 1, "training.sample_steps": 1,
                              "training.sample_seed": 7, "training.sample_prompts_file": str(prompts)})
        components.Sampler(cfg, Predictor(), tmp_path / str(seed)).run(1)
        starts[seed] = seen
    for i in (0, 1):
        assert torch.equal(starts[5][i], initial_noise(cfg, 7 + i)) and torch.equal(starts[9][i], starts[5][i])
    assert not torch.equal(starts[5][0], starts[5][1])
    assert [(a[1], a[2], a[3], a[4]) for a in handed] == [(1, i, p, 7 + i) for _ in (5, 9) for i, p in
                                                          enumerate(("one", "two"))]
    assert np.array_equal(handed[0][0], initial_noise(cfg, 7).numpy())  # a zero velocity: the sample is its noise


@pytest.mark.slow  # 15 s: test_samples_during_training keeps sampling during training in the default run
def test_samples_during_training_use_the_moving_average(ray_session, small_config, tmp_path, monkeypatch):
    """``training.ema_decay`` with ``ema_eval``: through Ray, the step-2 sample is denoised with the
    average of the weights (the checkpoint's ``ema``), not with the trained weights, and training
    goes on from the trained weights (the last checkpoint's, checked against the in-process trainer's)."""
    from actors.compute import ComputeActor
    from megaslide_ray.driver import components
    from megaslide_ray.evaluation.sampling import CheckpointWeights, euler_sample

    taken = []

    def recording(*args, **kwargs):
        taken.append(euler_sample(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(components, "euler_sample", recording)
    cfg = small_config(**{"training.steps": 3, "training.sample_every": 2, "training.sample_steps": 2,
                          "training.checkpoint_every": 2, "training.ema_decay": 0.5, "optim.lr": 3e-3})
    run(cfg, tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "step_2"

    def sample_with(average: bool) -> torch.Tensor:
        source = CheckpointWeights(ckpt, cfg, "w", average)
        compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
        try:
            return euler_sample(compute, cfg, cfg.training.sample_prompt, 2, cfg.training.sample_seed, 2)
        finally:
            compute.close()
            source.close()

    averaged, trained = sample_with(True), sample_with(False)
    assert len(taken) == 1
    torch.testing.assert_close(taken[0], averaged, rtol=1e-5, atol=1e-6)
    assert float((averaged - trained).abs().max()) > 100 * float((taken[0] - averaged).abs().max())
    baseline = InProcessTrainer(cfg)
    decoder = VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes)
    for _ in range(3):
        baseline.train_step(decoder.next_batch())
    decoder.close()
    final = read_checkpoint_shards(tmp_path / "run" / "checkpoints" / "step_3")
    for i, (got, shard) in enumerate(zip(final, baseline.model.shards())):
        want = torch.cat([p.detach().reshape(-1) for p in shard.parameters()])
        assert float((got - want).norm() / want.norm()) < 1e-5, f"shard {i}"


@pytest.mark.core  # CI runs it every time: the device shards' checkpoint and rollback rules
@pytest.mark.slow  # 80 s: four Trainer runs; tests/test_device_shards.py holds the update itself by default
def test_device_shards_checkpoint_resume_and_a_lost_compute_actor(ray_session, small_config, tmp_path, monkeypatch):
    """runtime.device_shards through the Trainer: a checkpoint holds the device shards' state, so an
    interrupted run resumed ends bit-identical to a straight run without device shards; a compute
    actor killed mid-step takes their state with it, and the run rolls back to the latest
    checkpoint, redoes the steps after it and ends there too."""
    from megaslide_ray.runtime import faults

    over = {"training.steps": 4, "training.checkpoint_every": 2}
    straight = run(small_config(**over), tmp_path / "plain")
    cfg = small_config(**over, **{"runtime.device_shards": 2})
    run(cfg, tmp_path / "a", steps=2)
    resumed = run(cfg, tmp_path / "a", resume=True)
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path / "faults"))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.mid_backward@3")
    killed = run(cfg, tmp_path / "killed")
    monkeypatch.delenv(faults.ENV_SPEC)
    assert killed.rollbacks == 1 and killed.last_step == 4
    want = read_checkpoint_shards(Path(straight.checkpoint))
    for summary in (resumed, killed):
        for i, (x, y) in enumerate(zip(read_checkpoint_shards(Path(summary.checkpoint)), want)):
            assert torch.equal(x, y), f"shard {i} differs ({summary.run_dir})"
