"""The Gluon code of the fused halo-dense backward (``dsa_gluon_halo`` describes the algorithm and
holds the host side). Imported only where ``dsa_gluon_halo.gluon_halo_refusal`` finds a Triton whose
Gluon has the shared-memory gather and atomic scatter-add (>= 3.8).

One program = one 1 x 8 x 8 query tile of one (batch, head) pair, 8 warps, 216 KB of shared memory,
launched per colour phase (the tiles of one phase share no key, so each adds its halo's dk, dv rows
with plain loads and stores). Four frame loops, each frame's 64-key chunks on tensor cores, the
frame's matrix in ``S_s`` (fp16), the samples' values in ``P_s`` and ``G_s`` (fp32, one buffer per
window layer); every walk over a frame visits only the samples that touch it (each query's run of
its layer's sample order, ``dsa_halo_dense.sample_order``, ``JC`` samples a chunk):

1. ``dP = dO V^T``; the samples' ``dp`` gathered into ``G_s`` and, from the same corners, each one's
   derivative along the sample's position (``d(dp)/dpos = sum_c dP_c dw_c``) added into ``DOFF``.
2. ``S = Q K^T``; the samples' scores gathered into ``P_s`` and ``scale (dp - D) dz/dpos`` added
   into ``DOFF`` (dp is complete after pass 1); then ``p = exp2(z qk_scale - lse)``,
   ``ds = p (dp - D)``, and ``DOFF`` times ``p``: the offsets' gradient
   ``p d(dp)/dpos + scale ds dz/dpos``, done.
3. ``P`` scattered onto the frame (the queries with a sample past its reach found before it);
   ``dV = P^T dO`` (plain adds).
4. ``dS`` (``ds`` times the corners' weights, times ``DS_GAIN`` in fp16) scattered onto the frame;
   ``dQ += dS K``, ``dK = dS^T Q`` (plain adds), both times ``scale / DS_GAIN``.

The dots are asynchronous (``warpgroup_mma(is_async=True)``): while a chunk's run, the warps load the
next chunk's operands and read or write the fp32 rows of ``dK``/``dV``; in passes 1 and 2 the next
frame's first chunk runs while this frame's samples are walked (``_first_chunk``; the forward starts
three: the backward has neither the registers nor the shared memory for more); in passes 3 and 4 the
next frame's P or dS is scattered while the frame's last chunk's dot runs (the first frame's before the
frame loop).

Both parts of the offsets' gradient are taken where their matrix is computed, with the per-sample
factors that are known there (``scale (dp - D)``; ``p`` once the scores are complete), so S and dP
are computed once a frame (an earlier version recomputed both in two more passes: 12 more dots a
frame and two more walks over the samples). Shared memory holds one frame matrix and two per-sample
arrays (96 KB) beside Q, dO, a K/V chunk and the bf16 operand. The dQ accumulator is live in pass 4
alone, and each pass recomputes the tile's geometry (``_where``): held across passes it spilled.
``DOFF``, ``DK`` and ``DV`` are fp32 and zeroed by the caller; a program adds to its own queries'
offset rows only (the same thread reads and writes an element: no barrier needed)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper

from .dsa_gluon_halo_jit import (
    _LT,
    _LX,
    _LY,
    _first_chunk,
    _frame_i32,
    _frame_probs,
    _frame_scores,
    _halo_rows,
    _late,
    _layer_run,
    _layer_samples,
    _order_row,
    _scores_pass,
    _stage,
    _start,
    _zero_samples,
    _zero_tail,
)


@gluon.jit
def _pin(geo):
    """``geo`` with the queries' offset rows passed through an opaque move: what is computed from them
    stays inside the frame loop (hoisted, every layer's addresses would be held across it, and spill)."""
    off_row = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [geo[0]], dtype=gl.int32, is_pure=False, pack=1)
    return (off_row, geo[1], geo[2], geo[3])


