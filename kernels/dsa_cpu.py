"""Fast CPU path of 3D Deformable Slide Attention: ``dsa_cpu``.

The same function as ``dsa_reference`` (docs/dsa.md), with the
same gradients for q, k, v and offsets, but built from PyTorch's ``embedding_bag``
kernels instead of materialised corner gathers:

* Trilinear interpolation is linear in the 8 corner rows, so with corner weights
  ``W[j, c]`` and corner rows ``r[j, c]`` of sample j (query m):

      score_j = scale * sum_c W[j,c] <q_m, k[r[j,c]]>
      out_m   = sum_j sum_c a_j W[j,c] v[r[j,c]]

  ``out`` is one ``embedding_bag`` (bag = query, 8K rows, weights ``a_j W[j,c]``);
  the per-corner dots ``E[j,c] = <q_m, k[r[j,c]]>`` are a sampled dense-dense product
  (SDDMM), which is exactly ``embedding_bag``'s per-sample-weights gradient.
* Backward: ``F[j,c] = <dout_m, v[r[j,c]]>`` (SDDMM), ``dq`` (one embedding_bag),
  ``dW[j,c] = scale*ds_j*E[j,c] + a_j*F[j,c]`` -> d positions -> d offsets, and the
  transposed products ``dk``/``dv`` as embedding_bags over the samples sorted by their
  lower corner.
* k and v are copied into volumes padded by one zero token at the far end of every
  axis, so a sample's 8 corner rows are ``r000 + shift_c`` with fixed shifts. Where the
  reference clamps the upper corner (``t1 = min(t0+1, T-1)``) the position is exactly
  ``T-1``, its weight is exactly 0, and the padded row contributes nothing; the
  position gradient there is 0 in both (the reference's ``t1 == t0``).
* Queries are processed in chunks of at most ``chunk_size`` tokens (all heads); forward
  keeps only the inputs and backward recomputes each chunk, so extra memory is
  O(chunk * nh * K * 8) plus O(N * nh * d) for the padded k, v and their gradients.
* A chunk is a near-cubic tile of the (t, y, x) grid (``tile_shape``), not a run of
  consecutive tokens. A tile's samples land in a box only a few tokens larger than
  the tile on every side, so the k/v rows a chunk reads and the dk/dv rows it writes
  stay proportional to the tile, whatever the grid's shape. (A run of consecutive
  tokens shorter than an H*W plane touches ~kt+3 whole planes: the work per chunk then
  grows with H*W, and time grew x5.3 for 4x tokens from 8x32x32 to 8x64x64.) The dk/dv
  scatter writes only the rows a chunk touched (``_transposed_add``), never a span.

Numerics: floor, clamp and the corner weights are computed exactly as the reference
computes them (same dtype, same operation order), so positions sitting exactly on
integers (zero offsets!) take the same one-sided derivative; only summation order
differs, i.e. results agree to rounding. fp16/bf16 inputs are computed in fp32,
fp64 in fp64. Not twice differentiable (``once_differentiable``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .dsa_reference import validate_dsa_inputs, validate_slab_inputs, window_starts

__all__ = ["dsa_cpu", "dsa_cpu_slab", "default_chunk_size", "tile_shape", "CHUNK_SAMPLES"]

# Default chunk: about this many (query, head, sample) triples, i.e. 8x as many corner
# entries (~4 MB per fp32 per-corner array; backward holds ~15 such arrays at once):
# 1213 tokens at nh=4, K=27, where the speed is flat from ~512 to ~2048 tokens.
CHUNK_SAMPLES = 2**17

# aten's embedding_bag per-sample-weights gradient is the SDDMM we need; it is a
# private op, so fall back to autograd through F.embedding_bag if it ever goes away.
_PSW_BACKWARD = getattr(torch.ops.aten, "_embedding_bag_per_sample_weights_backward", None)
USE_PRIVATE_SDDMM = _PSW_BACKWARD is not None


def _sddmm(x: torch.Tensor, table: torch.Tensor, idx: torch.Tensor, bags) -> torch.Tensor:
    """``out[m, l] = <x[m], table[idx[m, l]]>`` for ``x (M, d)``, ``idx (M, L)``.

    ``bags``: ``(offsets, offset2bag)`` of at least M bags of L entries (sliced here).
    """
    M, L = idx.shape
    if USE_PRIVATE_SDDMM:
        offsets, offset2bag = bags
        out = _PSW_BACKWARD(x, table, idx.reshape(-1), offsets[:M], offset2bag[: M * L], 0, -1)
        return out.view(M, L)
    psw = torch.zeros(M, L, dtype=table.dtype, device=table.device, requires_grad=True)
    with torch.enable_grad():
        bag = F.embedding_bag(idx, table, mode="sum", per_sample_weights=psw)
        (out,) = torch.autograd.grad(bag, psw, x)
    return out


def _sort_1d(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort`` of a 1-D tensor as one row of a 2-D one.

    A 1-D integer sort goes to a multi-threaded radix sort whose many barriers stall
    badly when other processes load the cores (x50 slower on a busy 2-core box); the
    per-row sort of a (1, n) view is single-threaded and robust.
    """
    values, perm = torch.sort(x.view(1, -1), dim=1)
    return values.view(-1), perm.view(-1)


