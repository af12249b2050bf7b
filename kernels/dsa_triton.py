"""Fused Triton kernels for 3D Deformable Slide Attention (3D-DSA): the gather kernels.

Backend ``triton_gather``; since the tiled kernels (``dsa_triton_tiled.py``, backend
``triton``) exist, these are their fallback -- calls whose halo does not fit a tile, logged --
and the baseline they are timed against (benchmarks/gpu_check/).

Semantics are those of ``dsa_reference`` (docs/architecture.md, "3D-DSA: the operator"):
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
  * dk, dv are scattered to the 8 corners of every sample with fp32 ``atomic_add``
    (many queries sample the same key) into fp32 buffers, cast at the end;
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
  are untested. dk/dv use fp32 atomics, so backward is not bit-deterministic run to run.
  The sample loop is scalar-per-query (gathers, no tensor-core dot), which is the
  natural shape for K independent keys per query; it is memory-bound by design.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .dsa_reference import validate_dsa_inputs, validate_slab_inputs

__all__ = ["dsa_triton", "dsa_triton_slab", "INTERPRETED"]

LOG2E = 1.4426950408889634

# The @triton.jit decorator reads TRITON_INTERPRET when this module is imported; this
# records which kind of kernel we got (CPU tensors are only legal when interpreted).
try:
    INTERPRETED = bool(triton.knobs.runtime.interpret)
except AttributeError:  # triton < 3.4 has no knobs; it read the variable directly
    import os

    INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


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

    for j in range(KS):
        jt = j // (KH * KW)
        jy = (j // KW) % KH
        jx = j % KW
        # -- sample position, clamped per coordinate; trilinear corners
        t0, t1, wt, _ = _axis_position(off_base + j * 3 + 0, mask_m, st + jt, T)
        y0, y1, wy, _ = _axis_position(off_base + j * 3 + 1, mask_m, sy + jy, H)
        x0, x1, wx, _ = _axis_position(off_base + j * 3 + 2, mask_m, sx + jx, W)
        t0 = tl.minimum(tl.maximum(t0 - K0, 0), TK - 1)  # whole-grid frame -> held frame
        t1 = tl.minimum(tl.maximum(t1 - K0, 0), TK - 1)
        r00 = (t0 * H + y0) * W
        r01 = (t0 * H + y1) * W
        r10 = (t1 * H + y0) * W
        r11 = (t1 * H + y1) * W
        w00 = (1.0 - wt) * (1.0 - wy)
        w01 = (1.0 - wt) * wy
        w10 = wt * (1.0 - wy)
        w11 = wt * wy
        # -- interpolated key
        k_j = (w00 * (1.0 - wx))[:, None] * _gather(Kx, kv_base, r00 + x0, cols, mask2, row_stride)
        k_j += (w00 * wx)[:, None] * _gather(Kx, kv_base, r00 + x1, cols, mask2, row_stride)
        k_j += (w01 * (1.0 - wx))[:, None] * _gather(Kx, kv_base, r01 + x0, cols, mask2, row_stride)
        k_j += (w01 * wx)[:, None] * _gather(Kx, kv_base, r01 + x1, cols, mask2, row_stride)
        k_j += (w10 * (1.0 - wx))[:, None] * _gather(Kx, kv_base, r10 + x0, cols, mask2, row_stride)
        k_j += (w10 * wx)[:, None] * _gather(Kx, kv_base, r10 + x1, cols, mask2, row_stride)
        k_j += (w11 * (1.0 - wx))[:, None] * _gather(Kx, kv_base, r11 + x0, cols, mask2, row_stride)
        k_j += (w11 * wx)[:, None] * _gather(Kx, kv_base, r11 + x1, cols, mask2, row_stride)
        # -- interpolated value
        v_j = (w00 * (1.0 - wx))[:, None] * _gather(V, kv_base, r00 + x0, cols, mask2, row_stride)
        v_j += (w00 * wx)[:, None] * _gather(V, kv_base, r00 + x1, cols, mask2, row_stride)
        v_j += (w01 * (1.0 - wx))[:, None] * _gather(V, kv_base, r01 + x0, cols, mask2, row_stride)
        v_j += (w01 * wx)[:, None] * _gather(V, kv_base, r01 + x1, cols, mask2, row_stride)
        v_j += (w10 * (1.0 - wx))[:, None] * _gather(V, kv_base, r10 + x0, cols, mask2, row_stride)
        v_j += (w10 * wx)[:, None] * _gather(V, kv_base, r10 + x1, cols, mask2, row_stride)
        v_j += (w11 * (1.0 - wx))[:, None] * _gather(V, kv_base, r11 + x0, cols, mask2, row_stride)
        v_j += (w11 * wx)[:, None] * _gather(V, kv_base, r11 + x1, cols, mask2, row_stride)
        # -- online softmax update (base 2)
        s = tl.sum(q * k_j, axis=1) * qk_scale
        m_new = tl.maximum(m_i, s)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v_j
        m_i = m_new

    # -- epilogue: normalise, store out and the log-sum-exp for backward
    acc = acc / l_i[:, None]
    out_ptrs = _row_ptrs(OUT, head_base, offs_m, cols, row_stride)
    tl.store(out_ptrs, acc.to(OUT.dtype.element_ty), mask=mask2)
    tl.store(LSE + pid_bh.to(tl.int64) * N + offs_m, m_i + tl.math.log2(l_i), mask=mask_m)


# -----------------------------------------------------------------------------
# Backward


@triton.jit
def _corner_bwd(Kx, V, kv_base, tok, cols, mask2, row_stride, q, do):
    """One corner: its key row and the dots q.k_c, do.v_c (BLOCK_M scalars each)."""
    k_c = _gather(Kx, kv_base, tok, cols, mask2, row_stride)
    v_c = _gather(V, kv_base, tok, cols, mask2, row_stride)
    return k_c, tl.sum(q * k_c, axis=1), tl.sum(do * v_c, axis=1)


@triton.jit
def _corner_scatter(DK, DV, kv_base, tok, cols, mask2, row_stride, w, gk, gv):
    """dk[c] += w * gk, dv[c] += w * gv (fp32 atomics: other queries hit the same rows).
    ``relaxed``: the sums only need atomicity, no ordering against other memory (the default
    ``acq_rel`` adds fences to every one); the buffers are read after the kernel ends."""
    tl.atomic_add(_row_ptrs(DK, kv_base, tok, cols, row_stride), w[:, None] * gk, mask=mask2, sem="relaxed")
    tl.atomic_add(_row_ptrs(DV, kv_base, tok, cols, row_stride), w[:, None] * gv, mask=mask2, sem="relaxed")


@triton.jit
def _dsa_bwd(
    Q, Kx, V, OFF, OUT, DOUT, LSE,
    DQ, DK, DV, DOFF,
    sm_scale, qk_scale,
    N, T, H, W, NH,
    NK, TK, Q0, K0,
    HEAD_DIM: tl.constexpr,
    KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // NH
    h = pid_bh % NH
    KS: tl.constexpr = KT * KH * KW
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

    q = _gather(Q, head_base, offs_m, cols, mask2, row_stride)
    do = _gather(DOUT, head_base, offs_m, cols, mask2, row_stride)
    o = _gather(OUT, head_base, offs_m, cols, mask2, row_stride)
    delta = tl.sum(do * o, axis=1)  # = sum_j a_j (do . v_j)
    lse = tl.load(LSE + pid_bh.to(tl.int64) * N + offs_m, mask=mask_m, other=0.0)
    off_row = ((b.to(tl.int64) * N + offs_m) * NH + h) * (KS * 3)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(KS):
        jt = j // (KH * KW)
        jy = (j // KW) % KH
        jx = j % KW
        t0, t1, wt, in_t = _axis_position(OFF + off_row + j * 3 + 0, mask_m, st + jt, T)
        y0, y1, wy, in_y = _axis_position(OFF + off_row + j * 3 + 1, mask_m, sy + jy, H)
        x0, x1, wx, in_x = _axis_position(OFF + off_row + j * 3 + 2, mask_m, sx + jx, W)
        t0 = tl.minimum(tl.maximum(t0 - K0, 0), TK - 1)  # whole-grid frame -> held frame
        t1 = tl.minimum(tl.maximum(t1 - K0, 0), TK - 1)
        r00 = (t0 * H + y0) * W
        r01 = (t0 * H + y1) * W
        r10 = (t1 * H + y0) * W
        r11 = (t1 * H + y1) * W
        ut = 1.0 - wt
        uy = 1.0 - wy
        ux = 1.0 - wx

        # -- recompute: corners (t, y, x) in {0,1}^3; qk_c = q.k_c, dv_c = do.v_c
        k000, qk000, dv000 = _corner_bwd(Kx, V, kv_base, r00 + x0, cols, mask2, row_stride, q, do)
        k001, qk001, dv001 = _corner_bwd(Kx, V, kv_base, r00 + x1, cols, mask2, row_stride, q, do)
        k_j = (ut * uy * ux)[:, None] * k000 + (ut * uy * wx)[:, None] * k001
        k010, qk010, dv010 = _corner_bwd(Kx, V, kv_base, r01 + x0, cols, mask2, row_stride, q, do)
        k011, qk011, dv011 = _corner_bwd(Kx, V, kv_base, r01 + x1, cols, mask2, row_stride, q, do)
        k_j += (ut * wy * ux)[:, None] * k010 + (ut * wy * wx)[:, None] * k011
        k100, qk100, dv100 = _corner_bwd(Kx, V, kv_base, r10 + x0, cols, mask2, row_stride, q, do)
        k101, qk101, dv101 = _corner_bwd(Kx, V, kv_base, r10 + x1, cols, mask2, row_stride, q, do)
        k_j += (wt * uy * ux)[:, None] * k100 + (wt * uy * wx)[:, None] * k101
        k110, qk110, dv110 = _corner_bwd(Kx, V, kv_base, r11 + x0, cols, mask2, row_stride, q, do)
        k111, qk111, dv111 = _corner_bwd(Kx, V, kv_base, r11 + x1, cols, mask2, row_stride, q, do)
        k_j += (wt * wy * ux)[:, None] * k110 + (wt * wy * wx)[:, None] * k111

        # -- probabilities from the saved log-sum-exp; softmax backward
        qk = (ut * (uy * (ux * qk000 + wx * qk001) + wy * (ux * qk010 + wx * qk011))
              + wt * (uy * (ux * qk100 + wx * qk101) + wy * (ux * qk110 + wx * qk111)))
        dov = (ut * (uy * (ux * dv000 + wx * dv001) + wy * (ux * dv010 + wx * dv011))
               + wt * (uy * (ux * dv100 + wx * dv101) + wy * (ux * dv110 + wx * dv111)))
        a = tl.math.exp2(qk * qk_scale - lse)
        a = tl.where(mask_m, a, 0.0)
        ds = a * (dov - delta) * sm_scale  # d loss / d <q, k_j>
        dq += ds[:, None] * k_j

        # -- dk, dv: scatter to the 8 corners
        gk = ds[:, None] * q
        gv = a[:, None] * do
        _corner_scatter(DK, DV, kv_base, r00 + x0, cols, mask2, row_stride, ut * uy * ux, gk, gv)
        _corner_scatter(DK, DV, kv_base, r00 + x1, cols, mask2, row_stride, ut * uy * wx, gk, gv)
        _corner_scatter(DK, DV, kv_base, r01 + x0, cols, mask2, row_stride, ut * wy * ux, gk, gv)
        _corner_scatter(DK, DV, kv_base, r01 + x1, cols, mask2, row_stride, ut * wy * wx, gk, gv)
        _corner_scatter(DK, DV, kv_base, r10 + x0, cols, mask2, row_stride, wt * uy * ux, gk, gv)
        _corner_scatter(DK, DV, kv_base, r10 + x1, cols, mask2, row_stride, wt * uy * wx, gk, gv)
        _corner_scatter(DK, DV, kv_base, r11 + x0, cols, mask2, row_stride, wt * wy * ux, gk, gv)
        _corner_scatter(DK, DV, kv_base, r11 + x1, cols, mask2, row_stride, wt * wy * wx, gk, gv)

        # -- d(position): derivative of the trilinear weights; e_c = dL/d(corner weight)
        e000 = ds * qk000 + a * dv000
        e001 = ds * qk001 + a * dv001
        e010 = ds * qk010 + a * dv010
        e011 = ds * qk011 + a * dv011
        e100 = ds * qk100 + a * dv100
        e101 = ds * qk101 + a * dv101
        e110 = ds * qk110 + a * dv110
        e111 = ds * qk111 + a * dv111
        gpt = (uy * (ux * (e100 - e000) + wx * (e101 - e001))
               + wy * (ux * (e110 - e010) + wx * (e111 - e011)))
        gpy = (ut * (ux * (e010 - e000) + wx * (e011 - e001))
               + wt * (ux * (e110 - e100) + wx * (e111 - e101)))
        gpx = (ut * (uy * (e001 - e000) + wy * (e011 - e010))
               + wt * (uy * (e101 - e100) + wy * (e111 - e110)))
        doff_ptr = DOFF + off_row + j * 3
        out_ty = DOFF.dtype.element_ty
        tl.store(doff_ptr + 0, tl.where(in_t, gpt, 0.0).to(out_ty), mask=mask_m)
        tl.store(doff_ptr + 1, tl.where(in_y, gpy, 0.0).to(out_ty), mask=mask_m)
        tl.store(doff_ptr + 2, tl.where(in_x, gpx, 0.0).to(out_ty), mask=mask_m)

    tl.store(_row_ptrs(DQ, head_base, offs_m, cols, row_stride), dq.to(DQ.dtype.element_ty), mask=mask2)


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


def _dsa_fwd_launch(q, k, v, offsets, win, scale, block_m, slab=None):
    B, T, H, W, nh, d = q.shape
    N = T * H * W
    kv_args, T = _slab_args(q, k, slab)
    block_m = block_m or _default_block_m(d, backward=False)
    out = torch.empty_like(q)
    lse = torch.empty((B, nh, N), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(N, block_m), B * nh)
    _dsa_fwd[grid](
        q, k, v, offsets, out, lse,
        scale * LOG2E,
        N, T, H, W, nh, *kv_args,
        HEAD_DIM=d, KT=win[0], KH=win[1], KW=win[2],
        BLOCK_M=block_m, BLOCK_D=_block_d(d),
        num_warps=4,
    )
    return out, lse


def _dsa_bwd_launch(q, k, v, offsets, out, dout, lse, win, scale, block_m, slab=None):
    B, T, H, W, nh, d = q.shape
    N = T * H * W
    kv_args, T = _slab_args(q, k, slab)
    block_m = block_m or _default_block_m(d, backward=True)
    dq = torch.empty_like(q)
    # dk, dv receive atomics from many programs: fp32 accumulators, cast at the end
    dk = torch.zeros(k.shape, device=q.device, dtype=torch.float32)
    dv = torch.zeros(v.shape, device=q.device, dtype=torch.float32)
    doff = torch.empty_like(offsets)
    grid = (triton.cdiv(N, block_m), B * nh)
    _dsa_bwd[grid](
        q, k, v, offsets, out, dout, lse,
        dq, dk, dv, doff,
        scale, scale * LOG2E,
        N, T, H, W, nh, *kv_args,
        HEAD_DIM=d, KT=win[0], KH=win[1], KW=win[2],
        BLOCK_M=block_m, BLOCK_D=_block_d(d),
        num_warps=4,
    )
    return dq, dk.to(k.dtype), dv.to(v.dtype), doff


class _DSATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, win, scale, block_m, slab=None):
        q, k, v, offsets = (x.contiguous() for x in (q, k, v, offsets))
        _check_launch(q, k, v, offsets)
        out, lse = _dsa_fwd_launch(q, k, v, offsets, win, scale, block_m, slab)
        ctx.save_for_backward(q, k, v, offsets, out, lse)
        ctx.meta = (win, scale, block_m, slab)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, out, lse = ctx.saved_tensors
        win, scale, block_m, slab = ctx.meta
        dout = dout.contiguous().to(q.dtype)
        dq, dk, dv, doff = _dsa_bwd_launch(q, k, v, offsets, out, dout, lse, win, scale, block_m, slab)
        return dq, dk, dv, doff, None, None, None, None


def dsa_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """3D-DSA with the fused Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1).

    Same arguments and result as ``dsa_reference``; q/k/v in fp16/bf16/fp32 (computed
    in fp32), offsets in fp16/bf16/fp32. ``block_m`` (a power of two, >= 16) is queries
    per program for forward and backward; default: a heuristic on the head dim.
    """
    win = validate_dsa_inputs(q, k, v, offsets, window)
    return _gather_validated(q, k, v, offsets, win, scale, block_m)


def dsa_triton_slab(q, k, v, offsets, window, q_start: int, kv_start: int, frames: int,
                    scale: float | None = None, block_m: int | None = None) -> torch.Tensor:
    """``dsa_slab`` (the queries of some frames against the frames of k, v they reach) with the
    fused kernels: same arguments and result as ``dsa_reference.dsa_slab``."""
    win = validate_slab_inputs(q, k, v, offsets, window, q_start, kv_start, frames)
    slab = (k.shape[1], int(frames), int(q_start), int(kv_start))
    return _gather_validated(q, k, v, offsets, win, scale, block_m, slab)


def _gather_validated(q, k, v, offsets, win: tuple[int, int, int], scale: float | None, block_m: int | None,
                     slab=None) -> torch.Tensor:
    """The gather kernels on inputs an entry point has validated (``win``: its window tuple);
    ``dsa_triton``, ``dsa_triton_slab`` and the tiled kernels' fallback call it."""
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _DSATriton.apply(q, k, v, offsets, win, scale, block_m, slab)
