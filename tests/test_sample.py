"""Sampling from a checkpoint: train a tiny model for 2 steps in-process (no Ray), save a
checkpoint, then sample through ``ComputeActor.predict`` (function API and the CLI) and read
the mp4 back with decord."""

import subprocess
import sys

import decord
import numpy as np
import pytest

from actors.compute import ComputeActor, LocalStoreClient
from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.data.captions import caption_batch
from megaslide_ray.data.clips import read_frames
from megaslide_ray.evaluation.sampling import CheckpointWeights, sample_video, sampling_config
from megaslide_ray.models.videodit import VideoDiT

PROMPT = "a red circle moving right on a dark blue background"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    (root / "state").mkdir()
    cfg = build_config("tiny", None, {
        "model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "model.patch_size": "2,4,4",
        "data.num_frames": 8, "data.height": 32, "data.width": 32, "training.steps": 2,
        "runtime.state_dir": str(root / "state"), "runtime.compute_threads": 2, "runtime.optimizer_threads": 2})
    rng = np.random.default_rng(0)
    caption, caption_len = caption_batch(PROMPT, cfg.model.caption_max_bytes, 2)
    batch = {"video": rng.integers(0, 256, (2, 8, 32, 32, 3), dtype=np.uint8), "caption": caption,
             "caption_len": caption_len, "position": 2}
    run = root / "run"
    store = ParameterStore(cfg, str(run))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        for step in range(2):
            compute.train_step(batch, step)
            store.wait_step(step)
        store.save_checkpoint(str(run), 2, {"data_position": 0})
    finally:
        compute.close()
        store.close()
    return run


def _decode(path):
    reader = decord.VideoReader(str(path))
    return read_frames(reader, np.arange(len(reader)))


def test_predict_matches_the_whole_model(run_dir):
    """The streamed forward (checkpoint weights, shard by shard) equals an ordinary forward."""
    import json

    import torch

    ckpt = run_dir / "checkpoints" / "step_2"
    cfg = sampling_config(json.loads((ckpt / "state.json").read_text()), frames=6, device="cpu")
    source = CheckpointWeights(ckpt, cfg)
    compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    model = VideoDiT(cfg)
    for i, module in enumerate(model.shards()):
        flat = torch.from_numpy(source.get_weights(i, 2).copy()).view(torch.float32)
        module.load_state_dict(source.layouts[i].views(flat))
    x = torch.randn(2, 6, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.9, 0.3])
    cap, cap_len = caption_batch(PROMPT, cfg.model.caption_max_bytes, 2)
    cap_len[1] = 0
    try:
        got = compute.predict(x, t, cap, cap_len, 2)
        with torch.no_grad():
            want = model(x, t, torch.from_numpy(cap), torch.from_numpy(cap_len))
    finally:
        compute.close()
        source.close()
    assert want.abs().max() > 0, "the head must have moved off its zero init after 2 steps"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sample_is_deterministic_per_seed(run_dir, tmp_path):
    a = sample_video(run_dir, PROMPT, tmp_path / "a.mp4", frames=8, steps=3, seed=1)
    b = sample_video(run_dir / "checkpoints" / "step_2", PROMPT, tmp_path / "b.mp4", frames=8, steps=3, seed=1)
    c = sample_video(run_dir, PROMPT, tmp_path / "c.mp4", frames=8, steps=3, seed=2)
    assert a.checkpoint_step == 2
    assert a.frames.shape == (8, 32, 32, 3) and a.frames.dtype == np.uint8
    va, vb, vc = _decode(a.video_path), _decode(b.video_path), _decode(c.video_path)
    assert va.shape == (8, 32, 32, 3)
    np.testing.assert_array_equal(a.frames, b.frames)
    np.testing.assert_array_equal(va, vb)
    assert not np.array_equal(a.frames, c.frames)
    assert not np.array_equal(va, vc)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_other_size_and_guidance(run_dir, tmp_path):
    r = sample_video(run_dir, PROMPT, tmp_path / "g.mp4", frames=6, height=16, width=24, steps=2, seed=0,
                     cfg_scale=3.0)
    assert _decode(r.video_path).shape == (6, 16, 24, 3)
    big = sample_video(run_dir, PROMPT, tmp_path / "big.mp4", frames=6, height=16, width=24, steps=2, seed=0,
                       cfg_scale=3.0, upscale=3)
    assert big.frames.shape == (6, 48, 72, 3)
    np.testing.assert_array_equal(big.frames[:, ::3, ::3], r.frames)  # the same sample, pixels repeated
    np.testing.assert_array_equal(big.frames[:, 2::3, 1::3], r.frames)
    assert _decode(big.video_path).shape == (6, 48, 72, 3)
    with pytest.raises(ValueError, match="upscale=0"):
        sample_video(run_dir, PROMPT, tmp_path / "z.mp4", steps=1, upscale=0)


