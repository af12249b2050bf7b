"""Options of dsa's offset head, in both architectures: ``attention.offset_condition`` (the head
reads the block's condition vector: ``add``, added to its features; ``gate``, its offsets scaled by
a learned gate) and ``attention.offset_source = query`` (the head reads the attention's queries
instead of its input).

A fresh head still predicts zero offsets (the block is exactly neighborhood attention), a
conditioned head's offsets depend on the condition (so on the timestep) and ``max_offset`` still
bounds them, and a token-chunked block (``runtime.token_chunk``) is the same function as the whole
block, gradients included (the condition reaches the head through each slab's checkpoint; the
queries of the slab's frames and halo are recomputed there)."""

import pytest
import torch

from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.models.registry import build_shard, initialize_shard

D = 32


OPTIONS = [("add", "block"), ("gate", "query"), ("none", "query")]
"""(offset_condition, offset_source) pairs tested."""


def _config(arch: str, kind: str, condition: str, chunk: int = 0, max_offset: float = 1.5, source: str = "block"):
    over = {"model.depth": 1, "model.hidden_size": D, "model.num_heads": 2, "model.ffn_dim": 64,
            "attention.kind": kind, "attention.window": "3,3,3", "attention.max_offset": max_offset,
            "attention.offset_condition": condition, "attention.offset_source": source,
            "runtime.token_chunk": chunk}
    if arch == "wan":
        over.update({"model.arch": "wan", "model.text_dim": 16, "model.text_len": 5, "model.in_channels": 4,
                     "model.patch_size": "1,2,2", "model.timestep_freq_dim": 16, "data.num_frames": 9,
                     "data.height": 48, "data.width": 80})
    return build_config("tiny", None, over)


def _inputs(arch: str, seed: int = 1, B: int = 2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 6, 3, 3, D, generator=g)
    c = torch.randn(B, (7 * D + 5 * D) if arch == "wan" else D, generator=g)
    return x, c


def _attn(block):
    return getattr(block, "attn", None) or block.attn1


@pytest.mark.parametrize("arch", ["videodit", "wan"])
@pytest.mark.parametrize("condition,source", OPTIONS)
def test_a_fresh_head_is_neighborhood_attention(arch, condition, source):
    x, c = _inputs(arch)
    out = {}
    for kind in ("neighborhood", "dsa"):
        block = build_shard(_config(arch, kind, condition, source=source), 1)
        initialize_shard(block, 0, 1)
        with torch.no_grad():
            out[kind] = block(x, c)
    assert torch.equal(out["dsa"], out["neighborhood"])
    head = _attn(build_shard(_config(arch, "dsa", condition, source=source), 1)).offsets
    assert (head.cond is not None) == (condition == "add") and (head.gate is not None) == (condition == "gate")
    assert head.source == source


@pytest.mark.parametrize("arch", ["videodit", "wan"])
@pytest.mark.parametrize("condition", ["add", "gate"])
def test_the_offsets_follow_the_condition_and_keep_their_bound(arch, condition):
    head = _attn(build_shard(_config(arch, "dsa", condition, max_offset=1.5), 1)).offsets
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 2.0)
    h = torch.randn(2, 6, 3, 3, D, generator=g)
    c1, c2 = torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)
    a, b = head(h, c1), head(h, c2)
    assert a.shape == (2, 6, 3, 3, 2, 27, 3) and not torch.allclose(a, b)
    assert a.abs().max() <= 1.5 and b.abs().max() <= 1.5
    with pytest.raises(ValueError, match="offset_condition"):
        head(h)


