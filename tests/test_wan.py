"""The Wan transformer (megaslide_ray/models/wan.py) against diffusers' WanTransformer3DModel: forward and
gradients in fp32, the bf16 error, the streamed shards bit for bit, local attention with the whole
grid as window, the presets' parameter counts, config round trips and refusals. Tiny random
diffusers models are built on the fly; nothing is downloaded."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.func import functional_call

from megaslide_ray.config import Config, ConfigError, apply_overrides, build_config
from megaslide_ray.models.registry import build_model, build_shard, initialize_shard, num_shards, param_count
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.models.wan import WanTransformer
from megaslide_ray.models.wan_diffusers import (
    DiffusersWanTransformer,
    check_against,
    diffusers_config,
    from_diffusers,
    wan_config_from_diffusers,
)
from megaslide_ray.models.wan_layers import KEEP_FP32
from megaslide_ray.training.flow import flow_loss

# Tiny diffusers configs: (constructor arguments, latent shape (C, F, H, W), text tokens).
TINY = {
    "hd8": (dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                 text_dim=12, freq_dim=16, ffn_dim=24, num_layers=2), (4, 3, 6, 10), 5),
    "hd16-no-cross-norm": (dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=3,
                                out_channels=5, text_dim=20, freq_dim=32, ffn_dim=40, num_layers=3,
                                cross_attn_norm=False), (3, 5, 10, 6), 7),
    "patch222-4heads": (dict(patch_size=(2, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=6,
                             out_channels=6, text_dim=8, freq_dim=16, ffn_dim=20, num_layers=2, eps=1e-5),
                        (6, 6, 2, 10), 3),
}


def _diffusers(kw: dict, seed: int = 0) -> WanTransformer3DModel:
    """A random diffusers model; norms and biases moved off their ones/zeros so every parameter matters."""
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref.eval()


def _inputs(shape, text_tokens: int, text_dim: int, seed: int = 1, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, *shape, generator=g), torch.tensor([137.0, 912.5])[:B],
            torch.randn(B, text_tokens, text_dim, generator=g))


def _ours(ref: WanTransformer3DModel, **attention) -> DiffusersWanTransformer:
    cfg = Config()
    apply_overrides(cfg, wan_config_from_diffusers(dict(ref.config)))
    apply_overrides(cfg, {"attention.kind": "dense", **attention})
    model = DiffusersWanTransformer(cfg)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(".attn1.offsets." in n for n in missing)
    return model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("name", list(TINY))
def test_forward_and_every_gradient_match_diffusers_in_fp32(name):
    kw, shape, tokens = TINY[name]
    ref = _diffusers(kw)
    ours = _ours(ref)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x, ts, text = _inputs(shape, tokens, kw["text_dim"])
    want = ref(x, ts, text, return_dict=False)[0]
    got = ours(x, ts, text)
    assert got.shape == want.shape
    assert _rel(got, want) < 1e-5
    weight = torch.randn_like(want)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert p.grad is not None and ref_params[n].grad is not None, n
        assert _rel(p.grad, ref_params[n].grad) < 1e-4, n


def _diffusers_bf16(ref: WanTransformer3DModel) -> WanTransformer3DModel:
    """``ref`` in bf16 with diffusers' own float32 rule (``from_pretrained(torch_dtype=bf16)`` applies
    it, but only with ``accelerate`` installed): a parameter stays fp32 when a component of its name
    is in ``_keep_in_fp32_modules``."""
    keep = WanTransformer3DModel._keep_in_fp32_modules
    model = copy.deepcopy(ref)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if any(k in name.split(".") for k in keep) else torch.bfloat16)
    return model


def test_bf16_error_is_at_most_twice_diffusers_own(tmp_path):
    """From a saved, sharded diffusers directory in bf16: the same parameters stay fp32 as in
    diffusers, and the error against the fp32 model is no worse than 2x diffusers' own."""
    kw, shape, tokens = TINY["hd16-no-cross-norm"]
    kw = {**kw, "cross_attn_norm": True}
    ref = _diffusers(kw)
    ref.save_pretrained(tmp_path / "transformer", max_shard_size="40KB")
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    theirs = _diffusers_bf16(ref)
    ours = from_diffusers(tmp_path, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in theirs.named_parameters()}
    assert {n: p.dtype for n, p in ours.named_parameters()} == dtypes
    assert {n for n, d in dtypes.items() if d == torch.float32} == {
        n for n in dtypes if any(k in n.split(".") for k in KEEP_FP32)} != set()
    x, ts, text = _inputs(shape, tokens, kw["text_dim"])
    with torch.no_grad():
        exact = ref(x, ts, text, return_dict=False)[0]
        theirs_out = theirs(x.bfloat16(), ts, text.bfloat16(), return_dict=False)[0]
        ours_out = ours(x.bfloat16(), ts, text.bfloat16())
    assert ours_out.dtype == theirs_out.dtype == torch.bfloat16
    assert 0 < _rel(theirs_out, exact) < 0.05
    assert _rel(ours_out, exact) <= 2 * _rel(theirs_out, exact)


