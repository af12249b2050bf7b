"""The fused halo-dense forward and backward of 3D-DSA in Triton's Gluon dialect (sm_90): the algorithm
of ``dsa_halo_dense`` (its blocked PyTorch mirror, tested against the reference) on one 3D query tile
per program, with the tile's scores and probabilities in shared memory. The backward's kernel
(``dsa_gluon_halo_bwd_jit``, its docstring says how) runs once per colour phase (``phase_launches``)
and adds dk, dv without atomics; this module holds both kernels' host side.

The forward: one program = a 1 x 8 x 8 query tile of one (batch, head) pair, 8 warps, 184 KB of shared memory:

1. ``Q`` (64 x d, bf16) into shared memory.
2. Per halo frame ``f`` (at most kt + ELO + EHI frames, ELO = ceil(bound), EHI = floor(bound) + 1):
   the frame's halo keys (``FY x FX`` positions, in ``NCH`` chunks of 64 rows) one chunk at a time
   into shared memory, ``S = Q K^T`` per chunk on tensor cores (``warpgroup_mma``, asynchronous: while a
   chunk's dot runs, the next chunk's keys are loaded and the previous chunk's scores stored, and the next
   frame's first three chunks run while this frame's samples are walked), stored into the
   frame's score buffer ``S_s (64 x SW)`` in fp16 (scores are scaled by ``d^-1/2`` after: an fp16
   rounding of a score of 30 moves its logit by about 1e-3); then per window layer ``jt`` whose
   samples can reach ``f``, only the samples that touch ``f`` (each query's run of the layer's sample
   order, ``dsa_halo_dense.sample_order``: sorted by lower time corner before the launch, by one
   Triton kernel, ``dsa_order``, which also writes each sample's 16-byte record in that order:
   its corners' column in the tile's halo, fractions and clamps, ``dsa_halo_dense.sample_records``),
   in chunks of ``JC`` samples, as many as the tile's longest run needs: one 16-byte load per sample
   (no position is computed in the walk), its weight in ``f`` and the trilinear weights, the corners' scores read
   back with a shared-memory gather and added, fp32, into the samples' scores ``Z_s`` (one
   ``64 x KP`` buffer per window layer, indexed by sample: a shared-memory atomic add). A sample
   touches 2 of the 5 frames its layer can reach: the unsorted walks visited every sample in all 5.
3. Softmax over the window (base 2; the log-sum-exp kept as the gather kernels keep it, so their
   backward can follow this forward); the unnormalised probabilities written over ``Z_s``.
4. Per halo frame again (the same runs): the probabilities times the corners' weights scatter-added into ``S_s``
   (now the frame's ``P``, zeroed first: ``atomic_scatter_add`` on shared memory, a native
   ``red.shared.add.f16``), then ``O += P V`` per chunk of 64 keys on tensor cores, ``P`` cast to
   bf16 as flash attention casts its probabilities (asynchronous: the next chunk's values and ``P``
   loaded meanwhile; while the frame's last chunk's runs, the next frame's ``P`` is scattered, the
   first frame's before the loop).
5. ``O`` to memory; a query whose corners leave the halo, or with a sample past its layer's reach
   (an offset past the promised bound: sorted after every run), gets a NaN row, as in the other
   bounded kernels.

Needs Triton >= 3.8 (Gluon's shared-memory gather and atomic scatter-add: ``gluon_halo_refusal``
says why not where they are missing). No GPU has run it yet: ``tests/test_compile_sm90.py``
compiles it for sm_90 here (registers, spills, shared memory, the dots as ``wgmma``), and
``dsa_halo_dense`` is the algorithm it must match.
"""

from __future__ import annotations

import itertools
import logging
import math

import torch

from .aot import AOT_POINTER_TYPES, aligned_pointer_attrs

__all__ = ["gluon_halo_refusal", "gluon_halo_constexprs", "sample_walks", "GLUON_WARPS", "TILE_Y", "TILE_X"]

