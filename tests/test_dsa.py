"""3D Deformable Slide Attention: the reference against independent implementations.

- offsets == 0  -> naive loop 3D neighborhood attention (window shifted at borders);
- offsets == 0, window == (T, H, W) -> dense attention (torch SDPA), forward and the
  gradients of q, k, v, on every path (reference, cpu, chunked, Triton interpreter);
- float64 gradcheck of q, k, v, offsets (positions off the floor kinks, some clamped);
- input validation messages;
- the fast CPU path (``dsa_cpu``, what ``auto`` picks on CPU): forward and all four
  gradients against the reference (fp32 tight, fp64 incl. integer/clamped positions),
  fp64 gradcheck, both identities, chunk (tile) boundaries, size-1 axes, dispatch;
- the chunked CPU path and the Triton kernels against the reference. No GPU here: the
  Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1, small shapes, slow);
  ``test_triton_compiled_on_cuda`` runs the compiled kernels only where CUDA exists.
"""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch

from kernels import deformable_slide_attention, dsa_cpu, dsa_matrix, dsa_reference, resolve_dsa_backend
from kernels.checks import (
    assert_bf16_flash_rule,
    assert_dense_identity,
    assert_interpreter_tests_pass,
    edge_offsets,
    grads,
    make_qkv,
    naive_neighborhood_attention,
    off_kink_offsets,
    reference_flash_errors,
    wild_offsets,
)
from kernels.dsa_reference import dsa_reference_chunked, window_base_positions

dsa_cpu_module = importlib.import_module("kernels.dsa_cpu")  # the package exports the function


# -----------------------------------------------------------------------------
# Identities


@pytest.mark.parametrize(
    "grid,window",
    [
        ((3, 5, 4), (3, 3, 3)),
        ((4, 5, 7), (3, 3, 5)),
        ((5, 3, 6), (1, 3, 5)),
        ((2, 4, 3), (1, 1, 1)),
    ],
)
def test_zero_offsets_is_neighborhood_attention(grid, window):
    shape = (2, *grid, 2, 8)
    q, k, v = make_qkv(shape, torch.float64)
    K = window[0] * window[1] * window[2]
    offsets = torch.zeros(*shape[:5], K, 3, dtype=torch.float64)
    out = dsa_reference(q, k, v, offsets, window)
    ref = naive_neighborhood_attention(q, k, v, window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("grid", [(3, 5, 3), (1, 3, 3), (3, 1, 5)])
def test_zero_offsets_full_window_is_dense_attention(grid):
    def attn(q, k, v, offsets, window, scale):
        return dsa_reference(q, k, v, offsets, window, scale=scale)

    assert_dense_identity(attn, grid, torch.float64, 1e-10, seed=3)


def test_integer_offsets_move_the_sample_to_that_token():
    """An integer offset inside the volume samples exactly one token (no blending)."""
    shape = (1, 3, 4, 5, 1, 4)
    q, k, v = make_qkv(shape, torch.float64, seed=4)
    window = (1, 1, 1)
    offsets = torch.zeros(*shape[:5], 1, 3, dtype=torch.float64)
    offsets[..., 0, :] = torch.tensor([1.0, -2.0, 7.0])  # x clamps to W-1
    out = dsa_reference(q, k, v, offsets, window)
    # one sample -> softmax weight 1 -> out = v at the moved position
    t, y = 0, 3
    torch.testing.assert_close(out[0, t, y, 0, 0], v[0, t + 1, y - 2, 4, 0])


def test_fractional_offset_is_linear_blend():
    shape = (1, 1, 1, 4, 1, 3)
    q, k, v = make_qkv(shape, torch.float64, seed=5)
    offsets = torch.zeros(1, 1, 1, 4, 1, 1, 3, dtype=torch.float64)
    offsets[0, 0, 0, 0, 0, 0, 2] = 1.25  # x = 0 + 1.25
    out = dsa_reference(q, k, v, offsets, (1, 1, 1))
    torch.testing.assert_close(out[0, 0, 0, 0, 0], 0.75 * v[0, 0, 0, 1, 0] + 0.25 * v[0, 0, 0, 2, 0])


def test_base_positions_shift_inward_at_borders():
    base = window_base_positions((3, 5, 4), (3, 3, 3))
    assert base.shape == (3, 5, 4, 27, 3)
    # query (0, 0, 3): window starts (0, 0, 1); sample j=(jt*3+jy)*3+jx
    assert base[0, 0, 3, 0].tolist() == [0, 0, 1]
    assert base[0, 0, 3, (1 * 3 + 2) * 3 + 2].tolist() == [1, 2, 3]
    # centre query (1, 2, 2): window starts (0, 1, 1)
    assert base[1, 2, 2, 13].tolist() == [1, 2, 2]


def test_half_inputs_upcast_and_keep_dtype():
    shape = (2, 3, 4, 5, 2, 8)
    q, k, v = make_qkv(shape, torch.float32, seed=6)
    offsets = off_kink_offsets(shape, (3, 3, 3), span=2, dtype=torch.float32)
    ref = dsa_reference(q, k, v, offsets, (3, 3, 3))
    out = dsa_reference(*(x.bfloat16() for x in (q, k, v)), offsets.bfloat16(), (3, 3, 3))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.05)