@gluon.jit
def _layer_derivs(rbase, a, e, r0, q_ok, f, FX: gl.constexpr, JC: gl.constexpr, layout: gl.constexpr):
    """The forward's ``_layer_samples`` (weight in frame ``f``, corners, fractions, index, within the run)
    and the derivatives: of the weight along t (``-1`` at the lower corner frame, ``+1`` at the upper, 0
    where clamped), the y and x clamps' pass-through (1 or 0), from the records' clamp bits."""
    wt, c00, c01, c10, c11, fy, fx, j, ok, w, t0, t1 = _layer_samples(rbase, a, e, r0, q_ok, f, FX, JC, layout)
    lt = ((w >> _LT) & 1).to(gl.float32)
    dwt = gl.where(t0 == f, -lt, 0.0) + gl.where(t1 == f, lt, 0.0)
    return (wt, c00, c01, c10, c11, fy, fx, dwt, ((w >> _LY) & 1).to(gl.float32), ((w >> _LX) & 1).to(gl.float32),
            j, ok)


@gluon.jit
def _frame_scores_derivs(S_s, Z_s, C_s, D, c_scale, REC, DOFF, ORD, off_row, q_ok, st, lo_t, f, KT: gl.constexpr,
                         KH: gl.constexpr, KW: gl.constexpr, ELO: gl.constexpr, EHI: gl.constexpr, FX: gl.constexpr,
                         JC: gl.constexpr, smp: gl.constexpr, FACTOR: gl.constexpr):
    """A walk over frame ``f``'s matrix ``X`` (``dP`` in pass 1, ``S`` in pass 2; in ``S_s``), per window
    layer only over the samples that touch ``f`` (their run of the sample order): each one's value from
    its corners added to ``Z_s`` (the forward's ``_frame_sample_scores``), and from the same corners its
    derivative along the sample's position, ``sum_c X_c dw_c / dpos``, added into ``DOFF`` -- with
    ``FACTOR``, times ``c_scale (C_s - D)`` (pass 2: ``scale (dp - D)``, dp complete after pass 1)."""
    f = _frame_i32(f)
    ord_row = _order_row(off_row, KT, KH, KW)
    for jt in gl.static_range(KT):
        if (lo_t + f >= st + jt - ELO) & (lo_t + f <= st + jt + EHI):
            a, e, n, rbase = _layer_run(ORD, REC, ord_row, off_row, q_ok, jt, lo_t + f - st - jt, KH * KW, ELO, EHI)
            for r0 in range(0, n, JC):
                wt, c00, c01, c10, c11, fy, fx, dwt, ly, lx, j, ok = _layer_derivs(
                    rbase, a, e, r0, q_ok, f, FX, JC, smp)
                f00 = S_s.gather(c00, 1).to(gl.float32)
                f01 = S_s.gather(c01, 1).to(gl.float32)
                f10 = S_s.gather(c10, 1).to(gl.float32)
                f11 = S_s.gather(c11, 1).to(gl.float32)
                bil = (1.0 - fy) * ((1.0 - fx) * f00 + fx * f01) + fy * ((1.0 - fx) * f10 + fx * f11)
                Z_s[jt].atomic_scatter_add(wt * bil, j, 1, mask=ok)
                gy = ly * ((1.0 - fx) * (f10 - f00) + fx * (f11 - f01))
                gx = lx * ((1.0 - fy) * (f01 - f00) + fy * (f11 - f10))
                if FACTOR:
                    c = (C_s[jt].gather(j, 1) - D[:, None]) * c_scale
                    bil = bil * c
                    wt = wt * c
                dptr = DOFF + off_row[:, None] + (jt * KH * KW + j) * 3
                gl.store(dptr, gl.load(dptr, mask=ok, other=0.0) + dwt * bil, mask=ok)  # bil, wt: times c
                gl.store(dptr + 1, gl.load(dptr + 1, mask=ok, other=0.0) + wt * gy, mask=ok)
                gl.store(dptr + 2, gl.load(dptr + 2, mask=ok, other=0.0) + wt * gx, mask=ok)
    gl.barrier()


