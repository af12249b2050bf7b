"""Pure-PyTorch reference of 3D Deformable Slide Attention (3D-DSA).

This is the operator exactly as docs/dsa.md writes it, and
its autograd gradients are *by definition* the gradients of the operator: every
faster implementation (the Triton kernels in ``dsa_triton.py``, the fast CPU path in
``dsa_cpu.py``, the chunked path below) is tested against this file.

Layout (channels-last, so a token's heads and channels are contiguous):

    q, k, v  : (B, T, H, W, nh, d)
    offsets  : (B, T, H, W, nh, K, 3)   token units, ordered (dt, dy, dx)
    out      : (B, T, H, W, nh, d)

For the query at (t, y, x) and sample j = (jt*kh + jy)*kw + jx:

    s_t = clamp(t - kt//2, 0, T - kt)                 (window shifted inward at borders)
    p_j = clamp((s_t + jt, s_y + jy, s_x + jx) + offsets[..., j, :], 0, size - 1)
    k_j, v_j = trilinear(k, v at p_j)                 (t0 = floor(p), t1 = min(t0+1, size-1))
    out = sum_j softmax_j(scale * <q, k_j>) v_j

Memory is O(N*K*d) for N = T*H*W tokens (the 8 corner gathers are kept for
backward); no Python loop runs over tokens. For speed and long videos on CPU use
``dsa_cpu`` (same function, ~10x faster, chunked, recomputes in backward; what
``deformable_slide_attention`` picks for CPU tensors), ``dsa_reference_chunked`` (this
math in chunks: O(chunk*K*d) extra, reference speed) or, on GPU, the Triton kernels
(O(N*d): samples are never materialised; ``dsa_triton``).

``dsa_slab`` is the operator for the queries of a slab of frames against only the frames of
k, v they reach (``slab_kv_frames``), computed on the whole grid's geometry: the token-chunked
blocks (``runtime.token_chunk``) call it, through ``kernels.deformable_slide_attention_slab``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = [
    "dsa_reference",
    "dsa_slab",
    "slab_kv_frames",
    "dsa_reference_chunked",
    "dsa_rows",
    "validate_dsa_inputs",
    "window_starts",
    "window_base_positions",
    "trilinear_corners",
]


# -----------------------------------------------------------------------------
# Input validation


def _as_window(window: Sequence[int]) -> tuple[int, int, int]:
    try:
        win = tuple(int(w) for w in window)
    except TypeError:
        raise ValueError(
            f"window must be a sequence of three odd ints (kt, kh, kw), got {window!r}"
        ) from None
    if len(win) != 3 or any(int(w) != w for w in window):
        raise ValueError(
            f"window must be three odd ints (kt, kh, kw), got {window!r}"
        )
    return win  # type: ignore[return-value]


def validate_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q, k, v must be channels-last ``(B, T, H, W, nh, d)`` and of one shape."""
    if q.dim() != 6:
        raise ValueError(
            f"q must be (B, T, H, W, nh, d) (6 dims), got shape {tuple(q.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(
                f"{name} shape {tuple(t.shape)} != q shape {tuple(q.shape)}; "
                "q, k, v must all be (B, T, H, W, nh, d)"
            )


