"""The Gluon code of the fused halo-dense forward (``dsa_gluon_halo`` describes the algorithm and
holds the host side). Imported only where ``dsa_gluon_halo.gluon_halo_refusal`` finds a Triton whose
Gluon has the shared-memory gather and atomic scatter-add (>= 3.8)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper


@gluon.jit
def _frame_i32(f):
    """The frame loop's index through an opaque 32-bit move: LLVM widens the loop's counter to 64 bits,
    and every sample's compare with it (``t0 == f``) with it."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [f], dtype=gl.int32, is_pure=True, pack=1)


ORDER_WIDTH = gl.constexpr(64)  # int8 entries per (query, head, window layer) of ``ORD`` (``dsa_halo_dense.sample_order``)
STARTS_AT = gl.constexpr(56)  # where its bucket starts begin


@gluon.jit
def _order_row(off_row, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr):
    """A query's first entry in ``ORD`` from its first offset in ``OFF`` (both per (query, head) rows)."""
    return (off_row // (KT * KH * KW * 3)) * (KT * ORDER_WIDTH)


@gluon.jit
def _late(ORD, off_row, q_ok, broken, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr, ELO: gl.constexpr,
          EHI: gl.constexpr):
    """``broken`` with the queries that have a sample past its reach on some axis (an offset past the
    bound: sorted after the last bucket, walked in no frame). ``off_row``: each query's first offset."""
    for jt in gl.static_range(KT):
        n = gl.load(ORD + _order_row(off_row, KT, KH, KW) + jt * ORDER_WIDTH + STARTS_AT + ELO + EHI, mask=q_ok, other=KH * KW)
        broken = broken | (n.to(gl.int32) < KH * KW).to(gl.int32)
    return broken


# a sample record's word 0 (``dsa_halo_dense.RECORD_BITS``): each field's first bit (``c00`` at bit 0)
_T0 = gl.constexpr(9)
_J = gl.constexpr(13)
_LT = gl.constexpr(19)
_LY = gl.constexpr(20)
_LX = gl.constexpr(21)


@gluon.jit
def _load_records(ptr):
    """The 16-byte records at ``ptr`` (one ``ld.global.nc.v4`` each, unmasked: the records are followed by
    ``RECORD_PAD`` in memory): word 0 and the fractions ``fy, fx, ft`` (fp32)."""
    w, fy, fx, ft = gl.inline_asm_elementwise(
        "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [ptr],
        dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True, pack=1)
    return w, fy.to(gl.float32, bitcast=True), fx.to(gl.float32, bitcast=True), ft.to(gl.float32, bitcast=True)


@gluon.jit
def _layer_run(ORD, REC, ord_row, off_row, q_ok, jt, rel, K2: gl.constexpr, ELO: gl.constexpr, EHI: gl.constexpr):
    """A walk's reach in layer ``jt`` over the frame ``rel`` frames from the layer's: per query the run
    ``[a, e)`` of the layer's sample order whose samples touch that frame (lower time corner there or one
    below: ``dsa_halo_dense.frame_range``), the tile's longest run (the walk's length), and per query the
    address of the layer's first record (64-bit: no overflow at any size; the first query's for queries
    past the grid, a partial tile's: never walked, but read). ``ord_row``, ``off_row``: each query's first
    entry in ``ORD`` (``_order_row``) and first offset."""
    lo = gl.minimum(gl.maximum(rel - 1 + ELO, 0), ELO + EHI)
    hi = gl.minimum(gl.maximum(rel + ELO + 1, 0), ELO + EHI)
    srow = ORD + ord_row + jt * ORDER_WIDTH + STARTS_AT
    a = gl.load(srow + lo, mask=q_ok, other=0).to(gl.int32)
    e = gl.load(srow + hi, mask=q_ok, other=0).to(gl.int32)
    rbase = REC + (gl.where(q_ok, off_row // 3, 0).to(gl.int64) + jt * K2) * 4  # a record per 3 offsets
    return a, e, gl.max(e - a, axis=0), rbase


@gluon.jit
def _layer_samples(rbase, a, e, r0, q_ok, f, FX: gl.constexpr, JC: gl.constexpr, layout: gl.constexpr):
    """The samples at ``r0 .. r0 + JC`` of each query's run ``[a, e)`` of a layer's sample records
    (``rbase``: ``_layer_run``): per sample its weight in frame ``f`` (0 outside the run), its 4 corners'
    columns in the frame buffer (the upper ones a step past the lower: where the clamp makes them one,
    the fraction is 0), the fractions ``fy, fx``, its index ``j`` in the layer, whether it is one (within
    the run), and the record's word 0, its lower and upper time corner. Every sample of a run has its
    corners in the halo (``sample_order`` sorts the others out of every run); nothing about its position
    is computed here (``dsa_halo_dense.sample_records``)."""
    r = a[:, None] + r0 + gl.arange(0, JC, layout=gl.SliceLayout(0, layout))[None, :]
    ok = q_ok[:, None] & (r < e[:, None])
    w, fy, fx, ft = _load_records(rbase[:, None] + r * 4)
    c00 = w & 511
    t0 = (w >> _T0) & 15
    t1 = t0 + 1
    wt = gl.where(t0 == f, 1.0 - ft, 0.0) + gl.where(t1 == f, ft, 0.0)
    return gl.where(ok, wt, 0.0), c00, c00 + 1, c00 + FX, c00 + (FX + 1), fy, fx, (w >> _J) & 63, ok, w, t0, t1


@gluon.jit
def _halo_rows(X, base, row_stride, tf, r, H, W, lo_y, lo_x, fyn, fxn, cols, FX: gl.constexpr):
    """Rows ``r`` of frame ``tf``'s halo of k or v (zeros past the halo), bf16."""
    hy = r // FX
    hx = r % FX
    ok = (hy < fyn) & (hx < fxn)
    ptr = X + base + ((tf * H + lo_y + hy) * W + lo_x + hx)[:, None] * row_stride + cols[None, :]
    return gl.load(ptr, mask=ok[:, None], other=0.0).to(gl.bfloat16)


@gluon.jit
def _first_chunk(q_s, kv_s, K, base, row_stride, tf, H, W, lo_y, lo_x, fyn, fxn, M: gl.constexpr,
                 HEAD_DIM: gl.constexpr, FX: gl.constexpr, ld: gl.constexpr, s_mma: gl.constexpr):
    """The first chunk's ``S = Q K_halo^T`` of frame ``tf`` started on tensor cores, not waited for: the
    caller walks the previous frame's samples meanwhile (they read ``S_s``, not ``q_s`` or ``kv_s``) and
    passes the result to ``_frame_scores``."""
    kr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    gl.barrier()
    kv_s.store(_halo_rows(K, base, row_stride, tf, kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX))
    hopper.fence_async_shared()
    return hopper.warpgroup_mma(q_s, kv_s.permute((1, 0)), gl.zeros([M, 64], gl.float32, s_mma), is_async=True)


@gluon.jit
def _first_chunks(q_s, kv_pre, K, base, row_stride, tf, H, W, lo_y, lo_x, fyn, fxn, M: gl.constexpr,
                  HEAD_DIM: gl.constexpr, FX: gl.constexpr, ld: gl.constexpr, s_mma: gl.constexpr):
    """The forward's ``_first_chunk`` for three chunks at once (one K buffer each in ``kv_pre``): all
    three run while the previous frame's samples are walked."""
    kr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    gl.barrier()
    for i in gl.static_range(3):
        kv_pre.index(i).store(_halo_rows(K, base, row_stride, tf, i * 64 + kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX))
    hopper.fence_async_shared()
    zero = gl.zeros([M, 64], gl.float32, s_mma)
    return (hopper.warpgroup_mma(q_s, kv_pre.index(0).permute((1, 0)), zero, is_async=True),
            hopper.warpgroup_mma(q_s, kv_pre.index(1).permute((1, 0)), zero, is_async=True),
            hopper.warpgroup_mma(q_s, kv_pre.index(2).permute((1, 0)), zero, is_async=True))


@gluon.jit
def _frame_scores(q_s, kv_s, S_s, s, K, base, row_stride, tf, H, W, lo_y, lo_x, fyn, fxn,
                  M: gl.constexpr, HEAD_DIM: gl.constexpr, NCH: gl.constexpr, FIRST: gl.constexpr, FX: gl.constexpr,
                  ld: gl.constexpr, s_mma: gl.constexpr):
    """``S = Q K_halo^T`` of frame ``tf``, 64 keys a chunk on tensor cores, into ``S_s`` (fp16), from chunk
    ``FIRST``; ``s``: chunk ``FIRST - 1``'s (``_first_chunk``: the earlier ones are stored by the caller).
    Each further chunk's dot runs asynchronously while the next chunk's keys are loaded into registers
    and the previous chunk's scores stored."""
    kr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    x = _halo_rows(K, base, row_stride, tf, FIRST * 64 + kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX)
    for c in gl.static_range(FIRST, NCH):
        gl.barrier()
        kv_s.store(x)
        hopper.fence_async_shared()
        acc = hopper.warpgroup_mma(q_s, kv_s.permute((1, 0)), gl.zeros([M, 64], gl.float32, s_mma), is_async=True)
        S_s.slice((c - 1) * 64, 64, dim=1).store(s.to(gl.float16))
        if c + 1 < NCH:
            x = _halo_rows(K, base, row_stride, tf, (c + 1) * 64 + kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX)
        s = hopper.warpgroup_mma_wait(0, deps=[acc])
    S_s.slice((NCH - 1) * 64, 64, dim=1).store(s.to(gl.float16))
    gl.barrier()


@gluon.jit
def _scores_pass(q_s, kv_s, K, base, row_stride, lo_t, H, W, lo_y, lo_x, fyn, fxn, M: gl.constexpr,
                 HEAD_DIM: gl.constexpr, NCH: gl.constexpr, FX: gl.constexpr, ld: gl.constexpr, s_mma: gl.constexpr):
    """The first frame's first chunk of ``S`` (``_first_chunk``), waited for: the backward's frame loops
    that walk ``S`` or ``dP`` start the next frame's first chunk before each walk."""
    tok = _first_chunk(q_s, kv_s, K, base, row_stride, lo_t, H, W, lo_y, lo_x, fyn, fxn, M, HEAD_DIM, FX, ld, s_mma)
    return hopper.warpgroup_mma_wait(0, deps=[tok])


@gluon.jit
def _frame_sample_scores(S_s, Z_s, REC, ORD, off_row, q_ok, st, lo_t, f, KT: gl.constexpr, KH: gl.constexpr,
                         KW: gl.constexpr, ELO: gl.constexpr, EHI: gl.constexpr, FX: gl.constexpr, JC: gl.constexpr,
                         smp: gl.constexpr):
    """Each sample's score from its corners in frame ``f`` (a shared-memory gather of ``S_s``), added
    to ``Z_s`` with the sample's weight in that frame; per window layer only the samples that touch ``f``
    (their run of the sample order), none in the layers that cannot reach it."""
    f = _frame_i32(f)
    ord_row = _order_row(off_row, KT, KH, KW)
    for jt in gl.static_range(KT):
        if (lo_t + f >= st + jt - ELO) & (lo_t + f <= st + jt + EHI):
            a, e, n, rbase = _layer_run(ORD, REC, ord_row, off_row, q_ok, jt, lo_t + f - st - jt, KH * KW, ELO, EHI)
            for r0 in range(0, n, JC):
                wt, c00, c01, c10, c11, fy, fx, j, ok, _, _, _ = _layer_samples(rbase, a, e, r0, q_ok, f, FX, JC, smp)
                z = (S_s.gather(c00, 1).to(gl.float32) * (1.0 - fy) * (1.0 - fx)
                     + S_s.gather(c01, 1).to(gl.float32) * (1.0 - fy) * fx
                     + S_s.gather(c10, 1).to(gl.float32) * fy * (1.0 - fx)
                     + S_s.gather(c11, 1).to(gl.float32) * fy * fx)
                Z_s[jt].atomic_scatter_add(wt * z, j, 1, mask=ok)
    gl.barrier()


@gluon.jit
def _scores_pass_fwd(q_s, kv_pre, S_s, Z_s, K, REC, ORD, off_row, q_ok, st, lo_t, ftn, base, row_stride, H, W, lo_y,
                     lo_x, fyn, fxn, M: gl.constexpr, HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr,
                     KW: gl.constexpr, ELO: gl.constexpr, EHI: gl.constexpr, FX: gl.constexpr, JC: gl.constexpr,
                     NCH: gl.constexpr, ld: gl.constexpr, smp: gl.constexpr, s_mma: gl.constexpr):
    """The forward's first pass: per halo frame ``S`` (``_frame_scores``) and the samples' scores from it
    (``_frame_sample_scores``); the next frame's first three chunks of ``S`` run while this frame's samples
    are walked (``_first_chunks``; the first frame's before the loop)."""
    t0, t1, t2 = _first_chunks(q_s, kv_pre, K, base, row_stride, lo_t, H, W, lo_y, lo_x, fyn, fxn, M, HEAD_DIM, FX,
                               ld, s_mma)
    s0, s1, s2 = hopper.warpgroup_mma_wait(0, deps=[t0, t1, t2])
    for f in range(0, ftn):
        S_s.slice(0, 64, dim=1).store(s0.to(gl.float16))
        S_s.slice(64, 64, dim=1).store(s1.to(gl.float16))
        _frame_scores(q_s, kv_pre.index(0), S_s, s2, K, base, row_stride, lo_t + f, H, W, lo_y, lo_x, fyn, fxn,
                      M, HEAD_DIM, NCH, 3, FX, ld, s_mma)
        # the next frame's first chunks (past the last frame, the last's again: unused) while this frame is walked
        t0, t1, t2 = _first_chunks(q_s, kv_pre, K, base, row_stride, lo_t + gl.minimum(f + 1, ftn - 1), H, W, lo_y,
                                   lo_x, fyn, fxn, M, HEAD_DIM, FX, ld, s_mma)
        _frame_sample_scores(S_s, Z_s, REC, ORD, off_row, q_ok, st, lo_t, f, KT, KH, KW, ELO, EHI, FX, JC, smp)
        s0, s1, s2 = hopper.warpgroup_mma_wait(0, deps=[t0, t1, t2])


@gluon.jit
def _softmax(Z_s, qk_scale, M: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
             KP: gl.constexpr, JC: gl.constexpr, smp: gl.constexpr):
    """Base-2 softmax over the window: the row max and sum, the unnormalised probabilities written
    over the scores in ``Z_s``."""
    mx = gl.full([M], -float("inf"), gl.float32, gl.SliceLayout(1, smp))
    for jt in gl.static_range(KT):
        for j0 in gl.static_range(0, KH * KW, JC):
            j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, smp))
            z = gl.where((j < KH * KW)[None, :], Z_s[jt].slice(j0, JC, dim=1).load(smp) * qk_scale, -float("inf"))
            mx = gl.maximum(mx, gl.max(z, axis=1))
    den = gl.zeros([M], gl.float32, gl.SliceLayout(1, smp))
    for jt in gl.static_range(KT):
        for j0 in gl.static_range(0, KH * KW, JC):
            j = j0 + gl.arange(0, JC, layout=gl.SliceLayout(0, smp))
            zs = Z_s[jt].slice(j0, JC, dim=1)
            e = gl.where((j < KH * KW)[None, :], gl.exp2(zs.load(smp) * qk_scale - mx[:, None]), 0.0)
            den = den + gl.sum(e, axis=1)
            zs.store(e)
    gl.barrier()
    return mx, den


@gluon.jit
def _frame_probs(S_s, Z_s, inv, REC, ORD, off_row, q_ok, st, lo_t, f, M: gl.constexpr, KT: gl.constexpr,
                 KH: gl.constexpr, KW: gl.constexpr, ELO: gl.constexpr, EHI: gl.constexpr, FX: gl.constexpr,
                 JC: gl.constexpr, smp: gl.constexpr, NCH: gl.constexpr):
    """Frame ``f``'s ``P``: ``S_s``'s halo chunks zeroed, then every sample that touches ``f`` (its layer's run of the
    sample order) scatter-adds its probability times its corners' weights onto its corners
    (``red.shared.add.f16``)."""
    f = _frame_i32(f)
    ord_row = _order_row(off_row, KT, KH, KW)
    vec: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte stores
    zero = gl.zeros([M, 64], gl.float16, vec)
    for c in gl.static_range(NCH):  # the halo's chunks: no sample of a run reaches the padding past them
        S_s.slice(c * 64, 64, dim=1).store(zero)
    gl.barrier()
    for jt in gl.static_range(KT):
        if (lo_t + f >= st + jt - ELO) & (lo_t + f <= st + jt + EHI):
            a, e, n, rbase = _layer_run(ORD, REC, ord_row, off_row, q_ok, jt, lo_t + f - st - jt, KH * KW, ELO, EHI)
            for r0 in range(0, n, JC):
                wt, c00, c01, c10, c11, fy, fx, j, ok, _, _, _ = _layer_samples(rbase, a, e, r0, q_ok, f, FX, JC, smp)
                p = Z_s[jt].gather(j, 1) * inv[:, None] * wt
                _scatter_corners(S_s, p, fy, fx, c00, c01, c10, c11, M, JC)
    gl.barrier()


@gluon.jit
def _scatter_corners(S_s, p, fy, fx, c00, c01, c10, c11, M: gl.constexpr, JC: gl.constexpr):
    """``p`` times each corner's weight added onto its 4 corners in ``S_s`` (``red.shared.add.f16``) as one
    scatter of the 4 x ``JC`` values a row: one shared-memory write for the barrier analysis, not four."""
    v = gl.join(gl.join(p * (1.0 - fy) * (1.0 - fx), p * (1.0 - fy) * fx), gl.join(p * fy * (1.0 - fx), p * fy * fx))
    c = gl.join(gl.join(c00, c01), gl.join(c10, c11))
    v = v.reshape([M, 4 * JC])
    S_s.atomic_scatter_add(v.to(gl.float16), c.reshape([M, 4 * JC]), 1, mask=v != 0.0)


@gluon.jit
def _stage(kv_s, x, p_s, p):
    """A chunk's operands into shared memory for its dots, once every warp is past the previous chunk's
    (``gl.barrier``): ``x`` (K or V rows) into ``kv_s``, ``p`` (P or dS, bf16) into ``p_s``."""
    gl.barrier()
    kv_s.store(x)
    p_s.store(p)
    hopper.fence_async_shared()


@gluon.jit
def _output_pass(acc, S_s, Z_s, kv_s, p_s, inv, V, REC, ORD, off_row, q_ok, st, lo_t, ftn, base, row_stride, H, W,
                 lo_y, lo_x, fyn, fxn, M: gl.constexpr, HEAD_DIM: gl.constexpr, KT: gl.constexpr, KH: gl.constexpr,
                 KW: gl.constexpr, ELO: gl.constexpr, EHI: gl.constexpr, FX: gl.constexpr, JC: gl.constexpr,
                 NCH: gl.constexpr, ld: gl.constexpr, smp: gl.constexpr):
    """The forward's second pass: per halo frame ``P`` (``_frame_probs``) and ``O += P V_halo``, 64 keys a
    chunk on tensor cores, P cast to bf16. Each chunk's dot runs asynchronously while the next chunk's
    values and probabilities are loaded into registers; while the frame's last chunk's runs (every chunk
    of ``P`` is in registers or ``p_s`` by then), the next frame's ``P`` is built in ``S_s`` (the first
    frame's before the loop)."""
    kr = gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    _frame_probs(S_s, Z_s, inv, REC, ORD, off_row, q_ok, st, lo_t, lo_t * 0, M, KT, KH, KW, ELO, EHI, FX, JC, smp, NCH)
    for f in range(0, ftn):
        x = _halo_rows(V, base, row_stride, lo_t + f, kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX)
        p = S_s.slice(0, 64, dim=1).load(ld).to(gl.bfloat16)  # 8 a thread: 16-byte copies
        for c in gl.static_range(NCH):
            _stage(kv_s, x, p_s, p)
            acc = hopper.warpgroup_mma(p_s, kv_s, acc, is_async=True)
            if c + 1 < NCH:
                x = _halo_rows(V, base, row_stride, lo_t + f, (c + 1) * 64 + kr, H, W, lo_y, lo_x, fyn, fxn, cols, FX)
                p = S_s.slice((c + 1) * 64, 64, dim=1).load(ld).to(gl.bfloat16)
            elif f + 1 < ftn:
                _frame_probs(S_s, Z_s, inv, REC, ORD, off_row, q_ok, st, lo_t, f + 1, M, KT, KH, KW, ELO, EHI, FX, JC,
                             smp, NCH)
            acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        gl.barrier()
    return acc


@gluon.jit
def _zero_tail(S_s, M: gl.constexpr, NCH: gl.constexpr, SW: gl.constexpr):
    """The frame buffer's columns past the halo's chunks set to 0 once. A run's samples read only the halo's
    chunks (their corners one step past the lower stay on halo positions, zero keys past the grid); the
    lanes past a run read other queries' records and may reach past them: what they read stays finite
    (their results are masked out)."""
    vec: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte stores
    for c in gl.static_range(NCH, SW // 64):
        S_s.slice(c * 64, 64, dim=1).store(gl.zeros([M, 64], gl.float16, vec))


@gluon.jit
def _zero_samples(Z_s, M: gl.constexpr, KT: gl.constexpr, KP: gl.constexpr, JC: gl.constexpr, smp: gl.constexpr):
    """Every sample slot of ``Z_s`` (one ``M x KP`` fp32 buffer per window layer) set to 0."""
    for jt in gl.static_range(KT):
        for c in gl.static_range(KP // JC):
            Z_s[jt].slice(c * JC, JC, dim=1).store(gl.zeros([M, JC], gl.float32, smp))
    gl.barrier()


@gluon.jit
def _start(x, k: gl.constexpr, size):
    """The window's first position along one axis for queries at ``x`` (shifted inward at borders)."""
    return gl.minimum(gl.maximum(x - k // 2, 0), size - k)


@gluon.jit
def halo_dense_fwd(Q, K, V, REC, ORD, OUT, LSE, qk_scale, T, H, W, NH,
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

    tile = gl.program_id(0)
    bh = gl.program_id(1)
    tiles_x = gl.cdiv(W, TX)
    x0 = (tile % tiles_x) * TX
    y0 = ((tile // tiles_x) % gl.cdiv(H, TY)) * TY
    t = tile // (tiles_x * gl.cdiv(H, TY))
    N = T * H * W
    row_stride = NH * HEAD_DIM
    base = ((bh // NH) * N * NH + bh % NH) * HEAD_DIM

    # the tile's queries, their windows, and the halo: every corner a sample within the bound reaches
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
    off_row = (((bh // NH) * N + (t * H + qy) * W + qx) * NH + bh % NH) * (KT * KH * KW * 3)

    lm = gl.arange(0, M, layout=gl.SliceLayout(1, ld))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    rows = (t * H + y0 + lm // TX) * W + x0 + lm % TX
    rows_ok = (y0 + lm // TX < H) & (x0 + lm % TX < W)
    q = gl.load(Q + base + rows[:, None] * row_stride + cols[None, :], mask=rows_ok[:, None], other=0.0)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [M, HEAD_DIM],
                                    gl.NVMMASharedLayout.get_default_for([M, HEAD_DIM], gl.bfloat16), q.to(gl.bfloat16))
    gl.static_assert(NCH > 3, "three chunks a frame start before the previous frame's walk")
    kv_pre = gl.allocate_shared_memory(gl.bfloat16, [3, 64, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([64, HEAD_DIM], gl.bfloat16))
    kv_s = kv_pre.index(0)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [M, 64], gl.NVMMASharedLayout.get_default_for([M, 64], gl.bfloat16))
    S_s = gl.allocate_shared_memory(gl.float16, [M, SW], flat)  # a frame's scores, then its P
    gl.static_assert(KT == 3, "the samples' buffers are one per window layer: built for kt = 3")
    Z_s = (gl.allocate_shared_memory(gl.float32, [M, KP], flat), gl.allocate_shared_memory(gl.float32, [M, KP], flat),
           gl.allocate_shared_memory(gl.float32, [M, KP], flat))  # per window layer: the samples' scores, then p
    _zero_tail(S_s, M, NCH, SW)
    _zero_samples(Z_s, M, KT, KP, JC, smp)
    broken = _late(ORD, off_row, q_ok, gl.zeros([M], gl.int32, gl.SliceLayout(1, smp)), KT, KH, KW, ELO, EHI)

    # pass 1: the samples' scores, frame by frame
    _scores_pass_fwd(q_s, kv_pre, S_s, Z_s, K, REC, ORD, off_row, q_ok, st, lo_t, ftn, base, row_stride, H, W, lo_y,
                     lo_x, fyn, fxn, M, HEAD_DIM, KT, KH, KW, ELO, EHI, FX, JC, NCH, ld, smp, s_mma)
    mx, den = _softmax(Z_s, qk_scale, M, KT, KH, KW, KP, JC, smp)
    inv = 1.0 / den
    acc = gl.zeros([M, HEAD_DIM], gl.float32, o_mma)
    # pass 2: the probabilities onto the halo, O = P V, frame by frame
    acc = _output_pass(acc, S_s, Z_s, kv_s, p_s, inv, V, REC, ORD, off_row, q_ok, st, lo_t, ftn, base, row_stride, H, W,
                       lo_y, lo_x, fyn, fxn, M, HEAD_DIM, KT, KH, KW, ELO, EHI, FX, JC, NCH, ld, smp)

    bad = gl.convert_layout(broken, gl.SliceLayout(1, ld)) != 0
    o = gl.where(bad[:, None], float("nan"), gl.convert_layout(acc, ld))
    gl.store(OUT + base + rows[:, None] * row_stride + cols[None, :], o.to(OUT.dtype.element_ty), mask=rows_ok[:, None])
    gl.store(LSE + bh * N + (t * H + qy) * W + qx, mx + gl.log2(den), mask=q_ok)