@gluon.jit
def _probs_from_lse(P_s, lse, qk_scale, M: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
                    KP: gl.constexpr, JC: gl.constexpr, smp: gl.constexpr):
    """The samples' scores in ``P_s`` become their probabilities ``exp2(z qk_scale - lse)`` (0 on padding)."""
    for jt in gl.static_range(KT):
        for j0 in gl.static_range(0, KH * KW, JC):
            j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, smp))
            zs = P_s[jt].slice(j0, JC, dim=1)
            zs.store(gl.where((j < KH * KW)[None, :], gl.exp2(zs.load(smp) * qk_scale - lse[:, None]), 0.0))
    gl.barrier()


@gluon.jit
def _ds_from_dp(G_s, P_s, D, DOFF, off_row, q_ok, M: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr,
                KW: gl.constexpr, JC: gl.constexpr, smp: gl.constexpr):
    """The samples' ``dp`` in ``G_s`` become ``ds = p (dp - D)``; what passes 1 and 2 left in ``DOFF``,
    ``d(dp)/dpos + scale (dp - D) dz/dpos``, times ``p``: the offsets' gradient."""
    for jt in gl.static_range(KT):
        for j0 in gl.static_range(0, KH * KW, JC):
            j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, smp))
            gs = G_s[jt].slice(j0, JC, dim=1)
            c = P_s[jt].slice(j0, JC, dim=1).load(smp)
            gs.store(c * (gs.load(smp) - D[:, None]))
            ok = q_ok[:, None] & (j < KH * KW)[None, :]
            dptr = DOFF + off_row[:, None] + ((jt * KH * KW + j) * 3)[None, :]
            gl.store(dptr, gl.load(dptr, mask=ok, other=0.0) * c, mask=ok)
            gl.store(dptr + 1, gl.load(dptr + 1, mask=ok, other=0.0) * c, mask=ok)
            gl.store(dptr + 2, gl.load(dptr + 2, mask=ok, other=0.0) * c, mask=ok)
    gl.barrier()


@gluon.jit
def _rows_at(X, layout: gl.constexpr, base, row_stride, tf, c, H, W, lo_y, lo_x, fyn, fxn, COLS: gl.constexpr,
             FX: gl.constexpr):
    """The halo rows of chunk ``c`` of frame ``tf`` in ``X`` (fp32, first ``COLS`` columns) in ``layout`` (an
    accumulator's: no shared-memory round trip): their addresses and which are in the halo. Plain loads
    and stores: the colour phase gives this program the rows alone."""
    r = c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    hy = r // FX
    hx = r % FX
    ok = ((hy < fyn) & (hx < fxn))[:, None]
    return X + base + ((tf * H + lo_y + hy) * W + lo_x + hx)[:, None] * row_stride + cols[None, :], ok


