"""The fused kernels' sample order and records as one Triton kernel: ``dsa_halo_dense.sample_order``
and ``sample_records`` (the definitions, in torch ops) in a single pass over the offsets.

``sample_order`` in torch materialises fp32 copies of the offsets, int64 keys and a sort per call:
several bytes of temporaries per byte it reads (at Wan 14B 480p, 40 heads, over 10 GB of traffic
a call). This kernel reads each query's offsets once and writes its order, bucket starts and
records once, the bytes the cost model prices (``dsa_fused_cost.order_bytes``, with its issue
slots: ``order_cost``). One program (a warp) takes ``BLOCK_R`` (query, head) rows of one window
layer: the samples' positions per axis from the offsets (fp32, clamped as the operator clamps), the
key (the lower time corner's bucket, or "past the reach"), a stable counting sort by key (every
bucket's running count along the samples in one scan, packed in 6-bit fields), the positions
scattered as ``jy * 8 + jx``, and each sample's record (its corners in its tile's halo, fractions
and clamps, packed as ``RECORD_BITS`` says) written at its position.

Tested under the Triton interpreter against ``sample_order`` and ``sample_records``
(``tests/test_dsa_order.py``); on a GPU the fused kernels it feeds are checked against the reference
on first use.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .dsa_halo_dense import ORDER_WIDTH, RECORD_PAD, STARTS_AT, TILE, halo_frame, sample_limits, time_reach

__all__ = ["sample_order_kernel", "ORDER_BLOCK_ROWS", "ORDER_WARPS"]

ORDER_BLOCK_ROWS = 4  # (query, head) rows a program of one warp: 4 x 64 samples of a layer (80 registers: many
# warps resident, the kernel is bound by DRAM; 8 rows take 210 and leave 9 warps an SM)
ORDER_WARPS = 1


@triton.jit
def _axis(base, off, size, lo):
    """Along one axis: the raw position ``base + off``, its clamp to ``[0, size - 1]``, the lower corner
    relative to ``base`` (fp32, the sort's key) and to ``lo`` (the halo's first row), the fraction, and
    whether the weights' derivative along the axis is live (int32 1 or 0: the clamp passes the gradient
    and the upper corner is not the lower)."""
    raw = base + off
    p = tl.minimum(tl.maximum(raw, 0.0), (size - 1).to(tl.float32))
    f0 = tl.floor(p)
    i0 = f0.to(tl.int32)
    live = ((raw >= 0.0) & (raw <= (size - 1).to(tl.float32)) & (i0 < size - 1)).to(tl.int32)
    return f0 - base, i0 - lo, p - f0, live


@triton.jit
def _start(x, k: tl.constexpr, size):
    """The window's first position along one axis for queries at ``x`` (shifted inward at borders)."""
    return tl.minimum(tl.maximum(x - k // 2, 0), size - k)


@triton.jit
def _halo_lo(first, k: tl.constexpr, size, ELO: tl.constexpr):
    """The first key row of the halo of a tile whose first query row is ``first``."""
    return tl.maximum(_start(first, k, size) - ELO, 0)


@triton.jit
def _order_kernel(OFF, ORD, REC, R, T, H, W, NH, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                  ELO: tl.constexpr, EHI: tl.constexpr, KP: tl.constexpr, OW: tl.constexpr, SA: tl.constexpr,
                  TT: tl.constexpr, TY: tl.constexpr, TX: tl.constexpr, FX: tl.constexpr, SW: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    jt = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    rok = rows < R
    q = rows // NH  # the query: ((b * T + t) * H + y) * W + x
    x = q % W
    y = (q // W) % H
    t = (q // (W * H)) % T
    j = tl.arange(0, KP)[None, :]
    ok = rok & (j < KH * KW)
    jy = j // KW
    jx = j % KW
    ptr = OFF + (rows.to(tl.int64) * (KT * KH * KW) + jt * KH * KW + j) * 3
    ot = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    oy = tl.load(ptr + 1, mask=ok, other=0.0).to(tl.float32)
    ox = tl.load(ptr + 2, mask=ok, other=0.0).to(tl.float32)
    bt = (_start(t, KT, T) + jt).to(tl.float32) + tl.zeros_like(ot)
    by = (_start(y, KH, H) + jy).to(tl.float32)
    bx = (_start(x, KW, W) + jx).to(tl.float32)
    rt, t0, ft, lt = _axis(bt, ot, T, _halo_lo(t // TT * TT, KT, T, ELO))
    ry, y0, fy, ly = _axis(by, oy, H, _halo_lo(y // TY * TY, KH, H, ELO))
    rx, x0, fx, lx = _axis(bx, ox, W, _halo_lo(x // TX * TX, KW, W, ELO))
    inside = ((rt >= -ELO) & (rt <= EHI - 1) & (ry >= -ELO) & (ry <= EHI - 1) & (rx >= -ELO) & (rx <= EHI - 1))
    key = tl.where(inside, (rt + ELO).to(tl.int32), ELO + EHI)  # the bucket; "past the reach" last
    c00 = tl.minimum(tl.maximum(y0 * FX + x0, 0), SW - FX - 2)  # the record's word 0, packed before the sort
    w0 = c00 | (tl.minimum(tl.maximum(t0, 0), 15) << 9) | (j << 13) | (lt << 19) | (ly << 20) | (lx << 21)
    # a stable counting sort: every bucket's running count at once, 6 bits each (at most 56 samples) of
    # one int32 (at most 5 buckets: bounds up to 2) or int64: one scan along the samples
    pack = tl.int64 if (ELO + EHI + 1) * 6 > 31 else tl.int32
    shift = (6 * key).to(pack)
    one = tl.where(ok, tl.full(key.shape, 1, pack) << shift, 0)
    before = ((tl.cumsum(one, axis=1) - one) >> shift) & 63  # the same bucket's samples before this one
    starts = tl.sum(one, axis=1) << 6  # per bucket b, the samples in buckets < b: a prefix sum over the fields
    starts += starts << 6
    starts += starts << 12
    starts += starts << 24
    pos = (((starts[:, None] >> shift) & 63) + before).to(tl.int32)
    out = ORD + rows.to(tl.int64) * (KT * OW) + jt * OW
    for b in tl.static_range(ELO + EHI + 1):
        tl.store(out + SA + b, ((starts >> (6 * b)) & 63).to(tl.int8)[:, None], mask=rok)
    tl.store(out + pos, (jy * 8 + jx).to(tl.int8) + tl.zeros_like(pos).to(tl.int8), mask=ok)
    rec = REC + ((rows.to(tl.int64) * KT + jt) * (KH * KW) + pos) * 4
    tl.store(rec, w0, mask=ok)
    tl.store(rec + 1, fy.to(tl.int32, bitcast=True), mask=ok)
    tl.store(rec + 2, fx.to(tl.int32, bitcast=True), mask=ok)
    tl.store(rec + 3, ft.to(tl.int32, bitcast=True), mask=ok)


def sample_order_kernel(offsets: torch.Tensor, window, bound: float, tile=TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sample_order(offsets, window, bound), sample_records(offsets, window, bound, tile))`` of
    ``dsa_halo_dense`` by the Triton kernel: the same tensors (the order's entries past its samples and
    bucket starts zero; the records followed by ``RECORD_PAD`` zero records in memory)."""
    B, T, H, W, nh, K, _ = offsets.shape
    kt, kh, kw = (int(w) for w in window)
    elo, ehi = time_reach(bound)
    sample_limits(window, bound, tile)
    _, fx, _, sw = halo_frame(window, bound, tile)
    order = torch.zeros((B, T, H, W, nh, kt, ORDER_WIDTH), dtype=torch.int8, device=offsets.device)
    shape = (B, T, H, W, nh, kt, kh * kw, 4)
    flat = torch.empty(math.prod(shape) + RECORD_PAD * 4, dtype=torch.int32, device=offsets.device)
    flat[-RECORD_PAD * 4:] = 0  # a walk's last chunk may read past its query's records (weight 0)
    rec = flat[:math.prod(shape)].view(shape)
    R = B * T * H * W * nh
    grid = (triton.cdiv(R, ORDER_BLOCK_ROWS), kt)
    _order_kernel[grid](offsets.contiguous(), order, rec, R, T, H, W, nh, KT=kt, KH=kh, KW=kw, ELO=elo, EHI=ehi,
                        KP=triton.next_power_of_2(kh * kw), OW=ORDER_WIDTH, SA=STARTS_AT, TT=tile[0], TY=tile[1], TX=tile[2],
                        FX=fx, SW=sw, BLOCK_R=ORDER_BLOCK_ROWS, num_warps=ORDER_WARPS)
    return order, rec