def test_guidance_without_caption_dropout_warns(run_dir, tmp_path, caplog):
    import json
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints" / "step_2", ckpt)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["config"]["training"]["caption_dropout"] == 0.1  # the default trains the empty caption
    state["config"]["training"]["caption_dropout"] = 0.0
    (ckpt / "state.json").write_text(json.dumps(state))
    with caplog.at_level("WARNING", logger="megaslide_ray.evaluation.sampling"):
        sample_video(ckpt, PROMPT, tmp_path / "a.mp4", steps=1, cfg_scale=1.0)
        assert "caption dropout" not in caplog.text
        sample_video(ckpt, PROMPT, tmp_path / "b.mp4", steps=1, cfg_scale=3.0)
    assert "trained without caption dropout" in caplog.text


def test_sample_refuses_sizes_off_the_patch_grid(run_dir, tmp_path):
    with pytest.raises(ConfigError, match="--height 30 is not a positive multiple of the model's patch size 4"):
        sample_video(run_dir, PROMPT, tmp_path / "x.mp4", height=30)


def test_sample_cli(run_dir, tmp_path):
    out = tmp_path / "cli" / "video.mp4"
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.sample", "--checkpoint", str(run_dir), "--prompt",
                           PROMPT, "--frames", "6", "--steps", "2", "--seed", "3", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "video:" in proc.stdout
    assert _decode(out).shape == (6, 32, 32, 3)
    assert out.with_suffix(".png").is_file()

    bad = subprocess.run([sys.executable, "-m", "megaslide_ray.sample", "--checkpoint", str(tmp_path / "nowhere"),
                          "--out", str(tmp_path / "n.mp4")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "neither a checkpoint directory" in bad.stderr


@pytest.mark.slow  # a benchmark end to end (about 10 s): the default run stays under 10 minutes
def test_learning_benchmark_scores_a_checkpoint_as_a_user_would(run_dir, tmp_path, monkeypatch):
    """``benchmarks.studies.learning --checkpoint``: every prompt sampled by megaslide_ray.sample into
    an mp4 (upscaled), and the scores are the motion metric of those mp4s as read back."""
    import json

    from benchmarks.studies import learning
    from benchmarks.studies.harness import shows_prompt
    from megaslide_ray.evaluation.motion_score import motion_fidelity, read_video

    captions = ["a red circle moving right fast on a black background",
                "a green square moving up slowly on a dark blue background"]
    monkeypatch.setattr(learning, "prompts_of", lambda variant, split, n: captions[:n])
    out = tmp_path / "scored"
    assert learning.main(["--checkpoint", str(run_dir), "--prompts", "2", "--sample-steps", "2", "--upscale", "2",
                          "--out", str(out)]) == 0
    got = json.loads((out / "learning.json").read_text())
    assert got["meta"]["checkpoint"].endswith("step_2") and [p["step"] for p in got["points"]] == [2]
    samples = got["points"][0]["samples"]
    assert [s["caption"] for s in samples] == captions
    for j, (s, caption) in enumerate(zip(samples, captions)):
        frames = read_video(out / f"sample_{j:02d}.mp4")
        assert frames.shape == (8, 64, 64, 3)
        want = motion_fidelity(frames, caption)
        assert s["detection_rate"] == want["detection_rate"] and s["shows"] == shows_prompt(want)
    assert (out / "learning_step_2.png").is_file()
