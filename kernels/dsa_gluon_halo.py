"""The fused halo-dense forward of 3D-DSA in Triton's Gluon dialect (sm_90): the algorithm of
``dsa_halo_dense`` (its blocked PyTorch mirror, tested against the reference) on one 3D query tile
per program, with the tile's scores and probabilities in shared memory.

One program = a 1 x 8 x 8 query tile of one (batch, head) pair, 8 warps, 168 KB of shared memory:

1. ``Q`` (64 x d, bf16) into shared memory.
2. Per halo frame ``f`` (at most kt + ELO + EHI frames, ELO = ceil(bound), EHI = floor(bound) + 1):
   the frame's halo keys (``FY x FX`` positions, in ``NCH`` chunks of 64 rows) one chunk at a time
   into shared memory, ``S = Q K^T`` per chunk on tensor cores (``warpgroup_mma``), stored into the
   frame's score buffer ``S_s (64 x SW)`` in fp16 (scores are scaled by ``d^-1/2`` after: an fp16
   rounding of a score of 30 moves its logit by about 1e-3); then per window layer ``jt`` whose
   samples can reach ``f``, in chunks of ``JC`` samples: their positions, clamped, their corners in
   ``f`` and the trilinear weights, the corners' scores read back with a shared-memory gather and
   summed, fp32, into the samples' scores ``Z_s (64 x KT*KP)``.
3. Softmax over the window (base 2; the log-sum-exp kept as the gather kernels keep it, so their
   backward can follow this forward); the unnormalised probabilities written over ``Z_s``.
4. Per halo frame again: the probabilities times the corners' weights scatter-added into ``S_s``
   (now the frame's ``P``, zeroed first: ``atomic_scatter_add`` on shared memory, a native
   ``red.shared.add.f16``), then ``O += P V`` per chunk of 64 keys on tensor cores, ``P`` cast to
   bf16 as flash attention casts its probabilities.
5. ``O`` to memory; a query whose corners leave the halo (an offset past the promised bound) gets
   a NaN row, as in the other bounded kernels.

Needs Triton >= 3.8 (Gluon's shared-memory gather and atomic scatter-add: ``gluon_halo_refusal``
says why not where they are missing). No GPU has run it yet: ``tests/test_compile_sm90.py``
compiles it for sm_90 here (registers, spills, shared memory, the dots as ``wgmma``), and
``dsa_halo_dense`` is the algorithm it must match.
"""

from __future__ import annotations

import math

import torch

__all__ = ["gluon_halo_refusal", "gluon_halo_constexprs", "GLUON_WARPS", "TILE_Y", "TILE_X"]

GLUON_WARPS = 8
TILE_Y, TILE_X = 8, 8  # queries per tile: one frame, 8 x 8 tokens (64 rows: one wgmma M)
SAMPLE_CHUNK = 16  # samples of one window layer handled at once (registers: 64 x 16 per tensor)


def gluon_halo_refusal() -> str | None:
    """Why this Triton cannot build the Gluon halo forward, or None where it can."""
    try:
        import triton
        from triton.experimental.gluon.language import _core
    except ImportError as e:  # no triton, or one without Gluon
        return f"Triton's Gluon dialect does not import ({e})"
    if not hasattr(_core.shared_memory_descriptor, "atomic_scatter_add"):
        return (f"Triton {triton.__version__}'s Gluon has no shared-memory atomic scatter-add (Triton >= 3.8 has it): "
                "the fused halo-dense forward cannot be built")
    return None


