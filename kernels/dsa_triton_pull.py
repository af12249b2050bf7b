"""The gather kernels' key-side backward for dk and dv: each key tile pulls what the samples that
reach it owe it, so no float atomics and a deterministic result.

Why
  The gather backward (``dsa_triton._dsa_bwd``) owns queries. A sample's key gradient lands on its
  8 trilinear corners, which other programs' samples hit too, so in its atomic mode it adds
  ``16 d`` fp32 values per (query, sample) with global atomics. That is the largest term of its
  cost model (benchmarks/gpu_check/cost.py), and it makes the result differ from run to run.

Two passes (the pull mode of the gather backward)
  1. The query-side pass (``_dsa_bwd`` with ``PULL``) computes ``dq`` and the offsets' gradient as
     before. Instead of the atomics it writes one record per (query, sample) to a scratch buffer
     ``REC (BH, 5, K, N)`` fp32: the clamped sample position ``(p_t, p_y, p_x)`` on the whole grid,
     ``ds`` (the score gradient, softmax scale included) and ``a`` (the probability).
     Then ``dk[n] = sum ds w_n(p) q`` and ``dv[n] = sum a w_n(p) do`` over the samples whose
     corners include key ``n``; ``w_n(p)`` is the trilinear weight of ``p`` on ``n``.
  2. The key-side pass (``_dsa_pull_dkv``, this module). One program owns a row segment of ``BX``
     keys (one frame, one row, one (batch, head)). Which samples can reach them is bounded by
     the offsets' bound ``M`` (``|offset| <= M``). The sample of window slot ``j`` of query ``q``
     has base ``b = s(q) + j``. Here ``s`` is the window start, shifted inward at borders. Its
     position lies in ``[b - M, b + M]``, so it reaches key ``n`` only if
     ``b - n in [-(floor(M) + 1), ceil(M)]`` on every axis. The program walks the candidate query
     rows ``(qt, qy)`` (scalar loops whose slot ranges follow from that bound). On each row the
     candidate queries are a run of ``QXP`` consecutive ``x``. For each slot ``j`` allowed on
     both scalar axes, the program loads the records of those queries (coalesced). It weights
     them by the ``t`` and ``y`` tents at the tile's frame and row, and spreads them with the ``x``
     tent over a band of ``UP`` columns per query, relative to its window start (``u = n - s_x +
     EHI``: every slot's two x corners land in ``[0, KW + ELO + EHI)``). bf16 takes ``JC`` slots
     at once (``_band_add_slots``: their records as ``(JC, QXP)`` tiles, the tents summed over a
     leading slot axis of a ``(JC, QXP, UP)`` tensor, within 4096 elements so the pass does not
     spill): about 95 instructions a slot and thread at 3x7x7, d 128, where one slot at a time with
     its own loads, tents and loop took 480 (sm_90 PTX). After the row's slots,
     one ``tl.gather`` places each query's band on the tile's keys: a ``(BXP, QXP)`` matrix ``G``
     (``BXP = 64`` rows, of which ``BX`` are the tile's keys: the ``wgmma`` M). The band has a
     quarter of the lanes of ``G`` at 3x7x7 (16 columns, not 64), and the tents are built there.
     fp32 builds ``G`` itself (the gather spilled there). Then ``dk_tile += G @ Q_row``
     (the dk launch, ``ds`` weights) or ``dv_tile += G @ dO_row`` (the dv launch, ``a``
     weights), with ``tl.dot`` on tensor cores at bf16/fp16. Two launches keep one ``G`` live,
     not two. ``G`` is split into a high and a low half (two dots) so the result keeps the fp32
     path's precision; fp32 inputs use ``ieee`` dots. Every key belongs to one program, so the
     stores are plain and the summation order is fixed. A window wider than the candidate run
     allows (``MAX_REACH``) takes the atomic mode.

When it runs
  When the offsets' bound ``M`` is known and small: the caller's ``max_offset`` (the model's
  bounded offset head passes it; a constant of the config, never measured per call), up to
  ``PULL_MAX_OFFSET`` (the candidate set grows as ``(2M + 2)^3``). With a given bound, the query-side pass checks each sample against it: a query
  whose sample lies beyond it gets a NaN ``dq`` row. The key-side pass would miss that sample's
  corners, so the result is refused rather than wrong. Slab calls take the pull only when the
  held frames contain every corner the bound allows. Otherwise (no bound, or past the cap) the
  split mode runs it at its cap for the queries within (``dsa_triton_split``), and the first
  such call per reason is logged.

Verification status (Caution)
  Verified under the Triton CPU interpreter against ``dsa_reference`` (tests/test_dsa_pull.py)
  and compiled for sm_90 (``python -m benchmarks.gpu_check --compile-only``); not yet run on a GPU.
"""