@pytest.mark.parametrize("kind", ["dsa", "neighborhood"])
def test_local_attention_over_the_whole_grid_is_diffusers_dense_attention(tmp_path, kind):
    """Zero offsets (a fresh offset head) and a window equal to the (odd) token grid: 3D-DSA and
    neighborhood attention over RoPE-rotated keys are Wan's dense attention. Loaded from a single
    safetensors file in the transformer folder itself."""
    kw, shape, tokens = TINY["hd8"]
    ref = _diffusers(kw)
    ref.save_pretrained(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").is_file()
    grid = (3, 3, 5)
    ours = from_diffusers(tmp_path, attention_kind=kind, window=grid)
    has_offsets = any(".attn1.offsets." in n for n, _ in ours.named_parameters())
    assert has_offsets == (kind == "dsa")
    if kind == "dsa":  # a plain Wan directory: the Wan presets' bound
        heads = [m for n, m in ours.named_modules() if n.endswith(".attn1.offsets")]
        assert heads and all((h.max_offset, h.bound) == (1.5, "clamp") for h in heads)
    x, ts, text = _inputs(shape, tokens, kw["text_dim"])
    with torch.no_grad():
        assert _rel(ours(x, ts, text), ref(x, ts, text, return_dict=False)[0]) < 1e-5


def _small_cfg(**extra):
    return build_config("tiny", None, {
        "model.arch": "wan", "model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.ffn_dim": 48,
        "model.in_channels": 4, "model.patch_size": "1,2,2", "model.text_dim": 12, "model.text_len": 8,
        "model.timestep_freq_dim": 16, "data.num_frames": 9, "data.height": 48, "data.width": 80,
        "data.batch_size": 2, "attention.kind": "dsa", "attention.window": "3,3,3", **extra})


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, (F, H, W), m = cfg.data.batch_size, cfg.latent_grid, cfg.model
    x_t = torch.randn(B, F, H, W, m.in_channels, generator=g)
    target = torch.randn(B, F, H, W, m.out_channels or m.in_channels, generator=g)
    text = torch.randn(B, 5, m.text_dim, generator=g)
    return x_t, torch.tensor([0.25, 0.8]), text, torch.tensor([3, 5]), target


def test_streamed_shards_equal_the_module_bit_for_bit():
    """Flat per-shard buffers, functional_call and the compute actor's schedule (forward without
    gradients, head and loss, blocks recomputed from their inputs, c's gradient summed over the
    shards, shard 0 last) give the plain module's prediction and gradients exactly."""
    cfg = _small_cfg(**{"attention.offset_groups": 1})
    assert cfg.token_grid == (3, 3, 5)
    model = build_model(cfg, seed=3)
    with torch.no_grad():  # leave the zero-initialised layers so every parameter gets a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    x_t, t, text, text_len, target = _batch(cfg)
    pred = model(x_t, t, text, text_len)
    flow_loss(pred, target).backward()

    L = cfg.model.depth
    metas = [build_shard(cfg, i, "meta") for i in range(num_shards(cfg))]
    layouts, flats, expected = [], [], []
    for i, shard in enumerate(model.shards()):
        lay = ShardLayout.of(shard, i)
        assert lay == ShardLayout.of(metas[i], i)
        flat = torch.empty(lay.numel)
        lay.flatten_into(shard, flat)
        layouts.append(lay)
        flats.append(flat)
        expected.append(torch.cat([p.grad.reshape(-1) for _, p in shard.named_parameters()]))
    run = lambda i, w, *args: functional_call(metas[i], layouts[i].views(w), args)  # noqa: E731

    with torch.no_grad():
        x, c = run(0, flats[0], x_t, t, text, text_len)
        saved = []
        for i in range(1, L + 1):
            saved.append(x)
            x = run(i, flats[i], x, c)
    w_head = flats[L + 1].clone().requires_grad_(True)
    x_last, c_leaf = x.detach().requires_grad_(True), c.detach().requires_grad_(True)
    streamed = run(L + 1, w_head, x_last, c_leaf)
    flow_loss(streamed, target).backward()
    grads = {L + 1: w_head.grad}
    dx, dc = x_last.grad, c_leaf.grad.clone()
    for i in range(L, 0, -1):
        w = flats[i].clone().requires_grad_(True)
        x_in, c_leaf = saved[i - 1].detach().requires_grad_(True), c.detach().requires_grad_(True)
        torch.autograd.backward(run(i, w, x_in, c_leaf), dx)
        grads[i], dx = w.grad, x_in.grad
        dc += c_leaf.grad
    w0 = flats[0].clone().requires_grad_(True)
    torch.autograd.backward(list(run(0, w0, x_t, t, text, text_len)), [dx, dc])
    grads[0] = w0.grad

    assert torch.equal(streamed, pred)
    for i in range(L + 2):
        assert torch.equal(grads[i], expected[i]), f"shard {i}"


def test_fresh_init_is_seeded_shard_by_shard_and_starts_as_neighborhood_attention():
    cfg = _small_cfg()
    model = build_model(cfg, seed=3)
    assert isinstance(model, WanTransformer)
    names = [n for n, _ in model.named_parameters()]
    assert names[:3] == ["scale_shift_table", "patch_embedding.weight", "patch_embedding.bias"]
    assert "blocks.1.attn1.offsets.out.weight" in names and "blocks.0.ffn.net.0.proj.weight" in names
    alone = build_shard(cfg, 2)
    initialize_shard(alone, 3, 2)
    for (n, p), q in zip(alone.named_parameters(), model.blocks[1].parameters()):
        assert torch.equal(p, q), n
    assert not model.blocks[0].attn1.offsets.out.weight.any()
    nbr = build_model(_small_cfg(**{"attention.kind": "neighborhood"}), seed=3)
    nbr.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        for m in (model, nbr):
            m.proj_out.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
        x_t, t, text, text_len, _ = _batch(cfg)
        a, b = model(x_t, t, text, text_len), nbr(x_t, t, text, text_len)
    assert a.abs().sum() > 0 and torch.equal(a, b)


def test_text_is_zeroed_past_its_length_and_padded_to_text_len():
    cfg = _small_cfg(**{"attention.kind": "dense"})
    model = build_model(cfg, seed=0)
    x_t, t, text, text_len, _ = _batch(cfg)
    garbage = text.clone()
    garbage[0, 3:] = 7.0
    padded = torch.cat([text, torch.zeros(2, 3, cfg.model.text_dim)], dim=1)
    embed = model.shards()[0]
    with torch.no_grad():
        _, c = embed(x_t, t, text, text_len)
        assert c.shape == (2, 7 * 32 + cfg.model.text_len * 32)
        assert torch.equal(c, embed(x_t, t, garbage, text_len)[1])
        assert torch.equal(c, embed(x_t, t, padded, text_len)[1])
    with pytest.raises(ValueError, match="more than model.text_len=8"):
        embed(x_t, t, torch.zeros(2, 9, cfg.model.text_dim), text_len)


@pytest.mark.parametrize("groups,expect", [(0, 2), (1, 1), (2, 2)])
def test_offset_groups_set_the_offset_head_size(groups, expect):
    cfg = _small_cfg(**{"attention.offset_groups": groups})
    K = 27
    block = build_shard(cfg, 1)
    assert block.attn1.offsets.out.weight.shape == (expect * K * 3, 32)
    dense = param_count(_small_cfg(**{"attention.kind": "dense"}))
    per_block = 32 * 27 + 32 + (32 + 1) * expect * K * 3  # depthwise conv, output linear
    assert param_count(cfg) == dense + cfg.model.depth * per_block
    with torch.no_grad():
        block.attn1.offsets.out.weight.normal_()
        off = block.attn1.offsets(torch.randn(1, 3, 3, 5, 32))
    assert off.shape == (1, 3, 3, 5, 2, K, 3)
    assert torch.equal(off[..., 0, :, :], off[..., 1, :, :]) == (expect == 1)
    videodit = build_shard(build_config("tiny", None, {"attention.offset_groups": 2}), 1)
    assert videodit.attn.offsets.out.weight.shape[0] == 2 * 27 * 3
    with pytest.raises(ConfigError, match="attention.offset_groups=3 does not divide model.num_heads=2"):
        _small_cfg(**{"attention.offset_groups": 3})


PRESET_COUNTS = {"wan2.1-t2v-1.3b": 1_418_996_800, "wan2.1-t2v-14b": 14_288_491_584,
                 "wan2.2-ti2v-5b": 4_999_787_712}
"""diffusers' WanTransformer3DModel built on the meta device with the published configs."""


@pytest.mark.parametrize("name", list(PRESET_COUNTS))
def test_presets_have_the_published_parameter_counts(name):
    cfg = build_config(name)
    assert cfg.attention.kind == "dsa" and cfg.model.arch == "wan"
    dense = build_config(name, None, {"attention.kind": "dense"})
    assert param_count(dense) == PRESET_COUNTS[name]
    m = cfg.model
    K = 3 * 7 * 7
    offsets = m.depth * (m.hidden_size * 28 + (m.hidden_size + 1) * m.num_heads * K * 3)
    assert param_count(cfg) == PRESET_COUNTS[name] + offsets


def test_diffusers_config_round_trips_and_builds_the_same_model():
    cfg = build_config("wan2.2-ti2v-5b")
    exported = diffusers_config(cfg)
    overrides = wan_config_from_diffusers(json.loads(json.dumps(exported)),
                                          {"z_dim": 48, "scale_factor_temporal": 4, "scale_factor_spatial": 16})
    check_against(cfg, overrides)
    with torch.device("meta"):
        theirs = WanTransformer3DModel.from_config(exported)
    dense = build_config("wan2.2-ti2v-5b", None, {"attention.kind": "dense"})
    with torch.device("meta"):
        ours = WanTransformer(dense)
    assert ({n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()})


def test_check_against_lists_every_contradiction_at_once():
    cfg = build_config("wan2.1-t2v-1.3b", None, {"model.depth": 20, "model.ffn_dim": 0, "model.in_channels": 48})
    overrides = wan_config_from_diffusers(diffusers_config(build_config("wan2.1-t2v-1.3b")))
    with pytest.raises(ConfigError) as e:
        check_against(cfg, overrides, source="transformer/config.json")
    msg = str(e.value)
    assert "3 field(s)" in msg
    for needle in ("model.depth: the config has 20, transformer/config.json has 30", "model.ffn_dim: the config has 6144",
                   "model.in_channels: the config has 48"):
        assert needle in msg


def test_unknown_configs_are_refused(tmp_path):
    base = diffusers_config(build_config("wan2.1-t2v-14b"))
    got = wan_config_from_diffusers({**base, "image_dim": 1280, "added_kv_proj_dim": 5120})  # I2V: test_wan_i2v.py
    assert (got["model.image_dim"], got["model.added_kv_proj_dim"], got["model.pos_embed_seq_len"]) == (1280, 5120, 0)
    with pytest.raises(ConfigError, match="unknown WanTransformer3DModel config keys \\['vace_layers'\\]"):
        wan_config_from_diffusers({**base, "vace_layers": [0, 2]})
    with pytest.raises(ConfigError, match="qk_norm='rms_norm'"):
        wan_config_from_diffusers({**base, "qk_norm": "rms_norm"})
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({**base, "_class_name": "WanVACETransformer3DModel"}))
    with pytest.raises(ConfigError, match="Wan VACE"):
        from_diffusers(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither transformer/config.json nor config.json"):
        from_diffusers(tmp_path / "transformer" / "nothing")


def test_weights_that_do_not_fit_are_listed_in_one_error(tmp_path):
    kw, _, _ = TINY["hd8"]
    ref = _diffusers(kw)
    sd = {k: v for k, v in ref.state_dict().items() if k != "proj_out.bias"}
    sd["blocks.0.attn1.to_q.weight"] = torch.zeros(3, 3)
    sd["extra.weight"] = torch.zeros(1)
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(dict(ref.config)))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(ValueError) as e:
        from_diffusers(tmp_path)
    msg = str(e.value)
    assert "3 problem(s)" in msg and "missing: proj_out.bias" in msg and "unexpected: extra.weight" in msg
    assert "blocks.0.attn1.to_q.weight: shape (3, 3)" in msg