def validate_dsa_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
) -> tuple[int, int, int]:
    """Check shapes, window and dtypes; return the window as a tuple of ints.

    Raises ``ValueError`` naming the offending value (and ``TypeError`` for dtypes).
    """
    win = _as_window(window)
    validate_qkv_shapes(q, k, v)
    B, T, H, W, nh, d = q.shape
    for axis, w, size in (("kt", win[0], T), ("kh", win[1], H), ("kw", win[2], W)):
        if w < 1 or w % 2 == 0:
            raise ValueError(
                f"window {win}: {axis}={w} must be a positive odd int "
                "(the window is centred on the query)"
            )
        if w > size:
            raise ValueError(
                f"window {win}: {axis}={w} exceeds the axis size {size} of q shape "
                f"{tuple(q.shape)}; use a window no larger than (T, H, W)=({T}, {H}, {W})"
            )
    K = win[0] * win[1] * win[2]
    if offsets.dim() != 7 or offsets.shape[-1] != 3:
        raise ValueError(
            f"offsets must be (B, T, H, W, nh, K, 3) with last dim 3 (dt, dy, dx), "
            f"got shape {tuple(offsets.shape)}"
        )
    if offsets.shape[-2] != K:
        raise ValueError(
            f"offsets has K={offsets.shape[-2]} samples per query but window {win} "
            f"needs K = {win[0]}*{win[1]}*{win[2]} = {K}"
        )
    if tuple(offsets.shape[:5]) != (B, T, H, W, nh):
        raise ValueError(
            f"offsets leading dims {tuple(offsets.shape[:5])} != (B, T, H, W, nh) = "
            f"{(B, T, H, W, nh)} from q"
        )
    for name, t in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    devices = {t.device for t in (q, k, v, offsets)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, offsets must be on one device, got {devices}")
    return win


# -----------------------------------------------------------------------------
# Window geometry


def window_starts(size: int, window: int, device=None) -> torch.Tensor:
    """First index of each position's window along one axis, shifted inward at borders.

    ``s[i] = clamp(i - window//2, 0, size - window)``, shape ``(size,)``, int64.
    """
    i = torch.arange(size, device=device)
    return (i - window // 2).clamp(0, size - window)


def window_base_positions(
    grid: Sequence[int], window: Sequence[int], device=None
) -> torch.Tensor:
    """Base (un-displaced) sample positions of every query: ``(T, H, W, K, 3)`` int64.

    ``[t, y, x, j] = (s_t + jt, s_y + jy, s_x + jx)`` with ``j = (jt*kh + jy)*kw + jx``.
    """
    T, H, W = (int(g) for g in grid)
    kt, kh, kw = (int(w) for w in window)
    bt = window_starts(T, kt, device)[:, None] + torch.arange(kt, device=device)  # (T, kt)
    by = window_starts(H, kh, device)[:, None] + torch.arange(kh, device=device)  # (H, kh)
    bx = window_starts(W, kw, device)[:, None] + torch.arange(kw, device=device)  # (W, kw)
    shape = (T, H, W, kt, kh, kw)
    pt = bt[:, None, None, :, None, None].expand(shape)
    py = by[None, :, None, None, :, None].expand(shape)
    px = bx[None, None, :, None, None, :].expand(shape)
    return torch.stack((pt, py, px), dim=-1).reshape(T, H, W, kt * kh * kw, 3)


# -----------------------------------------------------------------------------
# The operator


def _trilinear_gather(
    rows: torch.Tensor,  # (B*N*nh, d): token-major rows of k or v
    corners: list[tuple[torch.Tensor, torch.Tensor]],  # 8 x (row index, weight)
) -> torch.Tensor:
    """sum_c weight_c[..., None] * rows[index_c]  ->  index shape + (d,)."""
    out = None
    for idx, w in corners:
        term = rows[idx] * w.unsqueeze(-1)
        out = term if out is None else out + term
    return out


def trilinear_corners(
    offsets_rows: torch.Tensor,  # (B, M, nh, K, 3)
    base_rows: torch.Tensor,  # (M, K, 3) int64 base positions
    held: tuple[int, int, int],  # (Tk, H, W): the grid k and v hold
    cdtype: torch.dtype,
    pdtype: torch.dtype,
    frames: int | None = None,
    kv_start: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The 8 trilinear corners of every sample: ``(token, weight)`` pairs, each ``(B, M, nh, K)``,
    ``token`` the corner's flat index ``(t * H + y) * W + x`` into the held grid (int64),
    ``weight`` its trilinear weight in ``cdtype``, in the order (t0|t1) x (y0|y1) x (x0|x1).
    Positions are ``clamp(base + offsets, 0, size - 1)`` per axis, computed in ``pdtype`` on the
    whole grid (``frames`` frames, default the held ``Tk``) and moved into the held frames
    ``[kv_start, kv_start + Tk)`` (``dsa_slab``)."""
    Tk, H, W = held
    T = Tk if frames is None else int(frames)
    M, K = base_rows.shape[:2]

    # -- sample positions p_j = clamp(base_j + offsets_j, 0, size-1)     (B, M, nh, K, 3)
    pos = base_rows.to(pdtype).reshape(1, M, 1, K, 3) + offsets_rows.to(pdtype)
    coords = []  # per axis: (lower index, upper index, fractional weight)
    for axis, size in enumerate((T, H, W)):
        p = pos[..., axis].clamp(0, size - 1)  # clamp per coordinate: grad 0 outside
        p0 = torch.floor(p)  # floor: derivative 0
        i0 = p0.long()
        i1 = (i0 + 1).clamp(max=size - 1)
        coords.append((i0, i1, p - p0))

    (t0, t1, wt), (y0, y1, wy), (x0, x1, wx) = coords
    if frames is not None:  # whole-grid frame -> frame of the held slab
        t0 = (t0 - kv_start).clamp(0, Tk - 1)
        t1 = (t1 - kv_start).clamp(0, Tk - 1)
    corners = []
    for ti, wti in ((t0, 1 - wt), (t1, wt)):
        for yi, wyi in ((y0, 1 - wy), (y1, wy)):
            for xi, wxi in ((x0, 1 - wx), (x1, wx)):
                corners.append(((ti * H + yi) * W + xi, (wti * wyi * wxi).to(cdtype)))
    return corners


def _resolve_dtypes(q: torch.Tensor, upcast: bool | None) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype for interpolation + softmax, dtype of sample positions)."""
    if upcast is None:
        upcast = q.dtype in (torch.float16, torch.bfloat16)
    cdtype = torch.float32 if upcast else q.dtype
    return cdtype, torch.promote_types(cdtype, torch.float32)


def dsa_rows(
    q_rows: torch.Tensor,  # (B, M, nh, d): a subset of the queries
    k: torch.Tensor,  # (B, T, H, W, nh, d): all keys
    v: torch.Tensor,  # (B, T, H, W, nh, d): all values
    offsets_rows: torch.Tensor,  # (B, M, nh, K, 3)
    base_rows: torch.Tensor,  # (M, K, 3) int64 base positions of those queries
    scale: float,
    cdtype: torch.dtype,
    pdtype: torch.dtype,
    frames: int | None = None,
    kv_start: int = 0,
) -> torch.Tensor:
    """The operator for M queries (any subset of the N tokens): ``(B, M, nh, d)`` in cdtype.

    ``dsa_reference`` calls it with every query; the chunked path with one chunk at a time.
    ``frames``/``kv_start``: k and v hold only frames ``[kv_start, kv_start + Tk)`` of a grid
    of ``frames`` frames (``dsa_slab``); positions are computed and clamped on the whole grid,
    then looked up in the frames held (a frame outside them is clamped into them: the caller
    must hold every frame the samples reach, see ``dsa_slab``).
    """
    B, Tk, H, W, nh, d = k.shape
    M, K = base_rows.shape[:2]
    N = Tk * H * W
    device = k.device

    # -- 8 trilinear corners: flat row index into (B*N*nh, d) and weight  (B, M, nh, K)
    b_idx = torch.arange(B, device=device).view(B, 1, 1, 1)
    h_idx = torch.arange(nh, device=device).view(1, 1, nh, 1)
    corners = [((b_idx * N + tok) * nh + h_idx, w)
               for tok, w in trilinear_corners(offsets_rows, base_rows, (Tk, H, W), cdtype, pdtype, frames, kv_start)]

    # -- interpolated keys and values                                    (B, M, nh, K, d)
    k_s = _trilinear_gather(k.to(cdtype).reshape(B * N * nh, d), corners)
    v_s = _trilinear_gather(v.to(cdtype).reshape(B * N * nh, d), corners)

    # -- softmax over the K samples
    s = torch.einsum("bmhd,bmhkd->bmhk", q_rows.to(cdtype), k_s) * scale
    a = torch.softmax(s, dim=-1)
    return torch.einsum("bmhk,bmhkd->bmhd", a, v_s)


def dsa_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    upcast: bool | None = None,
) -> torch.Tensor:
    """3D-DSA, written exactly as docs/dsa.md specifies.

    Args:
        q, k, v: ``(B, T, H, W, nh, d)``.
        offsets: ``(B, T, H, W, nh, K, 3)`` in token units, ordered (dt, dy, dx).
        window: ``(kt, kh, kw)``, each odd and at most its axis size; ``K = kt*kh*kw``.
        scale: softmax scale, default ``d ** -0.5``.
        upcast: compute in fp32 (result cast back to q's dtype). Default: True for
            fp16/bf16 inputs. With ``upcast=False`` the interpolation and attention run
            in the input dtype (the "same-dtype torch" baseline of the tolerance rule);
            sample *positions* and trilinear weights are always at least fp32, because
            coordinates above 256 have no fractional bits left in bf16.

    Returns:
        ``out`` of shape ``(B, T, H, W, nh, d)`` in q's dtype.
    """
    win = validate_dsa_inputs(q, k, v, offsets, window)
    B, T, H, W, nh, d = q.shape
    K = win[0] * win[1] * win[2]
    N = T * H * W
    cdtype, pdtype = _resolve_dtypes(q, upcast)
    scale = d ** -0.5 if scale is None else scale
    base = window_base_positions((T, H, W), win, q.device).reshape(N, K, 3)
    out = dsa_rows(
        q.reshape(B, N, nh, d), k, v, offsets.reshape(B, N, nh, K, 3), base,
        scale, cdtype, pdtype,
    )
    return out.reshape(B, T, H, W, nh, d).to(q.dtype)


# -----------------------------------------------------------------------------
# Chunked path: bounded memory on CPU


class _DSAChunked(torch.autograd.Function):
    """Queries in chunks; backward recomputes each chunk (activation-checkpoint style).

    Peak extra memory is O(chunk * nh * K * d) instead of O(N * nh * K * d); the math
    is ``dsa_rows`` itself, so gradients equal the reference's up to summation order.
    """

    @staticmethod
    def forward(ctx, q, k, v, offsets, win, scale, upcast, chunk):
        B, T, H, W, nh, d = q.shape
        K = win[0] * win[1] * win[2]
        N = T * H * W
        cdtype, pdtype = _resolve_dtypes(q, upcast)
        base = window_base_positions((T, H, W), win, q.device).reshape(N, K, 3)
        q_rows = q.reshape(B, N, nh, d)
        off_rows = offsets.reshape(B, N, nh, K, 3)
        out = torch.empty_like(q_rows)
        for lo in range(0, N, chunk):
            hi = min(lo + chunk, N)
            out[:, lo:hi] = dsa_rows(
                q_rows[:, lo:hi], k, v, off_rows[:, lo:hi], base[lo:hi], scale, cdtype, pdtype
            )
        ctx.save_for_backward(q, k, v, offsets)
        ctx.meta = (win, scale, cdtype, pdtype, chunk)
        return out.reshape(q.shape)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets = ctx.saved_tensors
        win, scale, cdtype, pdtype, chunk = ctx.meta
        B, T, H, W, nh, d = q.shape
        K = win[0] * win[1] * win[2]
        N = T * H * W
        base = window_base_positions((T, H, W), win, q.device).reshape(N, K, 3)
        q_rows = q.detach().reshape(B, N, nh, d)
        off_rows = offsets.detach().reshape(B, N, nh, K, 3)
        dout_rows = dout.reshape(B, N, nh, d)
        dq = torch.empty_like(q_rows)
        doff = torch.empty_like(off_rows)
        # dk, dv gather contributions from every chunk: accumulate in fp32 at least
        acc_dtype = torch.promote_types(k.dtype, torch.float32)
        dk = torch.zeros(k.shape, dtype=acc_dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc_dtype, device=v.device)
        kd = k.detach().requires_grad_(True)
        vd = v.detach().requires_grad_(True)
        for lo in range(0, N, chunk):
            hi = min(lo + chunk, N)
            qc = q_rows[:, lo:hi].requires_grad_(True)
            oc = off_rows[:, lo:hi].requires_grad_(True)
            with torch.enable_grad():
                out_c = dsa_rows(qc, kd, vd, oc, base[lo:hi], scale, cdtype, pdtype)
                gq, gk, gv, go = torch.autograd.grad(
                    out_c, (qc, kd, vd, oc), dout_rows[:, lo:hi].to(out_c.dtype)
                )
            dq[:, lo:hi] = gq
            doff[:, lo:hi] = go
            dk += gk
            dv += gv
        return (
            dq.reshape(q.shape), dk.to(k.dtype), dv.to(v.dtype), doff.reshape(offsets.shape),
            None, None, None, None,
        )


def dsa_reference_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    upcast: bool | None = None,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """``dsa_reference`` with bounded memory: queries in chunks of ``chunk_size`` tokens.

    Forward keeps no per-sample tensors; backward recomputes each chunk. Use it on
    CPU for inputs where the reference's O(N*K*d) autograd graph does not fit.
    """
    win = validate_dsa_inputs(q, k, v, offsets, window)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _DSAChunked.apply(q, k, v, offsets, win, scale, upcast, int(chunk_size))


# -----------------------------------------------------------------------------
# Slabs: the queries of some frames against the frames their samples reach


def validate_slab_inputs(q, k, v, offsets, window, q_start, kv_start, frames) -> tuple[int, int, int]:
    """Checks of ``dsa_slab``'s arguments; returns the window."""
    win = _as_window(window)
    if q.dim() != 6 or k.dim() != 6:
        raise ValueError(f"q and k must be (B, T, H, W, nh, d), got {tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    B, Tq, H, W, nh, d = q.shape
    Tk = k.shape[1]
    if k.shape[0] != B or tuple(k.shape[2:]) != (H, W, nh, d):
        raise ValueError(f"k shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} but in frames")
    if not (0 <= q_start and q_start + Tq <= frames and 0 <= kv_start and kv_start + Tk <= frames):
        raise ValueError(f"frames [{q_start}, {q_start + Tq}) of q and [{kv_start}, {kv_start + Tk}) of k, v "
                         f"must lie in a grid of {frames} frames")
    for axis, w, size in (("kt", win[0], frames), ("kh", win[1], H), ("kw", win[2], W)):
        if w < 1 or w % 2 == 0 or w > size:
            raise ValueError(f"window {win}: {axis}={w} must be a positive odd int at most {size}")
    K = win[0] * win[1] * win[2]
    if tuple(offsets.shape) != (B, Tq, H, W, nh, K, 3):
        raise ValueError(f"offsets shape {tuple(offsets.shape)} != {(B, Tq, H, W, nh, K, 3)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return win


def slab_kv_frames(q_start: int, q_stop: int, frames: int, window_t: int,
                   max_offset: float | None) -> tuple[int, int]:
    """Frames ``[a, b)`` of k and v that the queries of frames ``[q_start, q_stop)`` can reach.

    The slab's windows cover frames ``[lo, hi]`` (``s_t`` to ``s_t + kt - 1``); an offset of at
    most ``m = max_offset`` in size moves a sample within ``[lo - m, hi + m]``, whose trilinear
    corners lie in ``[lo - ceil(m), hi + floor(m) + 1]``. Returns ``(a, b)`` with ``[a, b)`` the
    frames ``lo - ceil(m) - 1 .. hi + ceil(m) + 1``, clipped to the grid: every corner is held,
    and no position sits on the last held frame unless that is the grid's last (where the
    operator clamps the upper corner). ``max_offset`` None (offsets unbounded): the whole grid.
    """
    if max_offset is None:
        return 0, frames
    m = math.ceil(max_offset)
    starts = window_starts(frames, window_t)
    lo, hi = int(starts[q_start]), int(starts[q_stop - 1]) + window_t - 1
    return max(0, lo - m - 1), min(frames, hi + m + 2)


def dsa_slab(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    q_start: int,
    kv_start: int,
    frames: int,
    scale: float | None = None,
    upcast: bool | None = None,
) -> torch.Tensor:
    """3D-DSA for the queries of frames ``[q_start, q_start + Tq)`` of a ``frames``-frame grid.

    ``q (B, Tq, H, W, nh, d)`` and ``offsets (B, Tq, H, W, nh, K, 3)`` are those frames' queries
    and offsets; ``k, v (B, Tk, H, W, nh, d)`` hold frames ``[kv_start, kv_start + Tk)``. The
    result is exactly the slab's rows of ``dsa_reference`` on the whole grid (window starts,
    positions and clamps are computed on the whole grid) provided k and v hold every frame the
    samples reach, e.g. ``slab_kv_frames`` for offsets bounded by ``attention.max_offset``.
    Returns ``(B, Tq, H, W, nh, d)`` in q's dtype.
    """
    win = validate_slab_inputs(q, k, v, offsets, window, q_start, kv_start, frames)
    B, Tq, H, W, nh, d = q.shape
    K = win[0] * win[1] * win[2]
    M = Tq * H * W
    cdtype, pdtype = _resolve_dtypes(q, upcast)
    scale = d ** -0.5 if scale is None else scale
    base = window_base_positions((frames, H, W), win, q.device)[q_start:q_start + Tq].reshape(M, K, 3)
    out = dsa_rows(q.reshape(B, M, nh, d), k, v, offsets.reshape(B, M, nh, K, 3), base,
                   scale, cdtype, pdtype, frames=frames, kv_start=kv_start)
    return out.reshape(q.shape).to(q.dtype)
