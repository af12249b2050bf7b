"""3D (shifted) window attention, Video-Swin style: the ``swin`` attention kind.

Layout is the same channels-last layout as 3D-DSA (see ``dsa_reference``):

    q, k, v, out : (B, T, H, W, nh, d)

Algorithm (Liu et al., "Video Swin Transformer", 2021), for ``window = (kt, kh, kw)``:

1. Effective window per axis: ``w = min(window_axis, size)``. An axis no longer than
   its window is one window and is never shifted (Video Swin's ``get_window_size``).
   Unlike DSA, swin windows need NOT be odd: they tile the grid, they are not centred
   on a query.
2. Pad each axis at the end to a multiple of ``w`` (zeros). Padded *keys* are masked
   out, so they get no attention weight; outputs at padded positions are dropped.
3. ``shift=True``: roll the padded grid by ``-(w // 2)`` per axis before partitioning
   and roll back afterwards. Tokens that wrap around land in the last window of the
   axis next to tokens they were not adjacent to; the standard Swin region mask stops
   them from attending to each other.
4. Partition into non-overlapping windows of ``kt*kh*kw`` tokens and run
   ``torch.nn.functional.scaled_dot_product_attention`` in each, with a boolean mask
   (only when padding or shifting makes one necessary).

Equivalently, in the unrolled frame: along each axis the grid is cut at
``s + m*w`` (``s`` the shift, ``m`` any integer); a query attends to every real key
that lies in the same cell on all three axes. The tests check exactly that.

Cost: ``4 * N * V * d * nh * B`` FLOPs per forward (two matmuls, 2 FLOPs per
multiply-add) for ``N`` tokens and window volume ``V``: linear in N. The mask is
``(windows, V, V)`` booleans, shared by batch and heads.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from .dsa_reference import validate_qkv_shapes

__all__ = ["swin_attention_3d", "swin_geometry", "swin_window_mask"]


# -----------------------------------------------------------------------------
# Geometry


def swin_geometry(
    grid: Sequence[int], window: Sequence[int], shift: bool
) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]:
    """(effective window, shift per axis, padded grid) for a ``(T, H, W)`` grid.

    The window is clipped to the axis size; an axis that fits in one window is not shifted.
    """
    try:
        win = tuple(int(w) for w in window)
    except TypeError:
        raise ValueError(f"window must be three positive ints (kt, kh, kw), got {window!r}") from None
    if len(win) != 3 or any(w < 1 for w in win):
        raise ValueError(f"window must be three positive ints (kt, kh, kw), got {window!r}")
    eff, shifts, padded = [], [], []
    for size, w in zip(grid, win):
        w = min(w, int(size))
        s = w // 2 if (shift and size > w) else 0
        eff.append(w)
        shifts.append(s)
        padded.append(-(-int(size) // w) * w)  # ceil to a multiple of w
    return tuple(eff), tuple(shifts), tuple(padded)  # type: ignore[return-value]


def _partition(x: torch.Tensor, win: tuple[int, int, int]) -> torch.Tensor:
    """(B, Tp, Hp, Wp, nh, d) -> (B*nWin, nh, V, d): one row block per window."""
    B, Tp, Hp, Wp, nh, d = x.shape
    kt, kh, kw = win
    x = x.view(B, Tp // kt, kt, Hp // kh, kh, Wp // kw, kw, nh, d)
    x = x.permute(0, 1, 3, 5, 7, 2, 4, 6, 8)  # (B, nT, nH, nW, nh, kt, kh, kw, d)
    return x.reshape(-1, nh, kt * kh * kw, d)


def _merge(x: torch.Tensor, B: int, padded: tuple[int, int, int], win: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of ``_partition``: (B*nWin, nh, V, d) -> (B, Tp, Hp, Wp, nh, d)."""
    Tp, Hp, Wp = padded
    kt, kh, kw = win
    nh, d = x.shape[1], x.shape[3]
    x = x.view(B, Tp // kt, Hp // kh, Wp // kw, nh, kt, kh, kw, d)
    x = x.permute(0, 1, 5, 2, 6, 3, 7, 4, 8)  # (B, nT, kt, nH, kh, nW, kw, nh, d)
    return x.reshape(B, Tp, Hp, Wp, nh, d)


def swin_window_mask(
    grid: Sequence[int],
    win: tuple[int, int, int],
    shifts: tuple[int, int, int],
    padded: tuple[int, int, int],
    device=None,
) -> torch.Tensor | None:
    """Boolean ``(nWin, V, V)`` mask (True = may attend) in the rolled, padded frame.

    ``None`` when no position is padded and nothing is shifted (plain window attention).
    """
    if tuple(grid) == tuple(padded) and not any(shifts):
        return None
    # Per axis, for rolled position r: the original index it holds, whether it wrapped
    # around in the roll (the Swin "region"), and whether it is a real (unpadded) token.
    labels, valid = [], []
    for size, s, P in zip(grid, shifts, padded):
        r = torch.arange(P, device=device)
        orig = (r + s) % P
        labels.append((r + s >= P).long())  # wrapped tokens form their own region
        valid.append(orig < size)
    lt, ly, lx = labels
    region = (lt[:, None, None] * 4 + ly[None, :, None] * 2 + lx[None, None, :])  # (Tp, Hp, Wp)
    real = valid[0][:, None, None] & valid[1][None, :, None] & valid[2][None, None, :]
    # -- to windows: (nWin, V)
    kt, kh, kw = win
    Tp, Hp, Wp = padded

    def to_windows(x: torch.Tensor) -> torch.Tensor:
        x = x.view(Tp // kt, kt, Hp // kh, kh, Wp // kw, kw).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(-1, kt * kh * kw)

    region_w, real_w = to_windows(region), to_windows(real)
    mask = (region_w[:, :, None] == region_w[:, None, :]) & real_w[:, None, :]
    # A padded query may see no real key of its region; let every query see itself so no
    # softmax row is empty (an all-masked row would make NaNs that leak into backward).
    # Real queries always see themselves already, so their outputs are unchanged.
    mask |= torch.eye(mask.shape[-1], dtype=torch.bool, device=device)
    return mask


# -----------------------------------------------------------------------------
# The operator


def swin_attention_3d(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: Sequence[int],
    shift: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """3D (shifted) window attention on ``(B, T, H, W, nh, d)`` q, k, v.

    Args:
        window: ``(kt, kh, kw)``, positive ints (any parity); clipped per axis to the
            grid size.
        shift: roll by ``-(w // 2)`` per axis before partitioning (the odd blocks of a
            Swin stack), with the region mask that keeps wrapped tokens apart.
        scale: softmax scale, default ``d ** -0.5``.

    Returns:
        ``out`` ``(B, T, H, W, nh, d)`` in q's dtype.
    """
    validate_qkv_shapes(q, k, v)
    B, T, H, W, nh, d = q.shape
    win, shifts, padded = swin_geometry((T, H, W), window, shift)
    scale = d ** -0.5 if scale is None else float(scale)

    pads = (0, 0, 0, 0, 0, padded[2] - W, 0, padded[1] - H, 0, padded[0] - T)
    dims = (1, 2, 3)
    neg = tuple(-s for s in shifts)

    def prepare(x: torch.Tensor) -> torch.Tensor:
        if any(pads):
            x = F.pad(x, pads)  # pad at the end of T, H, W
        if any(shifts):
            x = torch.roll(x, shifts=neg, dims=dims)
        return _partition(x, win)  # (B*nWin, nh, V, d)

    qw, kw_, vw = prepare(q), prepare(k), prepare(v)
    mask = swin_window_mask((T, H, W), win, shifts, padded, q.device)
    if mask is not None:
        # (nWin, V, V) -> (B*nWin, 1, V, V): one mask per window, shared by batch and heads
        n_win, V = mask.shape[0], mask.shape[1]
        mask = mask.unsqueeze(0).expand(B, n_win, V, V).reshape(B * n_win, 1, V, V)
    out = F.scaled_dot_product_attention(qw, kw_, vw, attn_mask=mask, scale=scale)

    out = _merge(out, B, padded, win)  # (B, Tp, Hp, Wp, nh, d)
    if any(shifts):
        out = torch.roll(out, shifts=shifts, dims=dims)
    return out[:, :T, :H, :W].contiguous()