# -----------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize(
    "grid,window,span,fast",
    [
        ((3, 2, 2), (3, 1, 1), 1, False),  # full jacobian, small
        ((3, 4, 5), (3, 3, 3), 1, True),  # random projections, all borders
        ((3, 4, 5), (3, 3, 3), 6, True),  # big offsets: many samples clamped
    ],
)
def test_gradcheck_float64(grid, window, span, fast):
    shape = (2, *grid, 2, 2 if not fast else 3)
    q, k, v = make_qkv(shape, torch.float64, seed=7, requires_grad=True)
    offsets = off_kink_offsets(shape, window, span).requires_grad_(True)

    def fn(q, k, v, offsets):
        return dsa_reference(q, k, v, offsets, window)

    assert torch.autograd.gradcheck(fn, (q, k, v, offsets), fast_mode=fast)


def test_clamped_samples_have_zero_offset_gradient():
    shape = (1, 3, 3, 3, 1, 2)
    q, k, v = make_qkv(shape, torch.float64, seed=8)
    offsets = torch.full((*shape[:5], 1, 3), 0.4, dtype=torch.float64)
    offsets[..., 0, 1] = 10.3  # every y position clamped to H-1
    offsets.requires_grad_(True)
    dsa_reference(q, k, v, offsets, (1, 1, 1)).sum().backward()
    assert torch.all(offsets.grad[..., 1] == 0)
    assert offsets.grad[..., 2].abs().sum() > 0


# -----------------------------------------------------------------------------
# Public API and validation


def test_public_function_matches_reference_and_honours_the_backend_switch():
    shape = (1, 3, 3, 3, 1, 4)
    q, k, v = make_qkv(shape)
    offsets = off_kink_offsets(shape, (3, 3, 3), span=1, dtype=torch.float32)
    ref = dsa_reference(q, k, v, offsets, (3, 3, 3))
    torch.testing.assert_close(deformable_slide_attention(q, k, v, offsets, (3, 3, 3)), ref)
    torch.testing.assert_close(deformable_slide_attention(q, k, v, offsets, (3, 3, 3), backend="reference"), ref)
    with pytest.raises(ValueError, match="bogus"):
        deformable_slide_attention(q, k, v, offsets, (3, 3, 3), backend="bogus")


def test_automatic_fallback_to_the_reference_warns_once(monkeypatch, caplog):
    """'auto' on a device tensor without a fused kernel runs the reference: never silently."""
    import kernels

    monkeypatch.setattr(kernels, "_WARNED", set())
    q = torch.empty(1, 3, 3, 3, 1, 4, device="meta")
    with caplog.at_level("WARNING", logger="kernels"):
        assert resolve_dsa_backend(q) == "reference"
        assert resolve_dsa_backend(q) == "reference"
    assert sum("falls back to the pure-PyTorch reference" in r.message for r in caplog.records) == 1