from __future__ import annotations

import logging
import math
import re

import torch
import triton
import triton.language as tl

from .aot import AOT_POINTER_TYPES, aligned_pointer_attrs, signature_for
from .dsa_reference import window_starts

__all__ = ["pull_bound", "bound_refusal", "pull_launch", "PULL_MAX_OFFSET", "REC_BUDGET_BYTES", "pull_config", "aot_variants"]

log = logging.getLogger(__name__)

MAX_REACH = 96  # candidate queries beyond a tile's keys along x (KW - 1 + ELO + EHI): QXP stays <= 128
PULL_MAX_OFFSET = 3.0  # beyond it the candidate set ((2M+2)^3 per key) costs more than the atomics
REC_BUDGET_BYTES = 1 << 30  # scratch records per launch; (batch, head) pairs are done in chunks within it
REC_FIELDS = 5  # p_t, p_y, p_x, ds, a
_LOGGED: set[str] = set()

# The @triton.jit decorator reads TRITON_INTERPRET when a module is imported; this records which
# kind of kernel the Triton modules got (dsa_triton imports it from here).
try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs; it read the variable directly
    import os

    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _reach(n_lo, n_hi, ELO, EHI, SIZE, KWIN: tl.constexpr):
    """Queries along one axis whose window slots (bases ``s(q) + j``) lie in
    ``[n_lo - ELO, n_hi + EHI]`` for some slot: the ``[q_lo, q_hi]`` run (``s`` is monotone)."""
    s_min = n_lo - ELO - (KWIN - 1)
    s_max = n_hi + EHI
    q_lo = tl.where(s_min <= 0, 0, s_min + KWIN // 2)
    q_hi = tl.where(s_max >= SIZE - KWIN, SIZE - 1, s_max + KWIN // 2)
    return q_lo, q_hi


@triton.jit
def _past_bound(i0, w, base, ELO, EHI):
    """For the query-side pass: a sample whose corners ``i0``, ``i0 + 1`` (weight ``w`` on the
    upper) leave ``[base - EHI, base + ELO]``, where ``_reach`` looks for it (NaN positions too)."""
    upper = tl.where(w > 0.0, i0 + 1, i0)
    return (i0 < base - EHI) | (upper > base + ELO) | (w != w)


@triton.jit
def _tent(p, n, SIZE):
    """Trilinear weight of the clamped position ``p`` on grid index ``n`` along one axis (the
    corners of ``dsa_triton._axis_position``: ``i0 = floor p``, ``i1 = min(i0 + 1, SIZE - 1)``)."""
    i0 = p.to(tl.int32)  # p >= 0: truncation is floor
    f = p - i0.to(tl.float32)
    i1 = tl.minimum(i0 + 1, SIZE - 1)
    return tl.where(i0 == n, 1.0 - f, 0.0) + tl.where(i1 == n, f, 0.0)


@triton.jit
def _x_tents(u0, u1, f, c, u):
    """Weight ``c`` split by the x tent over the positions ``u``: ``(1 - f) c`` where ``u == u0``,
    ``f c`` where ``u == u1``, 0 elsewhere; the arguments broadcast. Every weight band and matrix of
    the key-side pass and the halo kernels (``dsa_triton_halo``) is built from it."""
    return tl.where(u0 == u, (1.0 - f) * c, 0.0) + tl.where(u1 == u, f * c, 0.0)


@triton.jit
def _band_add(band, u, u0, u1, f, c):
    """``band (R, UP)`` plus each row's sample: weight ``c`` split by the x tent over its band
    columns ``u0`` (``1 - f``) and ``u1`` (``f``); ``u = arange(UP)``."""
    return band + _x_tents(u0[:, None], u1[:, None], f[:, None], c[:, None], u[None, :])


@triton.jit
def _band_add_slots(band, rec_base, rec0, tok, lane_ok, slot_ok, N, FIELD, kt, ky, T, H, ucol,
                    COEF: tl.constexpr, JC: tl.constexpr):
    """``band (QXP, UP)`` plus the samples of ``JC`` consecutive window slots (records from
    ``rec_base + rec0``, slot ``j`` at ``+ j N``) that reach key row ``(kt, ky)``: each weighted by
    its ``t``, ``y`` tents and its coefficient (record field ``COEF``), split by its x tent over
    its band columns, whose key columns are ``ucol`` (``(QXP, UP)`` fp32: ``u + s_x - EHI``). The
    slots go on a leading axis of a ``(JC, QXP, UP)`` tensor summed over it: one pass of the lanes
    for ``JC`` slots rather than one per slot with its own loads and tents (the key-side pass issued
    about 480 instructions a slot and thread that way). The x tent is the interpolation's own,
    ``max(1 - |x - p_x|, 0)`` (four operations an element; the two-corner form, ``_x_tents``, took
    seven), and every chunk is added: with trained offsets almost every chunk reaches the row, and
    testing it cost a block-wide reduction (about 35 instructions and 2 barriers)."""
    j = tl.arange(0, JC)
    m = slot_ok[:, None] & lane_ok[None, :]  # (JC, QXP)
    rec = rec_base + rec0 + j[:, None] * N + tok[None, :]
    w_ty = _tent(tl.load(rec, mask=m, other=0.0), kt, T) * _tent(tl.load(rec + FIELD, mask=m, other=0.0), ky, H)
    c = tl.where(m, w_ty * tl.load(rec + COEF * FIELD, mask=m, other=0.0), 0.0)
    px = tl.load(rec + 2 * FIELD, mask=m, other=0.0)
    tent = tl.maximum(1.0 - tl.abs(ucol[None, :, :] - px[:, :, None]), 0.0)
    return band + tl.sum(tent * c[:, :, None], axis=0)


@triton.jit
def _band_place(band, rel, UP: tl.constexpr):
    """The dense matrix ``band[r, rel[r, col]]`` (0 where ``rel`` leaves ``[0, UP)``): each row's
    band placed on the columns ``rel`` gives its band coordinates, by ``tl.gather``."""
    picked = tl.gather(band, tl.minimum(tl.maximum(rel, 0), UP - 1), axis=1)
    return tl.where((rel >= 0) & (rel < UP), picked, 0.0)


@triton.jit
def _pairs(a, b):
    """``(R, C)`` tensors ``a``, ``b`` interleaved into ``(R, 2 C)``: ``a[:, j]`` at ``2 j``,
    ``b[:, j]`` at ``2 j + 1``."""
    return tl.reshape(tl.join(a, b), [a.shape[0], 2 * a.shape[1]])


@triton.jit
def _band_place4(band, rel0, UP: tl.constexpr, XP: tl.constexpr):
    """``_band_place(band, arange(XP)[None, :] + rel0, UP)`` as four gathers of every fourth column,
    interleaved back: a gather whose index is as wide as its source's placement costs about one
    shuffle an element; four times as wide, about four (65 shuffles and 70 selections a row)."""
    i4 = 4 * tl.arange(0, XP // 4)[None, :] + rel0
    p = _pairs(_band_place(band, i4, UP), _band_place(band, i4 + 2, UP))
    q = _pairs(_band_place(band, i4 + 1, UP), _band_place(band, i4 + 3, UP))
    return _pairs(p, q)


@triton.jit
def _split_dot(acc, g, rows, IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """``acc + g @ rows`` with ``g`` fp32: an ``ieee`` dot for fp32 rows, else ``g`` split into a
    high and a low half in the rows' dtype (two tensor-core dots, fp32 accumulation).
    ``WIDEN`` (the interpreter): the halves are widened back first, since triton 3.9's interpreter
    multiplies the raw bits of bf16 tiles; the products are the same."""
    if IEEE:
        acc = tl.dot(g, rows, acc, input_precision="ieee")
    else:
        hi = g.to(rows.dtype)
        lo = (g - hi.to(tl.float32)).to(rows.dtype)
        if WIDEN:
            wide = rows.to(tl.float32)
            acc = tl.dot(hi.to(tl.float32), wide, acc, input_precision="ieee")
            acc = tl.dot(lo.to(tl.float32), wide, acc, input_precision="ieee")
        else:
            acc = tl.dot(hi, rows, acc)
            acc = tl.dot(lo, rows, acc)
    return acc


@triton.jit
def _key_tile(pid, H, W, K0, BX, HEAD_DIM: tl.constexpr, BXP: tl.constexpr, BLOCK_D: tl.constexpr):
    """The program's key tile: ``BX`` keys of one held frame ``kt_l`` (``kt`` on the whole grid) and
    row ``ky`` from column ``x0``, on ``BXP`` rows ``nx``, with the keys' and columns' masks."""
    tiles_x = tl.cdiv(W, BX)
    kt_l = pid // (H * tiles_x)
    ky = (pid // tiles_x) % H
    x0 = (pid % tiles_x) * BX
    kt = K0 + kt_l  # frame on the whole grid
    nx = x0 + tl.arange(0, BXP)
    key_ok = (tl.arange(0, BXP) < BX) & (nx < W)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    return kt_l, ky, x0, kt, nx, key_ok, cols, col_ok


@triton.jit
def _candidates(kt, ky, x0, BX, T, H, W, Q0, TQ, ELO, EHI, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                QXP: tl.constexpr, UP: tl.constexpr):
    """The queries whose samples may reach the key tile: a box of rows ``[qt_lo, qt_hi] x [qy_lo,
    qy_hi]``, each a run of ``QXP`` consecutive x (``qx``, valid where ``lane_ok``) with their window
    starts ``sx``; ``u = arange(UP)`` and the band's key columns ``ucol`` (``(QXP, UP)`` fp32)."""
    qt_lo, qt_hi = _reach(kt, kt, ELO, EHI, T, KT)
    qt_lo = tl.maximum(qt_lo, Q0)
    qt_hi = tl.minimum(qt_hi, Q0 + TQ - 1)
    qy_lo, qy_hi = _reach(ky, ky, ELO, EHI, H, KH)
    qy_hi = tl.minimum(qy_hi, H - 1)
    qx_lo, qx_hi = _reach(x0, tl.minimum(x0 + BX - 1, W - 1), ELO, EHI, W, KW)
    qx_hi = tl.minimum(qx_hi, W - 1)
    qx = qx_lo + tl.arange(0, QXP)
    lane_ok = qx <= qx_hi
    sx = tl.minimum(tl.maximum(qx - KW // 2, 0), W - KW)  # the candidate queries' window starts
    u = tl.arange(0, UP)
    ucol = (u[None, :] + (sx - EHI)[:, None]).to(tl.float32)  # (QXP, UP): the band's key columns
    return qt_lo, qt_hi, qy_lo, qy_hi, qx, lane_ok, sx, u, ucol


@triton.jit
def _row_weights(rec_base, tok, lane_ok, sx, kt, ky, x0, nx, u, ucol, jt_lo, jt_hi, jy_lo, jy_hi, N, FIELD, T, H, W,
                 EHI, KH: tl.constexpr, KW: tl.constexpr, BXP: tl.constexpr, QXP: tl.constexpr, UP: tl.constexpr,
                 JC: tl.constexpr, COEF: tl.constexpr, IEEE: tl.constexpr):
    """The weights of one row's candidate queries (tokens ``tok``) on the tile's keys, ``G^T``
    ``(BXP, QXP)``: every window slot ``(jt, jy, jx)`` of the given ranges whose records reach key
    row ``(kt, ky)``, weighted by its ``t``, ``y`` tents and its coefficient (record field ``COEF``)
    and split by its x tent."""
    if IEEE:  # fp32: the weight matrix itself (the band's gather spilled at fp32)
        g = tl.zeros([BXP, QXP], dtype=tl.float32)
    else:  # per query: its slots' x tents on a band relative to its window, u = x - s_x + EHI
        band = tl.zeros([QXP, UP], dtype=tl.float32)
    for jt in tl.range(jt_lo, jt_hi + 1, loop_unroll_factor=1):
        for jy in tl.range(jy_lo, jy_hi + 1, loop_unroll_factor=1):
            if JC > 1:  # bf16: JC slots at once, (JC, QXP) records, their tents summed onto the band
                for jx0 in tl.range(0, KW, JC, loop_unroll_factor=1):
                    band = _band_add_slots(band, rec_base, ((jt * KH + jy) * KW + jx0) * N, tok, lane_ok,
                                           (jx0 + tl.arange(0, JC)) < KW, N, FIELD, kt, ky, T, H, ucol,
                                           COEF, JC)
            else:  # one slot at a time
                for jx in tl.range(0, KW, loop_unroll_factor=1):
                    rec = rec_base + ((jt * KH + jy) * KW + jx) * N + tok
                    w_ty = (_tent(tl.load(rec, mask=lane_ok, other=0.0), kt, T)
                            * _tent(tl.load(rec + FIELD, mask=lane_ok, other=0.0), ky, H))
                    w_ty = tl.where(lane_ok, w_ty, 0.0)
                    if tl.max(w_ty, axis=0) > 0.0:  # else no sample of this slot reaches the tile's row
                        px = tl.load(rec + 2 * FIELD, mask=lane_ok, other=0.0)
                        c = w_ty * tl.load(rec + COEF * FIELD, mask=lane_ok, other=0.0)
                        i0 = px.to(tl.int32)  # the x tent
                        f = px - i0.to(tl.float32)
                        i1 = tl.minimum(i0 + 1, W - 1)
                        if IEEE:  # spread over the tile's keys: (BXP, QXP)
                            g += _x_tents(i0[None, :], i1[None, :], f[None, :], c[None, :], nx[:, None])
                        else:  # on the band: (QXP, UP), a quarter of the lanes
                            band = _band_add(band, u, i0 - sx + EHI, i1 - sx + EHI, f, c)
    if not IEEE:  # the band placed on the tile's keys: G^T[q, n] = band[q, n - s_x(q) + EHI]
        g = tl.trans(_band_place4(band, (x0 + EHI - sx)[:, None], UP, BXP))  # (BXP, QXP)
    return g


@triton.jit
def _store_keys(DX, ACC, acc, kv_base, rec_bh, NK, kt_l, ky, H, W, nx, key_ok, cols, col_ok, row_stride,
                HEAD_DIM: tl.constexpr, ACCUM: tl.constexpr):
    """The tile's sums into its keys' rows of ``DX``, in its dtype (``ACCUM``: ``ACC``'s rows added first)."""
    key_tok = (kt_l * H + ky) * W + nx
    out_mask = key_ok[:, None] & col_ok[None, :]
    out_off = kv_base + key_tok.to(tl.int64)[:, None] * row_stride + cols[None, :]
    if ACCUM:
        acc += tl.load(ACC + (rec_bh.to(tl.int64) * NK + key_tok)[:, None] * HEAD_DIM + cols[None, :], mask=out_mask,
                       other=0.0)
    tl.store(DX + out_off, acc.to(DX.dtype.element_ty), mask=out_mask)


@triton.jit
def _dsa_pull_dkv(
    X, REC, DX,  # X: q (for dk) or dout (for dv); DX: dk or dv
    ACC,  # ACCUM: fp32 (pairs, NK, d), what the split mode's atomics summed for its flagged queries
    N, T, H, W, NH,
    NK, TK, Q0, K0, BH0,
    ELO, EHI,  # a sample reaches key n only if its base b has b - n in [-ELO, EHI] on every axis
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BX, BXP: tl.constexpr, QXP: tl.constexpr, BLOCK_D: tl.constexpr,  # BX keys per tile on BXP rows
    UP: tl.constexpr,  # band width: KW + ELO + EHI columns, to a power of two
    JC: tl.constexpr,  # window slots along x taken at once onto the band (1: one at a time; fp32)
    COEF: tl.constexpr,  # the record field that weighs X's rows: 3 (ds: dk) or 4 (a: dv)
    WIDEN: tl.constexpr = False,  # under the interpreter: half dots widened (``_split_dot``)
    ACCUM: tl.constexpr = False,  # add ACC's rows before the one rounding to DX's dtype
):
    pid = tl.program_id(0)
    rec_bh = tl.program_id(1)
    pid_bh = BH0 + rec_bh
    b = pid_bh // NH
    h = pid_bh % NH
    KS: tl.constexpr = KT * KH * KW
    IEEE: tl.constexpr = X.dtype.element_ty == tl.float32
    TQ = N // (H * W)  # query frames [Q0, Q0 + TQ) of the whole grid's T
    row_stride = NH * HEAD_DIM
    head_base = b.to(tl.int64) * N * row_stride + h * HEAD_DIM  # X rows
    kv_base = b.to(tl.int64) * NK * row_stride + h * HEAD_DIM  # DX rows

    kt_l, ky, x0, kt, nx, key_ok, cols, col_ok = _key_tile(pid, H, W, K0, BX, HEAD_DIM, BXP, BLOCK_D)
    qt_lo, qt_hi, qy_lo, qy_hi, qx, lane_ok, sx, u, ucol = _candidates(kt, ky, x0, BX, T, H, W, Q0, TQ, ELO, EHI,
                                                                       KT, KH, KW, QXP, UP)
    row_mask = lane_ok[:, None] & col_ok[None, :]

    rec_base = REC + rec_bh.to(tl.int64) * (5 * KS * N)
    FIELD = KS * N  # elements between a record's fields
    acc = tl.zeros([BXP, BLOCK_D], dtype=tl.float32)
    for qt in tl.range(qt_lo, qt_hi + 1, loop_unroll_factor=1):
        st = tl.minimum(tl.maximum(qt - KT // 2, 0), T - KT)
        jt_lo = tl.maximum(kt - ELO - st, 0)
        jt_hi = tl.minimum(kt + EHI - st, KT - 1)
        for qy in tl.range(qy_lo, qy_hi + 1, loop_unroll_factor=1):
            sy = tl.minimum(tl.maximum(qy - KH // 2, 0), H - KH)
            jy_lo = tl.maximum(ky - ELO - sy, 0)
            jy_hi = tl.minimum(ky + EHI - sy, KH - 1)
            tok = ((qt - Q0) * H + qy) * W + qx  # the row's candidate queries
            g = _row_weights(rec_base, tok, lane_ok, sx, kt, ky, x0, nx, u, ucol, jt_lo, jt_hi, jy_lo, jy_hi, N,
                             FIELD, T, H, W, EHI, KH, KW, BXP, QXP, UP, JC, COEF, IEEE)
            rows = tl.load(X + head_base + tok.to(tl.int64)[:, None] * row_stride + cols[None, :],
                           mask=row_mask, other=0.0)
            acc = _split_dot(acc, g, rows, IEEE, WIDEN)
    _store_keys(DX, ACC, acc, kv_base, rec_bh, NK, kt_l, ky, H, W, nx, key_ok, cols, col_ok, row_stride, HEAD_DIM,
                ACCUM)


# -----------------------------------------------------------------------------
# Host side


def pull_config(head_dim: int, window, elo: int, ehi: int, fp32: bool = False, cc: int = 90) -> dict:
    """The key-side pass's launch configuration: tiles of ``BX`` keys on ``BXP = 64`` rows (the
    ``wgmma`` M), and ``QXP`` candidate queries per row, which must cover
    ``BX + KW - 1 + ELO + EHI``: 64 when that leaves at least 32 keys per tile (54 at 3x7x7 with
    ``max_offset`` 1.5), else 128; the band of ``UP`` columns per query. ``cc``: the target's compute
    capability (90 Hopper, 100 Blackwell). bf16 on sm_90: 4 warps (246 registers at d 128: 2 blocks
    per SM). bf16 on sm_100 and fp32 take 8 (at 4 they spilled: 20-56 bytes per thread on sm_100,
    200 bytes in fp32's ``ieee`` dots). ``maxnreg``: sm_100 launches with a register limit of 255
    (ptxas otherwise held fp32 to 128 registers and bf16 at d 128 to 80, and they spilled 16 and
    64 B; with it they take 135 and 178-199)."""
    reach = window[2] - 1 + elo + ehi
    if reach > MAX_REACH:
        raise ValueError(f"window width {window[2]} with a reach of ({elo}, {ehi}) tokens needs {reach} candidate "
                         f"queries beyond a tile's keys; the key-side pass takes at most {MAX_REACH}")
    qxp = 64 if 64 - reach >= 32 else 128
    up = triton.next_power_of_2(window[2] + elo + ehi)
    jc = 1 if fp32 else min(triton.next_power_of_2(window[2]), max(1, 4096 // (qxp * up)))
    return dict(BX=min(64, qxp - reach), BXP=64, QXP=qxp, UP=up, JC=jc,
                num_warps=8 if fp32 or cc >= 100 else 4, maxnreg=255 if cc >= 100 else None)


def pull_span(bound: float) -> tuple[int, int]:
    """``(ELO, EHI)``: a sample with ``|offset| <= bound`` reaches key ``n`` only from a base ``b``
    with ``b - n`` in ``[-ELO, EHI]`` (its corners are ``floor(p)`` and ``floor(p) + 1`` with
    ``p`` in ``[b - bound, b + bound]``)."""
    return math.floor(bound) + 1, math.ceil(bound)


def bound_refusal(bound: float, src: str = "max_offset", window_w: int | None = None) -> str | None:
    """Why offsets up to ``bound`` (from ``src``) cannot take the pull mode whatever the slab, or
    None: non-finite, past ``PULL_MAX_OFFSET``, or a window too wide for the candidate run."""
    if not math.isfinite(bound):
        return f"non-finite offsets ({src} {bound})"
    if bound > PULL_MAX_OFFSET:
        return f"offsets up to {bound:.3g} ({src}) exceed the key-side pass's {PULL_MAX_OFFSET}"
    if window_w is not None and window_w - 1 + sum(pull_span(bound)) > MAX_REACH:
        return f"window width {window_w} is too wide for the key-side pass's candidate run"
    return None


def pull_bound(offsets: torch.Tensor, max_offset: float | None, slab=None, window_t: int = 1,
               window_w: int | None = None) -> tuple[float | None, str]:
    """The offsets' bound for the pull mode, or ``(None, why)`` when it cannot run: ``max_offset``
    (the caller's guarantee, a constant of the config) when given; without it the offsets are
    unbounded (nothing is measured: that would be a host sync per call)."""
    if max_offset is None:
        return None, "no max_offset (unbounded offsets)"
    bound, src = float(max_offset), "max_offset"
    why = bound_refusal(bound, src, window_w)
    if why:
        return None, why
    if slab is not None:
        tk, frames, q0, k0 = slab
        tq = offsets.shape[1]
        elo, ehi = pull_span(bound)

        starts = window_starts(frames, window_t)
        lo = max(0, int(starts[q0]) - ehi)
        hi = min(frames - 1, int(starts[q0 + tq - 1]) + window_t - 1 + elo)
        if lo < k0 or hi > k0 + tk - 1:
            return None, (f"the slab's k, v hold frames [{k0}, {k0 + tk}) but offsets up to {bound:.3g} "
                          f"reach [{lo}, {hi}]")
    return bound, src


_MODES = {"pull": "the key-side pass", "atomic": "fp32 atomics",
          "split": "the key-side pass, and fp32 atomics for the queries whose offsets reach past its bound"}


def log_mode_once(mode: str, why: str, key: str | None = None) -> None:
    """Log how the backward sums dk, dv (``mode``: "pull", "atomic" or "split"), once per ``key``
    (default: ``why`` without its numbers, so a measured extent does not log every call)."""
    key = f"{mode}: " + (re.sub(r"\d+(\.\d+)?", "#", why) if key is None else key)
    if key not in _LOGGED:
        _LOGGED.add(key)
        level = logging.INFO if mode in ("pull", "split") else logging.WARNING
        log.log(level, "3D-DSA gather backward: dk, dv by %s (%s)", _MODES[mode], why)


def log_halo_once(pass_: str, halo: bool, why: str) -> None:
    """Log, once per reason, which kernels take ``pass_`` (the forward or the backward's query side)."""
    key = f"{pass_}: {why}"
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("3D-DSA %s: %s (%s)", pass_, "the halo kernels on tensor cores" if halo
                 else "the gather kernels on CUDA cores", why)


def pairs_within(pairs: int, per_pair_bytes: int, budget_bytes: int) -> int:
    """(batch, head) pairs per launch so a launch's scratch of ``per_pair_bytes`` a pair stays
    within ``budget_bytes`` (at least one pair)."""
    return max(1, min(pairs, budget_bytes // per_pair_bytes))


def rec_chunk(bh: int, window, tokens: int) -> int:
    """(batch, head) pairs per launch so the scratch records stay within ``REC_BUDGET_BYTES``."""
    return pairs_within(bh, REC_FIELDS * math.prod(window) * tokens * 4, REC_BUDGET_BYTES)


def compute_capability(x: torch.Tensor) -> int:
    """The compute capability of ``x``'s GPU as one number (90 for 9.0); 90 off the GPU (the
    interpreter), where the launch options do not matter."""
    if not x.is_cuda:
        return 90
    major, minor = torch.cuda.get_device_capability(x.device)
    return 10 * major + minor


def pull_launch(q, dout, rec, dk, dv, win, bound, grid_args, bh0: int, bh_count: int, acc=None):
    """The key-side pass for (batch, head) pairs ``[bh0, bh0 + bh_count)`` (``rec`` holds theirs).
    ``acc``: the split mode's fp32 ``(2, pairs, NK, d)`` sums of its flagged queries, added to the
    pass's (``dsa_triton_split``)."""
    N, T, H, W, nh, NK, TK, Q0, K0 = grid_args
    elo, ehi = pull_span(bound)
    cfg = pull_config(q.shape[-1], win, elo, ehi, fp32=q.dtype == torch.float32, cc=compute_capability(q))
    d = q.shape[-1]
    grid = (TK * H * triton.cdiv(W, cfg["BX"]), bh_count)
    for x, dx, coef in ((q, dk, 3), (dout, dv, 4)):  # two launches: one (BX, QXP) weight tile live, not two
        _dsa_pull_dkv[grid](x, rec, dx, rec if acc is None else acc[coef - 3], N, T, H, W, nh, NK, TK, Q0, K0, bh0, elo, ehi,
                            BX=cfg["BX"], HEAD_DIM=d, KT=win[0], KH=win[1], KW=win[2], BXP=cfg["BXP"], QXP=cfg["QXP"], UP=cfg["UP"],
                            JC=cfg["JC"],
                            BLOCK_D=max(16, triton.next_power_of_2(d)), COEF=coef, WIDEN=INTERPRETED, ACCUM=acc is not None,
                            num_warps=cfg["num_warps"],
                            num_stages=1, maxnreg=cfg["maxnreg"])


def aot_variants(shape, accum: bool = False) -> list[dict]:
    """The key-side pass as the launcher compiles it at ``shape`` (dtype, head dim, window,
    ``max_offset``), for the compile-only check. ``accum``: as the split mode launches it (adding
    its atomics' sums: ``ACCUM``; kernels ``pull_dk+acc``, ``pull_dv+acc``)."""
    t = AOT_POINTER_TYPES[shape.dtype]
    d = shape.head_dim
    elo, ehi = pull_span(shape.max_offset if shape.max_offset is not None else 0.0)
    fp32 = shape.dtype == "fp32"
    fn = _dsa_pull_dkv
    ptrs = {"X": t, "DX": t, "REC": "*fp32", "ACC": "*fp32"}
    out = []
    # the launch options depend on the target (pull_config's warps and register limit): one variant
    # per target, compiled for it
    for archs, cc in ((("sm_90",), 90), (("sm_100",), 100)):
        cfg = pull_config(d, shape.window, elo, ehi, fp32=fp32, cc=cc)
        for coef, name in ((3, "pull_dk"), (4, "pull_dv")):
            consts = dict(HEAD_DIM=d, KT=shape.window[0], KH=shape.window[1], KW=shape.window[2], BXP=cfg["BXP"],
                          QXP=cfg["QXP"], UP=cfg["UP"], JC=cfg["JC"], BLOCK_D=max(16, triton.next_power_of_2(d)), COEF=coef,
                          WIDEN=False, ACCUM=accum)
            out.append(dict(kernel=name + ("+acc" if accum else ""), fn=fn, signature=signature_for(fn, ptrs, (), consts), constexprs=consts,
                            attrs=aligned_pointer_attrs(fn, ptrs), num_warps=cfg["num_warps"], num_stages=1,
                            config=f"BX={cfg['BX']},QXP={cfg['QXP']}" + ("" if fp32 else f",UP={cfg['UP']}")
                            + (f",maxnreg={cfg['maxnreg']}" if cfg["maxnreg"] else ""),
                            tensor_cores=not fp32, archs=archs, maxnreg=cfg["maxnreg"]))  # fp32: ieee dots, CUDA cores
    return out