@gluon.jit
def _frame_dq_dk(dq, S_s, kv_s, p_s, q_s, K, DK, base, row_stride, f, lo_t, ftn, H, W, lo_y, lo_x, fyn, fxn, walk,
                 M: gl.constexpr, HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
                 ELO: gl.constexpr, EHI: gl.constexpr, NCH: gl.constexpr, FX: gl.constexpr, JC: gl.constexpr,
                 ld: gl.constexpr, smp: gl.constexpr, o_mma: gl.constexpr, dk_scale):
    """Halo frame ``f``'s ``dS`` (in ``S_s``) times its keys: ``dK += dS^T Q`` and ``dQ += dS K``, 64 keys a
    chunk on tensor cores, ``dS`` cast to bf16. Both dots are asynchronous, ``dK``'s first: while it runs
    the warps read the chunk's ``dK`` rows and load the next chunk's ``dS``; once it is done (``dQ``'s
    still running) they write the rows and load the next chunk's keys -- after the last chunk's, they
    build the next frame's ``dS`` in ``S_s`` (``_frame_probs`` with ``walk``'s samples' array, factor,
    records, order and geometry)."""
    tf = lo_t + f
    kr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    x = _halo_rows(K, base, row_stride, tf, kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX)
    p = S_s.slice(0, 64, dim=1).load(ld).to(gl.bfloat16)  # 8 a thread: 16-byte copies
    for c in gl.static_range(NCH):
        _stage(kv_s, x, p_s, p)
        dk = hopper.warpgroup_mma(p_s.permute((1, 0)), q_s, gl.zeros([64, HEAD_DIM], gl.float32, o_mma), is_async=True)
        dq = hopper.warpgroup_mma(p_s, kv_s, dq, is_async=True)
        ptr, ok = _rows_at(DK, o_mma, base, row_stride, tf, c, H, W, lo_y, lo_x, fyn, fxn, HEAD_DIM, FX)
        old = gl.load(ptr, mask=ok, other=0.0)
        if c + 1 < NCH:
            p = S_s.slice((c + 1) * 64, 64, dim=1).load(ld).to(gl.bfloat16)
        dk = hopper.warpgroup_mma_wait(1, deps=[dk])  # dK's product done, dQ's running
        gl.store(ptr, old + dk * dk_scale, mask=ok)
        if c + 1 < NCH:
            x = _halo_rows(K, base, row_stride, tf, (c + 1) * 64 + kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX)
        elif f + 1 < ftn:
            _frame_probs(S_s, walk[0], walk[1], walk[2], walk[3], *_pin(walk[4]), f + 1, M, KT, KH, KW, ELO, EHI, FX,
                         JC, smp, NCH)
        dq = hopper.warpgroup_mma_wait(0, deps=[dq])
    gl.barrier()
    return dq


@gluon.jit
def _frame_dv(S_s, p_s, do_s, DV, base, row_stride, f, lo_t, ftn, H, W, lo_y, lo_x, fyn, fxn, walk, M: gl.constexpr,
              HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, ELO: gl.constexpr,
              EHI: gl.constexpr, NCH: gl.constexpr, FX: gl.constexpr, JC: gl.constexpr, ld: gl.constexpr,
              smp: gl.constexpr, o_mma: gl.constexpr):
    """Halo frame ``f``'s ``P`` (in ``S_s``): ``dV += P^T dO``, 64 keys a chunk on tensor cores, P in bf16. A
    chunk's dot runs asynchronously while the previous chunk's ``dV`` rows are written, its own read and
    the next chunk's ``P`` loaded; while the last chunk's runs, the next frame's ``P`` is built in ``S_s``
    (``_frame_dq_dk``)."""
    tf = lo_t + f
    p = S_s.slice(0, 64, dim=1).load(ld).to(gl.bfloat16)  # 8 a thread: 16-byte copies
    old = gl.zeros([64, HEAD_DIM], gl.float32, o_mma)  # the previous chunk's rows and product: none before the first
    dv = old
    for c in gl.static_range(NCH):
        gl.barrier()
        p_s.store(p)
        hopper.fence_async_shared()
        acc = hopper.warpgroup_mma(p_s.permute((1, 0)), do_s, gl.zeros([64, HEAD_DIM], gl.float32, o_mma),
                                   is_async=True)
        if c > 0:  # the previous chunk's rows added, this chunk's read, while this chunk's dot runs
            ptr, ok = _rows_at(DV, o_mma, base, row_stride, tf, c - 1, H, W, lo_y, lo_x, fyn, fxn, HEAD_DIM, FX)
            gl.store(ptr, old + dv, mask=ok)
        if c + 1 == NCH and f + 1 < ftn:
            _frame_probs(S_s, walk[0], walk[1], walk[2], walk[3], *_pin(walk[4]), f + 1, M, KT, KH, KW, ELO, EHI, FX,
                         JC, smp, NCH)
        ptr, ok = _rows_at(DV, o_mma, base, row_stride, tf, c, H, W, lo_y, lo_x, fyn, fxn, HEAD_DIM, FX)
        old = gl.load(ptr, mask=ok, other=0.0)
        if c + 1 < NCH:
            p = S_s.slice((c + 1) * 64, 64, dim=1).load(ld).to(gl.bfloat16)
        dv = hopper.warpgroup_mma_wait(0, deps=[acc])
    ptr, ok = _rows_at(DV, o_mma, base, row_stride, tf, NCH - 1, H, W, lo_y, lo_x, fyn, fxn, HEAD_DIM, FX)
    gl.store(ptr, old + dv, mask=ok)
    gl.barrier()