def test_wan_clip_validation_and_grids():
    cfg = build_config("wan2.1-t2v-1.3b")
    assert cfg.latent_grid == (21, 60, 104) and cfg.token_grid == (21, 30, 52)
    assert build_config("wan2.2-ti2v-5b").token_grid == (21, 15, 26)
    assert build_config("wan2.1-t2v-14b").token_grid == (21, 45, 80)
    for overrides, needle in [
        ({"data.num_frames": 80}, "data.num_frames=80: the Wan VAE encodes 4k+1 frames"),
        ({"data.num_frames": 80}, "use 77 or 81"),
        ({"data.height": 488}, "data.height=488 is not divisible by 16 (VAE compression 8 x model.patch_size 2); "
                               "use 480 or 496"),
        ({"model.rope_max_seq_len": 40}, "has 52 width, more than model.rope_max_seq_len=40"),
        ({"model.text_len": 0}, "model.text_len=0 must be > 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            build_config("wan2.1-t2v-1.3b", None, overrides)
        assert needle in str(e.value)
    with pytest.raises(ConfigError, match="model.out_channels=4: the videodit model predicts its 3 input channels"):
        build_config("tiny", None, {"model.out_channels": 4})


@pytest.mark.slow  # about a minute: two steps of each row at Wan 1.3B's widths, one block
def test_the_wan_benchmark_times_whole_steps_against_diffusers_with_adamw():
    """``benchmarks.wan`` times each streamed row twice: its compute, and its whole step to the end
    of the store's AdamW, which is held against diffusers with ``torch.optim.AdamW``."""
    from benchmarks import wan

    rows = {r["row"]: r for r in wan.run(1, (1, 2, 2), 2, "dense")}
    assert list(rows) == ["diffusers", "diffusers + AdamW", "ours", "streamed", "streamed + AdamW",
                          "streamed, kept graphs", "streamed, kept graphs + AdamW"]
    assert all(r["seconds"] > 0 and r["ratio"] > 0 for r in rows.values())
    assert rows["diffusers"]["ratio"] == 1.0 and rows["diffusers + AdamW"]["ratio_vs_adamw"] == 1.0
    for name in ("streamed", "streamed, kept graphs"):  # the step holds its compute and the store's update
        assert rows[f"{name} + AdamW"]["seconds"] >= rows[name]["seconds"]
        assert rows[f"{name} + AdamW"]["ratio_vs_adamw"] > 0 and "ratio_vs_adamw" not in rows[name]
