"""Fused Triton kernels for 3D Deformable Slide Attention (3D-DSA): the gather kernels.

Backend ``triton``: this module's launchers are its entry points (``dsa_triton``, ``dsa_triton_slab``).

The forward and the backward's query side have a second implementation, the halo kernels
(``dsa_triton_halo``: the products on tensor cores); the ``auto`` halo mode (``dsa_modes``) takes them per pass where
the cost model (``dsa_cost.choose_halo``) predicts them faster at the call's bound (``max_offset``,
a constant of the config: nothing is measured per call, so no host sync and no new compile
mid-run), and logs the choice once per span of the bound.

Semantics are those of ``dsa_reference`` (docs/dsa.md):
channels-last ``q, k, v: (B, T, H, W, nh, d)``, ``offsets: (B, T, H, W, nh, K, 3)``.

Algorithm (structure of the triton tutorial 06-fused-attention):

- forward ``_dsa_fwd``: one program = BLOCK_M consecutive queries of one (batch, head).
  For each of the K samples j: window base + offset -> clamped position -> 8 corner
  gathers of k (and v), trilinear blend, ``s_j = scale * <q, k_j>``, online softmax
  (running max m, running sum l, fp32 accumulator rescaled by exp2(m_old - m_new)).
  Saves the log-sum-exp (base 2, fp32, ``(B, nh, N)``), never the K probabilities.
- backward ``_dsa_bwd``: same blocking. Recomputes each sample from q, k, v, offsets
  and the saved log-sum-exp: ``a_j = exp2(s_j - lse)``, ``ds_j = a_j (do.v_j - delta)``
  with ``delta = do.o`` computed in the kernel.
  * dq accumulates in registers (one program owns its queries);
  * dk, dv: in the pull mode (the default when the offsets' bound is at most
    ``dsa_triton_pull.PULL_MAX_OFFSET``) each (query, sample) writes a record (position, ds, a)
    and the key-side pass ``dsa_triton_pull`` sums them per key tile: no atomics, deterministic.
    In the atomic mode (``KernelModes(dkv="atomic")``, or where no bound fits a slab) they are scattered
    to the 8 corners of every sample with fp32 ``atomic_add`` (many queries sample the same
    key) into fp32 buffers (``(pairs, keys, d)``, the (batch, head) pairs in chunks within
    ``ATOMIC_BUDGET_BYTES``), each chunk cast into dk, dv after its launch. The split mode
    (``SPLIT``; offsets past the cap, ``dsa_triton_split``) does both: records for every query,
    weightless for the queries ``OUTL`` flags, whose samples are scattered instead;
  * d(offsets) comes from the derivative of trilinear interpolation: for corner c with
    ``e_c = ds_j*scale*(q.k_c) + a_j*(do.v_c)``,
    ``dL/dp_t = sum_c (+-1) w_y w_x e_c`` (likewise y, x), zeroed where the position
    was clamped (torch's clamp passes gradient on [lo, hi] inclusive). Each (query, j)
    belongs to one program, so it is stored directly, without atomics.
  The per-corner dot products ``q.k_c`` and ``do.v_c`` are kept as BLOCK_M scalars, so
  the backward never materialises v_j and holds one (BLOCK_M, D) key tile at a time.

Verification status (Caution):
  These kernels have been verified ONLY under the Triton CPU interpreter
  (``TRITON_INTERPRET=1``, triton 3.9) against ``dsa_reference`` -- forward and
  backward, fp32 and bf16, odd sizes, every border, large offsets. No GPU was available
  when they were written: compiled-GPU correctness, block sizes / num_warps and speed
  are untested. In the atomic mode dk/dv use fp32 atomics, so that backward is not
  bit-deterministic run to run (the pull mode is).
  The sample loop is scalar-per-query (gathers, no tensor-core dot), which is the
  natural shape for K independent keys per query; it is memory-bound by design.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from .dsa_cost import choose_halo
from .dsa_gluon_halo import fused_backward, fused_forward  # the fused halo-dense pair (Gluon, built on first use)
from .dsa_modes import AUTO, KernelModes
from .dsa_reference import validate_dsa_inputs, validate_slab_inputs
from .dsa_triton_halo import halo_backward_query, halo_forward
from .dsa_triton_pull import (
    INTERPRETED,  # which kind of kernel the @triton.jit decorators made (CPU tensors only when interpreted)
    REC_FIELDS,
    _past_bound,
    log_halo_once,
    log_mode_once,
    pairs_within,
    pull_bound,
    pull_launch,
    pull_span,
    rec_chunk,
)
from .dsa_triton_split import split_chunk, split_plan

__all__ = ["dsa_triton", "dsa_triton_slab", "INTERPRETED"]

log = logging.getLogger(__name__)

LOG2E = 1.4426950408889634
ATOMIC_BUDGET_BYTES = 1 << 30  # the atomic mode's fp32 dk, dv per launch; (batch, head) pairs in chunks within it



# -----------------------------------------------------------------------------
# Small jit helpers


@triton.jit
def _axis_position(off_ptrs, mask_m, base, SIZE):
    """Clamped position along one axis: (lower index, upper index, weight, grad mask)."""
    p = base.to(tl.float32) + tl.load(off_ptrs, mask=mask_m, other=0.0).to(tl.float32)
    inside = (p >= 0.0) & (p <= SIZE - 1.0)  # clamp passes gradient on [lo, hi]
    p = tl.minimum(tl.maximum(p, 0.0), SIZE - 1.0)
    i0 = p.to(tl.int32)  # p >= 0, so truncation == floor
    w = p - i0.to(tl.float32)
    i1 = tl.minimum(i0 + 1, SIZE - 1)
    return i0, i1, w, inside


@triton.jit
def _row_ptrs(X, head_base, tok, cols, ROW_STRIDE):
    """(BLOCK_M, BLOCK_D) pointers to token rows ``tok`` of one (batch, head)."""
    return X + head_base + tok.to(tl.int64)[:, None] * ROW_STRIDE + cols[None, :]


@triton.jit
def _gather(X, head_base, tok, cols, mask2, ROW_STRIDE):
    return tl.load(_row_ptrs(X, head_base, tok, cols, ROW_STRIDE), mask=mask2, other=0.0).to(
        tl.float32
    )


@triton.jit
def _corner(c, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W):
    """Corner ``c`` (bits t, y, x) of every query's sample: token index and trilinear weight."""
    ct = (c // 4) % 2
    cy = (c // 2) % 2
    cx = c % 2
    tok = ((tl.where(ct == 1, t1, t0) * H + tl.where(cy == 1, y1, y0)) * W + tl.where(cx == 1, x1, x0))
    w = tl.where(ct == 1, wt, 1.0 - wt) * tl.where(cy == 1, wy, 1.0 - wy) * tl.where(cx == 1, wx, 1.0 - wx)
    return tok, w



# -----------------------------------------------------------------------------
# Forward


@triton.jit
def _dsa_fwd(
    Q, Kx, V, OFF, OUT, LSE,
    qk_scale,  # softmax scale * log2(e)
    N, T, H, W, NH,
    NK, TK, Q0, K0,  # k, v: NK tokens = frames [K0, K0 + TK) of T; queries start at frame Q0
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    KS: tl.constexpr = KT * KH * KW
    row_stride = NH * HEAD_DIM  # elements between consecutive tokens (channels-last)
    head_base = b.to(tl.int64) * N * row_stride + h * HEAD_DIM  # q, out, dout, dq rows
    kv_base = b.to(tl.int64) * NK * row_stride + h * HEAD_DIM  # k, v, dk, dv rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query token index n
    cols = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N
    mask2 = mask_m[:, None] & (cols[None, :] < HEAD_DIM)

    # -- query coordinates and window starts (shifted inward at borders)
    t = Q0 + offs_m // (H * W)  # frame on the whole grid
    y = (offs_m // W) % H
    x = offs_m % W
    st = tl.minimum(tl.maximum(t - KT // 2, 0), T - KT)
    sy = tl.minimum(tl.maximum(y - KH // 2, 0), H - KH)
    sx = tl.minimum(tl.maximum(x - KW // 2, 0), W - KW)

    q = _gather(Q, head_base, offs_m, cols, mask2, row_stride)
    # offsets row of (query, head): K*3 values, contiguous
    off_base = OFF + ((b.to(tl.int64) * N + offs_m) * NH + h) * (KS * 3)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for j in tl.range(0, KS, loop_unroll_factor=1):
        jt = j // (KH * KW)
        jy = (j // KW) % KH
        jx = j % KW
        # -- sample position, clamped per coordinate; trilinear corners
        t0, t1, wt, _ = _axis_position(off_base + j * 3 + 0, mask_m, st + jt, T)
        y0, y1, wy, _ = _axis_position(off_base + j * 3 + 1, mask_m, sy + jy, H)
        x0, x1, wx, _ = _axis_position(off_base + j * 3 + 2, mask_m, sx + jx, W)
        t0 = tl.minimum(tl.maximum(t0 - K0, 0), TK - 1)  # whole-grid frame -> held frame
        t1 = tl.minimum(tl.maximum(t1 - K0, 0), TK - 1)
        # -- interpolated key, one corner per iteration: a run-time loop (not unrolled) keeps one
        # corner's rows in flight, so the corner tiles are never live together
        k_j = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for c in tl.range(0, 8, loop_unroll_factor=1):
            tok, w = _corner(c, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W)
            k_j += w[:, None] * _gather(Kx, kv_base, tok, cols, mask2, row_stride)
        # -- online softmax update (base 2)
        s = tl.sum(q * k_j, axis=1) * qk_scale
        m_new = tl.maximum(m_i, s)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new)
        l_i = l_i * alpha + p
        # -- the interpolated value goes straight into the accumulator, corner by corner
        acc = acc * alpha[:, None]
        for c in tl.range(0, 8, loop_unroll_factor=1):
            tok, w = _corner(c, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W)
            acc += (p * w)[:, None] * _gather(V, kv_base, tok, cols, mask2, row_stride)
        m_i = m_new

    # -- epilogue: normalise, store out and the log-sum-exp for backward
    acc = acc / l_i[:, None]
    out_ptrs = _row_ptrs(OUT, head_base, offs_m, cols, row_stride)
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask2)
    tl.store(LSE + pid_bh.to(tl.int64) * N + offs_m, m_i + tl.math.log2(l_i), mask=mask_m)


# -----------------------------------------------------------------------------
# Backward


@triton.jit
def _corner_scatter(DK, DV, kv_base, tok, cols, mask2, row_stride, w, gk, gv):
    """dk[c] += w * gk, dv[c] += w * gv (fp32 atomics: other queries hit the same rows).
    ``relaxed``: the sums only need atomicity, no ordering against other memory (the default
    ``acq_rel`` adds fences to every one); the buffers are read after the kernel ends."""
    tl.atomic_add(_row_ptrs(DK, kv_base, tok, cols, row_stride), w[:, None] * gk, mask=mask2, sem="relaxed")
    tl.atomic_add(_row_ptrs(DV, kv_base, tok, cols, row_stride), w[:, None] * gv, mask=mask2, sem="relaxed")


@triton.jit
def _scatter_sample(DK, DV, acc_base, cols, mask2, row_stride, ds, a, q, do, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W):
    """One window slot's dk, dv: ``ds q`` and ``a do`` spread over the sample's 8 corners (fp32 atomics
    into the chunk's ``(pairs, NK, d)`` buffers at ``acc_base``)."""
    gk = ds[:, None] * q
    gv = a[:, None] * do
    for c in tl.range(0, 8, loop_unroll_factor=1):
        tok, w = _corner(c, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W)
        _corner_scatter(DK, DV, acc_base, tok, cols, mask2, row_stride, w, gk, gv)


@triton.jit
def _query_block(pid_m, pid_bh, N, T, H, W, NH, NK, Q0, HEAD_DIM: tl.constexpr, KT: tl.constexpr,
                 KH: tl.constexpr, KW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Block ``pid_m`` of ``BLOCK_M`` queries of (batch, head) ``pid_bh``: where its q and k rows start,
    the queries' tokens, columns and masks, and their window starts (shifted inward at borders)."""
    b = pid_bh // NH
    h = pid_bh % NH
    row_stride = NH * HEAD_DIM
    head_base = b.to(tl.int64) * N * row_stride + h * HEAD_DIM  # q, out, dout, dq rows
    kv_base = b.to(tl.int64) * NK * row_stride + h * HEAD_DIM  # k, v, dk, dv rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask_m = offs_m < N
    mask2 = mask_m[:, None] & (cols[None, :] < HEAD_DIM)

    t = Q0 + offs_m // (H * W)  # frame on the whole grid
    y = (offs_m // W) % H
    x = offs_m % W
    st = tl.minimum(tl.maximum(t - KT // 2, 0), T - KT)
    sy = tl.minimum(tl.maximum(y - KH // 2, 0), H - KH)
    sx = tl.minimum(tl.maximum(x - KW // 2, 0), W - KW)
    return b, h, row_stride, head_base, kv_base, offs_m, cols, mask_m, mask2, st, sy, sx


@triton.jit
def _record_position(rec_row, j, N, KS: tl.constexpr, mask_m, beyond, t0, wt, bt, y0, wy, by, x0, wx, bx, ELO, EHI):
    """The pull mode's position fields of slot ``j``'s records (the clamped position per axis), and
    ``beyond`` updated: whether a sample's corners leave where the key-side pass looks."""
    tl.store(rec_row + j * N, t0.to(tl.float32) + wt, mask=mask_m)
    tl.store(rec_row + (KS + j) * N, y0.to(tl.float32) + wy, mask=mask_m)
    tl.store(rec_row + (2 * KS + j) * N, x0.to(tl.float32) + wx, mask=mask_m)
    beyond |= _past_bound(t0, wt, bt, ELO, EHI) | _past_bound(y0, wy, by, ELO, EHI)
    beyond |= _past_bound(x0, wx, bx, ELO, EHI)
    return beyond


@triton.jit
def _corner_sums(Kx, V, kv_base, cols, mask2, row_stride, q, do, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """One sample recomputed, one corner per iteration (a run-time loop: one corner's rows in flight).
    Per corner c: q.k_c and do.v_c; their weighted sums give the sample's score and do.v_j;
    the offsets' gradient is linear in e_c = ds q.k_c + a do.v_c, so its three
    components are kept as sums of q.k_c and of do.v_c weighted by the derivative of the
    corner's weight along each axis (+-1 times the other two axes' weights). Returns
    ``(q.k_j, do.v_j, the q.k_c sums along t, y, x, the do.v_c sums along t, y, x, k_j)``."""
    qk = tl.zeros([BLOCK_M], dtype=tl.float32)
    dov = tl.zeros([BLOCK_M], dtype=tl.float32)
    qt = tl.zeros([BLOCK_M], dtype=tl.float32)
    qy = tl.zeros([BLOCK_M], dtype=tl.float32)
    qx = tl.zeros([BLOCK_M], dtype=tl.float32)
    vt = tl.zeros([BLOCK_M], dtype=tl.float32)
    vy = tl.zeros([BLOCK_M], dtype=tl.float32)
    vx = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_j = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for c in tl.range(0, 8, loop_unroll_factor=1):
        tok, w = _corner(c, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W)
        ct = (c // 4) % 2
        cy = (c // 2) % 2
        cx = c % 2
        at = tl.where(ct == 1, wt, 1.0 - wt)
        ay = tl.where(cy == 1, wy, 1.0 - wy)
        ax = tl.where(cx == 1, wx, 1.0 - wx)
        k_c = _gather(Kx, kv_base, tok, cols, mask2, row_stride)
        qk_c = tl.sum(q * k_c, axis=1)
        dv_c = tl.sum(do * _gather(V, kv_base, tok, cols, mask2, row_stride), axis=1)
        k_j += w[:, None] * k_c
        qk += w * qk_c
        dov += w * dv_c
        gt = tl.where(ct == 1, 1.0, -1.0) * ay * ax
        gy = tl.where(cy == 1, 1.0, -1.0) * at * ax
        gx = tl.where(cx == 1, 1.0, -1.0) * at * ay
        qt += gt * qk_c
        vt += gt * dv_c
        qy += gy * qk_c
        vy += gy * dv_c
        qx += gx * qk_c
        vx += gx * dv_c
    return qk, dov, qt, qy, qx, vt, vy, vx, k_j


@triton.jit
def _store_doff(doff_ptr, mask_m, in_t, in_y, in_x, ds, a, qt, qy, qx, vt, vy, vx):
    """d(position) of one slot: sum_c (d weight_c / d p) e_c, e_c = ds q.k_c + a do.v_c, zeroed along
    an axis where the position was clamped."""
    out_ty = doff_ptr.dtype.element_ty
    tl.store(doff_ptr + 0, tl.where(in_t, ds * qt + a * vt, 0.0).to(out_ty), mask=mask_m)
    tl.store(doff_ptr + 1, tl.where(in_y, ds * qy + a * vy, 0.0).to(out_ty), mask=mask_m)
    tl.store(doff_ptr + 2, tl.where(in_x, ds * qx + a * vx, 0.0).to(out_ty), mask=mask_m)


@triton.jit
def _dsa_bwd(
    Q, Kx, V, OFF, OUT, DOUT, LSE,
    DQ, DK, DV, DOFF, REC,
    OUTL,  # SPLIT: per (batch, query, head) int8, nonzero for a query whose samples go by atomics
    sm_scale, qk_scale,
    N, T, H, W, NH,
    NK, TK, Q0, K0, BH0,
    ELO, EHI,  # PULL: the offsets' bound as the key-side pass assumes it (dsa_triton_pull.pull_span)
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    PULL: tl.constexpr,  # write per-sample records for dsa_triton_pull instead of dk/dv atomics
    SPLIT: tl.constexpr = False,  # PULL for most queries, atomics for those OUTL flags (dsa_triton_split)
):
    pid_m = tl.program_id(0)
    pid_bh = BH0 + tl.program_id(1)
    KS: tl.constexpr = KT * KH * KW
    b, h, row_stride, head_base, kv_base, offs_m, cols, mask_m, mask2, st, sy, sx = _query_block(
        pid_m, pid_bh, N, T, H, W, NH, NK, Q0, HEAD_DIM, KT, KH, KW, BLOCK_M, BLOCK_D)

    q = _gather(Q, head_base, offs_m, cols, mask2, row_stride)
    do = _gather(DOUT, head_base, offs_m, cols, mask2, row_stride)
    o = _gather(OUT, head_base, offs_m, cols, mask2, row_stride)
    delta = tl.sum(do * o, axis=1)  # = sum_j a_j (do . v_j)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * N + offs_m, mask=mask_m, other=0.0)
    off_row = ((b.to(tl.int64) * N + offs_m) * NH + h) * (KS * 3)

    if SPLIT:  # the flagged queries' records carry no weight; their samples are scattered instead
        outl = tl.load(OUTL + (b.to(tl.int64) * N + offs_m) * NH + h, mask=mask_m, other=0) != 0
        any_outl = tl.max(outl.to(tl.int32), axis=0) > 0
        mask_o = mask2 & outl[:, None]
        keep = 1.0 - outl.to(tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    beyond = tl.zeros([BLOCK_M], dtype=tl.int1)  # PULL: a sample past the bound the key-side pass assumes
    rec_row = REC + tl.program_id(1).to(tl.int64) * (5 * KS * N) + offs_m  # PULL: this (batch, head)'s records
    for j in tl.range(0, KS, loop_unroll_factor=1):
        jt = j // (KH * KW)
        jy = (j // KW) % KH
        jx = j % KW
        t0, t1, wt, in_t = _axis_position(OFF + off_row + j * 3 + 0, mask_m, st + jt, T)
        y0, y1, wy, in_y = _axis_position(OFF + off_row + j * 3 + 1, mask_m, sy + jy, H)
        x0, x1, wx, in_x = _axis_position(OFF + off_row + j * 3 + 2, mask_m, sx + jx, W)
        if PULL:  # the sample's clamped position, and whether its corners stay where the pull looks
            beyond = _record_position(rec_row, j, N, KS, mask_m, beyond, t0, wt, st + jt, y0, wy, sy + jy,
                                      x0, wx, sx + jx, ELO, EHI)
        t0 = tl.minimum(tl.maximum(t0 - K0, 0), TK - 1)  # whole-grid frame -> held frame
        t1 = tl.minimum(tl.maximum(t1 - K0, 0), TK - 1)
        qk, dov, qt, qy, qx, vt, vy, vx, k_j = _corner_sums(Kx, V, kv_base, cols, mask2, row_stride, q, do, t0, t1, wt,
                                                            y0, y1, wy, x0, x1, wx, H, W, BLOCK_M, BLOCK_D)

        # -- probabilities from the saved log-sum-exp; softmax backward
        a = tl.math.exp2(qk * qk_scale - lse)
        a = tl.where(mask_m, a, 0.0)
        ds = a * (dov - delta) * sm_scale  # d loss / d <q, k_j>
        dq += ds[:, None] * k_j

        if PULL:  # dk, dv: the key-side pass reads ds and a (dsa_triton_pull)
            if SPLIT:
                tl.store(rec_row + (3 * KS + j) * N, ds * keep, mask=mask_m)
                tl.store(rec_row + (4 * KS + j) * N, a * keep, mask=mask_m)
                if any_outl:  # a program without a flagged query issues no atomics
                    _scatter_sample(DK, DV, (pid_bh - BH0).to(tl.int64) * NK * HEAD_DIM, cols, mask_o, HEAD_DIM,
                                    ds, a, q, do, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W)
            else:
                tl.store(rec_row + (3 * KS + j) * N, ds, mask=mask_m)
                tl.store(rec_row + (4 * KS + j) * N, a, mask=mask_m)
        else:  # dk, dv: scatter to the 8 corners (fp32 atomics: other queries sample the same rows)
            _scatter_sample(DK, DV, (pid_bh - BH0).to(tl.int64) * NK * HEAD_DIM, cols, mask2, HEAD_DIM,
                            ds, a, q, do, t0, t1, wt, y0, y1, wy, x0, x1, wx, H, W)
        _store_doff(DOFF + off_row + j * 3, mask_m, in_t, in_y, in_x, ds, a, qt, qy, qx, vt, vy, vx)

    if PULL:  # refused in-band: the key-side pass would miss this query's far corners
        if SPLIT:  # (the flagged queries' were scattered)
            beyond &= ~outl
        dq = tl.where(beyond[:, None], float("nan"), dq)
    tl.store(_row_ptrs(DQ, head_base, offs_m, cols, row_stride), dq.to(DQ.dtype.element_ty), mask=mask2)


# -----------------------------------------------------------------------------
# Tuning: on the GPU ``triton.autotune`` picks among these; every one of them compiles for sm_90 at
# the presets' shapes (bf16/fp32, head dims 64 and 128, windows up to 3x7x7) without spills
# (``python -m benchmarks.gpu_check --compile-only``; benchmarks/RESULTS.md). ``num_stages=1``:
# the sample loop's loads depend on offsets loaded in the same iteration, there is nothing for
# Triton's software pipeliner to prefetch, and its buffers would cost registers.

FWD_CONFIGS = [triton.Config({"BLOCK_M": 16}, num_warps=4, num_stages=1)]
# (2026-12-02: BLOCK_M 32 and 16 at 8 warps spilled 12 bytes per thread in the fp32 forward at d 64 /
# d 128 -- ptxas holds 256-thread blocks to 128 registers -- and 32 at 4 warps at bf16 d 128: dropped)
BWD_CONFIGS = [triton.Config({"BLOCK_M": 8}, num_warps=4, num_stages=1),
               triton.Config({"BLOCK_M": 8}, num_warps=8, num_stages=1),
               triton.Config({"BLOCK_M": 16}, num_warps=8, num_stages=1)]
# The pull mode's query-side pass (records instead of atomics): 8 queries at 4 warps only. At 8 warps
# ptxas holds it to 128 registers and it spilled 4 bytes per thread on sm_100; 16 queries at 4 warps
# spilled 4-8 bytes in fp32 at d 128 (2026-12-03).
BWD_PULL_CONFIGS = [triton.Config({"BLOCK_M": 8}, num_warps=4, num_stages=1)]
_TUNE_KEY = ["HEAD_DIM", "KT", "KH", "KW"]
_dsa_fwd_tuned = triton.autotune(configs=FWD_CONFIGS, key=_TUNE_KEY)(_dsa_fwd)
# autotune runs the kernel several times: the atomic targets must restart from zero each time
_dsa_bwd_tuned = triton.autotune(configs=BWD_CONFIGS, key=_TUNE_KEY, reset_to_zero=["DK", "DV"])(_dsa_bwd)
_dsa_bwd_pull_tuned = triton.autotune(configs=BWD_PULL_CONFIGS, key=_TUNE_KEY)(_dsa_bwd)
_dsa_bwd_split_tuned = triton.autotune(configs=BWD_PULL_CONFIGS, key=_TUNE_KEY, reset_to_zero=["DK", "DV"])(_dsa_bwd)


# -----------------------------------------------------------------------------
# Launchers

_KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_OFF_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_launch(q, k, v, offsets):
    """Assert what the kernels assume: dtypes, device, contiguous channels-last layout."""
    assert q.dtype in _KV_DTYPES, f"triton DSA supports q/k/v in {_KV_DTYPES}, got {q.dtype}"
    assert offsets.dtype in _OFF_DTYPES, (
        f"triton DSA supports offsets in {_OFF_DTYPES}, got {offsets.dtype}"
    )
    if not INTERPRETED:
        assert q.is_cuda, (
            f"compiled triton DSA needs CUDA tensors, got {q.device}; "
            "use backend='reference' (or TRITON_INTERPRET=1 for kernel debugging)"
        )
    for name, x in (("q", q), ("k", k), ("v", v), ("offsets", offsets)):
        assert x.is_contiguous(), f"{name} must be contiguous here (launcher bug)"
    # flat int32 token indices inside the kernel
    N = q.shape[1] * q.shape[2] * q.shape[3]
    assert N < 2**31, f"{N} tokens per clip overflow int32 indexing"


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _default_block_m(d: int, backward: bool) -> int:
    """Queries per program. Untuned (no GPU yet): keep the fp32 (BLOCK_M, BLOCK_D) tiles
    -- 4 live in forward, ~6 in backward -- near 32 registers per thread at 4 warps."""
    tiles_elems = 2048 if backward else 4096
    return max(16, min(64, tiles_elems // _block_d(d)))


def _slab_args(q, k, slab):
    """(NK, TK, Q0, K0) and the whole grid's frames for the kernels."""
    B, T, H, W, nh, d = q.shape
    Tk, frames, q0, k0 = (T, T, 0, 0) if slab is None else slab
    return (Tk * H * W, Tk, q0, k0), frames


def halo_refusal(q, block_m, modes: KernelModes = AUTO) -> str | None:
    """Why the halo kernels (``dsa_triton_halo``) may not run for ``q`` whatever the bound, or None:
    ``modes.halo`` "gather", an explicit ``block_m``, or fp32 in "auto"."""
    if modes.halo == "gather":
        return "halo mode gather"
    if block_m is not None:
        return f"block_m {block_m} asks for the gather kernels"
    if modes.halo == "auto" and q.dtype == torch.float32:
        return "fp32 inputs: the halo kernels' fp32 dots spill (bf16 and fp16 take them)"
    return None


def halo_choice(pass_: str, q, win, bound: float | None, why: str, block_m=None,
                modes: KernelModes = AUTO) -> tuple[bool, str]:
    """Whether pass ``pass_`` ("fwd" or "bwd": the backward's query side) takes the halo kernels,
    and why, given the pull mode's ``bound`` (None: refused, ``why``) and the call's ``modes``."""
    refused = halo_refusal(q, block_m, modes)
    if refused is not None:
        return False, refused
    if bound is None:
        return False, why
    if modes.halo == "halo":
        return True, f"halo mode halo; offsets up to {bound:g} ({why})"
    return choose_halo(tuple(q.shape[1:4]), tuple(win), q.shape[-1], float(bound), q.element_size())[pass_]


def _dsa_fwd_launch(q, k, v, offsets, win, scale, block_m, slab=None, max_offset=None, modes: KernelModes = AUTO):
    """``(out, lse, walks)``: the fused halo-dense forward's where ``modes.halo`` is "fused" and it may run
    (``walks``: its sample order and records, for its backward), else the halo forward's (``dsa_triton_halo``:
    tensor cores) where ``halo_choice`` takes it, else the gather forward's (``walks`` None both)."""
    B, T, H, W, nh, d = q.shape
    N = T * H * W
    kv_args, T = _slab_args(q, k, slab)
    out = torch.empty_like(q)
    lse = torch.empty((B, nh, N), device=q.device, dtype=torch.float32)
    if modes.halo == "fused":  # the fused halo-dense forward where it can run, else auto's choice
        if (got := fused_forward(q, k, v, offsets, win, scale, slab, max_offset)) is not None:
            return got
        modes = AUTO
    bound, why = ((None, "") if halo_refusal(q, block_m, modes)
                  else pull_bound(offsets, max_offset, slab, win[0], win[2]))
    halo, why = halo_choice("fwd", q, win, bound, why, block_m, modes)
    log_halo_once("forward", halo, why)
    if halo:
        halo_forward(q, k, v, offsets, win, scale * LOG2E, bound, (N, T, H, W, nh, *kv_args), out, lse)
        return out, lse, None
    args = (q, k, v, offsets, out, lse, scale * LOG2E, N, T, H, W, nh, *kv_args)
    meta = dict(HEAD_DIM=d, KT=win[0], KH=win[1], KW=win[2], BLOCK_D=_block_d(d))
    if block_m is None and not INTERPRETED:  # autotuned over configs the compile-only check passed
        _dsa_fwd_tuned[lambda m: (triton.cdiv(N, m["BLOCK_M"]), B * nh)](*args, **meta)
    else:
        block_m = block_m or _default_block_m(d, backward=False)
        _dsa_fwd[(triton.cdiv(N, block_m), B * nh)](*args, **meta, BLOCK_M=block_m, num_warps=4, num_stages=1)
    return out, lse, None


def _dsa_bwd_launch(q, k, v, offsets, out, dout, lse, win, scale, block_m, slab=None, max_offset=None,
                    modes: KernelModes = AUTO, walks=None):
    """dq, dk, dv, d(offsets). dk and dv come from the key-side pass (``dsa_triton_pull``) when the offsets'
    bound allows it (``modes.dkv`` "auto"), else from the split mode (the key-side pass at its cap, fp32
    atomics for the queries past it) or, where no bound fits, the query-side pass's atomics."""
    (B, T, H, W, nh, d), N = q.shape, math.prod(q.shape[1:4])
    kv_args, T = _slab_args(q, k, slab)
    dq, doff = torch.empty_like(q), torch.empty_like(offsets)
    if modes.halo == "fused":  # the fused halo-dense backward where it can run, else auto's kernels
        if (got := fused_backward(q, k, v, offsets, out, dout, lse, win, scale, slab, max_offset, walks)) is not None:
            return got
        modes = KernelModes(dkv=modes.dkv)
    bound, why = ((None, "dkv mode atomic") if modes.dkv == "atomic"
                  else pull_bound(offsets, max_offset, slab, win[0], win[2]))
    split = None  # a bound past the key-side pass's cap, or none: it still takes the queries within its cap
    if bound is None and modes.dkv == "auto":
        split = split_plan(offsets, win, max_offset, slab)
        if split is not None:
            bound, why = split.bound, split.why
    log_mode_once("split" if split else "atomic" if bound is None else "pull", why,
                  f"bound {bound:g}" if split else None)  # the split mode: once per bound
    # the query side on tensor cores (dsa_triton_halo) where the halo kernels may run: the pull mode's records
    halo, halo_why = (False, "the split mode: the gather query side") if split else halo_choice(
        "bwd", q, win, bound, why, block_m, modes)
    if bound is not None:
        log_halo_once("backward's query side", halo, halo_why)
    meta = dict(HEAD_DIM=d, KT=win[0], KH=win[1], KW=win[2], BLOCK_D=_block_d(d), PULL=bound is not None,
                SPLIT=split is not None)

    def query_pass(dk, dv, rec, bh0, count, elo, ehi):
        args = (q, k, v, offsets, out, dout, lse, dq, dk, dv, doff, rec, rec if split is None else split.flags,
                scale, scale * LOG2E, N, T, H, W, nh, *kv_args, bh0, elo, ehi)
        if block_m is None and not INTERPRETED:
            tuned = (_dsa_bwd_split_tuned if meta["SPLIT"] else _dsa_bwd_pull_tuned if meta["PULL"]
                     else _dsa_bwd_tuned)
            tuned[lambda m: (triton.cdiv(N, m["BLOCK_M"]), count)](*args, **meta)
        else:
            bm = block_m or _default_block_m(d, backward=True)
            _dsa_bwd[(triton.cdiv(N, bm), count)](*args, **meta, BLOCK_M=bm, num_warps=4, num_stages=1)

    if bound is None:
        # dk, dv receive atomics from many programs: fp32 accumulators per chunk of (batch, head)
        # pairs, each pair's keys contiguous, cast into dk, dv after the chunk's launch
        NK = kv_args[0]
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        chunk = atomic_chunk(B * nh, NK, d)
        acc = torch.empty((2, chunk, NK, d), device=q.device, dtype=torch.float32)
        heads = (dk.view(B, NK, nh, d), dv.view(B, NK, nh, d))
        for bh0 in range(0, B * nh, chunk):
            count = min(chunk, B * nh - bh0)
            acc.zero_()
            query_pass(acc[0], acc[1], acc[0], bh0, count, 0, 0)  # REC unused
            for i in range(count):
                b, h = divmod(bh0 + i, nh)
                for grad, part in zip(heads, acc):
                    grad[b, :, h].copy_(part[i])
        return dq, dk, dv, doff
    # every key is written once by the key-side pass: the result dtype directly, no zeroing
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    K = win[0] * win[1] * win[2]
    chunk = rec_chunk(B * nh, win, N)
    acc = None  # the split mode: the flagged queries' atomics, fp32, per chunk
    if split is not None:
        chunk = split_chunk(B * nh, win, N, kv_args[0], d)
        acc = torch.empty((2, chunk, kv_args[0], d), device=q.device, dtype=torch.float32)
    rec = torch.empty((chunk, REC_FIELDS, K, N), device=q.device, dtype=torch.float32)
    elo, ehi = pull_span(bound)
    grid_args = (N, T, H, W, nh, *kv_args)
    for bh0 in range(0, B * nh, chunk):
        count = min(chunk, B * nh - bh0)
        if halo:
            halo_backward_query(q, k, v, offsets, out, dout, lse, win, scale * LOG2E, scale, bound, grid_args, dq,
                                doff, rec, bh0, count)
        elif acc is not None:
            acc.zero_()
            query_pass(acc[0], acc[1], rec, bh0, count, elo, ehi)
        else:
            query_pass(dk, dv, rec, bh0, count, elo, ehi)
        pull_launch(q, dout, rec, dk, dv, win, bound, grid_args, bh0, count, acc)
    return dq, dk, dv, doff


class _DSATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, win, scale, block_m, slab=None, max_offset=None, modes=AUTO):
        q, k, v, offsets = (x.contiguous() for x in (q, k, v, offsets))
        _check_launch(q, k, v, offsets)
        out, lse, walks = _dsa_fwd_launch(q, k, v, offsets, win, scale, block_m, slab, max_offset, modes)
        # the fused forward's sample order and records, kept for its backward where a gradient is asked for
        keep = walks is not None and modes.keep_walks and any(ctx.needs_input_grad[:4])
        ctx.save_for_backward(q, k, v, offsets, out, lse, *(walks[1:] if keep else ()))
        ctx.meta = (win, scale, block_m, slab, max_offset, modes, walks[0] if keep else None)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, out, lse, *kept = ctx.saved_tensors
        win, scale, block_m, slab, max_offset, modes, walks_key = ctx.meta
        dout = dout.contiguous().to(q.dtype)
        dq, dk, dv, doff = _dsa_bwd_launch(q, k, v, offsets, out, dout, lse, win, scale, block_m, slab, max_offset,
                                           modes, (walks_key, *kept) if kept else None)
        return dq, dk, dv, doff, None, None, None, None, None, None


def dsa_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    block_m: int | None = None,
    max_offset: float | None = None,
    modes: KernelModes | None = None,
) -> torch.Tensor:
    """3D-DSA with the fused Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1).

    Same arguments and result as ``dsa_reference``; q/k/v in fp16/bf16/fp32 (computed
    in fp32), offsets in fp16/bf16/fp32. ``block_m`` (a power of two, >= 16) is queries
    per program for forward and backward; default: a heuristic on the head dim.
    ``max_offset``: a bound on ``|offsets|`` the caller guarantees. The call runs at it: it sizes
    the backward's key-side pass (``dsa_triton_pull``) and the halo kernels and picks between them
    and the gather kernels. A query with an offset beyond it gets a NaN ``dq``. Without it: the
    gather forward and the split backward at the key-side pass's cap. No host sync either way.
    ``modes``: which kernel families run (``kernels.dsa_modes.KernelModes``; default ``auto``).
    """
    win = validate_dsa_inputs(q, k, v, offsets, window)
    return _gather_validated(q, k, v, offsets, win, scale, block_m, max_offset=max_offset, modes=modes)


def dsa_triton_slab(q, k, v, offsets, window, q_start: int, kv_start: int, frames: int,
                    scale: float | None = None, block_m: int | None = None,
                    max_offset: float | None = None, modes: KernelModes | None = None) -> torch.Tensor:
    """``dsa_slab`` (the queries of some frames against the frames of k, v they reach) with the
    fused kernels: same arguments and result as ``dsa_reference.dsa_slab``; ``max_offset`` and
    ``modes`` as ``dsa_triton``."""
    win = validate_slab_inputs(q, k, v, offsets, window, q_start, kv_start, frames)
    slab = (k.shape[1], int(frames), int(q_start), int(kv_start))
    return _gather_validated(q, k, v, offsets, win, scale, block_m, slab, max_offset, modes)


def _gather_validated(q, k, v, offsets, win: tuple[int, int, int], scale: float | None, block_m: int | None,
                     slab=None, max_offset: float | None = None, modes: KernelModes | None = None) -> torch.Tensor:
    """The gather kernels on inputs an entry point has validated (``win``: its window tuple);
    ``dsa_triton`` and ``dsa_triton_slab`` call it."""
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    modes = AUTO if modes is None else modes
    if not isinstance(modes, KernelModes):
        raise TypeError(f"modes={modes!r}: pass a kernels.dsa_modes.KernelModes (or None for auto)")
    return _DSATriton.apply(q, k, v, offsets, win, scale, block_m, slab, max_offset, modes)


def atomic_chunk(pairs: int, key_tokens: int, head_dim: int) -> int:
    """(batch, head) pairs per atomic-mode launch so the fp32 dk, dv accumulators stay within
    ``ATOMIC_BUDGET_BYTES``."""
    return pairs_within(pairs, 2 * key_tokens * head_dim * 4, ATOMIC_BUDGET_BYTES)