def gluon_halo_constexprs(head_dim: int, window, bound: float) -> dict:
    """The compile-time sizes of the Gluon halo forward for a head dim, window and bound: the halo's
    largest extent per axis (``FT`` frames, ``FY x FX`` positions per frame), its chunks of 64 keys
    per frame, the samples per layer padded to whole chunks."""
    kt, kh, kw = (int(w) for w in window)
    elo, ehi = math.ceil(bound), math.floor(bound) + 1
    fy, fx = TILE_Y - 1 + kh - 1 + elo + ehi + 1, TILE_X - 1 + kw - 1 + elo + ehi + 1
    nch = -(-fy * fx // 64)
    return dict(HEAD_DIM=int(head_dim), KT=kt, KH=kh, KW=kw, ELO=elo, EHI=ehi, FY=fy, FX=fx,
                NCH=nch, SW=1 << (nch * 64 - 1).bit_length(), KTP=1 << (kt - 1).bit_length(),
                KP=1 << (kh * kw - 1).bit_length(), JC=SAMPLE_CHUNK, TY=TILE_Y, TX=TILE_X)


def _kernel():
    """The Gluon kernel, built on first use (it needs the Gluon imports ``gluon_halo_refusal`` checks)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper

    @gluon.jit
    def _axis(base, off, size, lo):
        """Clamped position along one axis: (lower corner, upper corner) relative to ``lo``, and the
        fraction; positions are fp32."""
        p = gl.minimum(gl.maximum(base.to(gl.float32) + off, 0.0), (size - 1).to(gl.float32))
        f0 = gl.floor(p)
        i0 = f0.to(gl.int32)
        i1 = gl.minimum(i0 + 1, size - 1)
        return i0 - lo, i1 - lo, p - f0

    @gluon.jit
    def _layer_samples(OFF, off_row, q_ok, jt, j0, st, sy, sx, T, H, W, lo_t, lo_y, lo_x, fyn, fxn, f,
                       KH: gl.constexpr, KW: gl.constexpr, JC: gl.constexpr, layout: gl.constexpr):
        """The samples ``j0 .. j0 + JC`` of window layer ``jt`` of every query: per sample its weight
        in frame ``f`` (0 where it does not touch it), its 4 (y, x) corners as indices into the frame's
        halo with their weights, and whether a corner leaves the halo."""
        j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, layout))
        j_ok = j < KH * KW
        jy = j // KW
        jx = j % KW
        ok = q_ok[:, None] & j_ok[None, :]
        ptr = OFF + off_row[:, None] + ((jt * KH * KW + j) * 3)[None, :]
        ot = gl.load(ptr, mask=ok, other=0.0).to(gl.float32)
        oy = gl.load(ptr + 1, mask=ok, other=0.0).to(gl.float32)
        ox = gl.load(ptr + 2, mask=ok, other=0.0).to(gl.float32)
        t0, t1, ft = _axis(st + jt + gl.zeros_like(jy)[None, :], ot, T, lo_t)
        y0, y1, fy = _axis(sy[:, None] + jy[None, :], oy, H, lo_y)
        x0, x1, fx = _axis(sx[:, None] + jx[None, :], ox, W, lo_x)
        wt = gl.where(t0 == f, 1.0 - ft, 0.0) + gl.where(t1 == f, ft, 0.0)
        wt = gl.where(ok, wt, 0.0)
        out = (t0 < 0) | (y0 < 0) | (x0 < 0) | (y1 >= fyn) | (x1 >= fxn)
        return wt, y0, y1, fy, x0, x1, fx, ok & out

    @gluon.jit
    def _halo_dense_fwd(Q, K, V, OFF, OUT, LSE, qk_scale, T, H, W, NH,
                        HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
                        ELO: gl.constexpr, EHI: gl.constexpr, FY: gl.constexpr, FX: gl.constexpr,
                        NCH: gl.constexpr, SW: gl.constexpr, KTP: gl.constexpr, KP: gl.constexpr,
                        JC: gl.constexpr, TY: gl.constexpr, TX: gl.constexpr):
        M: gl.constexpr = TY * TX
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte rows of q, k, v
        smp: gl.constexpr = gl.BlockedLayout([1, 1], [4, 8], [8, 1], [1, 0])  # (query, sample) tensors
        s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
        o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, HEAD_DIM // 2, 16])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        rows_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], gl.bfloat16)
        keys_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], gl.bfloat16)
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, 64], gl.bfloat16)

        tile = gl.program_id(0)
        bh = gl.program_id(1)
        b = bh // NH
        h = bh % NH
        tiles_x = gl.cdiv(W, TX)
        tiles_y = gl.cdiv(H, TY)
        x0 = (tile % tiles_x) * TX
        y0 = ((tile // tiles_x) % tiles_y) * TY
        t = tile // (tiles_x * tiles_y)
        N = T * H * W
        row_stride = NH * HEAD_DIM
        base = (b * N * NH + h) * HEAD_DIM

        # the tile's queries and their window starts (the window shifted inward at borders)
        m = gl.arange(0, M, layout=gl.SliceLayout(1, smp))
        qy = y0 + m // TX
        qx = x0 + m % TX
        q_ok = (qy < H) & (qx < W)
        st = gl.minimum(gl.maximum(t - KT // 2, 0), T - KT)
        sy = gl.minimum(gl.maximum(qy - KH // 2, 0), H - KH)
        sx = gl.minimum(gl.maximum(qx - KW // 2, 0), W - KW)
        # the halo: every corner a sample within the bound can reach (ELO below, EHI above the window)
        sy_first = gl.minimum(gl.maximum(y0 - KH // 2, 0), H - KH)
        sy_last = gl.minimum(gl.maximum(gl.minimum(y0 + TY, H) - 1 - KH // 2, 0), H - KH)
        sx_first = gl.minimum(gl.maximum(x0 - KW // 2, 0), W - KW)
        sx_last = gl.minimum(gl.maximum(gl.minimum(x0 + TX, W) - 1 - KW // 2, 0), W - KW)
        lo_t = gl.maximum(st - ELO, 0)
        lo_y = gl.maximum(sy_first - ELO, 0)
        lo_x = gl.maximum(sx_first - ELO, 0)
        ftn = gl.minimum(st + KT - 1 + EHI, T - 1) - lo_t + 1
        fyn = gl.minimum(sy_last + KH - 1 + EHI, H - 1) - lo_y + 1
        fxn = gl.minimum(sx_last + KW - 1 + EHI, W - 1) - lo_x + 1
        off_row = ((b * N + (t * H + qy) * W + qx) * NH + h) * (KT * KH * KW * 3)

        # Q into shared memory
        lm = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
        lqy = y0 + lm // TX
        lqx = x0 + lm % TX
        lq_ok = (lqy < H) & (lqx < W)
        q_ptr = Q + base + ((t * H + lqy) * W + lqx)[:, None] * row_stride + cols[None, :]
        q_s = gl.allocate_shared_memory(gl.bfloat16, [M, HEAD_DIM], rows_l,
                                        gl.load(q_ptr, mask=lq_ok[:, None], other=0.0).to(gl.bfloat16))
        kv_s = gl.allocate_shared_memory(gl.bfloat16, [64, HEAD_DIM], keys_l)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [M, 64], p_l)
        S_s = gl.allocate_shared_memory(gl.float16, [M, SW], flat)  # the frame's scores, then its P
        Z_s = gl.allocate_shared_memory(gl.float32, [M, KTP * KP], flat)  # the samples' scores, then p
        for c in gl.static_range(KTP * KP // JC):
            Z_s.slice(c * JC, JC, dim=1).store(gl.zeros([M, JC], gl.float32, smp))
        broken = gl.zeros([M], gl.int32, gl.SliceLayout(1, smp))
        kr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))

        # pass 1: the samples' scores, frame by frame
        for f in range(0, ftn):
            tf = lo_t + f
            for c in gl.static_range(NCH):
                r = c * 64 + kr
                hy = r // FX
                hx = r % FX
                k_ok = (hy < fyn) & (hx < fxn)
                k_ptr = K + base + ((tf * H + lo_y + hy) * W + lo_x + hx)[:, None] * row_stride + cols[None, :]
                gl.barrier()
                kv_s.store(gl.load(k_ptr, mask=k_ok[:, None], other=0.0).to(gl.bfloat16))
                hopper.fence_async_shared()
                s = hopper.warpgroup_mma(q_s, kv_s.permute((1, 0)), gl.zeros([M, 64], gl.float32, s_mma))
                S_s.slice(c * 64, 64, dim=1).store(s.to(gl.float16))
            gl.barrier()
            for jt in gl.static_range(KT):
                if (tf >= st + jt - ELO) & (tf <= st + jt + EHI):
                    for j0 in gl.static_range(0, KP, JC):
                        wt, y0c, y1c, fy, x0c, x1c, fx, out = _layer_samples(
                            OFF, off_row, q_ok, jt, j0, st, sy, sx, T, H, W, lo_t, lo_y, lo_x, fyn, fxn, f,
                            KH, KW, JC, smp)
                        broken = broken | gl.max(out.to(gl.int32), axis=1)
                        y0c = gl.minimum(gl.maximum(y0c, 0), FY - 1)
                        y1c = gl.minimum(gl.maximum(y1c, 0), FY - 1)
                        x0c = gl.minimum(gl.maximum(x0c, 0), FX - 1)
                        x1c = gl.minimum(gl.maximum(x1c, 0), FX - 1)
                        z = (S_s.gather(y0c * FX + x0c, 1).to(gl.float32) * (1.0 - fy) * (1.0 - fx)
                             + S_s.gather(y0c * FX + x1c, 1).to(gl.float32) * (1.0 - fy) * fx
                             + S_s.gather(y1c * FX + x0c, 1).to(gl.float32) * fy * (1.0 - fx)
                             + S_s.gather(y1c * FX + x1c, 1).to(gl.float32) * fy * fx)
                        zs = Z_s.slice(jt * KP + j0, JC, dim=1)
                        zs.store(zs.load(smp) + wt * z)
            gl.barrier()

        # softmax over the window, base 2
        mx = gl.full([M], -float("inf"), gl.float32, gl.SliceLayout(1, smp))
        for jt in gl.static_range(KT):
            for j0 in gl.static_range(0, KP, JC):
                j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, smp))
                z = gl.where((j < KH * KW)[None, :], Z_s.slice(jt * KP + j0, JC, dim=1).load(smp) * qk_scale,
                             -float("inf"))
                mx = gl.maximum(mx, gl.max(z, axis=1))
        den = gl.zeros([M], gl.float32, gl.SliceLayout(1, smp))
        for jt in gl.static_range(KT):
            for j0 in gl.static_range(0, KP, JC):
                j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, smp))
                zs = Z_s.slice(jt * KP + j0, JC, dim=1)
                e = gl.where((j < KH * KW)[None, :], gl.exp2(zs.load(smp) * qk_scale - mx[:, None]), 0.0)
                den = den + gl.sum(e, axis=1)
                zs.store(e)
        gl.barrier()
        inv = 1.0 / den

        # pass 2: probabilities onto the halo, O = P V, frame by frame
        acc = gl.zeros([M, HEAD_DIM], gl.float32, o_mma)
        zero_p = gl.zeros([M, 64], gl.float16, smp)
        for f in range(0, ftn):
            tf = lo_t + f
            for c in gl.static_range(SW // 64):
                S_s.slice(c * 64, 64, dim=1).store(zero_p)
            gl.barrier()
            for jt in gl.static_range(KT):
                if (tf >= st + jt - ELO) & (tf <= st + jt + EHI):
                    for j0 in gl.static_range(0, KP, JC):
                        wt, y0c, y1c, fy, x0c, x1c, fx, out = _layer_samples(
                            OFF, off_row, q_ok, jt, j0, st, sy, sx, T, H, W, lo_t, lo_y, lo_x, fyn, fxn, f,
                            KH, KW, JC, smp)
                        a = Z_s.slice(jt * KP + j0, JC, dim=1).load(smp) * inv[:, None] * wt
                        keep = (a != 0.0) & (out == 0)
                        S_s.atomic_scatter_add((a * (1.0 - fy) * (1.0 - fx)).to(gl.float16), y0c * FX + x0c, 1, mask=keep)
                        S_s.atomic_scatter_add((a * (1.0 - fy) * fx).to(gl.float16), y0c * FX + x1c, 1, mask=keep)
                        S_s.atomic_scatter_add((a * fy * (1.0 - fx)).to(gl.float16), y1c * FX + x0c, 1, mask=keep)
                        S_s.atomic_scatter_add((a * fy * fx).to(gl.float16), y1c * FX + x1c, 1, mask=keep)
            gl.barrier()
            for c in gl.static_range(NCH):
                r = c * 64 + kr
                hy = r // FX
                hx = r % FX
                k_ok = (hy < fyn) & (hx < fxn)
                v_ptr = V + base + ((tf * H + lo_y + hy) * W + lo_x + hx)[:, None] * row_stride + cols[None, :]
                gl.barrier()
                kv_s.store(gl.load(v_ptr, mask=k_ok[:, None], other=0.0).to(gl.bfloat16))
                p_s.store(S_s.slice(c * 64, 64, dim=1).load(smp).to(gl.bfloat16))
                hopper.fence_async_shared()
                acc = hopper.warpgroup_mma(p_s, kv_s, acc)
            gl.barrier()

        o = gl.convert_layout(acc, ld)
        bad = gl.convert_layout(broken, gl.SliceLayout(1, ld)) != 0
        o = gl.where(bad[:, None], float("nan"), o)
        o_ptr = OUT + base + ((t * H + lqy) * W + lqx)[:, None] * row_stride + cols[None, :]
        gl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=lq_ok[:, None])
        lse = mx + gl.log2(den)
        gl.store(LSE + bh * N + (t * H + qy) * W + qx, lse, mask=q_ok)

    return _halo_dense_fwd


_KERNEL = None


def halo_dense_kernel():
    """The compiled-on-launch Gluon kernel (built once; refused where ``gluon_halo_refusal`` says)."""
    global _KERNEL
    why = gluon_halo_refusal()
    if why is not None:
        raise RuntimeError(why)
    if _KERNEL is None:
        _KERNEL = _kernel()
    return _KERNEL


def halo_dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, window,
                       scale: float, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the Gluon forward on CUDA bf16 inputs (``lse`` base 2, ``(B, nh, N)`` fp32: the
    gather kernels' convention, so their backward can follow it)."""
    B, T, H, W, nh, d = q.shape
    cx = gluon_halo_constexprs(d, window, bound)
    out = torch.empty_like(q)
    lse = torch.empty((B, nh, T * H * W), device=q.device, dtype=torch.float32)
    grid = (T * -(-H // TILE_Y) * -(-W // TILE_X), B * nh)
    halo_dense_kernel()[grid](q, k, v, offsets, out, lse, scale * 1.4426950408889634, T, H, W, nh, **cx,
                              num_warps=GLUON_WARPS)
    return out, lse


def aot_variants(shape) -> list[dict]:
    """The Gluon forward as the compile-only check compiles it at ``shape`` (bf16 or fp16, a bound
    given, head dim 128 and window 3x7x7: the Wan shape it was written for): sm_90 only (``warpgroup_mma`` is Hopper's), listed for the record (``auto`` does not pick
    it: no GPU has run it yet). Empty where this Triton cannot build it or the shape has no bound."""
    from .aot import AOT_POINTER_TYPES

    if (shape.dtype == "fp32" or shape.max_offset is None or (shape.head_dim, tuple(shape.window)) != (128, (3, 7, 7))
            or gluon_halo_refusal() is not None):
        return []  # written for the Wan shape (head dim 128, window 3x7x7): compiled there only
    fn = halo_dense_kernel()
    cx = gluon_halo_constexprs(shape.head_dim, shape.window, float(shape.max_offset))
    t = AOT_POINTER_TYPES[shape.dtype]
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: t for n in ("Q", "K", "V", "OFF", "OUT")}, LSE="*fp32", qk_scale="fp32")
    sig.update({n: "constexpr" for n in cx})
    return [dict(kernel="fused_fwd", fn=fn, signature=sig, constexprs=cx, num_warps=GLUON_WARPS, num_stages=1,
                 config=f"tile 1x{TILE_Y}x{TILE_X},JC={cx['JC']}", tensor_cores=True, may_pick=False, archs=("sm_90",),
                 note="the fused halo-dense forward (Gluon): not picked until a GPU run checks it")]