GLUON_WARPS = 8
TILE_Y, TILE_X = 8, 8  # queries per tile: one frame, 8 x 8 tokens (64 rows: one wgmma M)
SAMPLE_CHUNK = 8  # samples of one window layer handled at once: the 49 of a 7x7 layer in 7 chunks (16: 4 chunks, 64 lanes)
BWD_SAMPLE_CHUNK = 8  # the backward's (16 compiles clean but issues 8% more a frame)


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
    from .dsa_halo_dense import halo_frame, time_reach  # lazy: the mirror's definitions, at launch

    kt, kh, kw = (int(w) for w in window)
    elo, ehi = time_reach(bound)
    fy, fx, nch, sw = halo_frame(window, bound, (1, TILE_Y, TILE_X))
    return dict(HEAD_DIM=int(head_dim), KT=kt, KH=kh, KW=kw, ELO=elo, EHI=ehi, FY=fy, FX=fx,
                NCH=nch, SW=sw, KTP=1 << (kt - 1).bit_length(),
                KP=1 << (kh * kw - 1).bit_length(), JC=SAMPLE_CHUNK, TY=TILE_Y, TX=TILE_X)


_KERNELS: dict[str, object] = {}


def _gluon_kernel(pass_: str):
    """The compiled-on-launch Gluon kernel of ``pass_`` (``fwd`` or ``bwd``), imported once; refused
    where ``gluon_halo_refusal`` says (the import itself needs a Triton whose Gluon has what it uses)."""
    why = gluon_halo_refusal()
    if why is not None:
        raise RuntimeError(why)
    if pass_ not in _KERNELS:
        if pass_ == "fwd":
            from .dsa_gluon_halo_jit import halo_dense_fwd as kernel  # lazy: Gluon, where this Triton has it
        else:
            from .dsa_gluon_halo_bwd_jit import halo_dense_bwd as kernel  # lazy: as above
        _KERNELS[pass_] = kernel
    return _KERNELS[pass_]


def halo_dense_kernel():
    """The Gluon forward (``_gluon_kernel``)."""
    return _gluon_kernel("fwd")


def halo_dense_bwd_kernel():
    """The Gluon backward (``_gluon_kernel``)."""
    return _gluon_kernel("bwd")


def sample_walks(offsets: torch.Tensor, window, bound: float) -> tuple:
    """The walks' sample order and records (``dsa_order``: one Triton kernel) for the fused kernels, with
    the key they were written for: ``(key, order, records)``. The forward returns them and the backward
    takes them (``halo_dense_backward(..., walks=)``) instead of writing them again."""
    from .dsa_order import sample_order_kernel  # lazy: the walks' order (a Triton kernel), on the GPU only

    order, records = sample_order_kernel(offsets, window, bound, (1, TILE_Y, TILE_X))
    return (_walks_key(offsets, window, bound), order, records)


def _walks_key(offsets: torch.Tensor, window, bound: float) -> tuple:
    """What a sample order and its records depend on besides the offsets' values: their shape, device
    and version (an in-place change after the forward), the window, the bound and the tile."""
    return (tuple(offsets.shape), offsets.dtype, str(offsets.device), offsets._version,
            tuple(int(w) for w in window), float(bound), (1, TILE_Y, TILE_X))