@gluon.jit
def _phase_tile(i, H, W, PT, PY, PX, CT, CY, CX, TY: gl.constexpr, TX: gl.constexpr):
    """The tile (frame t, first row y0, first column x0) this program takes in colour phase
    ``(PT, PY, PX)`` of colour counts ``(CT, CY, CX)``: tiles whose indices are the phase's modulo the
    counts, x fastest (``i``: the program's index in the phase)."""
    nx = gl.cdiv(gl.cdiv(W, TX) - PX, CX)
    ny = gl.cdiv(gl.cdiv(H, TY) - PY, CY)
    x0 = (PX + (i % nx) * CX) * TX
    y0 = (PY + ((i // nx) % ny) * CY) * TY
    t = PT + (i // (nx * ny)) * CT
    return t, y0, x0


@gluon.jit
def _tile_geometry(t, y0, x0, T, H, W, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, ELO: gl.constexpr,
                   EHI: gl.constexpr, TY: gl.constexpr, TX: gl.constexpr, M: gl.constexpr, smp: gl.constexpr):
    """The forward's geometry of a tile: its queries' window starts and the halo's corner and extent."""
    m = gl.arange(0, M, layout=gl.SliceLayout(1, smp))
    qy = y0 + m // TX
    qx = x0 + m % TX
    q_ok = (qy < H) & (qx < W)
    st = _start(t, KT, T)
    lo_t = gl.maximum(st - ELO, 0)
    lo_y = gl.maximum(_start(y0, KH, H) - ELO, 0)
    lo_x = gl.maximum(_start(x0, KW, W) - ELO, 0)
    ftn = gl.minimum(st + KT - 1 + EHI, T - 1) - lo_t + 1
    fyn = gl.minimum(_start(gl.minimum(y0 + TY, H) - 1, KH, H) + KH - 1 + EHI, H - 1) - lo_y + 1
    fxn = gl.minimum(_start(gl.minimum(x0 + TX, W) - 1, KW, W) + KW - 1 + EHI, W - 1) - lo_x + 1
    return qy, qx, q_ok, st, _start(qy, KH, H), _start(qx, KW, W), lo_t, lo_y, lo_x, ftn, fyn, fxn


@gluon.jit
def _where(pid, args, HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
           ELO: gl.constexpr, EHI: gl.constexpr, TY: gl.constexpr, TX: gl.constexpr, M: gl.constexpr,
           smp: gl.constexpr):
    """The tile's geometry as the frame helpers take it (``geo``, ``kv``) and its halo frames, from the
    program's index ``pid`` in the phase and ``args = (T, H, W, NH, PT, PY, PX, CT, CY, CX)``. Each
    pass recomputes it from an opaque read of the program id: held across the passes, it spills."""
    T, H, W, NH = args[0], args[1], args[2], args[3]
    t, y0, x0 = _phase_tile(pid, H, W, args[4], args[5], args[6], args[7], args[8], args[9], TY, TX)
    bh = gl.program_id(1)
    N = T * H * W
    base = ((bh // NH) * N * NH + bh % NH) * HEAD_DIM
    qy, qx, q_ok, st, sy, sx, lo_t, lo_y, lo_x, ftn, fyn, fxn = _tile_geometry(
        t, y0, x0, T, H, W, KT, KH, KW, ELO, EHI, TY, TX, M, smp)
    off_row = (((bh // NH) * N + (t * H + qy) * W + qx) * NH + bh % NH) * (KT * KH * KW * 3)
    return ((off_row, q_ok, st, lo_t),
            (base, NH * HEAD_DIM, H, W, lo_y, lo_x, fyn, fxn), ftn)


@gluon.jit
def _opaque_pid():
    """``program_id(0)``, read so that the compiler cannot reuse an earlier read (``_where``)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r,r", [gl.program_id(1)], dtype=gl.int32,
                                     is_pure=False, pack=1)


DS_GAIN = gl.constexpr(256.0)  # dS is staged in fp16 times this power of two (no underflow of small ds), undone after


@gluon.jit
def halo_dense_bwd(Q, K, V, REC, ORD, OUT, DO, LSE, DQ, DK, DV, DOFF, qk_scale, scale, T, H, W, NH, PT, PY, PX, CT, CY, CX,
                   HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
                   ELO: gl.constexpr, EHI: gl.constexpr, FY: gl.constexpr, FX: gl.constexpr,
                   NCH: gl.constexpr, SW: gl.constexpr, KTP: gl.constexpr, KP: gl.constexpr,
                   JC: gl.constexpr, TY: gl.constexpr, TX: gl.constexpr):
    M: gl.constexpr = TY * TX
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte rows of q, k, v
    smp: gl.constexpr = gl.BlockedLayout([1, 1], [32 // JC, JC], [8, 1], [1, 0])  # (query, sample) tensors
    s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                    instr_shape=[16, HEAD_DIM // 2, 16])
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    gl.static_assert(KT == 3, "the samples' buffers are one per window layer: built for kt = 3")

    t, y0, x0 = _phase_tile(gl.program_id(0), H, W, PT, PY, PX, CT, CY, CX, TY, TX)
    bh = gl.program_id(1)
    N = T * H * W
    row_stride = NH * HEAD_DIM
    base = ((bh // NH) * N * NH + bh % NH) * HEAD_DIM

    lm = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    rows = ((t * H + y0 + lm // TX) * W + x0 + lm % TX)[:, None] * row_stride + cols[None, :]
    rows_ok = ((y0 + lm // TX < H) & (x0 + lm % TX < W))[:, None]
    do = gl.load(DO + base + rows, mask=rows_ok, other=0.0)
    o = gl.load(OUT + base + rows, mask=rows_ok, other=0.0)
    D = gl.convert_layout(gl.sum(do.to(gl.float32) * o.to(gl.float32), axis=1), gl.SliceLayout(1, smp))
    io_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], gl.bfloat16)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [M, HEAD_DIM], io_l,
                                    gl.load(Q + base + rows, mask=rows_ok, other=0.0).to(gl.bfloat16))
    do_s = gl.allocate_shared_memory(gl.bfloat16, [M, HEAD_DIM], io_l, do.to(gl.bfloat16))
    kv_s = gl.allocate_shared_memory(gl.bfloat16, [64, HEAD_DIM], io_l)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [M, 64], gl.NVMMASharedLayout.get_default_for([M, 64], gl.bfloat16))
    S_s = gl.allocate_shared_memory(gl.float16, [M, SW], flat)  # a frame's S or dP, then its dS or P
    P_s = (gl.allocate_shared_memory(gl.float32, [M, KP], flat), gl.allocate_shared_memory(gl.float32, [M, KP], flat),
           gl.allocate_shared_memory(gl.float32, [M, KP], flat))  # per window layer: the samples' z, then p
    G_s = (gl.allocate_shared_memory(gl.float32, [M, KP], flat), gl.allocate_shared_memory(gl.float32, [M, KP], flat),
           gl.allocate_shared_memory(gl.float32, [M, KP], flat))  # per window layer: the samples' dp, then ds
    _zero_tail(S_s, M, NCH, SW)
    _zero_samples(P_s, M, KT, KP, JC, smp)
    _zero_samples(G_s, M, KT, KP, JC, smp)
    args = (T, H, W, NH, PT, PY, PX, CT, CY, CX)
    geo, kv, ftn = _where(_opaque_pid(), args, HEAD_DIM, KT, KH, KW, ELO, EHI, TY, TX, M, smp)
    lo_t = geo[3]
    s = _scores_pass(do_s, kv_s, V, kv[0], kv[1], lo_t, *kv[2:], M, HEAD_DIM, NCH, FX, ld, s_mma)
    for f in range(0, ftn):  # pass 1: the samples' dp and d(dp)/dpos
        _frame_scores(do_s, kv_s, S_s, s, V, kv[0], kv[1], lo_t + f, *kv[2:], M, HEAD_DIM, NCH, 1, FX, ld, s_mma)
        tok = _first_chunk(do_s, kv_s, V, kv[0], kv[1], lo_t + gl.minimum(f + 1, ftn - 1), *kv[2:], M, HEAD_DIM, FX,
                           ld, s_mma)  # the next frame's first chunk while this frame is walked
        _frame_scores_derivs(S_s, G_s, G_s, D, scale, REC, DOFF, ORD, *_pin(geo), f, KT, KH, KW, ELO, EHI, FX, JC,
                             smp, False)
        s = hopper.warpgroup_mma_wait(0, deps=[tok])
    geo, kv, ftn = _where(_opaque_pid(), args, HEAD_DIM, KT, KH, KW, ELO, EHI, TY, TX, M, smp)
    lo_t = geo[3]
    s = _scores_pass(q_s, kv_s, K, kv[0], kv[1], lo_t, *kv[2:], M, HEAD_DIM, NCH, FX, ld, s_mma)
    for f in range(0, ftn):  # pass 2: the samples' scores and scale (dp - D) dz/dpos
        _frame_scores(q_s, kv_s, S_s, s, K, kv[0], kv[1], lo_t + f, *kv[2:], M, HEAD_DIM, NCH, 1, FX, ld, s_mma)
        tok = _first_chunk(q_s, kv_s, K, kv[0], kv[1], lo_t + gl.minimum(f + 1, ftn - 1), *kv[2:], M, HEAD_DIM, FX,
                           ld, s_mma)
        _frame_scores_derivs(S_s, P_s, G_s, D, scale, REC, DOFF, ORD, *_pin(geo), f, KT, KH, KW, ELO, EHI, FX, JC,
                             smp, True)
        s = hopper.warpgroup_mma_wait(0, deps=[tok])
    tl, yl, xl = _phase_tile(_opaque_pid(), H, W, PT, PY, PX, CT, CY, CX, TY, TX)  # not held across the passes
    ql = gl.arange(0, M, layout=gl.SliceLayout(1, smp))
    lse = gl.load(LSE + gl.program_id(1) * N + (tl * H + yl + ql // TX) * W + xl + ql % TX,
                  mask=(yl + ql // TX < H) & (xl + ql % TX < W), other=0.0)
    _probs_from_lse(P_s, lse, qk_scale, M, KT, KH, KW, KP, JC, smp)
    _ds_from_dp(G_s, P_s, D, DOFF, geo[0], geo[1], M, KT, KH, KW, JC, smp)
    dq, broken = _passes_3_4(Q, K, V, REC, ORD, DK, DV, DOFF, scale, q_s, do_s, kv_s, p_s, S_s, P_s, G_s, args, M,
                             HEAD_DIM, KT, KH, KW, ELO, EHI, FY, FX, NCH, SW, KP, JC, TY, TX, ld, smp, s_mma, o_mma)
    t, y0, x0 = _phase_tile(_opaque_pid(), H, W, PT, PY, PX, CT, CY, CX, TY, TX)  # again: not held (spill)
    am = gl.arange(0, M, layout=gl.SliceLayout(1, o_mma))
    acols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_mma))
    arows = ((t * H + y0 + am // TX) * W + x0 + am % TX)[:, None] * row_stride + acols[None, :]
    bad = gl.convert_layout(broken, gl.SliceLayout(1, o_mma)) != 0
    dq = gl.where(bad[:, None], float("nan"), dq * (scale / DS_GAIN))
    gl.store(DQ + base + arows, dq.to(DQ.dtype.element_ty), mask=((y0 + am // TX < H) & (x0 + am % TX < W))[:, None])


@gluon.jit
def _passes_3_4(Q, K, V, REC, ORD, DK, DV, DOFF, scale, q_s, do_s, kv_s, p_s, S_s, P_s, G_s, args,
                M: gl.constexpr, HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
                ELO: gl.constexpr, EHI: gl.constexpr, FY: gl.constexpr, FX: gl.constexpr, NCH: gl.constexpr,
                SW: gl.constexpr, KP: gl.constexpr, JC: gl.constexpr, TY: gl.constexpr, TX: gl.constexpr,
                ld: gl.constexpr, smp: gl.constexpr, s_mma: gl.constexpr, o_mma: gl.constexpr):
    """Passes 3 and 4 (module docstring): P and dV (and the queries with a sample past its reach); dS,
    dQ and dK. The dQ accumulator is live in pass 4 alone."""
    gain = gl.full([M], DS_GAIN, gl.float32, gl.SliceLayout(1, smp))
    one = gl.full([M], 1.0, gl.float32, gl.SliceLayout(1, smp))
    broken = gl.zeros([M], gl.int32, gl.SliceLayout(1, smp))
    geo, kv, ftn = _where(_opaque_pid(), args, HEAD_DIM, KT, KH, KW, ELO, EHI, TY, TX, M, smp)
    lo_t = geo[3]
    broken = _late(ORD, geo[0], geo[1], broken, KT, KH, KW, ELO, EHI)
    # pass 3: P; dV += P^T dO (each frame's P built while the previous frame's last dot runs, the first's here)
    _frame_probs(S_s, P_s, one, REC, ORD, *_pin(geo), lo_t * 0, M, KT, KH, KW, ELO, EHI, FX, JC, smp, NCH)
    for f in range(0, ftn):
        _frame_dv(S_s, p_s, do_s, DV, kv[0], kv[1], f, lo_t, ftn, *kv[2:], (P_s, one, REC, ORD, geo), M, HEAD_DIM,
                  KT, KH, KW, ELO, EHI, NCH, FX, JC, ld, smp, o_mma)
    dq = gl.zeros([M, HEAD_DIM], gl.float32, o_mma)
    geo, kv, ftn = _where(_opaque_pid(), args, HEAD_DIM, KT, KH, KW, ELO, EHI, TY, TX, M, smp)
    lo_t = geo[3]
    # pass 4: dS; dQ += dS K, dK += dS^T Q (dS built as P in pass 3)
    _frame_probs(S_s, G_s, gain, REC, ORD, *_pin(geo), lo_t * 0, M, KT, KH, KW, ELO, EHI, FX, JC, smp, NCH)
    for f in range(0, ftn):
        dq = _frame_dq_dk(dq, S_s, kv_s, p_s, q_s, K, DK, kv[0], kv[1], f, lo_t, ftn, *kv[2:], (G_s, gain, REC, ORD, geo),
                          M, HEAD_DIM, KT, KH, KW, ELO, EHI, NCH, FX, JC, ld, smp, o_mma, scale / DS_GAIN)
    return dq, broken
