"""The offset field of a dsa checkpoint: offsets read back through the real shards, the motion
estimate recovers a planted motion, and the drawing is written."""

import math

import numpy as np
import pytest
import torch

from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.evaluation.offsets_view import draw_run_offsets, motion_alignment, motion_estimate, offset_field

OVR = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 4, "model.caption_dim": 16,
       "model.patch_size": "1,4,4", "data.num_frames": 5, "data.height": 24, "data.width": 32,
       "attention.kind": "dsa", "attention.window": "3,3,3", "attention.offset_groups": 2,
       "attention.max_offset": 4.0}


def test_motion_estimate_is_the_slope_over_the_time_slices():
    kt, kh, kw = 3, 3, 3
    v = torch.tensor([0.5, -1.25])
    tau = torch.tensor([-1.0, 0.0, 1.0])
    off = torch.zeros(2, 3, 4, 1, kt, kh * kw, 3)
    off[..., 1:] = (tau[:, None] * v[None, :])[:, None, :]          # sample at tau moves by tau * v
    off[..., 1:] += 0.3 * torch.randn(kh * kw, 2)                   # plus a time-independent spread
    est = motion_estimate(off.reshape(2, 3, 4, 1, kt * kh * kw, 3), (kt, kh, kw))
    assert torch.allclose(est, v.expand_as(est), atol=1e-6)
    al = motion_alignment(est, torch.ones(2, 3, 4, dtype=torch.bool), (0.5, -1.25))
    assert al["cosine"] == pytest.approx(1.0) and al["length_ratio"] == pytest.approx(1.0)
    assert motion_alignment(est, torch.ones(2, 3, 4, dtype=torch.bool), (-0.5, 1.25))["cosine"] == pytest.approx(-1.0)


def test_offset_field_of_a_checkpoint_with_a_planted_motion(tmp_path):
    cfg = build_config("tiny", None, {**OVR, "runtime.state_dir": str(tmp_path)})
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        # Block 1's offset head: zero weights, a bias that moves the samples of time slice tau by
        # (dy, dx) = tau * (0, 1) tokens (through max_offset * tanh).
        lay = store.layouts[1]
        views = lay.views(store.seg[1]["master"])
        groups, K = 2, 27
        bias = torch.zeros(groups, K, 3)
        for j in range(K):
            tau = j // 9 - 1
            bias[:, j, 2] = math.atanh(tau * 1.0 / 4.0)
        views["attn.offsets.out.weight"].zero_()
        views["attn.offsets.out.bias"].copy_(bias.reshape(-1))
        ckpt = store.save_checkpoint(str(tmp_path / "run"), 0, {})
    finally:
        store.close()
    clip = np.random.default_rng(0).integers(0, 256, (5, 24, 32, 3), dtype=np.uint8)
    offsets, got_cfg = offset_field(ckpt, clip, "a red circle moving right", block=1)
    assert offsets.shape == (5, 6, 8, 4, 27, 3)
    assert torch.allclose(offsets[..., 2], offsets[..., 2].new_tensor([float(j // 9 - 1) for j in range(27)]),
                          atol=1e-5)
    est = motion_estimate(offsets, (3, 3, 3))
    assert torch.allclose(est, torch.tensor([0.0, 1.0]).expand_as(est), atol=1e-5)
    out = draw_run_offsets(ckpt, clip, "a red circle moving right", tmp_path / "offsets.png")
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="shape"):
        offset_field(ckpt, clip[:4], "x")


def test_offset_field_with_dense_attention_levers(tmp_path):
    """A run with a dense block and dense samples above t = 0.3: the dense block has no offsets to
    draw (a clear error), a dsa block's are drawn at t = 0.5 all the same."""
    cfg = build_config("tiny", None, {**OVR, "runtime.state_dir": str(tmp_path), "attention.dense_blocks": "0",
                                      "attention.dense_above_t": 0.3})
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        ckpt = store.save_checkpoint(str(tmp_path / "run"), 0, {})
    finally:
        store.close()
    clip = np.random.default_rng(0).integers(0, 256, (5, 24, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="block=1 is dense"):
        offset_field(ckpt, clip, "x", block=1)
    offsets, _ = offset_field(ckpt, clip, "x", block=2, t=0.5)
    assert offsets.shape == (5, 6, 8, 4, 27, 3) and offsets.abs().max() == 0  # a fresh head: zero offsets
