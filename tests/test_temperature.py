"""``attention.learn_temperature``: a per-head log-temperature ``tau`` in every block's self-attention.

Checked against plain PyTorch, head by head: a block with ``tau`` is the block without it whose
head h has the softmax scale ``scale * exp(tau_h)`` (the reference operator called per head with
that scale), ``tau = 0`` is exactly today's block, ``tau``'s gradient is autograd's on that
per-head reference (and agrees with finite differences in float64), token-chunked blocks equal
whole ones with it, and a pretrained source without ``tau`` loads with ``tau = 0``.
"""

import pytest
import torch
import torch.nn.functional as F
from test_token_chunk import _assert_same, _inputs, _run

from kernels.dsa_reference import dsa_reference
from megaslide_ray.config import build_config
from megaslide_ray.models.attention import self_attention
from megaslide_ray.models.registry import build_shard

D, NH, GRID = 32, 2, (4, 3, 3)


def _config(arch="videodit", kind="dsa", learn=True, chunk=0, backend="reference"):
    over = {"model.depth": 1, "model.hidden_size": D, "model.num_heads": NH, "model.ffn_dim": 64,
            "attention.kind": kind, "attention.window": "3,3,3", "attention.max_offset": 1.5,
            "attention.learn_temperature": learn, "runtime.token_chunk": chunk, "attention.backend": backend}
    if arch == "wan":
        over.update({"model.arch": "wan", "model.text_dim": 16, "model.text_len": 5, "model.in_channels": 4,
                     "model.patch_size": "1,2,2", "model.timestep_freq_dim": 16, "data.num_frames": 9,
                     "data.height": 48, "data.width": 80})
    return build_config("tiny", None, over)


def _attn(block):
    return getattr(block, "attn", None) or block.attn1


def _random_block(cfg, seed=0):
    block = build_shard(cfg, 1).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    return block


