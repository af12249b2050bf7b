"""3D (shifted) window attention against an independent per-query loop.

The loop never pads or rolls: along each axis it cuts the grid at ``s + m*w`` (shift
``s``, window ``w``) and lets a query attend to every key in the same cell on all three
axes. That is what pad + roll + partition + region mask must amount to.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.checks import dense_attention, make_qkv
from kernels.swin import swin_attention_3d, swin_geometry

# -----------------------------------------------------------------------------
# Independent helpers


def naive_swin_attention(q, k, v, window, shift, scale=None):
    """Loop-per-query window attention with explicitly computed window membership."""
    B, T, H, W, nh, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    # same clipping rule as the op: an axis that fits in one window is one window, unshifted
    eff = [min(w, size) for w, size in zip(window, (T, H, W))]
    shifts = [w // 2 if (shift and size > w) else 0 for w, size in zip(eff, (T, H, W))]

    def cell(i, w, s):
        return (i - s) // w  # floor division: positions before the first cut are cell -1

    def members(i, size, w, s):
        return [j for j in range(size) if cell(j, w, s) == cell(i, w, s)]

    out = torch.empty_like(q)
    for t, y, x in itertools.product(range(T), range(H), range(W)):
        ts = members(t, T, eff[0], shifts[0])
        ys = members(y, H, eff[1], shifts[1])
        xs = members(x, W, eff[2], shifts[2])
        keys = torch.stack([k[:, a, b, c] for a, b, c in itertools.product(ts, ys, xs)], 1)
        vals = torch.stack([v[:, a, b, c] for a, b, c in itertools.product(ts, ys, xs)], 1)
        s = torch.einsum("bhd,bjhd->bhj", q[:, t, y, x], keys) * scale
        out[:, t, y, x] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), vals)
    return out


# -----------------------------------------------------------------------------
# Against the loop


@pytest.mark.parametrize("shift", [False, True], ids=["plain", "shifted"])
@pytest.mark.parametrize(
    "grid,window",
    [
        ((5, 7, 9), (2, 4, 4)),  # every axis padded, even window
        ((3, 5, 7), (3, 3, 3)),  # odd window, H and W padded
        ((4, 8, 6), (2, 4, 3)),  # no padding: only the shift needs a mask
        ((3, 5, 4), (4, 2, 8)),  # windows larger than T and W: clipped, never shifted
    ],
)
def test_matches_naive_loop(grid, window, shift):
    shape = (2, *grid, 2, 8)
    q, k, v = make_qkv(shape, torch.float64, seed=sum(grid))
    out = swin_attention_3d(q, k, v, window, shift=shift, scale=0.4)
    ref = naive_swin_attention(q, k, v, window, shift, scale=0.4)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


def test_shift_changes_the_result():
    q, k, v = make_qkv((1, 4, 8, 8, 2, 8), torch.float64, seed=7)
    a = swin_attention_3d(q, k, v, (2, 4, 4), shift=False)
    b = swin_attention_3d(q, k, v, (2, 4, 4), shift=True)
    assert not torch.allclose(a, b)


def test_geometry_rules():
    # clipped windows and no shift on an axis that fits in one window
    assert swin_geometry((3, 8, 7), (4, 4, 4), True) == ((3, 4, 4), (0, 2, 2), (3, 8, 8))
    assert swin_geometry((5, 7, 9), (2, 4, 4), False) == ((2, 4, 4), (0, 0, 0), (6, 8, 12))
    with pytest.raises(ValueError, match="positive ints"):
        swin_geometry((4, 4, 4), (0, 2, 2), False)


# -----------------------------------------------------------------------------
# Identities


@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("grid", [(3, 5, 4), (1, 3, 7)])
def test_whole_grid_window_is_dense_attention(grid, shift):
    # window == grid: one window; shift is disabled because no axis exceeds its window
    shape = (2, *grid, 2, 8)
    q, k, v = make_qkv(shape, torch.float64, seed=3)
    out = swin_attention_3d(q, k, v, grid, shift=shift, scale=0.3)
    torch.testing.assert_close(out, dense_attention(q, k, v, scale=0.3), rtol=1e-10, atol=1e-10)


# -----------------------------------------------------------------------------
# Gradients


def test_gradients_finite_fp32_with_padding_and_shift():
    q, k, v = make_qkv((2, 5, 7, 9, 2, 16), torch.float32, seed=5, requires_grad=True)
    out = swin_attention_3d(q, k, v, (2, 4, 4), shift=True)
    (out.square().sum()).backward()
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name


def test_gradcheck_fp64():
    q, k, v = make_qkv((1, 3, 4, 3, 1, 2), torch.float64, seed=11, requires_grad=True)  # T, W padded; all shifted
    fn = lambda q, k, v: swin_attention_3d(q, k, v, (2, 2, 2), shift=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-6)


def test_input_validation():
    q, k, v = make_qkv((1, 2, 2, 2, 1, 4), torch.float64)
    with pytest.raises(ValueError, match="6 dims"):
        swin_attention_3d(q[0], k[0], v[0], (2, 2, 2), shift=False)
    with pytest.raises(ValueError, match="k shape"):
        swin_attention_3d(q, k[:, :1], v, (2, 2, 2), shift=False)