def _inputs(shape=(1, 3, 5, 4, 2, 4), window=(3, 3, 3)):
    q, k, v = make_qkv(shape)
    K = window[0] * window[1] * window[2]
    return q, k, v, torch.zeros(*shape[:5], K, 3)


@pytest.mark.parametrize(
    "window,match",
    [
        ((2, 3, 3), r"kt=2 must be a positive odd"),
        ((3, 3, 5), r"kw=5 exceeds the axis size 4"),
        ((5, 3, 3), r"kt=5 exceeds the axis size 3"),
        ((3, 3), r"three odd ints"),
    ],
)
def test_bad_window(window, match):
    q, k, v, _ = _inputs()
    K = 1
    for w in window:
        K *= w
    offsets = torch.zeros(*q.shape[:5], K, 3)
    with pytest.raises(ValueError, match=match):
        dsa_reference(q, k, v, offsets, window)


def test_bad_shapes():
    q, k, v, offsets = _inputs()
    with pytest.raises(ValueError, match=r"k shape \(1, 3, 5, 4, 2, 8\) != q shape"):
        dsa_reference(q, torch.zeros(1, 3, 5, 4, 2, 8), v, offsets, (3, 3, 3))
    with pytest.raises(ValueError, match=r"6 dims"):
        dsa_reference(q[0], k[0], v[0], offsets, (3, 3, 3))
    with pytest.raises(ValueError, match=r"last dim 3"):
        dsa_reference(q, k, v, offsets[..., :2], (3, 3, 3))
    with pytest.raises(ValueError, match=r"K=9 samples per query but window \(3, 3, 3\) needs K = 3\*3\*3 = 27"):
        dsa_reference(q, k, v, offsets[..., :9, :], (3, 3, 3))
    with pytest.raises(ValueError, match=r"leading dims"):
        dsa_reference(q, k, v, offsets[:, :, :, :, :1], (3, 3, 3))
    with pytest.raises(TypeError, match=r"share a dtype"):
        dsa_reference(q, k.double(), v, offsets, (3, 3, 3))


# -----------------------------------------------------------------------------
# Chunked CPU path


@pytest.mark.parametrize("chunk", [7, 1000])
def test_chunked_matches_reference(chunk):
    shape = (2, 3, 4, 5, 2, 3)
    window = (3, 3, 3)
    q, k, v = make_qkv(shape, torch.float64, seed=9, requires_grad=True)
    offsets = off_kink_offsets(shape, window, span=4).requires_grad_(True)
    dout = torch.randn(shape, dtype=torch.float64)
    ref = dsa_reference(q, k, v, offsets, window)
    out = dsa_reference_chunked(q, k, v, offsets, window, chunk_size=chunk)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g_ref = torch.autograd.grad(ref, (q, k, v, offsets), dout)
    g_out = torch.autograd.grad(out, (q, k, v, offsets), dout)
    for name, a, b in zip("q k v offsets".split(), g_out, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"d{name}")


@pytest.mark.parametrize("grid", [(3, 5, 3), (3, 1, 5)])
def test_chunked_zero_offsets_full_window_is_dense_attention(grid):
    def attn(q, k, v, offsets, window, scale):  # chunks of 4 tokens: several per batch item
        return dsa_reference_chunked(q, k, v, offsets, window, scale=scale, chunk_size=4)

    assert_dense_identity(attn, grid, torch.float64, 1e-10, seed=36)


def test_chunked_gradcheck_and_dispatch():
    shape = (2, 3, 3, 4, 2, 2)
    window = (3, 1, 3)
    q, k, v = make_qkv(shape, torch.float64, seed=10, requires_grad=True)
    offsets = off_kink_offsets(shape, window, span=3).requires_grad_(True)

    def fn(q, k, v, offsets):
        return deformable_slide_attention(q, k, v, offsets, window, backend="chunked")

    assert torch.autograd.gradcheck(fn, (q, k, v, offsets), fast_mode=True)


