"""Tiled Triton kernels for 3D-DSA: 3D query tiles, a staged key/value halo, ``tl.dot``.

Same operator and signature as ``dsa_triton`` (semantics: docs/architecture.md, "3D-DSA:
the operator"; ground truth: ``dsa_reference``). The gather kernel in ``dsa_triton.py``
stays as the fallback and the baseline.

Why a second kernel
  The gather kernel runs a 1-D strip of queries per program, gathers 8 corner rows of k
  and v per sample from memory, blends them with elementwise FMAs and scatters dk/dv with
  one fp32 atomic per (query, sample, corner, channel). This kernel instead works on a
  3D box of queries and everything its samples can touch.

Geometry
  * A program owns one **query tile**: a ``BT x BY x BX`` box of tokens (``M`` queries,
    a power of two >= 16) of one (batch, head).
  * The window starts ``s`` are non-decreasing in the query coordinate, so along an axis
    the tile's window bases span at most ``B + k - 1`` positions. With every offset in
    ``[-R, R]`` (``R = ceil(max |offset|)``) and the trilinear upper corner ``+1``, every
    corner of every sample lies in the **halo**: per axis
    ``E = min(size, B + k + 2R)`` positions starting at ``clamp(s_first - R, 0, size - E)``.
    ``R`` is ``ceil`` of the caller's ``max_offset`` when given (``attention.max_offset`` bounds
    the offset head's output, by ``tanh`` or ``clamp``), else of the measured ``max |offsets|``
    (one reduction and a host sync per call). A given bound is checked, not trusted: the forward
    compares each offset it loads with ``R``, and a query with one beyond it (or a non-finite
    one) is refused in-band -- NaN output and log-sum-exp, hence NaN gradients -- rather than
    computed from a halo that may miss its corners.
  * The halo is staged once per program as a ``(HTY_P * HX_P, d)`` tile of k (and v):
    column ``n = (ht * HY + hy) * HX_P + hx`` (the (t, y) plane pairs flattened and padded to
    ``HTY_P``, x padded to ``HX_P``; padding rows are zero).

Trilinear weights are separable
  A sample at position ``p`` puts weight ``w_t(ht) * w_y(hy) * w_x(hx)`` on halo token
  ``(ht, hy, hx)``, where ``w_a(h) = (1 - f) [h == i0] + f [h == i1]`` (``i0 = floor(p)``,
  ``i1 = min(i0 + 1, size - 1)``, ``f = p - i0``: exactly the reference's corners, kinks
  and clamped upper border included). For a chunk of ``BJ`` samples the kernel builds two
  small factors, ``G_ty (M, BJ, HTY_P) = w_t * w_y`` and ``G_x (M, BJ, HX_P) = w_x``, and
  never materialises per-sample k or v rows:

  * scores: ``S = Q @ K_halo^T`` once (``tl.dot``, ``(M, HTY_P*HX_P)``, viewed as
    ``(M, HTY_P, HX_P)``); sample scores are the blend of corner scores,
    ``s[m, j] = sum_x (G_ty @ S)[m, j, x] * G_x[m, j, x]`` (a batched ``tl.dot``), since
    ``<q, sum_c w_c k_c> = sum_c w_c <q, k_c>``;
  * output: the probabilities scattered onto halo columns,
    ``P[m] = sum_j a_j G_ty[m, j]^T G_x[m, j]`` = ``G_ty^T @ (a * G_x)`` (batched ``tl.dot``),
    accumulated over sample chunks with an online softmax (base 2, rescaled by
    ``exp2(m_old - m_new)``), then ``out = P @ V_halo`` (``tl.dot``). Saves the base-2
    log-sum-exp ``(B, nh, N)`` like the gather kernel.

Backward (one program per query tile again)
  ``S = Q K_halo^T`` and ``dP = dO V_halo^T`` (``tl.dot``); per sample chunk
  ``a = exp2(scale*log2e * s - lse)``, ``dA = blend(dP)``, ``ds = a (dA - delta) scale``
  (``delta = do . o``); ``P`` and ``dS`` are scattered onto halo columns as in forward;
  offsets' gradient from the weight derivatives ``dw_a(h) = -[h == i0] + [h == i1]``:
  ``dL/dp_t = ds * blend_t'(S) + a * blend_t'(dP)`` (likewise y, x; zero where the position
  was clamped, as torch's clamp). Then ``dQ = dS @ K_halo``, ``dK_halo = dS^T @ Q``,
  ``dV_halo = P^T @ dO`` (``tl.dot``). Halos of neighbouring tiles overlap, so the halo
  partials are added with one fp32 ``atomic_add`` (``sem="relaxed"``) per halo element per
  tile -- about ``halo / (8 K M)`` of the gather kernel's per-corner atomics -- into fp32
  buffers cast at the end. Backward is therefore not bit-deterministic.

Precision
  fp32 inputs: every ``tl.dot`` with ``input_precision="ieee"``. fp16/bf16 inputs: ``Q K^T``
  and ``dO V^T`` take their (exact) operands in the input dtype with fp32 accumulation; in
  ``P V``, ``dS K``, ``dS^T Q``, ``P^T dO`` the computed fp32 tile is split into two half tiles
  (hi + lo) and both are multiplied -- casting P and dS once, as flash attention does, failed
  the project's bf16 tolerance rule on dk, dq and the offsets' gradient (measured under the
  interpreter). The weight contractions stay fp32 (``tf32x3`` on the GPU).

When it applies (else: the gather kernel, logged)
  The planner (``plan_tiles``) picks the tile shape that minimises padded halo columns per
  query with ``M * HTY_P * HX_P <= MAX_TILE_ELEMS`` (the per-program score/probability
  tiles live in registers). Large ``R`` on a large grid makes every halo too big: that call
  runs ``dsa_triton`` and a warning is logged (once per (window, d, reason); later ones at
  debug level); so do non-finite offsets and a compile failure of the tiled kernel.

Tuning
  On the GPU ``triton.autotune`` picks the sample chunk ``BJ`` and ``num_warps`` per
  ``(d, window, tile, halo)``; under the interpreter a fixed config runs.

Verification status (Caution)
  Verified ONLY under the Triton CPU interpreter (``TRITON_INTERPRET=1``, triton 3.9)
  against ``dsa_reference`` (tests/test_dsa_tiled.py). No GPU was available when it was
  written: compiled correctness, register pressure of the tile budget, autotune configs and
  speed against the gather kernel are untested.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl

from .dsa_reference import validate_dsa_inputs
from .dsa_triton import INTERPRETED, LOG2E, _check_launch, _dsa_bwd_launch, _gather_validated
from .dsa_triton_pull import offsets_extent

__all__ = ["dsa_triton_tiled", "plan_tiles", "TilePlan", "MAX_TILE_ELEMS", "INTERPRETED"]

log = logging.getLogger(__name__)

# Budget for one program's (M x halo columns) fp32 tiles (scores, probabilities; backward
# also dP and dS). Untuned: no GPU yet. Module attribute so tests and tuning can move it.
MAX_TILE_ELEMS = 16384

_FALLBACK_LOGGED: set[tuple] = set()
FALLBACKS: dict[str, int] = {}  # reason -> how many calls took the gather kernel


# -----------------------------------------------------------------------------
# Jit helpers


@triton.jit
def _tile_queries(pid, T, H, W, BT: tl.constexpr, BY: tl.constexpr, BX: tl.constexpr):
    """Query coordinates of tile ``pid`` (row-major over tiles), their mask and tile origin."""
    M: tl.constexpr = BT * BY * BX
    tiles_y = tl.cdiv(H, BY)
    tiles_x = tl.cdiv(W, BX)
    t0 = (pid // (tiles_y * tiles_x)) * BT
    y0 = ((pid // tiles_x) % tiles_y) * BY
    x0 = (pid % tiles_x) * BX
    m = tl.arange(0, M)
    t = t0 + m // (BY * BX)
    y = y0 + (m // BX) % BY
    x = x0 + m % BX
    valid = (t < T) & (y < H) & (x < W)
    return t, y, x, valid, t0, y0, x0


@triton.jit
def _halo_origin(c0, SIZE, KWIN: tl.constexpr, R, EXT: tl.constexpr):
    """First halo position on one axis: the tile's first window start minus R, kept inside."""
    s0 = tl.minimum(tl.maximum(c0 - KWIN // 2, 0), SIZE - KWIN)
    return tl.minimum(tl.maximum(s0 - R, 0), SIZE - EXT)


@triton.jit
def _halo_tokens(ot, oy, ox, H, W, HT: tl.constexpr, HY: tl.constexpr, HX: tl.constexpr,
                 HTY_P: tl.constexpr, HX_P: tl.constexpr):
    """Token index and mask of every halo column ``n = (ht*HY + hy)*HX_P + hx``."""
    n = tl.arange(0, HTY_P * HX_P)
    hty = n // HX_P
    hx = n % HX_P
    ht = hty // HY
    hy = hty % HY
    valid = (hty < HT * HY) & (hx < HX)
    tok = ((ot + ht) * H + (oy + hy)) * W + (ox + hx)
    return tl.where(valid, tok, 0), valid


@triton.jit
def _tile_setup(pid, T, H, W, R, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                BT: tl.constexpr, BY: tl.constexpr, BX: tl.constexpr,
                HT: tl.constexpr, HY: tl.constexpr, HX: tl.constexpr,
                HTY_P: tl.constexpr, HX_P: tl.constexpr):
    """Tile ``pid``'s queries and halo, as forward and backward both need them: the queries'
    token index and mask, their window starts ``(st, sy, sx)``, the halo origin ``(ot, oy, ox)``
    and the halo columns' token index and mask."""
    t, y, x, qmask, t0, y0, x0 = _tile_queries(pid, T, H, W, BT, BY, BX)
    qtok = tl.where(qmask, (t * H + y) * W + x, 0)
    st = tl.minimum(tl.maximum(t - KT // 2, 0), T - KT)
    sy = tl.minimum(tl.maximum(y - KH // 2, 0), H - KH)
    sx = tl.minimum(tl.maximum(x - KW // 2, 0), W - KW)
    ot = _halo_origin(t0, T, KT, R, HT)
    oy = _halo_origin(y0, H, KH, R, HY)
    ox = _halo_origin(x0, W, KW, R, HX)
    htok, hmask = _halo_tokens(ot, oy, ox, H, W, HT, HY, HX, HTY_P, HX_P)
    return qtok, qmask, st, sy, sx, ot, oy, ox, htok, hmask


@triton.jit
def _load_rows(X, head_base, tok, valid, cols, HEAD_DIM: tl.constexpr, ROW_STRIDE):
    ptrs = X + head_base + tok.to(tl.int64)[:, None] * ROW_STRIDE + cols[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (cols[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _mm(a, b, PREC: tl.constexpr, F32_OPERANDS: tl.constexpr):
    """``tl.dot`` of two tiles in the input dtype (q, k, v, do: exact operands), fp32
    accumulation. Under the interpreter (F32_OPERANDS) half operands are widened first: triton
    3.9's interpreter multiplies the raw uint16 bits of bf16 tensors."""
    if F32_OPERANDS:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _mm_split(a, b, PREC: tl.constexpr, F32_OPERANDS: tl.constexpr, HALF: tl.constexpr):
    """``a @ b`` for a computed fp32 ``a`` (P, dS) and an input tile ``b``. Half inputs: ``a`` is
    split into two half tiles ``hi + lo`` (about 16 mantissa bits instead of 8) and both go
    through the half-precision dot: twice the tensor-core work of a plain cast, and the result
    stays within the bf16 reference's error where a single cast of P and dS did not."""
    if HALF:
        hi = a.to(b.dtype)
        lo = (a - hi.to(tl.float32)).to(b.dtype)
        return _mm(hi, b, PREC, F32_OPERANDS) + _mm(lo, b, PREC, F32_OPERANDS)
    else:
        return _mm(a, b, PREC, F32_OPERANDS)


# The helpers below run once per sample chunk; their bodies are written out rather than
# split into more jit functions: every nested jit call costs milliseconds in the interpreter.


@triton.jit
def _sample_factors(OFF, off_row, j0, qmask, st, sy, sx, ot, oy, ox, T, H, W, R,
                    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
                    HY: tl.constexpr, HTY_P: tl.constexpr, HX_P: tl.constexpr,
                    BJ: tl.constexpr):
    """Separable trilinear weights of samples ``j0 .. j0+BJ-1`` of every query of the tile.

    Per axis: the position ``p = clamp(base + offset)``, its corners ``i0 = floor(p)``,
    ``i1 = min(i0 + 1, size - 1)`` in halo-local coordinates, ``f = p - i0``; on halo
    coordinates ``h`` the weight ``w(h) = (1-f)[h == i0] + f[h == i1]`` and its derivative
    ``dw(h) = -[h == i0] + [h == i1]``; ``in_*``: the unclamped position was in [0, size-1].
    Returns ``w_t, dw_t, w_y, dw_y`` on the (t, y) pairs (M, BJ, HTY_P), ``w_x, dw_x`` on x
    (M, BJ, HX_P), the (M, BJ) sample mask, the chunk's j mask, the three ``in_*`` and ``far``
    (M, BJ): an offset component beyond the halo radius ``R`` (or not finite), whose corners
    the halo need not hold.
    """
    KS: tl.constexpr = KT * KH * KW
    j = j0 + tl.arange(0, BJ)
    jmask = j < KS
    mask = qmask[:, None] & jmask[None, :]
    ptr = OFF + off_row[:, None] + (j * 3)[None, :]
    cty = tl.arange(0, HTY_P)[None, None, :]
    ct = cty // HY
    cy = cty % HY
    cx = tl.arange(0, HX_P)[None, None, :]
    # t
    p = (st[:, None] + (j // (KH * KW))[None, :]).to(tl.float32)
    d_t = tl.load(ptr + 0, mask=mask, other=0.0).to(tl.float32)
    p += d_t
    in_t = (p >= 0.0) & (p <= T - 1.0)
    p = tl.minimum(tl.maximum(p, 0.0), T - 1.0)
    i0 = p.to(tl.int32)  # p >= 0: truncation == floor
    f = (p - i0.to(tl.float32))[:, :, None]
    a0 = ct == (i0 - ot)[:, :, None]
    a1 = ct == (tl.minimum(i0 + 1, T - 1) - ot)[:, :, None]
    wt = tl.where(a0, 1.0 - f, 0.0) + tl.where(a1, f, 0.0)
    dwt = tl.where(a0, -1.0, 0.0) + tl.where(a1, 1.0, 0.0)
    # y
    p = (sy[:, None] + ((j // KW) % KH)[None, :]).to(tl.float32)
    d_y = tl.load(ptr + 1, mask=mask, other=0.0).to(tl.float32)
    p += d_y
    in_y = (p >= 0.0) & (p <= H - 1.0)
    p = tl.minimum(tl.maximum(p, 0.0), H - 1.0)
    i0 = p.to(tl.int32)
    f = (p - i0.to(tl.float32))[:, :, None]
    a0 = cy == (i0 - oy)[:, :, None]
    a1 = cy == (tl.minimum(i0 + 1, H - 1) - oy)[:, :, None]
    wy = tl.where(a0, 1.0 - f, 0.0) + tl.where(a1, f, 0.0)
    dwy = tl.where(a0, -1.0, 0.0) + tl.where(a1, 1.0, 0.0)
    # x
    p = (sx[:, None] + (j % KW)[None, :]).to(tl.float32)
    d_x = tl.load(ptr + 2, mask=mask, other=0.0).to(tl.float32)
    p += d_x
    in_x = (p >= 0.0) & (p <= W - 1.0)
    p = tl.minimum(tl.maximum(p, 0.0), W - 1.0)
    i0 = p.to(tl.int32)
    f = (p - i0.to(tl.float32))[:, :, None]
    a0 = cx == (i0 - ox)[:, :, None]
    a1 = cx == (tl.minimum(i0 + 1, W - 1) - ox)[:, :, None]
    wx = tl.where(a0, 1.0 - f, 0.0) + tl.where(a1, f, 0.0)
    dwx = tl.where(a0, -1.0, 0.0) + tl.where(a1, 1.0, 0.0)
    far = ~((tl.abs(d_t) <= R) & (tl.abs(d_y) <= R) & (tl.abs(d_x) <= R)) & mask
    return wt, dwt, wy, dwy, wx, dwx, mask, jmask, in_t, in_y, in_x, far


# -----------------------------------------------------------------------------
# Forward


@triton.jit
def _tiled_fwd(
    Q, Kx, V, OFF, OUT, LSE,
    qk_scale, N, T, H, W, NH, R,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BT: tl.constexpr, BY: tl.constexpr, BX: tl.constexpr,
    HT: tl.constexpr, HY: tl.constexpr, HX: tl.constexpr,
    HTY_P: tl.constexpr, HX_P: tl.constexpr,
    PREC: tl.constexpr, W_PREC: tl.constexpr, F32_OPERANDS: tl.constexpr, HALF: tl.constexpr,
    BJ: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    KS: tl.constexpr = KT * KH * KW
    M: tl.constexpr = BT * BY * BX
    NHP: tl.constexpr = HTY_P * HX_P
    row_stride = NH * HEAD_DIM
    head_base = b.to(tl.int64) * N * row_stride + h * HEAD_DIM
    cols = tl.arange(0, BLOCK_D)

    qtok, qmask, st, sy, sx, ot, oy, ox, htok, hmask = _tile_setup(
        pid, T, H, W, R, KT, KH, KW, BT, BY, BX, HT, HY, HX, HTY_P, HX_P)

    q = _load_rows(Q, head_base, qtok, qmask, cols, HEAD_DIM, row_stride)
    k_halo = _load_rows(Kx, head_base, htok, hmask, cols, HEAD_DIM, row_stride)
    s3 = tl.reshape(_mm(q, tl.trans(k_halo), PREC, F32_OPERANDS), (M, HTY_P, HX_P))
    off_row = ((b.to(tl.int64) * N + qtok) * NH + h) * (KS * 3)

    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    p_acc = tl.zeros([M, HTY_P, HX_P], dtype=tl.float32)
    n_far = tl.zeros([M], dtype=tl.int32)  # per query: samples with an offset beyond R
    for j0 in range(0, KS, BJ):
        wt, dwt, wy, dwy, wx, dwx, mask, jmask, in_t, in_y, in_x, far = _sample_factors(
            OFF, off_row, j0, qmask, st, sy, sx, ot, oy, ox, T, H, W, R,
            KT, KH, KW, HY, HTY_P, HX_P, BJ)
        n_far += tl.sum(far.to(tl.int32), axis=1)
        g_ty = wt * wy
        # sample scores = blends of corner scores: sum_x (G_ty @ S)[m, j, x] * w_x[m, j, x]
        s = tl.sum(tl.dot(g_ty, s3, input_precision=W_PREC) * wx, axis=2) * qk_scale
        s = tl.where(jmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # probabilities onto halo columns: G_ty^T @ (p * w_x)
        p_acc = p_acc * alpha[:, None, None] + tl.dot(
            tl.permute(g_ty, (0, 2, 1)), p[:, :, None] * wx, input_precision=W_PREC)
        m_i = m_new

    v_halo = _load_rows(V, head_base, htok, hmask, cols, HEAD_DIM, row_stride)
    probs = tl.reshape(p_acc, (M, NHP)) / l_i[:, None]
    out = _mm_split(probs, v_halo, PREC, F32_OPERANDS, HALF)
    # a query whose samples may leave the halo (max_offset below its offsets) is refused: NaN
    # output and log-sum-exp (so NaN gradients in the backward), no host sync
    far_q = n_far > 0
    out = tl.where(far_q[:, None], float("nan"), out)
    out_ptrs = OUT + head_base + qtok.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=qmask[:, None] & (cols[None, :] < HEAD_DIM))
    lse = tl.where(far_q, float("nan"), m_i + tl.math.log2(l_i))
    tl.store(LSE + pid_bh.to(tl.int64) * N + qtok, lse, mask=qmask)


# -----------------------------------------------------------------------------
# Backward


@triton.jit
def _tiled_bwd(
    Q, Kx, V, OFF, OUT, DOUT, LSE,
    DQ, DK, DV, DOFF,
    sm_scale, qk_scale, N, T, H, W, NH, R,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BT: tl.constexpr, BY: tl.constexpr, BX: tl.constexpr,
    HT: tl.constexpr, HY: tl.constexpr, HX: tl.constexpr,
    HTY_P: tl.constexpr, HX_P: tl.constexpr,
    PREC: tl.constexpr, W_PREC: tl.constexpr, F32_OPERANDS: tl.constexpr, HALF: tl.constexpr,
    BJ: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    KS: tl.constexpr = KT * KH * KW
    M: tl.constexpr = BT * BY * BX
    NHP: tl.constexpr = HTY_P * HX_P
    row_stride = NH * HEAD_DIM
    head_base = b.to(tl.int64) * N * row_stride + h * HEAD_DIM
    cols = tl.arange(0, BLOCK_D)
    dmask = cols[None, :] < HEAD_DIM

    qtok, qmask, st, sy, sx, ot, oy, ox, htok, hmask = _tile_setup(
        pid, T, H, W, R, KT, KH, KW, BT, BY, BX, HT, HY, HX, HTY_P, HX_P)

    q = _load_rows(Q, head_base, qtok, qmask, cols, HEAD_DIM, row_stride)
    do = _load_rows(DOUT, head_base, qtok, qmask, cols, HEAD_DIM, row_stride)
    o = _load_rows(OUT, head_base, qtok, qmask, cols, HEAD_DIM, row_stride)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * N + qtok, mask=qmask, other=0.0)
    k_halo = _load_rows(Kx, head_base, htok, hmask, cols, HEAD_DIM, row_stride)
    v_halo = _load_rows(V, head_base, htok, hmask, cols, HEAD_DIM, row_stride)
    s3 = tl.reshape(_mm(q, tl.trans(k_halo), PREC, F32_OPERANDS), (M, HTY_P, HX_P))
    dp3 = tl.reshape(_mm(do, tl.trans(v_halo), PREC, F32_OPERANDS), (M, HTY_P, HX_P))
    off_row = ((b.to(tl.int64) * N + qtok) * NH + h) * (KS * 3)
    doff_row = DOFF + off_row  # same layout as OFF

    p_acc = tl.zeros([M, HTY_P, HX_P], dtype=tl.float32)
    ds_acc = tl.zeros([M, HTY_P, HX_P], dtype=tl.float32)
    out_ty = DOFF.dtype.element_ty
    for j0 in range(0, KS, BJ):
        wt, dwt, wy, dwy, wx, dwx, mask, jmask, in_t, in_y, in_x, _far = _sample_factors(
            OFF, off_row, j0, qmask, st, sy, sx, ot, oy, ox, T, H, W, R,
            KT, KH, KW, HY, HTY_P, HX_P, BJ)
        g_ty = wt * wy
        g_ty_s = tl.dot(g_ty, s3, input_precision=W_PREC)  # (M, BJ, HX_P)
        g_ty_dp = tl.dot(g_ty, dp3, input_precision=W_PREC)
        s = tl.sum(g_ty_s * wx, axis=2)
        a = tl.math.exp2(s * qk_scale - lse[:, None])
        a = tl.where(mask, a, 0.0)
        da = tl.sum(g_ty_dp * wx, axis=2)  # do . v_j
        ds = a * (da - delta[:, None]) * sm_scale  # d loss / d <q, k_j>
        g_ty_t = tl.permute(g_ty, (0, 2, 1))
        p_acc += tl.dot(g_ty_t, a[:, :, None] * wx, input_precision=W_PREC)
        ds_acc += tl.dot(g_ty_t, ds[:, :, None] * wx, input_precision=W_PREC)
        # offsets: e = ds * S + a * dP on halo columns, contracted with the weight derivatives
        g_dt = dwt * wy
        g_dy = wt * dwy
        gpt = (ds * tl.sum(tl.dot(g_dt, s3, input_precision=W_PREC) * wx, axis=2)
               + a * tl.sum(tl.dot(g_dt, dp3, input_precision=W_PREC) * wx, axis=2))
        gpy = (ds * tl.sum(tl.dot(g_dy, s3, input_precision=W_PREC) * wx, axis=2)
               + a * tl.sum(tl.dot(g_dy, dp3, input_precision=W_PREC) * wx, axis=2))
        gpx = ds * tl.sum(g_ty_s * dwx, axis=2) + a * tl.sum(g_ty_dp * dwx, axis=2)
        dptr = doff_row[:, None] + (j0 + tl.arange(0, BJ))[None, :] * 3
        tl.store(dptr + 0, tl.where(in_t, gpt, 0.0).to(out_ty), mask=mask)
        tl.store(dptr + 1, tl.where(in_y, gpy, 0.0).to(out_ty), mask=mask)
        tl.store(dptr + 2, tl.where(in_x, gpx, 0.0).to(out_ty), mask=mask)

    ds2 = tl.reshape(ds_acc, (M, NHP))
    p2 = tl.reshape(p_acc, (M, NHP))
    dq = _mm_split(ds2, k_halo, PREC, F32_OPERANDS, HALF)
    dq_ptrs = DQ + head_base + qtok.to(tl.int64)[:, None] * row_stride + cols[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=qmask[:, None] & dmask)
    dk_halo = _mm_split(tl.trans(ds2), q, PREC, F32_OPERANDS, HALF)
    dv_halo = _mm_split(tl.trans(p2), do, PREC, F32_OPERANDS, HALF)
    hptrs = head_base + htok.to(tl.int64)[:, None] * row_stride + cols[None, :]
    hm = hmask[:, None] & dmask
    # one relaxed fp32 atomic per halo element per tile (neighbouring halos overlap)
    tl.atomic_add(DK + hptrs, dk_halo, mask=hm, sem="relaxed")
    tl.atomic_add(DV + hptrs, dv_halo, mask=hm, sem="relaxed")


# -----------------------------------------------------------------------------
# Tuning: fixed config under the interpreter, autotuned on the GPU

_TUNE_KEY = ["HEAD_DIM", "KT", "KH", "KW", "BT", "BY", "BX", "HT", "HY", "HX"]
_CONFIGS = [
    triton.Config({"BJ": bj}, num_warps=nw, num_stages=1)
    for bj in (16, 32) for nw in (4, 8)
]
# interpreter: fewer, larger chunks (its cost is per operation); K = 75 still takes two
_INTERP_BJ = 64

_tiled_fwd_tuned = triton.autotune(configs=_CONFIGS, key=_TUNE_KEY)(_tiled_fwd)
# autotune runs the kernel several times: the atomic targets must restart from zero each time
_tiled_bwd_tuned = triton.autotune(configs=_CONFIGS, key=_TUNE_KEY, reset_to_zero=["DK", "DV"])(_tiled_bwd)


# -----------------------------------------------------------------------------
# Planning


@dataclass(frozen=True)
class TilePlan:
    """Query tile (bt, by, bx), halo extents (ht, hy, hx) and padded halo layout."""

    tile: tuple[int, int, int]
    halo: tuple[int, int, int]
    hty_p: int
    hx_p: int
    radius: int

    @property
    def m(self) -> int:
        return self.tile[0] * self.tile[1] * self.tile[2]

    @property
    def columns(self) -> int:
        return self.hty_p * self.hx_p


def _p2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _tile_candidates():
    for bt in (1, 2, 4, 8):
        for by in (1, 2, 4, 8, 16):
            for bx in (1, 2, 4, 8, 16, 32):
                if 16 <= bt * by * bx <= 64:
                    yield bt, by, bx


def plan_tiles(grid: Sequence[int], window: Sequence[int], radius: int,
               max_tile_elems: int | None = None) -> TilePlan | None:
    """The tile shape with the fewest padded halo columns per (in-grid) query whose
    ``M * columns`` fits ``max_tile_elems`` (default ``MAX_TILE_ELEMS``); None if none fits.

    ``radius`` is ``ceil(max |offset|)``.
    """
    budget = MAX_TILE_ELEMS if max_tile_elems is None else max_tile_elems
    best, best_key = None, None
    for tile in _tile_candidates():
        halo = tuple(min(size, b + k + 2 * radius) for size, b, k in zip(grid, tile, window))
        plan = TilePlan(tile, halo, _p2(halo[0] * halo[1]), _p2(halo[2]), radius)
        if plan.m * plan.columns > budget:
            continue
        m_eff = math.prod(min(b, size) for b, size in zip(tile, grid))
        key = (plan.columns / m_eff, plan.m * plan.columns, tile)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    return best


def _offset_radius(offsets: torch.Tensor, max_offset: float | None) -> float:
    if max_offset is not None:
        return float(max_offset)
    return offsets_extent(offsets)


def _log_fallback(reason: str, key: tuple, detail: str) -> None:
    FALLBACKS[reason] = FALLBACKS.get(reason, 0) + 1
    msg = "3D-DSA tiled kernel does not apply (%s: %s); running the gather kernel (dsa_triton)"
    if (reason, *key) in _FALLBACK_LOGGED:
        log.debug(msg, reason, detail)
        return
    _FALLBACK_LOGGED.add((reason, *key))
    log.warning(msg + " -- logged once per window, head dim and reason", reason, detail)


# -----------------------------------------------------------------------------
# Launchers


def _launch_args(q, plan: TilePlan, win):
    B, T, H, W, nh, d = q.shape
    tiles = math.prod(triton.cdiv(s, b) for s, b in zip((T, H, W), plan.tile))
    grid = (tiles, B * nh)
    half = q.dtype in (torch.float16, torch.bfloat16)
    meta = dict(
        HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        KT=win[0], KH=win[1], KW=win[2],
        BT=plan.tile[0], BY=plan.tile[1], BX=plan.tile[2],
        HT=plan.halo[0], HY=plan.halo[1], HX=plan.halo[2],
        HTY_P=plan.hty_p, HX_P=plan.hx_p,
        PREC="ieee", F32_OPERANDS=INTERPRETED, HALF=half,
        W_PREC="tf32x3" if (half and not INTERPRETED) else "ieee",
    )
    return grid, (T * H * W, T, H, W, nh, plan.radius), meta


def _fwd(q, k, v, offsets, win, scale, plan):
    B, T, H, W, nh, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((B, nh, T * H * W), device=q.device, dtype=torch.float32)
    grid, dims, meta = _launch_args(q, plan, win)
    if INTERPRETED:
        _tiled_fwd[grid](q, k, v, offsets, out, lse, scale * LOG2E, *dims, **meta,
                         BJ=_INTERP_BJ, num_warps=4)
    else:
        _tiled_fwd_tuned[grid](q, k, v, offsets, out, lse, scale * LOG2E, *dims, **meta)
    return out, lse


def _bwd(q, k, v, offsets, out, dout, lse, win, scale, plan):
    dq = torch.empty_like(q)
    dk = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    dv = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    doff = torch.empty_like(offsets)
    grid, dims, meta = _launch_args(q, plan, win)
    args = (q, k, v, offsets, out, dout, lse, dq, dk, dv, doff, scale, scale * LOG2E, *dims)
    if INTERPRETED:
        _tiled_bwd[grid](*args, **meta, BJ=_INTERP_BJ, num_warps=4)
    else:
        _tiled_bwd_tuned[grid](*args, **meta)
    return dq, dk.to(k.dtype), dv.to(v.dtype), doff


class _DSATiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, win, scale, plan):
        q, k, v, offsets = (x.contiguous() for x in (q, k, v, offsets))
        _check_launch(q, k, v, offsets)
        out, lse = _fwd(q, k, v, offsets, win, scale, plan)
        ctx.save_for_backward(q, k, v, offsets, out, lse)
        ctx.meta = (win, scale, plan)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, out, lse = ctx.saved_tensors
        win, scale, plan = ctx.meta
        dout = dout.contiguous().to(q.dtype)
        try:
            dq, dk, dv, doff = _bwd(q, k, v, offsets, out, dout, lse, win, scale, plan)
        except (triton.CompilationError, triton.OutOfResources) as e:
            # the gather kernel's backward reads the same base-2 log-sum-exp
            _log_fallback("compile-backward", (win, q.shape[-1]), f"{type(e).__name__}: {str(e)[:300]}")
            dq, dk, dv, doff = _dsa_bwd_launch(q, k, v, offsets, out, dout, lse, win, scale, None)
        return dq, dk, dv, doff, None, None, None


def tiled_plan_for(q: torch.Tensor, offsets: torch.Tensor, window: Sequence[int],
                   max_offset: float | None = None) -> tuple[TilePlan | None, str]:
    """(plan, "") when the tiled kernel applies to this call, else (None, why)."""
    win = tuple(int(w) for w in window)
    bound = _offset_radius(offsets, max_offset)
    if not math.isfinite(bound):
        return None, f"offsets bound {bound} is not finite"
    grid = tuple(int(s) for s in q.shape[1:4])
    plan = plan_tiles(grid, win, int(math.ceil(bound)))
    if plan is None:
        return None, (f"halo of |offset| <= {bound:.3g} on grid {grid} with window {win} exceeds "
                      f"{MAX_TILE_ELEMS} tile elements for every query tile")
    return plan, ""


def dsa_triton_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    block_m: int | None = None,
    max_offset: float | None = None,
) -> torch.Tensor:
    """3D-DSA with the tiled kernels; the gather kernel (``dsa_triton``) where they do not
    apply, with a logged warning. Inputs are validated here, once (the fallback does not
    validate them again).

    Same arguments and result as ``dsa_triton``; ``block_m`` only reaches the gather kernel.
    ``max_offset``: a bound on ``|offsets|`` the caller guarantees (``attention.max_offset``
    of a tanh-bounded offset head), a number >= 0; the halo is then sized from it with no
    host sync. Default None: measured from ``offsets`` (a reduction and a host sync per call).
    Offsets beyond a given bound are not trusted: the kernel compares every offset with the
    halo radius ``R = ceil(max_offset)`` as it loads it, and a query with any offset beyond
    ``R`` (or a non-finite one) gets NaN output and NaN gradients, also spreading into the
    dk/dv of its tile's halo -- loud, as a non-finite loss, and checked without a host sync.
    Offsets up to ``R`` are computed exactly. (Where the bound's halo does not fit a tile the
    gather kernel runs, and it computes every offset exactly.)
    """
    win = validate_dsa_inputs(q, k, v, offsets, window)
    if max_offset is not None and not max_offset >= 0:
        raise ValueError(f"max_offset must be a bound >= 0 on |offsets| (or None: measured), got {max_offset!r}")
    scale_f = q.shape[-1] ** -0.5 if scale is None else float(scale)
    key = (win, q.shape[-1])
    plan, why = tiled_plan_for(q, offsets, win, max_offset)
    if plan is None:
        _log_fallback("halo", key, why)
        return _gather_validated(q, k, v, offsets, win, scale_f, block_m, max_offset=max_offset)
    try:
        return _DSATiled.apply(q, k, v, offsets, win, scale_f, plan)
    except (triton.CompilationError, triton.OutOfResources) as e:  # e.g. too many registers
        _log_fallback("compile", key, f"{type(e).__name__}: {str(e)[:300]}")
        return _gather_validated(q, k, v, offsets, win, scale_f, block_m, max_offset=max_offset)