def _balanced(size: int, want: int) -> int:
    """Largest tile side <= ``want`` that splits ``size`` into equal-ish parts."""
    want = max(1, min(size, want))
    parts = -(-size // want)
    return -(-size // parts)


def _iroot(x: int, n: int) -> int:
    """Integer n-th root: the largest r with r**n <= x."""
    r = max(1, round(x ** (1.0 / n)))
    while r ** n > x:
        r -= 1
    while (r + 1) ** n <= x:
        r += 1
    return r


def tile_shape(batch: int, grid: Sequence[int], chunk: int) -> tuple[int, int, int, int]:
    """Query tile ``(cb, ct, cy, cx)`` of at most ``chunk`` tokens for a ``(T, H, W)`` grid.

    Near-cubic in (t, y, x) so the box a tile's samples land in is only a window (plus
    offsets) wider than the tile on every side; sides split their axis evenly, an axis
    shorter than its share gives the rest to the others. ``cb > 1`` (several batch
    items per tile) only when one tile holds the whole grid.
    """
    T, H, W = (int(g) for g in grid)
    chunk = max(1, int(chunk))
    ct = _balanced(T, _iroot(chunk, 3))
    cy = _balanced(H, _iroot(chunk // ct, 2))
    cx = _balanced(W, chunk // (ct * cy))
    cb = 1
    if (ct, cy, cx) == (T, H, W):
        cb = max(1, min(int(batch), chunk // (T * H * W)))
    return cb, ct, cy, cx


class _Geometry:
    """Shapes, padded-volume strides, window bases and query tiles shared by all chunks."""

    def __init__(self, q: torch.Tensor, win: tuple[int, int, int], chunk: int,
                 slab: tuple[int, int, int, int] | None = None):
        # slab (Tk, frames, q_start, kv_start): q holds frames [q_start, q_start + Tq) and k, v
        # frames [kv_start, kv_start + Tk) of a grid of ``frames`` frames (``dsa_slab``)
        B, T, H, W, nh, d = q.shape
        Tk, frames, q_start, kv_start = (T, T, 0, 0) if slab is None else slab
        self.slab = slab
        self.B, self.T, self.H, self.W, self.nh, self.d = B, T, H, W, nh, d
        self.Tk = Tk
        self.K = K = win[0] * win[1] * win[2]
        self.win = win
        self.N = T * H * W
        self.cdtype = cdtype = torch.promote_types(q.dtype, torch.float32)
        self.Tp, self.Hp, self.Wp = Tk + 1, H + 1, W + 1
        self.rows = B * self.Tp * self.Hp * self.Wp * nh  # rows of the padded tables
        self.idtype = idt = torch.int32 if self.rows + 8 < 2**31 else torch.int64
        self.device = dev = q.device
        strides = (self.Hp * self.Wp * nh, self.Wp * nh, nh)
        self.strides = torch.tensor(strides, dtype=idt, device=dev)
        corner = torch.tensor([[c >> 2, (c >> 1) & 1, c & 1] for c in range(8)])
        shifts = (corner * torch.tensor(strides)).sum(-1)  # corner c = (t, y, x) bits
        self.shifts = shifts.to(device=dev, dtype=idt)
        # dk and dv rows of corner c in the stacked (2 * rows, d) accumulator
        self.scatter_shifts = torch.cat((shifts, shifts + self.rows)).to(dev).view(16, 1)
        self.batch_stride = self.Tp * self.Hp * self.Wp * nh
        self.head = torch.arange(nh, dtype=idt, device=dev).view(1, nh, 1)
        self.zero = torch.zeros(3, dtype=cdtype, device=dev)
        self.upper = torch.tensor([frames - 1, H - 1, W - 1], dtype=cdtype, device=dev)
        self.origin = torch.tensor([kv_start, 0, 0], dtype=cdtype, device=dev)
        self.held = torch.tensor([Tk - 1, H - 1, W - 1], dtype=cdtype, device=dev)
        # per-axis base positions (size, k_axis) in the position dtype; a query's K bases
        # are their outer sum (exactly ``window_base_positions``, what the reference uses)
        self.axis_base = [
            (window_starts(size, w, dev)[:, None] + torch.arange(w, device=dev)).to(cdtype)
            for size, w in zip((frames, H, W), win)
        ]
        self.axis_base[0] = self.axis_base[0][q_start:q_start + T]
        self.tile = tile_shape(B, (T, H, W), chunk)
        L = K * 8
        Mq = self.tile[0] * self.tile[1] * self.tile[2] * self.tile[3] * nh
        self.bags = (
            torch.arange(0, Mq * L, L, dtype=idt, device=dev),
            torch.arange(Mq, dtype=idt, device=dev).repeat_interleave(L),
        )

    def tiles(self):
        """Flat query rows (over B*T*H*W, int64) of every tile, tile by tile."""
        cb, ct, cy, cx = self.tile
        B, T, H, W, N = self.B, self.T, self.H, self.W, self.N
        dev = self.device
        for b0 in range(0, B, cb):
            bb = torch.arange(b0, min(b0 + cb, B), device=dev).view(-1, 1, 1, 1) * N
            for t0 in range(0, T, ct):
                tt = torch.arange(t0, min(t0 + ct, T), device=dev).view(-1, 1, 1) * (H * W)
                for y0 in range(0, H, cy):
                    yy = torch.arange(y0, min(y0 + cy, H), device=dev).view(-1, 1) * W
                    for x0 in range(0, W, cx):
                        xx = torch.arange(x0, min(x0 + cx, W), device=dev)
                        yield (bb + tt + yy + xx).view(-1)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, T, H, W, nh, d)`` -> rows ``(B*Tp*Hp*Wp*nh, d)`` zero-padded, cdtype."""
        xp = x.new_zeros((self.B, self.Tp, self.Hp, self.Wp, self.nh, self.d), dtype=self.cdtype)
        xp[:, : self.Tk, : self.H, : self.W] = x
        return xp.view(self.rows, self.d)

    def unpad(self, rows: torch.Tensor) -> torch.Tensor:
        xp = rows.view(self.B, self.Tp, self.Hp, self.Wp, self.nh, self.d)
        return xp[:, : self.Tk, : self.H, : self.W]

    def base(self, n: torch.Tensor) -> torch.Tensor:
        """Base positions ``(M, 1, K, 3)`` (cdtype) of grid tokens ``n`` (flat over T*H*W)."""
        kt, kh, kw = self.win
        M = n.numel()
        shape = (M, kt, kh, kw)
        bt = self.axis_base[0][n // (self.H * self.W)].view(M, kt, 1, 1).expand(shape)
        by = self.axis_base[1][(n // self.W) % self.H].view(M, 1, kh, 1).expand(shape)
        bx = self.axis_base[2][n % self.W].view(M, 1, 1, kw).expand(shape)
        return torch.stack((bt, by, bx), dim=-1).view(M, 1, self.K, 3)

    def corners(self, off: torch.Tensor, rows: torch.Tensor, need_grad_info: bool):
        """Corner rows and weights of the samples of query tokens ``rows`` (of B*N).

        ``off``: their offsets ``(M, nh, K, 3)`` in cdtype. Returns the lower-corner row
        ``r000 (M*nh*K,)``, corner rows ``idx (M*nh, K*8)``, weights ``Wc (M, nh, K, 8)``,
        the per-axis weight pairs ``Wp (M, nh, K, 3, 2)`` = (1 - frac, frac), the (t, y)
        weight products ``Wty`` and (if asked) the position-gradient mask ``(M, nh, K, 3)``.
        """
        M = rows.numel()
        b = rows // self.N
        pos = self.base(rows - b * self.N) + off  # == the reference's positions
        p = torch.clamp(pos, self.zero, self.upper)
        # NaN offsets: index row 0 with NaN weights (NaN out, as in the reference),
        # never a garbage row index
        p0 = torch.floor(p).nan_to_num_(0.0)
        frac = p - p0
        if self.slab is not None:  # whole-grid frame -> frame of the held slab
            p0 = torch.minimum(torch.maximum(p0 - self.origin, self.zero), self.held)
        r000 = (p0.to(self.idtype) * self.strides).sum(-1, dtype=self.idtype)
        r000 += (b.to(self.idtype) * self.batch_stride).view(M, 1, 1) + self.head
        Wp = torch.stack((1 - frac, frac), dim=-1)  # (M, nh, K, 3, 2)
        # same product order as the reference: (w_t * w_y) * w_x
        Wty = Wp[..., 0, :, None] * Wp[..., 1, None, :]
        Wc = (Wty[..., None] * Wp[..., 2, None, None, :]).view(M, self.nh, self.K, 8)
        idx = (r000.unsqueeze(-1) + self.shifts).view(M * self.nh, self.K * 8)
        mask = None
        if need_grad_info:
            # reference: clamp passes gradient on [0, size-1]; at size-1, t1 == t0 -> 0
            mask = (pos >= 0) & (pos < self.upper)
        return r000.view(-1), idx, Wc, Wp, Wty, mask


def _scores(geo: _Geometry, qs, kp, idx, Wc):
    """Scaled corner dots E (M, nh, K, 8) and softmax weights a (M, nh, K)."""
    E = _sddmm(qs, kp, idx, geo.bags).view(Wc.shape)
    a = torch.softmax((E * Wc).sum(-1), dim=-1)
    return E, a


def _transposed_add(geo: _Geometry, acc, r000, xk, xv, wk, wv):
    """``acc[0, r000_j + shift_c] += wk[j, c] * xk[j // K]``, same for ``acc[1]`` with v.

    Samples sorted by lower-corner row; one embedding_bag with a bag per
    (k|v, corner, distinct lower-corner row of the chunk), added at the shifted rows.
    Output and scatter are O(rows the chunk touched), never O(span of row numbers):
    a tile's rows lie in several far-apart t-planes.
    """
    sorted_r, perm = _sort_1d(r000)
    R = r000.numel()
    rows, counts = torch.unique_consecutive(sorted_r, return_counts=True)
    U = rows.numel()
    Mq = xk.shape[0]
    # entry/bag indices of the single embedding_bag: int32 unless 16 R overflows it
    edtype = torch.int32 if 16 * R < 2**31 - 1 else torch.int64
    starts = torch.zeros(U, dtype=edtype, device=acc.device)
    starts[1:] = counts[:-1].cumsum(0)
    bag_of = (perm // geo.K).to(edtype)  # query-head row (in this chunk) of each sample
    entries = bag_of + torch.tensor([[0], [Mq]], dtype=edtype, device=acc.device)
    entries = entries.view(2, 1, R).expand(2, 8, R).reshape(-1)
    bag_starts = starts + torch.arange(16, dtype=edtype, device=acc.device).view(16, 1) * R
    bag_starts = torch.cat((bag_starts.view(-1), bag_starts.new_tensor([16 * R])))
    weights = torch.cat((wk.reshape(R, 8), wv.reshape(R, 8)), dim=1).index_select(0, perm)
    parts = F.embedding_bag(
        entries, torch.cat((xk, xv)), bag_starts, mode="sum",
        per_sample_weights=weights.t().reshape(-1), include_last_offset=True,
    )  # (16 * U, d): (k|v, corner, row)
    # each (k|v, corner) block's targets are distinct and ascending: a cache-friendly add
    targets = rows.to(torch.int64) + geo.scatter_shifts
    acc.view(-1, geo.d).index_add_(0, targets.view(-1), parts)


class _DSACPU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, win, scale, chunk, slab=None):
        geo = _Geometry(q, win, chunk, slab)
        B, N, nh, d, K, cdtype = geo.B, geo.N, geo.nh, geo.d, geo.K, geo.cdtype
        kp, vp = geo.pad(k), geo.pad(v)
        q_rows = q.reshape(B * N, nh, d)
        off_rows = offsets.reshape(B * N, nh, K, 3)
        out = torch.empty((B * N, nh, d), dtype=q.dtype, device=q.device)
        for rows in geo.tiles():
            qs = (q_rows.index_select(0, rows).view(-1, d).to(cdtype) * scale).contiguous()
            off = off_rows.index_select(0, rows).to(cdtype)
            _, idx, Wc, _, _, _ = geo.corners(off, rows, False)
            _, a = _scores(geo, qs, kp, idx, Wc)
            pw = (a.unsqueeze(-1) * Wc).view(idx.shape)
            o = F.embedding_bag(idx, vp, mode="sum", per_sample_weights=pw)
            out.index_copy_(0, rows, o.view(-1, nh, d).to(out.dtype))
        ctx.save_for_backward(q, k, v, offsets)
        ctx.meta = (win, scale, chunk, slab)
        return out.view(q.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, offsets = ctx.saved_tensors
        win, scale, chunk, slab = ctx.meta
        geo = _Geometry(q, win, chunk, slab)
        B, N, nh, d, K, cdtype = geo.B, geo.N, geo.nh, geo.d, geo.K, geo.cdtype
        kp, vp = geo.pad(k), geo.pad(v)
        q_rows = q.reshape(B * N, nh, d)
        off_rows = offsets.reshape(B * N, nh, K, 3)
        g_rows = dout.reshape(B * N, nh, d)
        need_q, need_k, need_v, need_off = ctx.needs_input_grad[:4]
        dq = torch.empty((B * N, nh, d), dtype=q.dtype, device=q.device) if need_q else None
        doff = (
            torch.empty((B * N, nh, K, 3), dtype=offsets.dtype, device=q.device)
            if need_off else None
        )
        dkv = kp.new_zeros((2, geo.rows, d)) if (need_k or need_v) else None
        for rows in geo.tiles():
            qs = (q_rows.index_select(0, rows).view(-1, d).to(cdtype) * scale).contiguous()
            g_c = g_rows.index_select(0, rows).view(-1, d).to(cdtype).contiguous()
            off = off_rows.index_select(0, rows).to(cdtype)
            r000, idx, Wc, Wp, Wty, mask = geo.corners(off, rows, need_off)
            E, a = _scores(geo, qs, kp, idx, Wc)
            Fd = _sddmm(g_c, vp, idx, geo.bags).view(Wc.shape)  # <dout_m, v[corner]>
            da = (Fd * Wc).sum(-1)
            ds = a * (da - (a * da).sum(-1, keepdim=True))  # d loss / d score
            dsW = ds.unsqueeze(-1) * Wc  # d loss / d E (E holds the scaled q)
            aW = a.unsqueeze(-1) * Wc  # d loss / d F
            if need_q:
                dq_c = F.embedding_bag(
                    idx, kp, mode="sum", per_sample_weights=dsW.view(idx.shape)
                )
                dq.index_copy_(0, rows, (dq_c * scale).view(-1, nh, d).to(dq.dtype))
            if need_k or need_v:
                _transposed_add(geo, dkv, r000, qs, g_c, dsW, aW)
            if need_off:
                # d loss / d W[j, c], corners c = (t, y, x) bits
                dW = (ds.unsqueeze(-1) * E).addcmul_(a.unsqueeze(-1), Fd).view(*a.shape, 2, 2, 2)
                gx = ((dW[..., 1] - dW[..., 0]) * Wty).sum((-2, -1))
                dWx = dW[..., 0] * Wp[..., 2, None, None, 0] + dW[..., 1] * Wp[..., 2, None, None, 1]
                gy = ((dWx[..., 1] - dWx[..., 0]) * Wp[..., 0, :]).sum(-1)
                gt = ((dWx[..., 1, :] - dWx[..., 0, :]) * Wp[..., 1, :]).sum(-1)
                doff_c = torch.stack((gt, gy, gx), dim=-1) * mask
                doff.index_copy_(0, rows, doff_c.to(doff.dtype))
        dk = geo.unpad(dkv[0]).to(k.dtype) if need_k else None
        dv = geo.unpad(dkv[1]).to(v.dtype) if need_v else None
        return (
            dq.view(q.shape) if need_q else None, dk, dv,
            doff.view(offsets.shape) if need_off else None,
            None, None, None, None,
        )


def default_chunk_size(nh: int, K: int) -> int:
    """Query tokens per chunk for ``nh`` heads and ``K`` samples: ~CHUNK_SAMPLES samples."""
    return max(1, CHUNK_SAMPLES // (nh * K))


def dsa_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """3D-DSA, fast CPU path: same function and gradients as ``dsa_reference``.

    Args as ``dsa_reference`` (always computes in at least fp32, like its default).
    ``chunk_size``: at most this many query tokens per chunk, a near-cubic tile of the
    grid (``tile_shape``); default ``default_chunk_size(nh, K)``. Extra memory:
    O(chunk_size * nh * K * 8) per chunk plus O(B*N*nh*d) for padded k, v (and, in
    backward, their gradients).
    Returns ``(B, T, H, W, nh, d)`` in q's dtype. Not twice differentiable.
    """
    win = validate_dsa_inputs(q, k, v, offsets, window)
    nh, K = q.shape[4], win[0] * win[1] * win[2]
    chunk = default_chunk_size(nh, K) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _DSACPU.apply(q, k, v, offsets, win, scale, chunk)


def dsa_cpu_slab(q, k, v, offsets, window, q_start: int, kv_start: int, frames: int,
                 scale: float | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """``dsa_slab`` (the queries of some frames against the frames of k, v they reach), fast
    CPU path: same function and gradients as ``dsa_reference.dsa_slab``."""
    win = validate_slab_inputs(q, k, v, offsets, window, q_start, kv_start, frames)
    nh, K = q.shape[4], win[0] * win[1] * win[2]
    chunk = default_chunk_size(nh, K) if chunk_size is None else int(chunk_size)
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    slab = (k.shape[1], int(frames), int(q_start), int(kv_start))
    return _DSACPU.apply(q, k, v, offsets, win, scale, chunk, slab)