# -----------------------------------------------------------------------------
# Fast CPU path (dsa_cpu)


CPU_CASES = [
    # grid, window, nh, d, chunk (tokens of B*T*H*W per chunk)
    ((3, 5, 4), (3, 3, 3), 2, 6, 7),  # odd sizes; chunk does not divide B*N = 120
    ((4, 3, 7), (3, 3, 5), 2, 4, 13),
    ((1, 6, 5), (1, 3, 3), 2, 5, 11),  # T == 1
    ((5, 1, 4), (3, 1, 3), 3, 4, 1000),  # H == 1; one chunk
    ((3, 4, 1), (3, 3, 1), 2, 3, 1),  # W == 1; a chunk per token
]


@pytest.mark.parametrize("grid,window,nh,d,chunk", CPU_CASES)
def test_cpu_matches_reference_float32(grid, window, nh, d, chunk):
    shape = (2, *grid, nh, d)
    q, k, v = make_qkv(shape, seed=21)
    offsets = edge_offsets(shape, window, dtype=torch.float32)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(22))
    got = grads(lambda *a: dsa_cpu(*a, window, chunk_size=chunk), (q, k, v, offsets), dout)
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
    for name, a, b in zip("out dq dk dv doffsets".split(), got, want):
        assert a.dtype == b.dtype == torch.float32, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("grid,window,nh,d,chunk", CPU_CASES[:3])
def test_cpu_matches_reference_float64_on_kinks(grid, window, nh, d, chunk):
    """Integer, zero and clamp-bound positions: same one-sided derivatives as autograd."""
    shape = (2, *grid, nh, d)
    q, k, v = make_qkv(shape, torch.float64, seed=23)
    offsets = edge_offsets(shape, window, seed=24)
    dout = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(25))
    got = grads(lambda *a: dsa_cpu(*a, window, chunk_size=chunk), (q, k, v, offsets), dout)
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
    for name, a, b in zip("out dq dk dv doffsets".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=name)


@pytest.mark.parametrize(
    "grid,window,span,chunk,fast",
    [
        ((3, 2, 1), (3, 1, 1), 1, 5, False),  # full jacobian (tiny: every call counts)
        ((3, 4, 5), (3, 3, 3), 1, 17, True),
        ((3, 4, 5), (3, 3, 3), 6, 50, True),  # many samples clamped
        ((1, 3, 4), (1, 3, 3), 2, 7, True),  # T == 1
    ],
)
def test_cpu_gradcheck_float64(grid, window, span, chunk, fast):
    shape = (2, *grid, 2, 3) if fast else (1, *grid, 2, 2)
    q, k, v = make_qkv(shape, torch.float64, seed=26, requires_grad=True)
    offsets = off_kink_offsets(shape, window, span, seed=27).requires_grad_(True)

    def fn(q, k, v, offsets):
        return dsa_cpu(q, k, v, offsets, window, chunk_size=chunk)

    assert torch.autograd.gradcheck(fn, (q, k, v, offsets), fast_mode=fast)


@pytest.mark.parametrize(
    "grid,window",
    [((3, 5, 4), (3, 3, 3)), ((4, 5, 7), (3, 3, 5)), ((1, 4, 3), (1, 3, 3)), ((3, 1, 5), (3, 1, 5))],
)
def test_cpu_zero_offsets_is_neighborhood_attention(grid, window):
    shape = (2, *grid, 2, 8)
    K = window[0] * window[1] * window[2]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 2e-6)):
        q, k, v = make_qkv(shape, dtype, seed=28)
        offsets = torch.zeros(*shape[:5], K, 3, dtype=dtype)
        out = dsa_cpu(q, k, v, offsets, window, chunk_size=9)
        ref = naive_neighborhood_attention(*(x.double() for x in (q, k, v)), window)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("grid", [(3, 5, 3), (1, 3, 3), (3, 1, 5), (3, 3, 1)])
