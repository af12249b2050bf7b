"""The video DiT: every attention kind trains on ``tiny`` (finite loss and gradients), shards
rebuild the whole model exactly, and streaming-style calls equal the ordinary forward."""

import numpy as np
import pytest
import torch
from torch.func import functional_call

from megaslide_ray.config import build_config
from megaslide_ray.diffusion import flow_loss, sample_flow_inputs
from megaslide_ray.model import build_model, build_shard, initialize_shard, num_shards
from megaslide_ray.shards import ShardLayout


def _batch(cfg, seed=0):
    rng = np.random.default_rng(seed)
    d = cfg.data
    video = rng.integers(0, 256, (d.batch_size, d.num_frames, d.height, d.width, 3), dtype=np.uint8)
    caption = torch.zeros(d.batch_size, cfg.model.caption_max_bytes, dtype=torch.uint8)
    caption[:, :5] = torch.tensor(list(b"hello"))
    return video, caption, torch.full((d.batch_size,), 5)


@pytest.mark.parametrize("kind", ["dense", "swin", "neighborhood", "dsa"])
def test_every_attention_kind_gives_finite_loss_and_grads(kind):
    cfg = build_config("tiny", None, {"attention.kind": kind, "model.depth": 2})
    model = build_model(cfg)
    with torch.no_grad():  # leave adaLN-Zero so every parameter gets a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    video, cap, cap_len = _batch(cfg)
    fx = sample_flow_inputs(video, 0, 0)
    loss = flow_loss(model(fx.x_t, fx.t, cap, cap_len), fx.target)
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if kind == "dsa":  # the offset predictor is trained
        assert model.blocks[0].attn.offsets.out.weight.grad.abs().sum() > 0


def test_dsa_starts_as_neighborhood_attention():
    cfg = build_config("tiny", None, {"model.depth": 1})
    nbr = build_config("tiny", None, {"model.depth": 1, "attention.kind": "neighborhood"})
    a, b = build_model(cfg), build_model(nbr)
    with torch.no_grad():  # non-zero gates so attention matters
        for blk in a.blocks:
            blk.ada[-1].weight.normal_(0, 0.05)
        a.head.linear.weight.normal_(0, 0.05)
    missing, unexpected = b.load_state_dict(a.state_dict(), strict=False)
    assert not missing and all(".attn.offsets." in k for k in unexpected)
    video, cap, cap_len = _batch(cfg)
    fx = sample_flow_inputs(video, 0, 0)
    assert torch.allclose(a(fx.x_t, fx.t, cap, cap_len), b(fx.x_t, fx.t, cap, cap_len), atol=1e-6)


def test_shard_by_shard_init_and_views_rebuild_the_model():
    cfg = build_config("tiny")
    model = build_model(cfg, seed=3)
    video, cap, cap_len = _batch(cfg)
    fx = sample_flow_inputs(video, 0, 0)
    with torch.no_grad():
        for blk in model.blocks:
            blk.ada[-1].weight.normal_(0, 0.05)
        model.head.linear.weight.normal_(0, 0.05)
        expected = model(fx.x_t, fx.t, cap, cap_len)
        metas = [build_shard(cfg, i, "meta") for i in range(num_shards(cfg))]
        flats = []
        for i, shard in enumerate(model.shards()):
            lay = ShardLayout.of(shard, i)
            flat = torch.empty(lay.numel)
            lay.flatten_into(shard, flat)
            flats.append((lay, flat))
        call = lambda i, *args: functional_call(metas[i], flats[i][0].views(flats[i][1]), args)  # noqa: E731
        x, c = call(0, fx.x_t, fx.t, cap, cap_len)
        for i in range(1, cfg.model.depth + 1):
            x = call(i, x, c)
        got = call(cfg.model.depth + 1, x, c)
    assert torch.equal(got, expected)
    # A shard initialised alone equals the same shard of a whole-model init.
    alone = build_shard(cfg, 2)
    initialize_shard(alone, 3, 2)
    fresh = build_model(cfg, seed=3)
    for (n, p), q in zip(alone.named_parameters(), fresh.blocks[1].parameters()):
        assert torch.equal(p, q), n