def _qkv(seed=2, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, *GRID, NH, D // NH, generator=g, dtype=dtype) for _ in range(3)]


def _per_head_reference(attn, q, k, v, h):
    """Head by head, the plain operator with the scale ``scale * exp(tau_h)`` (no query scaling)."""
    scale = attn.scale or (D // NH) ** -0.5
    outs = []
    for head in range(NH):
        s = scale * torch.exp(attn.tau[head])
        qh, kh, vh = (z[..., head:head + 1, :] for z in (q, k, v))
        if attn.kind == "dense":
            B = q.shape[0]
            qf, kf, vf = (z.reshape(B, -1, 1, z.shape[-1]).transpose(1, 2) for z in (qh, kh, vh))
            a = torch.softmax(s * qf @ kf.transpose(-1, -2), dim=-1)
            outs.append((a @ vf).transpose(1, 2).reshape(qh.shape))
        else:
            off = (attn.offsets(h) if attn.offsets is not None
                   else h.new_zeros(*q.shape[:5], 27, 3))[..., head:head + 1, :, :]
            outs.append(dsa_reference(qh, kh, vh, off, attn.window, scale=s))
    return torch.cat(outs, dim=-2)


@pytest.mark.parametrize("kind", ["dense", "neighborhood", "dsa"])
def test_tau_scales_each_heads_softmax_as_the_reference(kind):
    attn = _attn(_random_block(_config(kind=kind)))
    with torch.no_grad():
        attn.tau.copy_(torch.tensor([0.7, -0.4], dtype=torch.float64))
    q, k, v = _qkv()
    h = torch.randn(2, *GRID, D, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got = self_attention(attn, q, k, v, h)
    want = _per_head_reference(attn, q, k, v, h)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    # tau's gradient: autograd through the block's path against autograd through the per-head reference
    dy = torch.randn(got.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    g_got, = torch.autograd.grad(self_attention(attn, q, k, v, h), attn.tau, dy)
    g_want, = torch.autograd.grad(_per_head_reference(attn, q, k, v, h), attn.tau, dy)
    assert (g_got - g_want).abs().max() <= 1e-10 * g_want.abs().max()
    assert g_want.abs().min() > 0


def test_tau_gradient_matches_finite_differences():
    attn = _attn(_random_block(_config(kind="neighborhood")))
    q, k, v = _qkv()
    h = torch.zeros(2, *GRID, D, dtype=torch.float64)
    dy = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    loss = lambda: (self_attention(attn, q, k, v, h) * dy).sum()  # noqa: E731
    grad, = torch.autograd.grad(loss(), attn.tau)
    eps = 1e-6
    for head in range(NH):
        with torch.no_grad():
            attn.tau[head] += eps
            up = loss()
            attn.tau[head] -= 2 * eps
            down = loss()
            attn.tau[head] += eps
        fd = (up - down) / (2 * eps)
        assert abs(float(fd) - float(grad[head])) <= 1e-6 * max(1.0, abs(float(fd)))


@pytest.mark.parametrize("arch", ["videodit", "wan"])
@pytest.mark.parametrize("kind", ["dense", "dsa"])
def test_tau_zero_is_exactly_the_block_without_it(arch, kind):
    plain = build_shard(_config(arch, kind, learn=False), 1)
    with_tau = build_shard(_config(arch, kind, learn=True), 1)
    assert _attn(with_tau).tau is not None and _attn(plain).tau is None
    state = plain.state_dict()
    assert torch.equal(dict(with_tau.named_parameters())[next(n for n, _ in with_tau.named_parameters()
                                                                if n.endswith(".tau"))], torch.zeros(NH))
    with_tau.load_state_dict(state, strict=False)  # tau keeps its fresh 0
    x, c = _inputs(arch)
    with torch.no_grad():
        assert torch.equal(with_tau(x, c), plain(x, c))


@pytest.mark.parametrize("arch", ["videodit", "wan"])
@pytest.mark.parametrize("kind", ["dense", "swin", "dsa"])
def test_token_chunked_block_with_tau_equals_whole(arch, kind):
    # the CPU kernels (every backend computes the same function: tests/test_dsa*.py), not the slow reference
    whole = build_shard(_config(arch, kind, chunk=0, backend="cpu"), 1)
    chunked = build_shard(_config(arch, kind, chunk=40, backend="cpu"), 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        _attn(whole).tau.copy_(torch.tensor([0.5, -0.3]))
    chunked.load_state_dict(whole.state_dict())
    x, c = _inputs(arch, grid=(12, 3, 3))
    want, got = _run(whole, x, c), _run(chunked, x, c)
    tau = next(n for n in want if n.endswith(".tau"))
    assert want[tau].abs().min() > 0
    # a gradient fp32 cannot give to 1e-6 (a cross-attention key bias: sums that cancel) is held to
    # the float64 result instead, as in tests/test_token_chunk.py
    _assert_same(got, want, 1e-6, lambda: _run(whole.double(), x.double(), c.double()))


def test_a_pretrained_source_without_tau_loads_with_tau_zero(tmp_path):
    from safetensors.torch import save_file

    from megaslide_ray.state.pretrained_io import check_pretrained, describe_init, model_names

    plain, learn = _config(learn=False), _config(learn=True)
    names = model_names(plain)
    save_file({n: torch.zeros(shape) for n, (shape, _, _) in names.items()}, str(tmp_path / "w.safetensors"))
    source = check_pretrained(learn, tmp_path / "w.safetensors")  # refuses a source that misses anything else
    assert [n for n in model_names(learn) if n not in source] == ["blocks.0.attn.tau"]
    assert "1 per-head temperatures" in describe_init(learn, tmp_path / "w.safetensors", source)


def test_dense_sdpa_agrees_with_the_manual_softmax():
    """The per-head reference's dense branch is the SDPA the block calls, at tau = 0."""
    q, k, v = _qkv()
    attn = _attn(_random_block(_config(kind="dense")))
    with torch.no_grad():
        attn.tau.zero_()
    B = q.shape[0]
    sdpa = F.scaled_dot_product_attention(*(z.reshape(B, -1, NH, D // NH).transpose(1, 2) for z in (q, k, v)))
    want = _per_head_reference(attn, q, k, v, None)
    assert (sdpa.transpose(1, 2).reshape(want.shape) - want).abs().max() <= 1e-12