def test_cpu_zero_offsets_full_window_is_dense_attention(grid):
    def attn(q, k, v, offsets, window, scale):
        return dsa_cpu(q, k, v, offsets, window, scale=scale, chunk_size=4)

    assert_dense_identity(attn, grid, torch.float64, 1e-12, seed=29)
    # fp32, default chunks, through the public dispatch
    def public(q, k, v, offsets, window, scale):
        return deformable_slide_attention(q, k, v, offsets, window, scale=scale, backend="cpu")

    assert_dense_identity(public, grid, torch.float32, 2e-5, seed=37)


@pytest.mark.parametrize(
    "batch,grid,chunk",
    [(2, (3, 5, 4), 7), (2, (3, 4, 1), 1), (3, (2, 3, 4), 100), (1, (5, 1, 7), 6), (1, (8, 64, 64), 2427)],
)
def test_cpu_tiles_partition_the_queries(batch, grid, chunk):
    """Chunks are tiles of at most ``chunk`` tokens that cover every query exactly once."""
    cb, ct, cy, cx = dsa_cpu_module.tile_shape(batch, grid, chunk)
    assert cb * ct * cy * cx <= chunk
    geo = dsa_cpu_module._Geometry(torch.empty(batch, *grid, 1, 1), (1, 1, 1), chunk)
    tiles = list(geo.tiles())
    assert max(t.numel() for t in tiles) <= chunk
    rows = torch.cat(tiles)
    assert torch.equal(rows.sort().values, torch.arange(batch * grid[0] * grid[1] * grid[2]))


def test_cpu_partial_grads_and_noncontiguous_inputs():
    """q, k, v sliced from one qkv tensor; offsets without grad (neighborhood mode)."""
    B, T, H, W, nh, d = 2, 3, 4, 5, 2, 4
    window = (3, 3, 3)
    qkv = torch.randn(B, T, H, W, 3, nh, d, generator=torch.Generator().manual_seed(30))
    qkv.requires_grad_(True)
    q, k, v = qkv.unbind(dim=4)
    assert not q.is_contiguous()
    offsets = edge_offsets((B, T, H, W, nh, d), window, dtype=torch.float32, seed=31)
    dout = torch.randn(B, T, H, W, nh, d)
    (g_cpu,) = torch.autograd.grad(dsa_cpu(q, k, v, offsets, window, chunk_size=16), qkv, dout)
    (g_ref,) = torch.autograd.grad(dsa_reference(q, k, v, offsets, window), qkv, dout)
    torch.testing.assert_close(g_cpu, g_ref, rtol=1e-5, atol=1e-5)
    # only offsets need a gradient
    off = offsets.clone().requires_grad_(True)
    qd, kd, vd = (x.detach() for x in (q, k, v))
    (go_cpu,) = torch.autograd.grad(dsa_cpu(qd, kd, vd, off, window), off, dout)
    (go_ref,) = torch.autograd.grad(dsa_reference(qd, kd, vd, off, window), off, dout)
    torch.testing.assert_close(go_cpu, go_ref, rtol=1e-5, atol=1e-5)


