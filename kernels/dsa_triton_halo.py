"""The halo kernels: the gather kernels' forward and the backward's query side with their
products on tensor cores. Each query tile multiplies its queries with whole key and value rows
(``tl.dot``), then picks and spreads the samples' corners in registers.

Why
  The gather kernels (``dsa_triton``) interpolate each sample's key and value from its 8 corner
  rows and take ``<q, k_j>`` and ``a_j v_j`` as vector operations: every product runs on CUDA-core
  FMAs, ``16 d`` per (query, sample), and every corner row goes through L1 once per sample that
  touches it. The queries of one row segment, though, sample the same few key rows: their
  offsets are bounded, so their samples' corners lie in a small box around their windows.

The tile
  One program owns ``BX`` consecutive queries of one frame and row (one (batch, head)), on
  ``BXP = 64`` rows: the ``wgmma`` M; where the image's rows are narrower than ``BX``, ``RY``
  whole rows of it (``halo_tile``: two 26-token rows at Wan2.2 TI2V-5B's 480p grid, not one in
  64 lanes). Their window start ``s_t`` is one scalar; ``s_y`` runs with the row, ``s_x`` with
  ``x``. With the offsets' bound ``M`` every corner of a slot-``j`` sample lies in
  ``[b - ceil(M), b + floor(M) + 1]`` per axis around its base ``b`` (``dsa_triton_pull.pull_span``),
  so the tile's x corners fit ``XP`` consecutive key columns from ``cx0``. Window slots are taken a
  group at a time: ``GY`` consecutive window rows of one frame, ``(jt, jy .. jy + GY - 1)``, their
  ``GY KW`` slots packed on ``GC`` columns (``(BXP, GC)`` tensors; in the scores pass and the
  backward's query side as many window rows as fill 16 columns, 2 at 3x7x7 and 3 at 3x5x5, where
  the registers allow; in the rows pass one, on ``KWP`` columns). For a
  group the program computes the samples' clamped positions and the box of key rows ``(t', y')``
  their corners touch (a runtime min/max), so the work follows the offsets present: one row per
  group at zero offsets, up to ``(2M + 2)^2``. Every row of the box takes its dot, weighted or not:
  testing a row's weights cost a block-wide reduction (about 35 instructions and 3 barriers a
  row) and with trained offsets almost every row of the box is touched.

Four passes
  1. ``_dsa_halo_scores`` (forward): per touched row, ``S = q @ K_row^T`` (``(BXP, XP)``, a
     tensor-core dot); each sample takes its two x corners from ``S`` with one ``tl.gather`` for
     the whole group (``(BXP, 2 GC)``: the corners interleaved, ``_pairs``) and adds them with
     its ``t`` and ``y`` weights; the ``x`` weights apply once per group. Triton lays a gather out
     with the source's axis across a warp and the index broadcast over it, so a gather of 16 or 32
     columns per query costs what one of 8 does: two gathers of 8 took 481 instructions a row, one
     of 16 with the row test gone 211, one of 32 (``GY`` 2) 229 for twice the samples, and a group
     of ``GY`` window rows reaches ``span + GY - 1`` key rows, not ``GY span``. The unscaled scores
     go to a scratch buffer ``(pairs, K, N)`` fp32 and the log-sum-exp (base 2, as the gather
     forward saves it) to ``LSE``.
  2. ``_dsa_halo_rows`` with ``SOFTMAX`` (forward output): ``a_j = exp2(s_j scale - lse)``. Once
     per group, each slot's x tent goes on a band of ``UP`` columns relative to its query's window
     (``u = x' - s_x + ceil M``: its two x corners), ``(KWP, BXP, UP)``; per touched row the
     probabilities times the ``t``, ``y`` weights scale the slots' tents, summed over the slots
     into the row's band (the slot axis leads, so the sum stays within each thread), the band is
     placed on the row's ``XP`` columns (``_band_place4``: four ``tl.gather`` of every fourth
     column, interleaved: 242 instructions a row against 402 for one gather), and ``acc += P @ V_row``
     (a tensor-core dot; ``P`` in the values' dtype, as flash attention's ``P @ V``; ``ieee`` at
     fp32). Built per row and slot instead, the band cost 2.6 times the instructions a row.
  3. ``_dsa_halo_bwd`` (the backward's query side), two launches of one sweep each over the rows
     the corners touch or whose weight's derivative reaches, one dot a row: ``dO V_row^T`` gives
     ``dO . v_j`` and its derivatives along each axis, then ``q K_row^T`` the score and its
     derivatives (times ``ds / a``, known from the first): the offsets' gradient, and the pull
     mode's records ``(p_t, p_y, p_x, ds, a)``. Each row's corner values come from one gather and
     go into three sums (the ``t``, ``y`` tents' product and each tent's derivative times the
     other); the ``x`` tent and its derivative do not depend on the row and apply after the sweep
     (both sweeps in one program with a loop per source: 1,184 instructions a row; now 267 a
     sweep and row, 301 at ``GY`` 2). The first sweep's four results wait in the records' fields
     for the second. Both sweeps take the scores pass's ``GY`` but the second at head dim 128 and
     on sm_100, which takes 1 (with 2 it spilled 28-40 B there).
  4. ``_dsa_halo_rows`` without ``SOFTMAX`` (``dq``): as 2, with ``X = k`` and the records' ``ds``.
  dk and dv come from the key-side pass (``dsa_triton_pull``), as in the gather kernels' pull mode.

  Four passes, not two: fused, the accumulator, a row's scores and the sample tensors did not fit
  the registers (ptxas spilled 0.4-3 KB per thread at 4 and 8 warps); apart, each pass compiles
  without spills at 8 warps (``python -m benchmarks.gpu_check --compile-only``). The scores'
  scratch costs ``4 K`` bytes per token and head each way; pairs are chunked within
  ``SCORE_BUDGET_BYTES``.

When it runs
  Where the backward's pull mode may run (a known bound up to ``PULL_MAX_OFFSET``, a window the
  column run covers, a slab holding every reachable frame: ``dsa_triton_pull.pull_bound``), bf16
  and fp16. the ``auto`` halo mode (``dsa_modes.KernelModes``) takes the halo kernels per pass (the forward; the
  backward's query side) where the cost model (``dsa_cost.choose_halo``) predicts them faster than
  the gather kernels at the call's bound (its ``max_offset``), both counted in issue slots from their sm_90 compiles. At the Wan grid
  (21x30x52) and head dim 128, window 3x7x7: both passes up to offsets of 2 (the GPU check's bound
  is 1.5); past that it predicts the gather kernels faster (at 3x5x5 from 2). At
  Wan2.2 TI2V-5B's narrower grid (21x15x26, two image rows a tile) both passes up to offsets in
  (1, 2). "halo" forces them. fp32
  takes the gather kernels (the halo passes' fp32 ``ieee`` dots spill). A query with an offset
  beyond a given bound gets a NaN output row (and dq row): its corners may lie outside the columns
  the tile loaded.

Verification status (Caution)
  Verified under the Triton CPU interpreter against ``dsa_reference`` and against the gather
  kernels (tests/test_dsa_halo.py) and compiled for sm_90 and sm_100; not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import AOT_POINTER_TYPES, aligned_pointer_attrs, signature_for
from .dsa_triton_pull import (
    INTERPRETED,
    _band_add,
    _band_place4,
    _pairs,
    _past_bound,
    _x_tents,
    compute_capability,
    pairs_within,
    pull_config,
    pull_span,
)

__all__ = ["halo_forward", "halo_config", "halo_tile", "aot_variants", "SCORE_BUDGET_BYTES", "score_chunk"]

SCORE_BUDGET_BYTES = 1 << 30  # the scores' scratch per launch; (batch, head) pairs in chunks within it


@triton.jit
def _clamped_axis(off, base, SIZE):
    """A sample coordinate clamped to the grid: (lower corner, upper corner, weight on the upper)."""
    p = tl.minimum(tl.maximum(base.to(tl.float32) + off, 0.0), SIZE - 1.0)
    i0 = p.to(tl.int32)  # p >= 0: truncation is floor
    f = p - i0.to(tl.float32)
    return i0, tl.minimum(i0 + 1, SIZE - 1), f


@triton.jit
def _upper(i0, LIM):
    """The upper corner beside lower corner ``i0`` (``min(i0 + 1, LIM)``; -1 stays -1: no row).
    Recomputed where used rather than kept: fewer tensors live through the row loops."""
    return tl.where(i0 >= 0, tl.minimum(i0 + 1, LIM), -1)


@triton.jit
def _row_tent(i0, i1, f, r):
    """Weight of the samples' positions (corners ``i0``, ``i1``, weight ``f`` on ``i1``) on row ``r``."""
    return tl.where(i0 == r, 1.0 - f, 0.0) + tl.where(i1 == r, f, 0.0)