@pytest.mark.parametrize("arch", ["videodit", "wan"])
@pytest.mark.parametrize("condition,source", OPTIONS)
def test_the_chunked_block_equals_the_whole_block(arch, condition, source):
    whole = build_shard(_config(arch, "dsa", condition, source=source), 1)
    chunked = build_shard(_config(arch, "dsa", condition, chunk=7, source=source), 1)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        _attn(whole).offsets.out.weight.normal_(0.0, 2.0, generator=g)  # large offsets, some saturated
    chunked.load_state_dict(whole.state_dict())
    whole, chunked = whole.double(), chunked.double()  # float64: sums that cancel stay exact enough
    tol = 1e-5 if arch == "wan" else 1e-10  # wan computes norms, modulation and RoPE in float32 whatever the dtype
    x, c = (z.double() for z in _inputs(arch))
    grads = {}
    for name, block in (("whole", whole), ("chunked", chunked)):
        xi, ci = x.clone().requires_grad_(True), c.clone().requires_grad_(True)
        y = block(xi, ci)
        params = [p for _, p in block.named_parameters()]
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
        grads[name] = [y.detach(), *torch.autograd.grad(y, (xi, ci, *params), dy, allow_unused=True)]
    for a, b in zip(grads["chunked"], grads["whole"]):
        if b is None:
            assert a is None or not a.any()
            continue
        assert (a - b).norm() <= tol * b.norm().clamp(min=1e-30)
    head = _attn(whole).offsets
    names = [n for n, _ in whole.named_parameters()]
    if condition != "none":  # the head's condition layer gets a gradient
        lin = head.cond if condition == "add" else head.gate
        assert grads["whole"][3 + names.index(next(n for n, p in whole.named_parameters() if p is lin.weight))].any()


@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_a_head_reading_the_queries_predicts_other_offsets(arch):
    offsets = {}
    for source in ("block", "query"):
        block = build_shard(_config(arch, "dsa", "none", source=source), 1)
        initialize_shard(block, 0, 1)
        with torch.no_grad():
            _attn(block).offsets.out.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
        got = []
        hook = _attn(block).offsets.register_forward_hook(lambda m, a, out: got.append(out))
        with torch.no_grad():
            block(*_inputs(arch))
        hook.remove()
        offsets[source] = got[0]
    assert offsets["query"].shape == offsets["block"].shape and not torch.allclose(offsets["query"], offsets["block"])


def test_a_choice_that_is_not_offered_is_refused():
    with pytest.raises(ConfigError, match="offset_condition"):
        build_config("tiny", None, {"attention.offset_condition": "timestep"})
    with pytest.raises(ConfigError, match="offset_source"):
        build_config("tiny", None, {"attention.offset_source": "keys"})


def test_a_clamped_bound_keeps_the_offsets_within_it_and_leaves_the_rest_as_unbounded():
    """``attention.offset_bound = clamp``: each coordinate is the unbounded head's clipped to
    ``max_offset`` (those within it unchanged, unlike ``tanh``), its gradient zero where clipped;
    a fresh head still predicts zeros; an unknown bound is refused before any work."""
    from megaslide_ray.models.attention import OffsetPredictor

    torch.manual_seed(0)
    free = OffsetPredictor(D, 2, (3, 3, 3), 0.0)
    clamped = OffsetPredictor(D, 2, (3, 3, 3), 1.5, bound="clamp")
    smooth = OffsetPredictor(D, 2, (3, 3, 3), 1.5)
    with torch.no_grad():
        free.out.weight.normal_(0.0, 0.5)
        free.out.bias.normal_(0.0, 1.0)
    clamped.load_state_dict(free.state_dict())
    smooth.load_state_dict(free.state_dict())
    h = torch.randn(1, 4, 3, 3, D)
    raw = free(h)
    got = clamped(h)
    inside = raw.abs() < 1.5
    assert 0.2 < inside.float().mean() < 0.9  # both sides of the bound are exercised
    assert torch.equal(got, raw.clamp(-1.5, 1.5)) and torch.equal(got[inside], raw[inside])
    assert not torch.allclose(smooth(h)[inside], raw[inside])  # tanh compresses inside the bound too
    g = torch.randn(got.shape)
    (gw,) = torch.autograd.grad((clamped(h) * g).sum(), clamped.out.bias)
    (want,) = torch.autograd.grad((free(h) * g * inside).sum(), free.out.bias)
    assert torch.allclose(gw, want, atol=1e-5)
    fresh = OffsetPredictor(D, 2, (3, 3, 3), 1.5, bound="clamp")
    fresh.reset_output()
    assert torch.equal(fresh(h), torch.zeros_like(raw))
    with pytest.raises(ConfigError, match="offset_bound"):
        build_config("tiny", None, {"attention.offset_bound": "sigmoid"})