def test_cpu_half_inputs_and_sddmm_fallback(monkeypatch):
    shape = (2, 3, 4, 5, 2, 8)
    window = (3, 3, 3)
    q, k, v = make_qkv(shape, seed=32)
    offsets = edge_offsets(shape, window, dtype=torch.float32, seed=33)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(34))
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
    half = grads(lambda *a: dsa_cpu(*a, window), [x.bfloat16() for x in (q, k, v, offsets)], dout)
    for name, a, b in zip("out dq dk dv doffsets".split(), half, want):
        assert a.dtype == torch.bfloat16, name
    same = grads(
        lambda *a: dsa_reference(*a, window), [x.bfloat16() for x in (q, k, v, offsets)], dout
    )
    for name, a, b in zip("out dq dk dv doffsets".split(), half, same):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=name)
    # public autograd fallback for the corner dots (if aten's private op goes away)
    monkeypatch.setattr(dsa_cpu_module, "USE_PRIVATE_SDDMM", False)
    got = grads(lambda *a: dsa_cpu(*a, window, chunk_size=13), (q, k, v, offsets), dout)
    for name, a, b in zip("out dq dk dv doffsets".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_cpu_nan_offset_poisons_only_its_query():
    shape = (1, 2, 3, 3, 2, 4)
    q, k, v = make_qkv(shape, seed=35)
    offsets = torch.zeros(*shape[:5], 1, 3)
    offsets[0, 1, 2, 0, 1, 0, 1] = float("nan")
    out = dsa_cpu(q, k, v, offsets, (1, 1, 1))
    nan = torch.isnan(out).any(-1)
    assert nan[0, 1, 2, 0, 1] and nan.sum() == 1


def test_dispatch_auto_picks_cpu_path(monkeypatch):
    import kernels

    shape = (1, 3, 3, 3, 1, 4)
    q, k, v = make_qkv(shape)
    offsets = off_kink_offsets(shape, (3, 3, 3), span=1, dtype=torch.float32)
    monkeypatch.setattr(kernels, "MATRIX_MAX_TOKENS", 26)  # a 27-token grid: above the small-grid path
    assert resolve_dsa_backend(q) == "cpu"
    assert resolve_dsa_backend(q, "reference") == "reference"
    fast = dsa_cpu(q, k, v, offsets, (3, 3, 3))
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3)), fast)
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3), backend="cpu"), fast)
    ref = dsa_reference(q, k, v, offsets, (3, 3, 3))
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3), backend="reference"), ref)
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3), backend="cpu"), fast)
    with pytest.raises(ValueError, match="chunk_size"):
        dsa_cpu(q, k, v, offsets, (3, 3, 3), chunk_size=0)


# -----------------------------------------------------------------------------
# Small grids on CPU (dsa_matrix)


@pytest.mark.parametrize("grid,window,nh,d", [c[:4] for c in CPU_CASES])
def test_matrix_matches_reference(grid, window, nh, d):
    """fp32 tight and fp64 on integer, zero and clamp-bound positions (the one-sided derivatives
    of the reference's floor and clamp)."""
    shape = (2, *grid, nh, d)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-11)):
        q, k, v = make_qkv(shape, dtype, seed=41)
        offsets = edge_offsets(shape, window, dtype=dtype, seed=42)
        dout = torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(43))
        got = grads(lambda *a: dsa_matrix(*a, window), (q, k, v, offsets), dout)
        want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
        for name, a, b in zip("out dq dk dv doffsets".split(), got, want):
            assert a.dtype == b.dtype == dtype, name
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("grid,window,span,fast", [((3, 2, 1), (3, 1, 1), 1, False),
                                                   ((3, 4, 5), (3, 3, 3), 6, True)])
def test_matrix_gradcheck_float64(grid, window, span, fast):
    shape = (2, *grid, 2, 3) if fast else (1, *grid, 2, 2)
    q, k, v = make_qkv(shape, torch.float64, seed=44, requires_grad=True)
    offsets = off_kink_offsets(shape, window, span, seed=45).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda *a: dsa_matrix(*a, window), (q, k, v, offsets), fast_mode=fast)