@triton.jit
def _pair_sum(x, R: tl.constexpr, C: tl.constexpr):
    """``(R, 2 C)`` -> ``(R, C)``: the sum of each interleaved pair (``_pairs``'s inverse, added)."""
    return tl.sum(tl.reshape(x, [R, C, 2]), axis=2)


@triton.jit
def _pair_diff(x, R: tl.constexpr, C: tl.constexpr):
    """``(R, 2 C)`` -> ``(R, C)``: each interleaved pair's second element minus its first."""
    a, b = tl.split(tl.reshape(x, [R, C, 2]))
    return b - a


@triton.jit
def _tile(BH0, N, T, H, W, NH, NK, TK, Q0, K0, EHI, BX, HEAD_DIM: tl.constexpr, KT: tl.constexpr,
          KH: tl.constexpr, KW: tl.constexpr, BXP: tl.constexpr, XP: tl.constexpr, BLOCK_D: tl.constexpr,
          RY: tl.constexpr):
    """A program's query tile: ``RY`` rows of ``BX`` queries each, of one frame, one x range and
    one (batch, head), the ``(BH0 + program_id(1))``-th pair; lane ``r BX + i`` is query ``i`` of
    row ``r``. Returns the pair's index in the launch (``slot``) and in the whole tensor, the
    queries' tokens and validity, the window starts (``sx`` per query, ``sy`` one scalar at ``RY``
    1, else ``(BXP, 1)``: it broadcasts against a group's columns), the key run's first
    column ``cx0`` (every row of the tile shares it), where each query's offsets and rows start
    (``off_row``, ``row_ptr``, ``row_mask``), where the pair's k and v rows start, and the upper
    corners' limits (``_upper``: the held frames, the key run's columns)."""
    pid = tl.program_id(0)
    slot = tl.program_id(1)
    pid_bh = BH0 + slot
    b = pid_bh // NH
    h = pid_bh % NH
    tiles_x = tl.cdiv(W, BX)
    tiles_y = tl.cdiv(H, RY)
    qt_l = pid // (tiles_y * tiles_x)
    qy0 = ((pid // tiles_x) % tiles_y) * RY
    x0 = (pid % tiles_x) * BX
    lane = tl.arange(0, BXP)
    if RY == 1:  # one row: its window start s_y is one scalar (a register fewer through the loops)
        qx = x0 + lane
        q_ok = (lane < BX) & (qx < W)
        tok = (qt_l * H + qy0) * W + qx
        sy = tl.minimum(tl.maximum(qy0 - KH // 2, 0), H - KH)
    else:
        ry = lane // BX
        qx = x0 + (lane - ry * BX)
        qy = qy0 + ry
        q_ok = (ry < RY) & (qx < W) & (qy < H)
        tok = (qt_l * H + qy) * W + qx
        sy = tl.minimum(tl.maximum(qy - KH // 2, 0), H - KH)[:, None]  # (BXP, 1)
    qt = Q0 + qt_l  # frame on the whole grid
    st = tl.minimum(tl.maximum(qt - KT // 2, 0), T - KT)
    sx = tl.minimum(tl.maximum(qx - KW // 2, 0), W - KW)  # (BXP,)
    # the key columns the tile's corners can reach: [cx0, cx0 + XP)
    cx0 = tl.maximum(tl.minimum(tl.maximum(x0 - KW // 2, 0), W - KW) - EHI, 0)
    off_row = ((b.to(tl.int64) * N + tok) * NH + h) * (KT * KH * KW * 3)  # element offset of each query's offsets
    row_stride = NH * HEAD_DIM
    d = tl.arange(0, BLOCK_D)
    row_ptr = (b.to(tl.int64) * N + tok)[:, None] * row_stride + h * HEAD_DIM + d[None, :]
    row_mask = q_ok[:, None] & (d < HEAD_DIM)[None, :]
    kv_base = b.to(tl.int64) * NK * row_stride + h * HEAD_DIM
    return (slot, pid_bh, tok, q_ok, st, sy, sx, cx0, off_row, row_ptr, row_mask, kv_base,
            tl.minimum(T - 1 - K0, TK - 1), tl.minimum(W - 1 - cx0, XP - 1))


@triton.jit
def _group(OFF, off_row, q_ok, jt, jy, st, sy, sx, cx0, T, H, W, TK, K0, ELO, EHI,
           KH: tl.constexpr, KW: tl.constexpr, XP: tl.constexpr, GY: tl.constexpr, GC: tl.constexpr):
    """The samples of window rows ``(jt, jy .. jy + GY - 1)`` (``KW`` slots each, packed on ``GC``
    columns: column ``c`` is slot ``c % KW`` of row ``jy + c // KW``), ``(BXP, GC)``: the lower
    corners (held frame ``t0``, -1 for padding and refused slots: they touch no row; row ``y0``;
    column of the tile's key run ``g0``; the upper corners are ``_upper`` of them), the weights on
    the upper corners, which slots count (``ok``), which queries have a slot past the bound
    (``past``, per query), the key rows the weighted corners touch, ``[t_lo, t_hi] x [y_lo, y_hi]``,
    each column's slot ``j`` and which slots exist (``slot_ok``: the window's, of a valid query)."""
    col = tl.arange(0, GC)
    jyc = jy + col // KW
    jx = col % KW
    slot_ok = q_ok[:, None] & ((col < GY * KW) & (jyc < KH))[None, :]
    j = (jt * KH + jyc) * KW + jx
    optr = OFF + off_row[:, None] + j[None, :] * 3
    ot = tl.load(optr + 0, mask=slot_ok, other=0.0).to(tl.float32)
    oy = tl.load(optr + 1, mask=slot_ok, other=0.0).to(tl.float32)
    ox = tl.load(optr + 2, mask=slot_ok, other=0.0).to(tl.float32)
    bt = st + jt
    by = sy + jyc[None, :]
    bx = sx[:, None] + jx[None, :]
    t0, t1, ft = _clamped_axis(ot, bt, T)
    y0, y1, fy = _clamped_axis(oy, by, H)
    c0, c1, fx = _clamped_axis(ox, bx, W)
    past = (_past_bound(t0, ft, bt, ELO, EHI) | _past_bound(y0, fy, by, ELO, EHI)
            | _past_bound(c0, fx, bx, ELO, EHI) | (ot != ot) | (oy != oy) | (ox != ox)) & slot_ok
    ok = slot_ok & (past == 0)
    t0 = tl.where(ok, tl.minimum(tl.maximum(t0 - K0, 0), TK - 1), -1)  # whole-grid frame -> held frame
    t1 = tl.where(ok, tl.minimum(tl.maximum(t1 - K0, 0), TK - 1), -1)
    g0 = tl.minimum(tl.maximum(c0 - cx0, 0), XP - 1)
    t_lo = tl.min(tl.min(tl.where(ok, t0, TK), axis=1), axis=0)
    y_lo = tl.min(tl.min(tl.where(ok, y0, H), axis=1), axis=0)
    t_hi = tl.max(tl.max(tl.where(ft > 0.0, t1, t0), axis=1), axis=0)
    y_hi = tl.max(tl.max(tl.where(ok, tl.where(fy > 0.0, y1, y0), -1), axis=1), axis=0)
    return (t0, ft, y0, fy, g0, fx, ok, tl.max(past.to(tl.int32), axis=1) > 0, t_lo, t_hi, y_lo, y_hi,
            j, slot_ok)


@triton.jit
def _inside(OFF, off_row, slot_ok, j, bt, by, bx, T, H, W):
    """Where the clamp of each sample's position passes gradient, per axis (torch's clamp: on
    ``[lo, hi]`` inclusive), and the clamped positions (``_clamped_axis``'s, the records' first
    three fields), from the offsets reloaded (cheaper than keeping six tensors live)."""
    optr = OFF + off_row[:, None] + j[None, :] * 3
    pt = bt + tl.load(optr + 0, mask=slot_ok, other=0.0).to(tl.float32)
    py = by + tl.load(optr + 1, mask=slot_ok, other=0.0).to(tl.float32)
    px = bx + tl.load(optr + 2, mask=slot_ok, other=0.0).to(tl.float32)
    return ((pt >= 0.0) & (pt <= T - 1.0), (py >= 0.0) & (py <= H - 1.0), (px >= 0.0) & (px <= W - 1.0),
            tl.minimum(tl.maximum(pt, 0.0), T - 1.0), tl.minimum(tl.maximum(py, 0.0), H - 1.0),
            tl.minimum(tl.maximum(px, 0.0), W - 1.0))


@triton.jit
def _key_row(X, kv_base, tr, yr, H, W, cx0, row_stride, HEAD_DIM: tl.constexpr, XP: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """Key (or value) row ``(tr, yr)`` of held frames, columns ``[cx0, cx0 + XP)``: ``(XP, BLOCK_D)``."""
    kcol = cx0 + tl.arange(0, XP)
    d = tl.arange(0, BLOCK_D)
    return tl.load(X + kv_base + ((tr * H + yr) * W + kcol).to(tl.int64)[:, None] * row_stride + d[None, :],
                   mask=(kcol < W)[:, None] & (d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _row_dot(x, X, kv_base, tr, yr, H, W, cx0, row_stride, HEAD_DIM: tl.constexpr, XP: tl.constexpr,
             BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """``x X_row^T`` for key row ``(tr, yr)``: ``(BXP, XP)`` fp32."""
    xrow = _key_row(X, kv_base, tr, yr, H, W, cx0, row_stride, HEAD_DIM, XP, BLOCK_D)
    if IEEE:
        return tl.dot(x, tl.trans(xrow), input_precision="ieee")
    elif WIDEN:  # the interpreter multiplies bf16 tiles' raw bits: widen (the products are the same)
        return tl.dot(x.to(tl.float32), tl.trans(xrow.to(tl.float32)), input_precision="ieee")
    else:
        return tl.dot(x, tl.trans(xrow))


@triton.jit
def _dsa_halo_scores(
    Q, Kx, OFF, S, LSE,
    qk_scale,  # softmax scale * log2(e)
    N, T, H, W, NH,
    NK, TK, Q0, K0, BH0,  # k: NK tokens = frames [K0, K0 + TK) of T; queries start at frame Q0
    ELO, EHI,  # the bound's span (pull_span): corners of base b lie in [b - EHI, b + ELO]
    BX,  # a tile: RY image rows of BX queries each (RY BX <= BXP lanes)
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BXP: tl.constexpr, XP: tl.constexpr, KWP: tl.constexpr, BLOCK_D: tl.constexpr,
    RY: tl.constexpr,  # image rows per tile (``halo_tile``)
    GY: tl.constexpr,  # window rows per group: their samples against each touched key row
    GC: tl.constexpr,  # columns per group (GY KW slots, to a power of two)
    WIDEN: tl.constexpr = False,  # under the interpreter: bf16 dots widened (as ``dsa_triton_pull._split_dot``)
):
    """Pass 1: every sample's score ``<q, k_j>`` (unscaled, fp32) into ``S (BH, KS, N)`` and the
    log-sum-exp (base 2) into ``LSE``; a query with a sample past the bound gets a NaN log-sum-exp."""
    KS: tl.constexpr = KT * KH * KW
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    row_stride = NH * HEAD_DIM
    s_bh, pid_bh, tok, q_ok, st, sy, sx, cx0, off_row, row_ptr, row_mask, kv_base, TUP, GUP = _tile(
        BH0, N, T, H, W, NH, NK, TK, Q0, K0, EHI, BX, HEAD_DIM, KT, KH, KW, BXP, XP, BLOCK_D, RY)
    q = tl.load(Q + row_ptr, mask=row_mask, other=0.0)
    s_row = S + s_bh.to(tl.int64) * (KS * N) + tok  # (BXP,): sample j of a query at + j * N
    beyond = tl.zeros([BXP], dtype=tl.int1)
    m_i = tl.full([BXP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BXP], dtype=tl.float32)
    for jt in tl.range(0, KT, loop_unroll_factor=1):
        for jy in tl.range(0, KH, GY, loop_unroll_factor=1):
            t0, ft, y0, fy, g0, fx, ok, past, t_lo, t_hi, y_lo, y_hi, j, slot_ok = _group(
                OFF, off_row, q_ok, jt, jy, st, sy, sx, cx0, T, H, W, TK, K0, ELO, EHI, KH, KW, XP, GY, GC)
            beyond |= past
            g01 = _pairs(g0, _upper(g0, GUP))  # (BXP, 2 GC): both x corners of every slot, one gather a row
            s2 = tl.zeros([BXP, 2 * GC], dtype=tl.float32)
            for tr in tl.range(t_lo, t_hi + 1, loop_unroll_factor=1):
                wt = _row_tent(t0, _upper(t0, TUP), ft, tr)
                for yr in tl.range(y_lo, y_hi + 1, loop_unroll_factor=1):
                    w = wt * _row_tent(y0, _upper(y0, H - 1), fy, yr)
                    sc = _row_dot(q, Kx, kv_base, tr, yr, H, W, cx0, row_stride, HEAD_DIM, XP, BLOCK_D, IEEE,
                                  WIDEN)  # (BXP, XP) on tensor cores
                    s2 += _pairs(w, w) * tl.gather(sc, g01, axis=1)
            s = _pair_sum(s2 * _pairs(1.0 - fx, fx), BXP, GC)
            tl.store(s_row[:, None] + j[None, :] * N, s, mask=slot_ok)
            sl = tl.where(ok, s * qk_scale, float("-inf"))  # online log-sum-exp over the groups (base 2)
            m_new = tl.maximum(m_i, tl.max(sl, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.math.exp2(m_i - m_use) + tl.sum(tl.math.exp2(sl - m_use[:, None]), axis=1)
            m_i = m_new
    lse = m_i + tl.math.log2(tl.where(q_ok, l_i, 1.0))
    tl.store(LSE + pid_bh.to(tl.int64) * N + tok, tl.where(beyond, float("nan"), lse), mask=q_ok)


@triton.jit
def _dsa_halo_rows(
    X, OFF, C, LSE, OUT,
    qk_scale,
    N, T, H, W, NH,
    NK, TK, Q0, K0, BH0,
    ELO, EHI,
    BX,
    C_STRIDE,  # elements between two (batch, head) pairs' coefficients in C: K N (scores) or 5 K N (records)
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BXP: tl.constexpr, XP: tl.constexpr, KWP: tl.constexpr, UP: tl.constexpr, BLOCK_D: tl.constexpr,
    RY: tl.constexpr,
    SOFTMAX: tl.constexpr,  # C holds scores: the coefficient is a_j = exp2(s_j qk_scale - lse); else C as is
    BAND3: tl.constexpr,  # the slots' x tents built once per group, (KWP, BXP, UP); else per row and slot
    WIDEN: tl.constexpr = False,
):
    """``OUT = sum_j c_j x_j``, ``x_j`` the trilinear blend of ``X`` (k or v) at sample ``j``: one
    dense ``P_row @ X_row`` per touched key row. The forward's output (``X = v``, ``c = a``) and
    the backward's ``dq`` (``X = k``, ``c = ds``). A query with a slot past the bound gets a NaN row."""
    IEEE: tl.constexpr = X.dtype.element_ty == tl.float32
    row_stride = NH * HEAD_DIM
    c_bh, pid_bh, tok, q_ok, st, sy, sx, cx0, off_row, row_ptr, row_mask, kv_base, TUP, GUP = _tile(
        BH0, N, T, H, W, NH, NK, TK, Q0, K0, EHI, BX, HEAD_DIM, KT, KH, KW, BXP, XP, BLOCK_D, RY)
    jx = tl.arange(0, KWP)
    u = tl.arange(0, UP)
    c_row = C + c_bh.to(tl.int64) * C_STRIDE + tok
    if SOFTMAX:
        lse = tl.load(LSE + pid_bh.to(tl.int64) * N + tok, mask=q_ok, other=0.0)
    beyond = tl.zeros([BXP], dtype=tl.int1)
    acc = tl.zeros([BXP, BLOCK_D], dtype=tl.float32)
    for jt in tl.range(0, KT, loop_unroll_factor=1):
        for jy in tl.range(0, KH, loop_unroll_factor=1):
            t0, ft, y0, fy, g0, fx, ok, past, t_lo, t_hi, y_lo, y_hi, j, _ = _group(
                OFF, off_row, q_ok, jt, jy, st, sy, sx, cx0, T, H, W, TK, K0, ELO, EHI, KH, KW, XP, 1, KWP)
            beyond |= past
            coef = tl.load(c_row[:, None] + j[None, :] * N, mask=ok, other=0.0)
            if SOFTMAX:
                coef = tl.math.exp2(coef * qk_scale - lse[:, None])
            coef = tl.where(ok, coef, 0.0)
            if BAND3:  # the slots' x tents on each query's band (u = x' - s_x + EHI) times their
                # coefficients, once per group: xt[j, q, u] = c (1 - fx) at u0, c fx at u1 (the row
                # loop's t, y weights only scale them; the coefficients folded in here keep the dq
                # pass within its registers: apart, it spilled 128-180 B)
                ub = ((cx0 + EHI) - sx)[None, :, None]
                xt = _x_tents(tl.trans(g0)[:, :, None] + ub, tl.trans(_upper(g0, GUP))[:, :, None] + ub,
                              tl.trans(fx)[:, :, None], tl.trans(coef)[:, :, None], u[None, None, :])  # (KWP, BXP, UP)
            for tr in tl.range(t_lo, t_hi + 1, loop_unroll_factor=1):
                ct = _row_tent(t0, _upper(t0, TUP), ft, tr)
                if not BAND3:  # else the coefficients are in xt
                    ct = coef * ct
                for yr in tl.range(y_lo, y_hi + 1, loop_unroll_factor=1):
                    c = ct * _row_tent(y0, _upper(y0, H - 1), fy, yr)
                    if BAND3:  # (BXP, UP): the row's weights on the band, summed over the slots
                        band = tl.sum(tl.trans(c)[:, :, None] * xt, axis=0)
                    else:  # slot by slot: its column of the group's tensors, its x tent on the band
                        band = tl.zeros([BXP, UP], dtype=tl.float32)
                        for js in tl.range(0, KW, loop_unroll_factor=1):
                            sel = (jx == js)[None, :]
                            u0j = tl.sum(tl.where(sel, g0, 0), axis=1) + (cx0 + EHI) - sx
                            u1j = tl.sum(tl.where(sel, _upper(g0, GUP), 0), axis=1) + (cx0 + EHI) - sx
                            band = _band_add(band, u, u0j, u1j, tl.sum(tl.where(sel, fx, 0.0), axis=1),
                                             tl.sum(tl.where(sel, c, 0.0), axis=1))
                    pr = _band_place4(band, (cx0 + EHI) - sx[:, None], UP, XP)  # (BXP, XP)
                    xrow = _key_row(X, kv_base, tr, yr, H, W, cx0, row_stride, HEAD_DIM, XP, BLOCK_D)
                    if IEEE:
                        acc = tl.dot(pr, xrow, acc, input_precision="ieee")
                    elif WIDEN:  # P in the rows' dtype as on the GPU, widened for the interpreter
                        acc = tl.dot(pr.to(xrow.dtype).to(tl.float32), xrow.to(tl.float32), acc,
                                     input_precision="ieee")
                    else:  # P in the rows' dtype, as flash attention's P @ V and dS @ K
                        acc = tl.dot(pr.to(xrow.dtype), xrow, acc)
    acc = tl.where(beyond[:, None], float("nan"), acc)
    tl.store(OUT + row_ptr, acc.to(OUT.dtype.element_ty), mask=row_mask)


@triton.jit
def _sweep_rows(Q, Kx, V, DOUT, kv_base, row_ptr, row_mask, t0, ft, y0, fy, g01, t_lo, t_hi2, y_lo, y_hi2, TUP, H,
                W, cx0, row_stride, HEAD_DIM: tl.constexpr, BXP: tl.constexpr, XP: tl.constexpr, BLOCK_D: tl.constexpr,
                GC: tl.constexpr, SWEEP: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """One group's sweep over the key rows ``[t_lo, t_hi2] x [y_lo, y_hi2]``: per row one dot (``dO
    V_row^T`` at sweep 0, ``q K_row^T`` at sweep 1), both x corners of every slot picked by one
    gather, summed weighted by the ``t``, ``y`` tents' product (``sw``), by the ``t`` tent's
    derivative times the ``y`` tent (``st_``) and by the ``t`` tent times the ``y`` tent's
    derivative (``sy_``), each ``(BXP, 2 GC)``."""
    sw = tl.zeros([BXP, 2 * GC], dtype=tl.float32)  # tents' product
    st_ = tl.zeros([BXP, 2 * GC], dtype=tl.float32)  # t tent's derivative
    sy_ = tl.zeros([BXP, 2 * GC], dtype=tl.float32)  # y tent's derivative
    for tr in tl.range(t_lo, t_hi2 + 1, loop_unroll_factor=1):
        wt = _row_tent(t0, _upper(t0, TUP), ft, tr)
        dwt = tl.where(_upper(t0, TUP) == tr, 1.0, 0.0) - tl.where(t0 == tr, 1.0, 0.0)
        for yr in tl.range(y_lo, y_hi2 + 1, loop_unroll_factor=1):
            wy = _row_tent(y0, _upper(y0, H - 1), fy, yr)
            dwy = tl.where(_upper(y0, H - 1) == yr, 1.0, 0.0) - tl.where(y0 == yr, 1.0, 0.0)
            if SWEEP == 0:
                row = _row_dot(tl.load(DOUT + row_ptr, mask=row_mask, other=0.0), V, kv_base, tr,
                               yr, H, W, cx0, row_stride, HEAD_DIM, XP, BLOCK_D, IEEE, WIDEN)
            else:
                row = _row_dot(tl.load(Q + row_ptr, mask=row_mask, other=0.0), Kx, kv_base, tr, yr,
                               H, W, cx0, row_stride, HEAD_DIM, XP, BLOCK_D, IEEE, WIDEN)
            e = tl.gather(row, g01, axis=1)
            sw += _pairs(wt * wy, wt * wy) * e
            st_ += _pairs(dwt * wy, dwt * wy) * e
            sy_ += _pairs(wt * dwy, wt * dwy) * e
    return sw, st_, sy_


@triton.jit
def _sweep1_records(OFF, DOFF, off_row, rec, FIELD, blend, et, ey, ex, ok, slot_ok, lse, qk_scale, j, jt, jy, col,
                    st, sy, sx, T, H, W, KW: tl.constexpr):
    """Sweep 1's results for one group: ``a`` from the score ``blend``, the offsets' gradient (sweep
    0's terms, parked in the records' first four fields, plus ``cs`` times this sweep's) and the
    records' final values ``(p_t, p_y, p_x, ds, a)`` over what sweep 0 parked."""
    a = tl.where(ok, tl.math.exp2(blend * qk_scale - lse[:, None]), 0.0)
    cs = tl.load(rec, mask=slot_ok, other=0.0)
    et = tl.load(rec + FIELD, mask=slot_ok, other=0.0) + cs * et
    ey = tl.load(rec + 2 * FIELD, mask=slot_ok, other=0.0) + cs * ey
    ex = tl.load(rec + 3 * FIELD, mask=slot_ok, other=0.0) + cs * ex
    tl.debug_barrier()  # every thread's loads are done before the records' final values overwrite them
    tl.store(rec + 3 * FIELD, a * cs, mask=slot_ok)
    tl.store(rec + 4 * FIELD, a, mask=slot_ok)
    in_t, in_y, in_x, pt, py, px = _inside(OFF, off_row, slot_ok, j, st + jt,
                                           sy + (jy + col // KW)[None, :],
                                           sx[:, None] + (col % KW)[None, :], T, H, W)
    doff = DOFF + off_row[:, None] + j[None, :] * 3
    out_ty = DOFF.dtype.element_ty
    tl.store(doff + 0, tl.where(in_t, a * et, 0.0).to(out_ty), mask=slot_ok)
    tl.store(doff + 1, tl.where(in_y, a * ey, 0.0).to(out_ty), mask=slot_ok)
    tl.store(doff + 2, tl.where(in_x, a * ex, 0.0).to(out_ty), mask=slot_ok)
    tl.store(rec, pt, mask=slot_ok)
    tl.store(rec + FIELD, py, mask=slot_ok)
    tl.store(rec + 2 * FIELD, px, mask=slot_ok)


@triton.jit
def _dsa_halo_bwd(
    Q, Kx, V, OFF, OUT, DOUT, LSE, DOFF, REC,
    qk_scale, sm_scale,
    N, T, H, W, NH,
    NK, TK, Q0, K0, BH0,
    ELO, EHI,
    BX,
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BXP: tl.constexpr, XP: tl.constexpr, KWP: tl.constexpr, BLOCK_D: tl.constexpr,
    RY: tl.constexpr,
    GY: tl.constexpr,  # window rows per group, as in the scores pass
    GC: tl.constexpr,
    SWEEP: tl.constexpr,  # 0: dO V_row^T, the first half of the gradient; 1: q K_row^T, the rest and the records
    WIDEN: tl.constexpr = False,
):
    """The backward's query side without dq, one sweep per launch (``SWEEP``): per key row a corner
    touches or whose weight's derivative reaches (an upper corner at zero weight: its derivative
    is 1), one tensor-core dot, ``dO V_row^T`` (sweep 0) or ``q K_row^T`` (sweep 1). Each row's
    values at both x corners of every slot come from one gather (``e``, the corners interleaved) and
    go into three sums, weighted by the row's ``t`` and ``y`` tents' product and each tent's
    derivative times the other; the ``x`` tent and its derivative do not depend on the row and
    apply once after the sweep. Sweep 0 gives ``dO . v_j`` and its derivatives: ``cs = ds / a`` and
    the ``dO.v_c`` terms of the offsets' gradient, which wait in the records' first four fields.
    Sweep 1 gives the score, so ``a``, and the ``q.k_c`` terms times ``cs``: the offsets' gradient,
    ``sum_c d(weight_c)/dp e_c`` with ``e_c = ds q.k_c + a dO.v_c = a (cs q.k_c + dO.v_c)``, and
    the records ``(p_t, p_y, p_x, ds, a)`` for the key-side pass and the ``dq`` pass
    (``_dsa_halo_rows`` with ``X = k``, ``c = ds``). Apart, each sweep takes ``GY`` window rows a
    group within its registers; together in one program (one ``GY``), they needed the first
    sweep's results parked in memory between them, and both sweeps' code held the registers."""
    KS: tl.constexpr = KT * KH * KW
    IEEE: tl.constexpr = Q.dtype.element_ty == tl.float32
    row_stride = NH * HEAD_DIM
    r_bh, pid_bh, tok, q_ok, st, sy, sx, cx0, off_row, row_ptr, row_mask, kv_base, TUP, GUP = _tile(
        BH0, N, T, H, W, NH, NK, TK, Q0, K0, EHI, BX, HEAD_DIM, KT, KH, KW, BXP, XP, BLOCK_D, RY)
    # q and dO are loaded again for every row's dot (L1 hits), not held through the loops
    if SWEEP == 0:
        delta = tl.sum(tl.load(DOUT + row_ptr, mask=row_mask, other=0.0).to(tl.float32)
                       * tl.load(OUT + row_ptr, mask=row_mask, other=0.0).to(tl.float32), axis=1)
    else:
        lse = tl.load(LSE + pid_bh.to(tl.int64) * N + tok, mask=q_ok, other=0.0)
    col = tl.arange(0, GC)
    rec_row = REC + r_bh.to(tl.int64) * (5 * KS * N) + tok
    for jt in tl.range(0, KT, loop_unroll_factor=1):
        for jy in tl.range(0, KH, GY, loop_unroll_factor=1):
            t0, ft, y0, fy, g0, fx, ok, past, t_lo, t_hi, y_lo, y_hi, j, slot_ok = _group(
                OFF, off_row, q_ok, jt, jy, st, sy, sx, cx0, T, H, W, TK, K0, ELO, EHI, KH, KW, XP, GY, GC)
            t_hi2 = tl.max(tl.max(_upper(t0, TUP), axis=1), axis=0)  # every upper corner: its weight's derivative is 1
            y_hi2 = tl.max(tl.max(tl.where(ok, _upper(y0, H - 1), -1), axis=1), axis=0)
            g01 = _pairs(g0, _upper(g0, GUP))
            sw, st_, sy_ = _sweep_rows(Q, Kx, V, DOUT, kv_base, row_ptr, row_mask, t0, ft, y0, fy, g01, t_lo, t_hi2,
                                       y_lo, y_hi2, TUP, H, W, cx0, row_stride, HEAD_DIM, BXP, XP, BLOCK_D, GC, SWEEP,
                                       IEEE, WIDEN)
            xw = _pairs(1.0 - fx, fx)
            blend = _pair_sum(sw * xw, BXP, GC)
            et = _pair_sum(st_ * xw, BXP, GC)  # this sweep's terms of the offsets' gradient
            ey = _pair_sum(sy_ * xw, BXP, GC)
            ex = _pair_diff(sw, BXP, GC)
            rec = rec_row[:, None] + j[None, :] * N  # (here, not held through the sweep)
            if SWEEP == 0:  # cs and the dO.v_c terms, for sweep 1
                tl.store(rec, (blend - delta[:, None]) * sm_scale, mask=slot_ok)  # cs: ds = a cs
                tl.store(rec + KS * N, et, mask=slot_ok)
                tl.store(rec + 2 * KS * N, ey, mask=slot_ok)
                tl.store(rec + 3 * KS * N, ex, mask=slot_ok)
            else:
                _sweep1_records(OFF, DOFF, off_row, rec, KS * N, blend, et, ey, ex, ok, slot_ok, lse, qk_scale, j, jt,
                                jy, col, st, sy, sx, T, H, W, KW)


# -----------------------------------------------------------------------------
# Host side


def halo_config(head_dim: int, window, elo: int, ehi: int, fp32: bool = False, cc: int = 90, hw=None) -> dict:
    """Launch configuration: tiles of ``RY`` image rows of ``BX`` queries on ``BXP = 64`` rows
    (``halo_tile`` at the image's ``hw = (H, W)``; one row of the most ``BX`` a row may take
    without it), ``XP`` key columns per row (the key-side pass's run: ``BX + KW - 1 + ELO + EHI``
    must fit), ``KWP`` slots per group,
    the band width ``UP`` (``KW + ELO + EHI`` columns, to a power of two), and each pass's warps.
    ``band3``: whether the rows pass builds its slots' x tents once per group (``BAND3``): within
    128 elements of ``KWP x UP`` per query (3x7x7 at offsets up to 3), 64 on sm_100 at head dim 128
    (at 128 it spilled 16-24 B there), where it compiles without spills; else per row and slot.
    ``rows_maxnreg``: the rows pass's register limit, set on sm_100, where ptxas otherwise holds it
    to 128 registers at narrow bands and spills (4-28 B; at 255 it takes 154-190, no spills).
    ``scores_gy``, ``bwd_gy`` (sweep v, sweep k): window rows per group of the scores pass and the
    backward's sweeps; the second sweep takes one at head dim 128 and on sm_100, where two spilled
    28-40 B (at 4 the scores pass spilled 12-36 B). With ``RY`` over 1 (``s_y`` per query, a
    register more) both sweeps take one but the first at head dim 64 on sm_90 (two spilled 8-24 B)."""
    cfg = pull_config(head_dim, window, elo, ehi, fp32, cc)
    kwp = triton.next_power_of_2(window[2])
    bx, ry = (cfg["BX"], 1) if hw is None else halo_tile(cfg["BX"], cfg["BXP"], *hw)
    gy = max(1, min(window[1], 16 // window[2]))  # window rows whose slots fill 16 columns at most
    wide = head_dim > 64
    small = not wide and cc < 100  # head dim 64 on sm_90
    bwd_gy = (gy if ry == 1 or small else 1, gy if small and ry == 1 else 1)
    return dict(BX=bx, RY=ry, BXP=cfg["BXP"], XP=cfg["QXP"], KWP=kwp, UP=cfg["UP"],
                scores_warps=8, rows_warps=8, bwd_warps=8, rows_maxnreg=255 if cc >= 100 else None,
                band3=kwp * cfg["UP"] <= (64 if cc >= 100 and wide else 128), scores_gy=gy, bwd_gy=bwd_gy)


def halo_tile(most: int, lanes: int, H: int, W: int) -> tuple[int, int]:
    """A tile at an ``H x W`` image: ``(BX, RY)``, ``RY`` rows of ``BX`` queries. A row narrower
    than the configuration's ``BX`` would leave lanes idle (Wan2.2 TI2V-5B's 26-token rows fill 26
    of 64), so the tile takes as many whole rows as its ``BXP`` lanes hold: their window rows
    overlap (a query row further down reaches one key row further), so a group's key rows grow by
    ``RY - 1`` while the queries they serve grow ``RY`` times. The key run is the same for every
    row: the rows share their x range. A row longer than ``most`` (the most queries a row of the
    tile may take: the key run's limit) is cut into equal parts, not ``most`` and a remainder: at
    52 tokens and ``most`` 51 (offsets up to 3 at 3x7x7) two tiles of two 26-query rows, not two
    tiles a row, one of them holding a single query. ``lanes``: ``BXP``."""
    bx = triton.cdiv(W, triton.cdiv(W, most))
    return bx, max(1, min(lanes // bx, H))


def _columns(gy: int, window) -> int:
    """Columns of a group of ``gy`` window rows: their ``gy KW`` slots, to a power of two."""
    return triton.next_power_of_2(gy * window[2])


def _constexprs(head_dim: int, window, cfg: dict, widen: bool) -> dict:
    """The constexprs every halo pass takes (the rows pass adds ``UP`` and ``SOFTMAX``)."""
    return dict(HEAD_DIM=head_dim, KT=window[0], KH=window[1], KW=window[2], BXP=cfg["BXP"], XP=cfg["XP"],
                KWP=cfg["KWP"], BLOCK_D=max(16, triton.next_power_of_2(head_dim)), RY=cfg["RY"], WIDEN=widen)


def _plan(q, win, bound: float, grid_args):
    """What both launchers need: the configuration, the bound's span, the program count along the
    grid's first axis, the launch constexprs and the scalar arguments after the scale(s) but ``BH0``
    (``tail(bh0)``)."""
    N, T, H, W, nh, NK, TK, Q0, K0 = grid_args
    elo, ehi = pull_span(bound)
    cfg = halo_config(q.shape[-1], win, elo, ehi, fp32=q.dtype == torch.float32, cc=compute_capability(q),
                      hw=(H, W))
    tiles = (N // (H * W)) * triton.cdiv(H, cfg["RY"]) * triton.cdiv(W, cfg["BX"])
    meta = dict(_constexprs(q.shape[-1], win, cfg, INTERPRETED), num_stages=1)

    def tail(bh0: int) -> tuple:
        return (N, T, H, W, nh, NK, TK, Q0, K0, bh0, elo, ehi, cfg["BX"])

    return cfg, tiles, meta, tail


def score_chunk(pairs: int, K: int, tokens: int) -> int:
    """(batch, head) pairs per launch so the scores' scratch stays within ``SCORE_BUDGET_BYTES``."""
    return pairs_within(pairs, K * tokens * 4, SCORE_BUDGET_BYTES)


def halo_forward(q, k, v, offsets, win, qk_scale: float, bound: float, grid_args, out, lse) -> None:
    """Launch the halo forward into ``out`` and ``lse`` (the gather forward's launcher allocates
    them). ``grid_args = (N, T, H, W, nh, NK, TK, Q0, K0)``; ``bound``: from ``pull_bound``. The
    scores go through a scratch buffer ``(pairs, K, N)`` fp32, (batch, head) pairs in chunks within
    ``SCORE_BUDGET_BYTES``."""
    N, nh = grid_args[0], grid_args[4]
    pairs = q.shape[0] * nh
    cfg, tiles, meta, tail = _plan(q, win, bound, grid_args)
    ks = win[0] * win[1] * win[2]
    chunk = score_chunk(pairs, ks, N)
    scores = torch.empty((chunk, ks, N), device=q.device, dtype=torch.float32)
    for bh0 in range(0, pairs, chunk):
        grid = (tiles, min(chunk, pairs - bh0))
        _dsa_halo_scores[grid](q, k, offsets, scores, lse, qk_scale, *tail(bh0), **meta, GY=cfg["scores_gy"],
                               GC=_columns(cfg["scores_gy"], win),
                               num_warps=cfg["scores_warps"])
        _dsa_halo_rows[grid](v, offsets, scores, lse, out, qk_scale, *tail(bh0), ks * N, **meta, UP=cfg["UP"],
                             SOFTMAX=True, BAND3=cfg["band3"], num_warps=cfg["rows_warps"],
                             maxnreg=cfg["rows_maxnreg"])


def halo_backward_query(q, k, v, offsets, out, dout, lse, win, qk_scale: float, sm_scale: float, bound: float,
                        grid_args, dq, doff, rec, bh0: int, count: int) -> None:
    """The backward's query side for (batch, head) pairs ``[bh0, bh0 + count)`` on tensor cores:
    the offsets' gradient into ``doff``, the records ``rec`` (``(count, 5, K, N)``: what the
    key-side pass ``dsa_triton_pull`` reads), then ``dq`` from the records' ``ds``."""
    cfg, tiles, meta, tail = _plan(q, win, bound, grid_args)
    ks = win[0] * win[1] * win[2]
    grid = (tiles, count)
    for sweep in (0, 1):
        _dsa_halo_bwd[grid](q, k, v, offsets, out, dout, lse, doff, rec, qk_scale, sm_scale, *tail(bh0), **meta,
                            GY=cfg["bwd_gy"][sweep], GC=_columns(cfg["bwd_gy"][sweep], win), SWEEP=sweep,
                            num_warps=cfg["bwd_warps"])
    _dsa_halo_rows[grid](k, offsets, rec[:, 3], lse, dq, qk_scale, *tail(bh0), 5 * ks * grid_args[0], **meta,
                         UP=cfg["UP"], SOFTMAX=False, BAND3=cfg["band3"], num_warps=cfg["rows_warps"],
                         maxnreg=cfg["rows_maxnreg"])


def aot_variants(shape) -> list[dict]:
    """The halo passes as the launchers compile them at ``shape`` (dtype, head dim, window,
    ``max_offset``), for the compile-only check: the forward's scores and output, the backward's
    query side and ``dq``, one set per target where the launch options differ (``halo_config``'s
    ``rows_maxnreg``). fp32 takes the gather kernels (listed for the record, not picked)."""
    t = AOT_POINTER_TYPES[shape.dtype]
    d = shape.head_dim
    fp32 = shape.dtype == "fp32"
    elo, ehi = pull_span(shape.max_offset if shape.max_offset is not None else 0.0)
    grid = getattr(shape, "grid", None)
    out = []
    for archs, cc in ((("sm_90",), 90), (("sm_100",), 100)):
        cfg = halo_config(d, shape.window, elo, ehi, fp32=fp32, cc=cc, hw=grid[1:] if grid else None)
        consts = _constexprs(d, shape.window, cfg, widen=False)
        rows = {"UP": cfg["UP"]}
        for name, fn, warps, extra in (
                ("halo_scores", _dsa_halo_scores, cfg["scores_warps"],
                 {"GY": cfg["scores_gy"], "GC": _columns(cfg["scores_gy"], shape.window)}),
                ("halo_out", _dsa_halo_rows, cfg["rows_warps"], dict(rows, SOFTMAX=True, BAND3=cfg["band3"])),
                ("halo_bwd_v", _dsa_halo_bwd, cfg["bwd_warps"], {"GY": cfg["bwd_gy"][0], "SWEEP": 0,
                                                                   "GC": _columns(cfg["bwd_gy"][0], shape.window)}),
                ("halo_bwd_k", _dsa_halo_bwd, cfg["bwd_warps"], {"GY": cfg["bwd_gy"][1], "SWEEP": 1,
                                                                   "GC": _columns(cfg["bwd_gy"][1], shape.window)}),
                ("halo_dq", _dsa_halo_rows, cfg["rows_warps"], dict(rows, SOFTMAX=False, BAND3=cfg["band3"]))):
            ptrs = {n: t for n in ("Q", "Kx", "V", "X", "OFF", "OUT", "DOUT", "DOFF") if n in fn.arg_names}
            ptrs.update({n: "*fp32" for n in ("S", "C", "LSE", "REC") if n in fn.arg_names})
            c = dict(consts, **extra)
            refused = "fp32 takes the gather kernels" if fp32 else None
            maxnreg = cfg["rows_maxnreg"] if fn is _dsa_halo_rows else None
            out.append(dict(kernel=name, fn=fn, signature=signature_for(fn, ptrs, ("qk_scale", "sm_scale"), c),
                            constexprs=c, attrs=aligned_pointer_attrs(fn, ptrs), num_warps=warps, num_stages=1,
                            config=f"BX={cfg['BX']},XP={cfg['XP']}" + (f",UP={cfg['UP']}" if "UP" in extra else "")
                            + (f",maxnreg={maxnreg}" if maxnreg else ""),
                            tensor_cores=not fp32, may_pick=refused is None, maxnreg=maxnreg, archs=archs,
                            note=f"{refused} (compiled for the record)" if refused else ""))
    return out