def halo_dense_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, window,
                       scale: float, bound: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """``(out, lse, walks)`` of the Gluon forward on CUDA bf16 inputs (``lse`` base 2, ``(B, nh, N)`` fp32:
    the gather kernels' convention, so their backward can follow it; ``walks``: ``sample_walks``, for the
    backward)."""
    B, T, H, W, nh, d = q.shape
    cx = gluon_halo_constexprs(d, window, bound)
    out = torch.empty_like(q)
    lse = torch.empty((B, nh, T * H * W), device=q.device, dtype=torch.float32)
    grid = (T * -(-H // TILE_Y) * -(-W // TILE_X), B * nh)
    walks = sample_walks(offsets, window, bound)
    _, order, records = walks
    halo_dense_kernel()[grid](q, k, v, records, order, out, lse, scale * 1.4426950408889634, T, H, W, nh, **cx,
                              num_warps=GLUON_WARPS)
    return out, lse, walks


def fused_forward(q, k, v, offsets, window, scale: float, slab, bound):
    """``halo_dense_forward``'s ``(out, lse, walks)`` where ``fused_refusal`` lets the fused forward take the
    call, else None (either said once per reason: ``note_fused_once``)."""
    refused = fused_refusal(q, window, bound, slab)
    note_fused_once(refused)
    return None if refused is not None else halo_dense_forward(q, k, v, offsets, window, scale, float(bound))


def fused_backward(q, k, v, offsets, out, dout, lse, window, scale: float, slab, bound, walks=None):
    """``halo_dense_backward``'s ``(dq, dk, dv, doffsets)`` (``walks``: the fused forward's sample order and
    records) where ``fused_refusal`` lets the fused backward take the call, else None (said as the forward's)."""
    refused = fused_refusal(q, window, bound, slab, "backward")
    note_fused_once(refused, "backward")
    if refused is not None:
        return None
    return halo_dense_backward(q, k, v, offsets, out, dout, lse, window, scale, float(bound), walks=walks)


def phase_launches(grid, window, bound: float) -> tuple[tuple[int, int, int], list[tuple[int, int, int, int]]]:
    """The backward's launches: the colour counts ``(ct, cy, cx)`` of the mirror's tiles
    (``dsa_halo_dense.colour_counts``) and per colour phase ``(pt, py, px, tiles)``, the phases with
    tiles, in the mirror's order. Phase ``p`` holds the tiles whose index is ``p`` modulo the counts."""
    from .dsa_halo_dense import colour_counts, halo_tiles  # lazy: the mirror's tiles, at launch

    tiles = halo_tiles(tuple(grid), tuple(window), float(bound), (1, TILE_Y, TILE_X))
    counts = colour_counts(tiles)
    per_axis = (grid[0], -(-grid[1] // TILE_Y), -(-grid[2] // TILE_X))
    phases = []
    for p in itertools.product(*(range(c) for c in counts)):
        n = math.prod(max(0, -(-(size - i) // c)) for size, i, c in zip(per_axis, p, counts))
        if n:
            phases.append((*p, n))
    return counts, phases


def phase_tile(i: int, phase, counts, grid) -> tuple[int, int, int]:
    """Program ``i``'s tile index (t, y, x) in ``phase`` (the kernel's ``_phase_tile``, x fastest)."""
    nx = -(-(-(-grid[2] // TILE_X) - phase[2]) // counts[2])
    ny = -(-(-(-grid[1] // TILE_Y) - phase[1]) // counts[1])
    return phase[0] + i // (nx * ny) * counts[0], phase[1] + (i // nx) % ny * counts[1], phase[2] + i % nx * counts[2]


def halo_dense_backward(q, k, v, offsets, out, dout, lse, window, scale: float, bound: float, walks=None):
    """``(dq, dk, dv, doffsets)`` of the Gluon backward on CUDA bf16 inputs, after any forward that left
    ``lse`` in the gather kernels' convention (base 2, ``(B, nh, N)`` fp32): one launch per colour phase
    and group of heads, each group on its own stream (``head_groups``, ``on_streams``); dk, dv and the
    offsets' gradient summed in fp32 and cast to the inputs' dtypes. ``walks``: the fused
    forward's sample order and records (``sample_walks``), taken where their key matches these offsets,
    window and bound; else (None, or another key) the order kernel writes them again."""
    B, T, H, W, nh, d = q.shape
    cx = dict(gluon_halo_constexprs(d, window, bound), JC=BWD_SAMPLE_CHUNK)
    dq = torch.empty_like(q)
    dk, dv = (torch.zeros(x.shape, device=x.device, dtype=torch.float32) for x in (k, v))
    doff = torch.zeros(offsets.shape, device=offsets.device, dtype=torch.float32)
    if walks is None or walks[0] != _walks_key(offsets, window, bound):
        walks = sample_walks(offsets, window, bound)
    _, order, records = walks
    counts, phases = phase_launches((T, H, W), window, bound)
    heads = [(b, h0, h1) for b in range(B) for h0, h1 in head_groups(nh)]
    operands = (q, k, v, records, order, out, dout, lse, dq, dk, dv, doff)

    def launch(group: int, phase) -> None:  # one phase of one group's (batch, head) pairs: views at its first pair
        b, h0, h1 = heads[group]
        views = [x[b, h0:h1] if x is lse else x[b:b + 1, :, :, :, h0:h1] for x in operands]
        halo_dense_bwd_kernel()[(phase[3], h1 - h0)](*views, scale * 1.4426950408889634, scale, T, H, W, nh,
                                                     *phase[:3], *counts, **cx, num_warps=GLUON_WARPS)

    on_streams(len(heads), phases, launch, q.device)
    return dq, dk.to(k.dtype), dv.to(v.dtype), doff.to(offsets.dtype)


BWD_STREAMS = 2
"""CUDA streams the backward's colour phases run on: each group of heads runs its phases in order on its
own stream, and a phase's last partial wave of blocks overlaps the other group's phase (the cost model's
``launch_schedule``: 86% of the slots busy at 40 heads on one stream, 98% on two)."""


def head_groups(nh: int, streams: int = BWD_STREAMS) -> list[tuple[int, int]]:
    """The heads ``[h0, h1)`` of each stream's group: ``nh`` split in ``streams`` runs that start at multiples
    of 4 (every operand's view then as aligned as the whole tensor: 16 bytes), fewer where ``nh`` is small."""
    cuts = sorted({0, nh, *(min(nh, 4 * round(nh * i / streams / 4)) for i in range(1, streams))})
    return list(zip(cuts[:-1], cuts[1:]))


def on_streams(groups: int, phases, launch, device) -> None:
    """``launch(group, phase)`` for every group and phase, each group's phases in order on a stream of its own
    (CUDA: side streams that wait for the current one first and that it waits for after; elsewhere, in
    order): groups share no key, a group's phases must follow each other."""
    if torch.device(device).type != "cuda" or groups == 1:
        for phase in phases:
            for g in range(groups):
                launch(g, phase)
        return
    main = torch.cuda.current_stream(device)
    side = [torch.cuda.Stream(device) for _ in range(groups)]
    for st in side:
        st.wait_stream(main)
    for phase in phases:  # interleaved: each stream's queue holds its next phase while the other runs
        for g, st in enumerate(side):
            with torch.cuda.stream(st):
                launch(g, phase)
    for st in side:
        main.wait_stream(st)


def aot_variants(shape) -> list[dict]:
    """The Gluon forward and backward as the compile-only check compiles them at ``shape`` (bf16 or fp16, a
    bound given, head dim 128 and window 3x7x7: the Wan shape they were written for): sm_90 only
    (``warpgroup_mma`` is Hopper's), listed for the record (``auto`` does not pick them: no GPU has run
    them yet), and the Triton kernel that writes their sample order. Empty where this Triton cannot
    build them or the shape has no bound."""

    if (shape.dtype == "fp32" or shape.max_offset is None or (shape.head_dim, tuple(shape.window)) != (128, (3, 7, 7))
            or gluon_halo_refusal() is not None):
        return []  # written for the Wan shape (head dim 128, window 3x7x7): compiled there only
    fn = halo_dense_kernel()
    cx = gluon_halo_constexprs(shape.head_dim, shape.window, float(shape.max_offset))
    t = AOT_POINTER_TYPES[shape.dtype]
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: t for n in ("Q", "K", "V", "OUT")}, REC="*i32", ORD="*i8", LSE="*fp32", qk_scale="fp32")
    sig.update({n: "constexpr" for n in cx})
    fwd = dict(kernel="fused_fwd", fn=fn, signature=sig, constexprs=cx, num_warps=GLUON_WARPS, num_stages=1,
               attrs=aligned_pointer_attrs(fn, {n: v for n, v in sig.items() if v.startswith("*")}),
               config=f"tile 1x{TILE_Y}x{TILE_X},JC={cx['JC']}", tensor_cores=True, may_pick=False, archs=("sm_90",),
               note="the fused halo-dense forward (Gluon): not picked until a GPU run checks it")
    bwd_fn = halo_dense_bwd_kernel()
    bsig = {n: "i32" for n in bwd_fn.arg_names}
    bsig.update({n: t for n in ("Q", "K", "V", "OUT", "DO", "DQ")}, REC="*i32", ORD="*i8", qk_scale="fp32", scale="fp32",
                **{n: "*fp32" for n in ("LSE", "DK", "DV", "DOFF")}, **{n: "constexpr" for n in cx})
    bcx = dict(cx, JC=BWD_SAMPLE_CHUNK)
    bwd = dict(fwd, kernel="fused_bwd", fn=bwd_fn, signature=bsig, constexprs=bcx,
               attrs=aligned_pointer_attrs(bwd_fn, {n: v for n, v in bsig.items() if v.startswith("*")}), config=f"tile 1x{TILE_Y}x{TILE_X},JC={bcx['JC']}",
               note="the fused halo-dense backward (Gluon): not picked until a GPU run checks it")
    return [fwd, bwd, _order_variant(shape, t)]


def _order_variant(shape, offsets_type: str) -> dict:
    """The sample order's Triton kernel (``dsa_order``) as the compile-only check compiles it beside the
    fused pair (plain Triton, no dots: any arch)."""
    from .dsa_halo_dense import ORDER_WIDTH, STARTS_AT, halo_frame, time_reach  # lazy: imports torch
    from .dsa_order import ORDER_BLOCK_ROWS, ORDER_WARPS, _order_kernel  # lazy: as above

    elo, ehi = time_reach(float(shape.max_offset))
    kt, kh, kw = shape.window
    tile = (1, TILE_Y, TILE_X)
    _, fx, _, sw = halo_frame(shape.window, float(shape.max_offset), tile)
    cx = dict(KT=kt, KH=kh, KW=kw, ELO=elo, EHI=ehi, KP=1 << (kh * kw - 1).bit_length(), OW=ORDER_WIDTH,
              SA=STARTS_AT, TT=1, TY=TILE_Y, TX=TILE_X, FX=fx, SW=sw, BLOCK_R=ORDER_BLOCK_ROWS)
    sig = {n: "i32" for n in _order_kernel.arg_names}
    pointers = {"OFF": offsets_type, "ORD": "*i8", "REC": "*i32"}
    sig.update(pointers, **{n: "constexpr" for n in cx})
    return dict(kernel="fused_order", fn=_order_kernel, signature=sig, constexprs=cx, num_warps=ORDER_WARPS, num_stages=1,
                attrs=aligned_pointer_attrs(_order_kernel, pointers),
                config=f"{ORDER_BLOCK_ROWS} rows", tensor_cores=False, may_pick=False,
                note="the fused kernels' sample order (Triton): runs with them")


# -----------------------------------------------------------------------------
# The forward as a backend choice (``KernelModes(halo="fused")``): refusals, and the first-use check

log = logging.getLogger(__name__)
_CHECKED: dict[tuple, str | None] = {}  # (device, dtype, window, bound) -> None (passed) or why not
CHECK_SHAPE = (1, 3, 20, 20, 2, 128)  # the first-use check's problem: 3 frames of 20 x 20 tokens, two heads
CHECK_BWD_HEADS = 8  # the backward's check: eight heads, two groups on two streams (``head_groups``)


def fused_refusal(q: torch.Tensor, window, bound: float | None, slab=None, pass_: str = "forward") -> str | None:
    """Why the fused ``pass_`` ("forward" or "backward") cannot take this call, or None: it needs Gluon's
    shared-memory ops, an sm_90 GPU, bf16 or fp16, a bound, the whole clip (no slab), head dim 128 and
    window 3x7x7 (the shape it was written and compiled for), and its first-use check passed at this shape."""
    why = _shape_refusal(q, window, bound, slab)
    if why is not None:
        return why.replace("the fused forward", f"the fused {pass_}")
    if pass_ == "backward":
        return first_use_check_bwd(q.device, q.dtype, tuple(window), float(bound))
    return first_use_check(q.device, q.dtype, tuple(window), float(bound))


def _shape_refusal(q: torch.Tensor, window, bound: float | None, slab) -> str | None:
    """``fused_refusal`` before the first-use check: the size, the Triton, the device, dtype and shape."""
    rows = q.numel() // q.shape[-1]  # (query, head) rows; the kernels index the offsets' elements in int32
    if rows * math.prod(window) * 3 >= 2 ** 31:
        return (f"the fused forward indexes the offsets in 32 bits: {rows} (query, head) rows x {math.prod(window)} "
                f"samples x 3 is past 2^31; split the batch")
    why = gluon_halo_refusal()
    if why is not None:
        return why
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        return "the fused forward runs on sm_90 (Hopper) GPUs only"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"the fused forward takes bf16 or fp16, not {q.dtype}"
    if bound is None or slab is not None:
        return "the fused forward needs a bound (attention.max_offset) and the whole clip (no token chunks)"
    if (q.shape[-1], tuple(window)) != (128, (3, 7, 7)):
        return f"the fused forward is built for head dim 128 and window 3x7x7, not {q.shape[-1]} and {tuple(window)}"
    return None


def first_use_check(device, dtype, window, bound: float) -> str | None:
    """Run the kernel once per (device, dtype, window, bound) on a small random problem at the same
    compile (``CHECK_SHAPE``: a 3 x 20 x 20 grid, two heads, offsets within the bound) and hold it to the fp32 reference
    by the flash rule; None when it passed, else why not (the caller falls back, never a wrong result)."""
    key = (str(device), dtype, window, bound)
    if key not in _CHECKED:
        _CHECKED[key] = _check_once(device, dtype, window, bound)
    return _CHECKED[key]


def _check_once(device, dtype, window, bound: float) -> str | None:
    from .checks import flash_rule_errors  # lazy: test helpers, needed only here
    from .dsa_reference import dsa_reference  # lazy: as above, once per shape

    g = torch.Generator().manual_seed(0)
    shape = CHECK_SHAPE
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    off = (torch.rand((*shape[:5], 147, 3), generator=g) * 2 - 1) * bound
    try:
        out = halo_dense_forward(*(x.to(device, dtype) for x in (q, k, v, off)), window, 128 ** -0.5, bound)[0]
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure to build or run means: not this kernel
        return f"the fused forward failed its first-use run ({type(e).__name__}: {str(e)[:200]})"
    ref32 = dsa_reference(q, k, v, off, window)
    same = dsa_reference(*(x.to(dtype) for x in (q, k, v, off)), window, upcast=False)
    errors = flash_rule_errors((out.float().cpu(),), (ref32,), (same,), 1e-3)
    return f"the fused forward failed its first-use check against the reference ({errors[0]})" if errors else None


_CHECKED_BWD: dict[tuple, str | None] = {}


def first_use_check_bwd(device, dtype, window, bound: float) -> str | None:
    """The backward's first-use check, once per (device, dtype, window, bound): the Gluon backward on
    ``CHECK_SHAPE``'s grid with ``CHECK_BWD_HEADS`` heads after the mirror's forward (its out and log-sum-exp, fp32), its four gradients held
    to the reference's by the flash rule; None when it passed, else why not (the caller falls back)."""
    key = (str(device), dtype, window, bound)
    if key not in _CHECKED_BWD:
        _CHECKED_BWD[key] = _check_bwd_once(device, dtype, window, bound)
    return _CHECKED_BWD[key]


def _check_bwd_once(device, dtype, window, bound: float) -> str | None:
    from .checks import flash_rule_errors, grads  # lazy: test helpers, needed only here
    from .dsa_halo_dense import _forward, _Layout  # lazy: the mirror's forward gives out and lse
    from .dsa_reference import dsa_reference  # lazy: as above

    g = torch.Generator().manual_seed(1)
    shape = (*CHECK_SHAPE[:4], CHECK_BWD_HEADS, CHECK_SHAPE[5])
    q, k, v, dout = (torch.randn(shape, generator=g) for _ in range(4))
    off = (torch.rand((*shape[:5], 147, 3), generator=g) * 2 - 1) * bound
    low = [x.to(dtype) for x in (q, k, v, off)]
    L = _Layout(low[0], low[3], window, bound, (1, TILE_Y, TILE_X))
    out, lse = _forward(L, *low[:3], 128 ** -0.5)  # (BH, T, H, W, d) and natural-log lse
    out = L.unrows(out).contiguous()
    lse2 = (lse / math.log(2.0)).reshape(shape[0], shape[4], -1).float()
    try:
        dev = [x.to(device) for x in low]  # the order and records passed in, as the fused forward passes them
        got = halo_dense_backward(*dev, out.to(device), dout.to(device, dtype), lse2.to(device), window,
                                  128 ** -0.5, bound, walks=sample_walks(dev[3], window, bound))
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure to build or run means: not this kernel
        return f"the fused backward failed its first-use run ({type(e).__name__}: {str(e)[:200]})"
    ref32 = grads(lambda *a: dsa_reference(*a, window), [q, k, v, off], dout)
    same = grads(lambda *a: dsa_reference(*a, window, upcast=False), low, dout.to(dtype))
    errors = flash_rule_errors((ref32[0], *(x.float().cpu() for x in got)), ref32, same, 1e-3)
    return f"the fused backward failed its first-use check against the reference ({errors[0]})" if errors else None


_NOTED: set = set()


def note_fused_once(refused: str | None, pass_: str = "forward") -> None:
    """Say once per pass and reason what took the pass: the fused kernel (INFO), or why not -- a failed
    first-use check as a warning (the kernel exists but disagreed), any other reason as INFO."""
    key = (pass_, refused or "fused")
    if key in _NOTED:
        return
    _NOTED.add(key)
    if refused is None:
        log.info("3D-DSA %s: the fused halo-dense kernel (its first-use check passed)", pass_)
    elif "first-use" in refused:
        log.warning("3D-DSA %s: %s; the other kernels take it", pass_, refused)
    else:
        log.info("3D-DSA %s: not the fused kernel (%s); the other kernels take it", pass_, refused)