def test_matrix_identities_and_half_inputs():
    shape = (2, 3, 5, 4, 2, 8)
    q, k, v = make_qkv(shape, torch.float64, seed=46)
    offsets = torch.zeros(*shape[:5], 27, 3, dtype=torch.float64)
    ref = naive_neighborhood_attention(q, k, v, (3, 3, 3))
    torch.testing.assert_close(dsa_matrix(q, k, v, offsets, (3, 3, 3)), ref, rtol=1e-12, atol=1e-12)
    assert_dense_identity(lambda q, k, v, o, w, scale: dsa_matrix(q, k, v, o, w, scale=scale), (3, 5, 3),
                          torch.float64, 1e-12, seed=47)
    q, k, v = make_qkv(shape, seed=48)
    offsets = edge_offsets(shape, (3, 3, 3), dtype=torch.float32, seed=49)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(50))
    half = grads(lambda *a: dsa_matrix(*a, (3, 3, 3)), [x.bfloat16() for x in (q, k, v, offsets)], dout)
    same = grads(lambda *a: dsa_reference(*a, (3, 3, 3)), [x.bfloat16() for x in (q, k, v, offsets)], dout)
    for name, a, b in zip("out dq dk dv doffsets".split(), half, same):
        assert a.dtype == torch.bfloat16, name
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2, msg=name)


def test_small_grids_take_the_matrix_path_and_large_ones_are_refused(monkeypatch):
    import kernels

    shape = (1, 3, 3, 3, 2, 4)
    q, k, v = make_qkv(shape, seed=51)
    offsets = off_kink_offsets(shape, (3, 3, 3), span=1, dtype=torch.float32, seed=52)
    small = dsa_matrix(q, k, v, offsets, (3, 3, 3))
    assert resolve_dsa_backend(q) == "matrix"
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3)), small)
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3), backend="matrix"), small)
    monkeypatch.setattr(kernels, "MATRIX_MAX_TOKENS", 26)
    assert resolve_dsa_backend(q) == "cpu"
    assert torch.equal(deformable_slide_attention(q, k, v, offsets, (3, 3, 3)), dsa_cpu(q, k, v, offsets, (3, 3, 3)))
    big = torch.empty(1, 17, 16, 16, 1, 1)  # 4352 tokens
    with pytest.raises(ValueError, match="4352 tokens .* at most 4096 tokens. Use dsa_cpu"):
        dsa_matrix(big, big, big, torch.empty(1, 17, 16, 16, 1, 1, 3), (1, 1, 1))


# -----------------------------------------------------------------------------
# Triton kernels under the CPU interpreter


INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_triton_kernels_under_interpreter"
)


@pytest.mark.core  # CI runs it every time: the gather kernels every mode builds on
@pytest.mark.slow  # about 6 min on one core: every Triton interpreter child runs in the slow half
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_triton_kernels_under_interpreter():
    """Run the ``test_interp_*`` tests below in a child process with TRITON_INTERPRET=1
    (it must be set before triton is first imported: ``assert_interpreter_tests_pass``)."""
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__)


