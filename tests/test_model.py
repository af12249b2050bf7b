"""The video DiT: every attention kind trains on ``tiny`` (finite loss and gradients), shards
rebuild the whole model exactly, and streaming-style calls equal the ordinary forward."""

import numpy as np
import pytest
import torch
from torch.func import functional_call

from megaslide_ray.config import build_config
from megaslide_ray.models.registry import build_model, build_shard, initialize_shard, num_shards
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.training.flow import flow_loss, sample_flow_inputs


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


def test_flow_shift_moves_times_towards_noise_and_latent_batches_are_taken_as_is():
    from megaslide_ray.training.flow import batch_conditioning, batch_flow_inputs, shift_time

    t = torch.linspace(0, 1, 11)
    assert torch.equal(shift_time(t, 1.0), t)
    shifted = shift_time(t, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1 and bool((shifted[1:-1] > t[1:-1]).all())
    assert float(shift_time(torch.tensor(0.5), 3.0)) == pytest.approx(0.75)  # 3 * 0.5 / (1 + 2 * 0.5)
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((2, 3, 4, 4, 16)).astype(np.float32)
    text = rng.standard_normal((2, 512, 8)).astype(np.float32)
    batch = {"latents": latents, "text": text, "text_len": np.array([5, 7], dtype=np.int32)}
    plain, moved = batch_flow_inputs(batch, 0, 3), batch_flow_inputs(batch, 0, 3, flow_shift=3.0)
    assert torch.equal(plain.x0, torch.from_numpy(latents)) and torch.equal(plain.noise, moved.noise)
    assert torch.allclose(moved.t, shift_time(plain.t, 3.0).clamp(1e-4, 1 - 1e-4))
    torch.testing.assert_close(moved.x_t, (1 - moved.t.view(2, 1, 1, 1, 1)) * plain.x0
                               + moved.t.view(2, 1, 1, 1, 1) * plain.noise)
    cond, cond_len = batch_conditioning(batch)
    assert torch.equal(cond, torch.from_numpy(text)) and cond_len.tolist() == [5, 7]


def test_caption_dropout_is_a_function_of_seed_and_step_and_spares_text():
    from megaslide_ray.data.captions import caption_batch
    from megaslide_ray.training.flow import batch_conditioning, caption_drops

    cap, cap_len = caption_batch("a red circle moving right", 32, 1)
    batch = {"caption": np.repeat(cap, 64, axis=0), "caption_len": np.repeat(cap_len, 64)}
    a, a_len = batch_conditioning(batch, 3, 7, 0.25)
    b, b_len = batch_conditioning(batch, 3, 7, 0.25)
    assert torch.equal(a, b) and torch.equal(a_len, b_len)
    dropped = a_len == 0
    assert torch.equal(dropped, caption_drops(3, 7, 64, 0.25))
    assert bool((a[dropped] == 0).all()) and bool((a[~dropped] == torch.from_numpy(cap[0])).all())
    assert 0 < int(dropped.sum()) < 64  # 0.25 of 64: both kinds present
    rate = float(torch.stack([caption_drops(0, s, 64, 0.25) for s in range(200)]).float().mean())
    assert abs(rate - 0.25) < 0.02, rate
    assert not bool(caption_drops(3, 8, 64, 0.25).equal(dropped))  # another step draws anew
    plain, plain_len = batch_conditioning(batch)
    assert bool((plain_len > 0).all())  # no dropout unless asked for
    text = {"text": np.ones((4, 8, 16), np.float32), "text_len": np.full(4, 8, np.int32)}
    t, t_len = batch_conditioning(text, 0, 0, 0.99)
    assert bool((t == 1).all()) and t_len.tolist() == [8] * 4  # text embeddings are never dropped


def test_offset_scale_scales_the_offset_heads_output():
    from megaslide_ray.config import build_config
    from megaslide_ray.models.registry import build_shard

    over = {"model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "attention.kind": "dsa"}
    one = build_shard(build_config("tiny", None, over), 1)
    tenth = build_shard(build_config("tiny", None, {**over, "attention.offset_scale": 0.1}), 1)
    bounded = build_shard(build_config("tiny", None, {**over, "attention.offset_scale": 0.1,
                                                      "attention.max_offset": 2.0}), 1)
    with torch.no_grad():
        for p in one.parameters():
            p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(p.numel()))
    tenth.load_state_dict(one.state_dict())
    bounded.load_state_dict(one.state_dict())
    h = torch.randn(1, 4, 4, 4, 32, generator=torch.Generator().manual_seed(0))
    raw = one.attn.offsets(h)
    assert raw.abs().max() > 1.0
    torch.testing.assert_close(tenth.attn.offsets(h), 0.1 * raw)
    torch.testing.assert_close(bounded.attn.offsets(h), 2.0 * torch.tanh(0.1 * raw))
    with pytest.raises(Exception, match="offset_scale"):
        build_config("tiny", None, {"attention.offset_scale": 0})


@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_dsa_starts_from_the_weights_of_the_fixed_window_kinds(arch):
    # the attention-kind comparisons (benchmarks.studies.quality) hold everything but the kind equal
    from megaslide_ray.config import build_config
    from megaslide_ray.models.registry import build_shard, initialize_shard

    over = {"model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2}
    if arch == "wan":
        over.update({"model.arch": "wan", "model.text_dim": 16, "model.text_len": 5, "model.in_channels": 4,
                     "model.patch_size": "1,2,2", "model.timestep_freq_dim": 16, "data.num_frames": 9,
                     "data.height": 48, "data.width": 80})
    blocks = {}
    for kind in ("dsa", "neighborhood", "swin"):
        b = build_shard(build_config("tiny", None, {**over, "attention.kind": kind}), 1)
        initialize_shard(b, 3, 1)
        blocks[kind] = dict(b.named_parameters())
    rest = {n: p for n, p in blocks["dsa"].items() if ".offsets." not in f".{n}"}
    assert len(rest) < len(blocks["dsa"])  # the dsa block has an offset head
    for kind in ("neighborhood", "swin"):
        assert rest.keys() == blocks[kind].keys()
        for n, p in rest.items():
            assert torch.equal(p, blocks[kind][n]), (kind, n)


def _encode(enc, texts, width=128, pad_byte=0, tokens=False):
    from megaslide_ray.data.captions import empty_captions, set_caption

    cap, cap_len = empty_captions(len(texts), width)
    for row, text in enumerate(texts):
        set_caption(cap, cap_len, row, text)
        cap[row, cap_len[row]:] = pad_byte
    out = enc(torch.from_numpy(cap), torch.from_numpy(cap_len))
    return out if tokens else (out[0] if isinstance(out, tuple) else out)


def test_caption_encoder_tells_the_objects_colour_from_the_backgrounds():
    """The same bytes in another order are another condition once the encoder has self-attention
    layers; a bag of bytes (caption_layers 0, the first encoder) cannot tell them apart, whatever
    its weights. (The layers' residual branches start at zero: the weights are moved first, as
    training moves them.)"""
    a = "a red circle moving right fast on a dark blue background"
    b = "a blue circle moving right fast on a dark red background"
    assert sorted(a) == sorted(b)
    gen = torch.Generator().manual_seed(0)
    for layers in (0, 1, 2):
        cfg = build_config("tiny", None, {"model.caption_layers": layers})
        enc = build_model(cfg).embed.caption
        with torch.no_grad():
            for p in enc.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            ca, cb = _encode(enc, [a, b])
            gap = float((ca - cb).abs().max())
            scale = float(ca.abs().max())
        if layers == 0:
            assert gap < 1e-6 * scale, gap
        else:
            assert gap > 0.05 * scale, (layers, gap, scale)


def test_a_fresh_caption_encoder_already_reads_word_order():
    """At init (the layers' residual branches still zero) the encoder binds each byte to its
    position through its MLP, because the byte and position embeddings start at std
    ``CAPTION_EMBED_STD``: the same bytes in another order move the caption vector by well over
    5% of its size (at the old 0.02 it was 1.7%), and the other embeddings keep 0.02."""
    from megaslide_ray.models.videodit import CAPTION_EMBED_STD

    a = "a red circle moving right fast on a dark blue background"
    b = "a blue circle moving right fast on a dark red background"
    cfg = build_config("tiny", None, {"model.cross_attention": True})
    embed = build_model(cfg).embed
    enc = embed.caption
    with torch.no_grad():
        ca, cb = _encode(enc, [a, b])
    bias = enc.proj.bias.detach()
    assert float((ca - cb).norm()) > 0.05 * float((ca - bias).norm())
    for table, std in ((enc.embed, CAPTION_EMBED_STD), (enc.position, CAPTION_EMBED_STD), (enc.null_token, 0.02)):
        got = float(table.weight.std())
        assert abs(got / std - 1) < 0.2, (table, got, std)


def test_caption_encoder_ignores_padding_and_pools_an_empty_caption_to_zeros():
    cfg = build_config("tiny", None, {"model.caption_layers": 2})
    enc = build_model(cfg).embed.caption
    with torch.no_grad():
        texts = ["a green square moving up slowly", "", "a yellow triangle"]
        clean = _encode(enc, texts)
        dirty = _encode(enc, texts, pad_byte=77)  # garbage past each caption's length
        alone = _encode(enc, texts[:1])  # another batch around it
    assert torch.isfinite(clean).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=1e-6)
    torch.testing.assert_close(alone[0], clean[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(clean[1], enc.proj.bias.detach(), rtol=0, atol=0)  # unconditional = bias


def test_caption_tokens_ignore_padding_and_start_with_the_null_token():
    """The tokens the blocks cross-attend to: one per byte after a learned null token; padding
    is masked out (and its garbage changes no valid token), an empty caption keeps the null."""
    cfg = build_config("tiny", None, {"model.cross_attention": True})
    enc = build_model(cfg).embed.caption
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        texts = ["a green square moving up slowly", "", "a yellow triangle"]
        _, tok, keys = _encode(enc, texts, tokens=True)
        _, tok_dirty, keys_dirty = _encode(enc, texts, pad_byte=77, tokens=True)
    lengths = [len(t.encode()) for t in texts]
    assert tok.shape == (3, 1 + 128, cfg.model.hidden_size) and keys.dtype == torch.bool
    assert keys.sum(1).tolist() == [1 + n for n in lengths] and keys[:, 0].all()
    assert torch.equal(keys, keys_dirty)
    torch.testing.assert_close(tok[keys], tok_dirty[keys], rtol=0, atol=1e-6)
    torch.testing.assert_close(tok[:, 0], enc.null_token.weight.expand(3, -1), rtol=0, atol=0)
    # with self-attention layers a byte's token depends on its neighbours: the same byte differs
    assert float((tok[0, 1] - tok[2, 1]).abs().max()) > 1e-3  # both "a", different captions


def test_condition_packs_and_splits():
    from megaslide_ray.models.videodit import pack_condition, split_condition

    B, D, L = 3, 8, 5
    cond, tokens = torch.randn(B, D), torch.randn(B, L, D)
    keys = torch.rand(B, L) > 0.5
    c2, t2, k2 = split_condition(pack_condition(cond, tokens, keys), D)
    assert torch.equal(c2, cond) and torch.equal(t2, tokens) and torch.equal(k2, keys)
    assert split_condition(pack_condition(cond), D)[1] is None
    with pytest.raises(ValueError, match="carries none"):
        split_condition(pack_condition(cond), D, tokens=True)
    with pytest.raises(ValueError, match="not D"):
        split_condition(torch.zeros(B, D + 3), D)


def test_cross_attention_carries_the_caption_to_every_token():
    """With the adaLN branches closed (zero gates: the pooled caption cannot act), a block's output
    still depends on the caption, at every token, through cross-attention; garbage past a
    caption's length changes nothing; a fresh block (zero output projection) is the identity."""
    cfg = build_config("tiny", None, {"model.cross_attention": True, "data.height": 16, "data.width": 16})
    model = build_model(cfg)
    embed, block = model.embed, model.blocks[0]
    x_t = torch.randn(2, cfg.data.num_frames, 16, 16, 3, generator=torch.Generator().manual_seed(0))
    t = torch.full((2,), 0.7)
    texts = ["a red circle moving left fast on a dark blue background",
             "a blue circle moving left fast on a dark red background"]

    def run(pad_byte=0):
        from megaslide_ray.data.captions import empty_captions, set_caption

        cap, cap_len = empty_captions(2, cfg.model.caption_max_bytes)
        for row, text in enumerate(texts):
            set_caption(cap, cap_len, row, text)
            cap[row, cap_len[row]:] = pad_byte
        x, c = embed(x_t, t, torch.from_numpy(cap), torch.from_numpy(cap_len))
        return x, block(x, c)

    with torch.no_grad():
        x, y = run()
        torch.testing.assert_close(y, x, rtol=0, atol=0)  # fresh: identity
        gen = torch.Generator().manual_seed(1)
        for p in embed.caption.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        for p in block.cross.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        assert float(block.ada[-1].weight.abs().max()) == 0.0
        x, y = run()
        _, y_dirty = run(pad_byte=77)
    delta = (y - x).flatten(1, 3)  # (B, tokens, D): the cross-attention branch alone
    assert (delta.norm(dim=-1) > 0).all()
    assert float((delta[0] - delta[1]).norm(dim=-1).min()) > 1e-4  # every token tells the two captions apart
    torch.testing.assert_close(y_dirty, y, rtol=0, atol=1e-6)


def test_caption_layers_zero_keeps_the_first_encoders_parameters():
    """Checkpoints trained before ``model.caption_layers`` hold the bag-of-bytes encoder: with 0
    layers (and no cross-attention, also later) the parameter names and shapes are those, so such
    runs resume and sample."""
    old = {"model.caption_layers": 0, "model.cross_attention": False}
    names = {k: tuple(v.shape) for k, v in build_shard(build_config("tiny", None, old),
                                                        0).state_dict().items() if k.startswith("caption.")}
    assert names == {"caption.embed.weight": (257, 64), "caption.mlp.0.weight": (64, 64),
                     "caption.mlp.0.bias": (64,), "caption.proj.weight": (128, 64), "caption.proj.bias": (128,)}
    with pytest.raises(Exception, match="caption_layers=-1"):
        build_config("tiny", None, {"model.caption_layers": -1})


def test_a_clean_clip_estimate_becomes_the_flow_velocity():
    """``model.prediction = sample``: the exact clean clip gives the exact velocity noise - x0
    (t >= 0.05; below, t is clamped); ``velocity`` passes the output through; wan refuses it."""
    from megaslide_ray.config import ConfigError
    from megaslide_ray.models.prediction import as_velocity

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(4, 2, 3, 3, 3, generator=g), torch.randn(4, 2, 3, 3, 3, generator=g)
    t = torch.tensor([0.05, 0.3, 0.7, 1.0])
    x_t = (1 - t.view(-1, 1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1, 1) * noise
    torch.testing.assert_close(as_velocity(x0, x_t, t, "sample"), noise - x0, rtol=1e-5, atol=1e-5)
    assert as_velocity(x0, x_t, t, "velocity") is x0
    small = torch.tensor([0.01])
    torch.testing.assert_close(as_velocity(x0[:1], x_t[:1], small, "sample"), (x_t[:1] - x0[:1]) / 0.05)
    with pytest.raises(ValueError, match="prediction='x0'"):
        as_velocity(x0, x_t, t, "x0")
    with pytest.raises(ConfigError, match="model.prediction='noise'"):
        build_config("tiny", None, {"model.prediction": "noise"})
    with pytest.raises(ConfigError, match="wan models predict the velocity"):
        build_config("wan2.1-t2v-1.3b", None, {"model.prediction": "sample"})
