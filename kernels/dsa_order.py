"""The fused kernels' sample order as one Triton kernel: ``dsa_halo_dense.sample_order`` (the
definition, in torch ops) in a single pass over the offsets.

``sample_order`` in torch materialises fp32 copies of the offsets, int64 keys and a sort per call:
several bytes of temporaries per byte it reads (at Wan 14B 480p, 40 heads, over 10 GB of traffic
a call). This kernel reads each query's offsets once and writes its order and bucket starts once,
the bytes the cost model prices (``dsa_fused_cost.order_bytes``). One program takes ``BLOCK_R``
(query, head) rows of one window layer: the samples' lower corners per axis from the offsets (fp32,
clamped as the operator and the fused kernels clamp), the key (the lower time corner's bucket, or
"past the reach"), and a stable counting sort by key (per bucket an exclusive running count along
the samples), the positions scattered as ``jy * 8 + jx``.

Tested under the Triton interpreter against ``sample_order`` (``tests/test_dsa_order.py``); on a
GPU the fused kernels it feeds are checked against the reference on first use.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dsa_halo_dense import ORDER_WIDTH, STARTS_AT, time_reach

__all__ = ["sample_order_kernel", "ORDER_BLOCK_ROWS"]

ORDER_BLOCK_ROWS = 32  # (query, head) rows a program: 32 x 64 samples a layer


@triton.jit
def _lower_corner(base, off, size):
    """The lower corner of ``base + off`` clamped to ``[0, size - 1]``, relative to ``base`` (fp32)."""
    p = tl.minimum(tl.maximum(base + off, 0.0), (size - 1).to(tl.float32))
    return tl.floor(p) - base


@triton.jit
def _order_kernel(OFF, ORD, R, T, H, W, NH, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                  ELO: tl.constexpr, EHI: tl.constexpr, KP: tl.constexpr, OW: tl.constexpr, SA: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    jt = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rok = rows < R
    q = rows // NH  # the query: ((b * T + t) * H + y) * W + x
    x = q % W
    y = (q // W) % H
    t = (q // (W * H)) % T
    j = tl.arange(0, KP)
    ok = rok[:, None] & (j < KH * KW)[None, :]
    jy = j // KW
    jx = j % KW
    ptr = OFF + (rows.to(tl.int64)[:, None] * (KT * KH * KW) + jt * KH * KW + j[None, :]) * 3
    ot = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    oy = tl.load(ptr + 1, mask=ok, other=0.0).to(tl.float32)
    ox = tl.load(ptr + 2, mask=ok, other=0.0).to(tl.float32)
    bt = (tl.minimum(tl.maximum(t - KT // 2, 0), T - KT) + jt).to(tl.float32)[:, None] + tl.zeros_like(ot)
    by = (tl.minimum(tl.maximum(y - KH // 2, 0), H - KH)[:, None] + jy[None, :]).to(tl.float32)
    bx = (tl.minimum(tl.maximum(x - KW // 2, 0), W - KW)[:, None] + jx[None, :]).to(tl.float32)
    rt = _lower_corner(bt, ot, T)
    ry = _lower_corner(by, oy, H)
    rx = _lower_corner(bx, ox, W)
    inside = ((rt >= -ELO) & (rt <= EHI - 1) & (ry >= -ELO) & (ry <= EHI - 1) & (rx >= -ELO) & (rx <= EHI - 1))
    key = tl.where(inside, (rt + ELO).to(tl.int32), ELO + EHI)
    key = tl.where(ok, key, ELO + EHI + 1)  # the padding past the layer's samples: in no bucket, not written
    out = ORD + rows.to(tl.int64) * (KT * OW) + jt * OW
    pos = tl.zeros([BLOCK_R, KP], tl.int32)
    start = tl.zeros([BLOCK_R], tl.int32)
    for b in tl.static_range(ELO + EHI + 1):  # the buckets in order, "past the reach" last
        hit = (key == b).to(tl.int32)
        pos = tl.where(key == b, start[:, None] + tl.cumsum(hit, axis=1) - hit, pos)
        tl.store(out + SA + b, start.to(tl.int8), mask=rok)
        start = start + tl.sum(hit, axis=1)
    tl.store(out[:, None] + pos, (jy * 8 + jx).to(tl.int8)[None, :] + tl.zeros_like(pos).to(tl.int8), mask=ok)


def sample_order_kernel(offsets: torch.Tensor, window, bound: float) -> torch.Tensor:
    """``dsa_halo_dense.sample_order(offsets, window, bound)`` by the Triton kernel (the same tensor: the
    order as ``jy * 8 + jx``, the bucket starts at ``STARTS_AT``, zeros elsewhere)."""
    B, T, H, W, nh, K, _ = offsets.shape
    kt, kh, kw = (int(w) for w in window)
    elo, ehi = time_reach(bound)
    if kh * kw > STARTS_AT or kw > 8 or kh > 15 or elo + ehi + 1 > ORDER_WIDTH - STARTS_AT:
        raise ValueError(f"window {tuple(window)} and bound {bound}: the sample order holds layers of at most "
                         f"{STARTS_AT} samples (kw <= 8, kh <= 15) and bounds of at most 3")
    out = torch.zeros((B, T, H, W, nh, kt, ORDER_WIDTH), dtype=torch.int8, device=offsets.device)
    R = B * T * H * W * nh
    grid = (triton.cdiv(R, ORDER_BLOCK_ROWS), kt)
    _order_kernel[grid](offsets.contiguous(), out, R, T, H, W, nh, KT=kt, KH=kh, KW=kw, ELO=elo, EHI=ehi,
                        KP=triton.next_power_of_2(kh * kw), OW=ORDER_WIDTH, SA=STARTS_AT, BLOCK_R=ORDER_BLOCK_ROWS)
    return out