@pytest.mark.parametrize(
    "grid,window,d,block_m,chunk",
    [
        ((3, 5, 4), (3, 3, 3), 6, 32, None),  # d not a power of 2; partial last query block (auto: the split mode)
        ((5, 3, 7), (5, 1, 3), 4, 64, 3),  # window spans all of T; every border on x; the atomic mode's
        # fp32 dk, dv in chunks of 3 (batch, head) pairs of 4: the first chunk spans both batch items
    ],
)
@interpreter_only
def test_interp_fp32_matches_reference(grid, window, d, block_m, chunk, monkeypatch):
    import kernels.dsa_triton as DT
    from kernels.dsa_modes import AUTO, KernelModes
    from kernels.dsa_triton import dsa_triton

    if chunk is not None:
        monkeypatch.setattr(DT, "ATOMIC_BUDGET_BYTES", chunk * 2 * math.prod(grid) * d * 4)
        assert DT.atomic_chunk(4, math.prod(grid), d) == chunk
    # one clip for the split mode's case (its key-side pass is the interpreter's slowest kernel; the
    # atomic case keeps two clips of two heads: pairs across batch items)
    shape = (1 if chunk is None else 2, *grid, 2, d)
    q, k, v = make_qkv(shape, seed=12)
    offsets = wild_offsets(shape, window)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(13))

    # the chunked case asks for the atomic mode itself (auto reaches it at this window only because
    # no split bound fits it: kernels/dsa_triton_split.py), and counts the chunks it takes
    modes = AUTO if chunk is None else KernelModes(dkv="atomic")

    def tri(q, k, v, offsets):
        return dsa_triton(q, k, v, offsets, window, block_m=block_m, modes=modes)

    def ref(q, k, v, offsets):
        return dsa_reference(q, k, v, offsets, window)

    if chunk is not None:  # the chunks are really taken: count the launches of the query-side pass
        launches = []
        real = DT.atomic_chunk
        monkeypatch.setattr(DT, "atomic_chunk", lambda *a: launches.append(real(*a)) or launches[-1])
    got = grads(tri, (q, k, v, offsets), dout)
    if chunk is not None:
        assert launches == [chunk], launches
    want = grads(ref, (q, k, v, offsets), dout)
    for name, a, b in zip("out dq dk dv doffsets".split(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5, msg=f"{name}")


@interpreter_only
def test_interp_bf16_tolerance_rule():
    """flash-attention rule: |tri - ref32| <= 2 |torch_bf16 - ref32| + atol (max abs), for the gather
    kernels with the atomic mode's dk, dv (the key-side pass and the split mode have their own bf16
    checks: tests/test_dsa_pull.py, tests/test_dsa_split.py)."""
    from kernels.dsa_modes import KernelModes
    from kernels.dsa_triton import dsa_triton

    window = (3, 3, 3)
    shape = (2, 3, 4, 5, 2, 8)
    q, k, v = (x.bfloat16() for x in make_qkv(shape, seed=14))
    offsets = wild_offsets(shape, window, dtype=torch.bfloat16, seed=15)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(16))
    inputs = (q, k, v, offsets)

    got = grads(
        lambda *a: dsa_triton(*a, window, block_m=64, modes=KernelModes(dkv="atomic")), inputs, dout
    )
    assert_bf16_flash_rule(got, inputs, dout, window, "triton")


@interpreter_only
def test_interp_noncontiguous_neighborhood_public_api():
    """Public API, backend='triton': q, k, v sliced from one qkv tensor (non-contiguous)."""
    B, T, H, W, nh, d = 2, 3, 3, 5, 2, 4
    window = (3, 3, 3)
    qkv = torch.randn(B, T, H, W, 3, nh, d, dtype=torch.float64)
    q, k, v = qkv.float().unbind(dim=4)
    assert not q.is_contiguous()
    offsets = torch.zeros(B, T, H, W, nh, 27, 3).transpose(0, 1).contiguous().transpose(0, 1)
    out = deformable_slide_attention(q, k, v, offsets, window, backend="triton")
    ref = naive_neighborhood_attention(*(x.double() for x in (q, k, v)), window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@interpreter_only
def test_interp_zero_offsets_full_window_is_dense_attention():
    """Dense identity through the public API, backend='triton': fp32 against fp64 SDPA.

    Grid (3, 1, 5): non-cube, H == 1; N = 15 tokens: one partial query block per (b, head).
    """
    def attn(q, k, v, offsets, window, scale):
        return deformable_slide_attention(q, k, v, offsets, window, scale=scale, backend="triton")

    assert_dense_identity(attn, (3, 1, 5), torch.float32, 2e-5, seed=38)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_compiled_on_cuda():
    from kernels.dsa_triton import dsa_triton

    window = (3, 5, 5)
    shape = (2, 5, 9, 11, 3, 64)
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (x.cuda().to(dtype) for x in make_qkv(shape, seed=17))
        offsets = wild_offsets(shape, window, seed=18).cuda()
        dout = torch.randn(shape, device="cuda")
        got = grads(lambda *a: dsa_triton(*a, window), (q, k, v, offsets), dout)
        errors = reference_flash_errors(got, (q, k, v, offsets), dout, window, rel_atol=1e-4)
        assert not errors, f"{dtype}: " + "; ".join(errors)
