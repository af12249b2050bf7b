"""The fused halo-dense kernels' price (``kernels/dsa_halo_dense.py``'s algorithm; the Gluon kernels of
``dsa_gluon_halo``): from their sm_90 compiles (the issue table's PTX counts per loop level, their
sample walks' loop bodies once per chunk of the samples that land in a frame, simulated per tile:
``tile_trips``; their asynchronous dots credited with what the compile issues meanwhile: ``_overlap``), or, where no compile exists, from the design's work counts and assumptions
(``halo_dense_design``). The roofline terms, chips and FlashAttention-3's figures are
``dsa_cost``'s; ``python -m kernels.dsa_cost`` prints these rows under ``fused``."""

from __future__ import annotations

import functools
import heapq
import math

from .dsa_roofline import CHIPS, FA3_MFU, Chip, Cost, _terms, fa3_seconds, issue_key, issue_table

DESIGN_ASSUMPTIONS = {
    "mma_efficiency": "FA3_MFU per pass (the same tensor-core efficiency as the dense baseline)",
    "corner_instr": 6,  # lane instructions per sample corner per gather or scatter (index, weight, smem op)
    "sample_instr": 40,  # per sample and pass: positions, clamps, floors, fractions, 8 weights and indices
    "smem_conflict": 2.0,  # shared-memory gathers and scatter-adds at half the conflict-free rate
    "blocks_per_sm": 1,  # ~200 KB of halo K or V, scores and probabilities per block: no second block
}


def layer_frames(tiles, grid, cx: dict) -> list[int]:
    """Per window layer ``jt``: the (tile, halo frame) pairs whose frame loops walk its samples in the fused
    kernels, the frames ``st + jt - ELO .. st + jt + EHI`` it reaches within the tile's halo (the kernels'
    guard; ``st`` the window's first frame). At bound 1.5 an inner tile has 7 halo frames, a layer reaches 5."""
    T, KT, ELO, EHI = grid[0], cx["KT"], cx["ELO"], cx["EHI"]
    out = [0] * KT
    for tile in tiles:
        st = min(max(tile.q_lo[0] - KT // 2, 0), T - KT)
        lo, hi = max(st - ELO, 0), min(st + KT - 1 + EHI, T - 1)
        for jt in range(KT):
            out[jt] += max(0, min(hi, st + jt + EHI) - max(lo, st + jt - ELO) + 1)
    return out


RECORD_BYTES = 16  # one sample's record (``dsa_halo_dense.sample_records``)


def order_bytes(window) -> int:
    """DRAM bytes per query and head of the kernel that writes the walks' sample order and records
    (``dsa_order``), before the forward (the backward takes its output): the offsets read (bf16), the
    int8 order zeroed (a fill before it) and written, the records written."""
    return math.prod(window) * (3 * 2 + RECORD_BYTES) + 2 * window[0] * 64


def walk_bytes(window) -> int:
    """DRAM bytes per query and head a fused kernel reads of what ``dsa_order`` wrote: every record once
    (every walk's reads of them are priced as L2 bytes, ``_fused_work``) and the order's bucket starts (a
    32-byte sector per layer)."""
    return math.prod(window) * RECORD_BYTES + window[0] * 32


def order_cost(grid, window, head_dim: int, bound: float) -> Cost | None:
    """The sample order and records' Triton kernel (``dsa_order``), a launch of its own before the fused
    forward (the backward takes the forward's): its DRAM bytes (``order_bytes``) and issue slots from its
    sm_90 compile (straight-line code, ``ORDER_BLOCK_ROWS`` (query, head) rows of one layer per program of
    ``ORDER_WARPS`` warps). None where the issue table lacks the compile."""
    from .dsa_halo_dense import time_reach  # lazy: imports torch
    from .dsa_order import ORDER_BLOCK_ROWS, ORDER_WARPS  # lazy: as above

    elo, ehi = time_reach(bound)
    entry = issue_table().get(issue_key("fused_order", head_dim, window, {"ELO": elo, "EHI": ehi}, ORDER_WARPS))
    if entry is None:
        return None
    N = math.prod(grid)
    programs = -(-N // ORDER_BLOCK_ROWS) * window[0]
    return Cost("fused_order", N, math.prod(window), head_dim, 0.0, tc_flops=0.0, dram_bytes=N * order_bytes(window),
                l1_bytes=0.0, atomic_bytes=0.0, issue=programs * 32 * ORDER_WARPS * sum(entry["depths"].values()),
                blocks_per_sm=entry.get("blocks_per_sm"))


@functools.lru_cache(maxsize=64)
def tile_trips(grid, cx_items: tuple, bound: float, offsets: str = "uniform", seed: int = 0) -> tuple:
    """The sample-walk chunks of one walk over each tile's halo frames, tile by tile: ``((((chunks of layer
    0, of layer 1, ...) for each halo frame in order), how many tiles run them), ...)``. A walk over frame ``f``
    visits, per query, the run of its layer's sample order whose samples touch ``f``
    (``dsa_halo_dense.sample_order``), ``JC`` a chunk, as many chunks as the tile's longest run needs;
    a layer that cannot reach ``f`` runs none (``layer_frames``). The runs depend on the offsets' time
    components: ``uniform`` draws them uniform in ``[-bound, bound]`` (the widest spread within the
    bound; ``seed`` fixed, so the figure is reproducible), ``zero`` puts every sample on its layer's
    frame (it touches that frame and, with weight 0, the next). Offsets piled at both ends of the bound
    in different queries of one tile would make every run full: the walks of today's unsorted kernels,
    ``5 x 7`` chunks a layer at bound 1.5."""
    import torch  # lazy: the simulation only

    from .dsa_halo_dense import halo_tiles  # lazy: imports torch

    cx = dict(cx_items)
    T, KT, ELO, EHI, JC, K2 = grid[0], cx["KT"], cx["ELO"], cx["EHI"], cx["JC"], cx["KH"] * cx["KW"]
    window = (KT, cx["KH"], cx["KW"])
    gen = torch.Generator().manual_seed(seed)
    groups: dict[tuple, int] = {}
    for tile in halo_tiles(tuple(grid), window, bound, (1, 8, 8)):
        m = math.prod(h - lo + 1 for lo, h in zip(tile.q_lo, tile.q_hi))
        groups[(tile.q_lo[0], m)] = groups.get((tile.q_lo[0], m), 0) + 1
    out: dict[tuple, int] = {}
    for (t, m), n in sorted(groups.items()):
        st = min(max(t - KT // 2, 0), T - KT)
        lo, hi = max(st - ELO, 0), min(st + KT - 1 + EHI, T - 1)
        trips = torch.zeros((n, hi - lo + 1, KT), dtype=torch.long)  # per tile, halo frame and layer
        for jt in range(KT):
            ot = (torch.zeros((n, m, K2), dtype=torch.float64) if offsets == "zero"
                  else (torch.rand((n, m, K2), generator=gen, dtype=torch.float64) * 2 - 1) * bound)
            t0 = torch.floor((st + jt + ot.float()).clamp(0, T - 1)).long()
            t1 = (t0 + 1).clamp(max=T - 1)
            for f in range(max(lo, st + jt - ELO), min(hi, st + jt + EHI) + 1):
                runs = ((t0 == f) | (t1 == f)).sum(-1).amax(-1)  # per tile: its longest run
                trips[:, f - lo, jt] = -(-runs // JC)
        rows, counts = torch.unique(trips.reshape(n, -1), dim=0, return_counts=True)
        for row, c in zip(rows.tolist(), counts.tolist()):
            key = tuple(tuple(row[i:i + KT]) for i in range(0, len(row), KT))
            out[key] = out.get(key, 0) + c
    return tuple(sorted(out.items()))  # cached: not to be changed by a caller


def frame_trips(grid, cx_items: tuple, bound: float, offsets: str = "uniform", seed: int = 0,
                ahead: bool = False) -> dict:
    """``tile_trips`` per (tile, frame): ``{(chunks of layer 0, of layer 1, ...): how many (tile, frame)
    pairs run them}``; with ``ahead``, each frame's pair holds the next frame's chunks (the last frame's:
    none), as a walk of the next frame run during a frame's dots sees them."""
    out: dict[tuple, int] = {}
    for frames, n in tile_trips(grid, cx_items, bound, offsets, seed):
        seq = frames[1:] + (tuple(0 for _ in frames[0]),) if ahead else frames
        for trips in seq:
            out[trips] = out.get(trips, 0) + n
    return out


def walk_trips(grid, cx_items: tuple, bound: float, offsets: str = "uniform", seed: int = 0) -> tuple[int, ...]:
    """Per window layer ``jt``: the sample-walk chunks the fused kernels run in one walk over every tile
    and halo frame (``frame_trips``, summed)."""
    KT = dict(cx_items)["KT"]
    return tuple(sum(n * row[jt] for row, n in frame_trips(grid, cx_items, bound, offsets, seed).items())
                 for jt in range(KT))


def _fused_work(kernel: str, grid, window, head_dim: int, bound: float, cx: dict,
                offsets: str = "uniform") -> tuple | None:
    """A fused kernel's issue table entry, its tiles' halo frames, the PTX instructions one thread issues
    over them, the records' L2 bytes, its dots' overlap (``_overlap``) and the chunks of K or V loaded
    before the frame loops (None where the table lacks the compile): the code outside the
    frame loops once per 1x8x8 tile, the frame loops' own code once per halo frame, and the sample walks'
    loop bodies once per chunk ``tile_trips`` counts at ``offsets``. The walks in the frame loops
    (``loops["2"]``) are one per window layer and pass, in layer order; a pass that walks a frame while
    the previous frame's dots run walks its first frame before its frame loop (``outer_walks``, one per
    layer: those passes are the last ones) and the others a frame ahead in the loop."""
    from .dsa_gluon_halo import GLUON_WARPS  # lazy: imports torch
    from .dsa_halo_dense import halo_tiles  # lazy: imports torch

    entry = issue_table().get(issue_key(kernel, head_dim, window, cx, GLUON_WARPS))
    if entry is None:
        return None
    tiles = halo_tiles(tuple(grid), tuple(window), bound, (1, 8, 8))
    loops, KT, frames = entry.get("loops", {}).get("2", []), cx["KT"], sum(t.halo_shape[0] for t in tiles)
    outer = entry.get("outer_walks", [])
    if not loops or len(loops) % KT or len(outer) % KT or len(outer) > len(loops):
        raise ValueError(f"{kernel}: {len(loops)} sample walks in its frame loops and {len(outer)} before them, not "
                         f"one per window layer ({KT}) and pass: rerun `python -m benchmarks.gpu_check.issue_table`")
    cx_items = tuple(sorted(cx.items()))
    per_tile = tile_trips(tuple(grid), cx_items, float(bound), offsets)
    every = [sum(n * sum(f[jt] for f in seq) for seq, n in per_tile) for jt in range(KT)]
    first = [sum(n * seq[0][jt] for seq, n in per_tile) for jt in range(KT)]
    ahead = len(loops) - len(outer)  # the walks from here on run a frame ahead
    trips = [every[i % KT] - (first[i % KT] if i >= ahead else 0) for i in range(len(loops))]
    trips += [first[i % KT] for i in range(len(outer))]

    def issued(depths: dict, walk_loops: list, outer_walks: list) -> float:
        """What one thread runs over every tile of counts per loop level (instructions, or barriers):
        outside the frame loops once a tile, the frame loops' own once a frame (less the walks before them),
        each walk once per chunk of its trips."""
        frame_code = depths.get("1", 0) - sum(outer_walks)
        return (len(tiles) * depths.get("0", 0) + frames * frame_code
                + sum(size * n for size, n in zip([*walk_loops, *outer_walks], trips)))

    # every chunk reads a record per lane: from L2 (a tile's records, ~150 KB, do not stay in the L1 left
    # beside the shared memory; their first read from DRAM is in ``walk_bytes``)
    records = sum(trips) * 64 * cx["JC"] * RECORD_BYTES
    bars = entry.get("barriers")
    if bars is None:
        raise ValueError(f"{kernel}: no barrier counts in the issue table: rerun `python -m benchmarks.gpu_check.issue_table`")
    barriers = issued(bars["depths"], bars["loops"].get("2", []), bars["outer_walks"])  # a block's, summed over tiles
    walks_at = {False: frame_trips(tuple(grid), cx_items, float(bound), offsets),
                True: frame_trips(tuple(grid), cx_items, float(bound), offsets, ahead=True)}
    # the dots before the frame loops (a pass's first chunks): each loads a 64-row chunk of K or V too
    first_chunks = len(tiles) * sum(f for d, _, f, _ in entry.get("mma_groups", []) if d == 0) * entry["warps"] // 4
    return (entry, frames, issued(entry["depths"], loops, outer), records,
            _overlap(entry, len(tiles), frames, walks_at, ahead, KT), first_chunks // (2 * 64 * 64 * head_dim), barriers)


def _overlap(entry: dict, tiles: int, frames: int, walks_at: dict, ahead: int, KT: int) -> tuple:
    """A fused kernel's asynchronous dots (``Cost.overlap``) from its compile's ``mma_groups``: a group
    outside the frame loops once per tile, in them once per halo frame, with the instructions it overlaps
    over the block's warps (one warpgroup each four); where sample walks run while it does (one loop per
    window layer, ``KT`` of them), per (tile, frame) with those walks' chunks (``walks_at``: ``frame_trips``, ``True``:
    a frame ahead, for the walks at index ``ahead`` and past in ``loops["2"]``). Where ptxas serialized the
    dots (its "wgmma serialized" warning), none overlaps anything."""
    warps, out = entry["warps"], []
    loops = entry.get("loops", {}).get("2", [])
    if not entry.get("mma_groups"):
        raise ValueError(f"{entry['kernel']}: no wgmma groups in the issue table: rerun "
                         "`python -m benchmarks.gpu_check.issue_table`")
    serialized = entry.get("mma_serialized", False)  # ptxas waits for every wgmma where it was issued: no overlap
    for depth, between, flops, spans in entry["mma_groups"]:
        if depth > 1 or (spans and (depth != 1 or len(spans) != KT or {i // KT for i in spans} != {spans[0] // KT})):
            raise ValueError(f"{entry['kernel']}: a wgmma group at loop depth {depth} over loops {spans}: the model "
                             "counts groups in the frame loops (depth 1), over one pass's walks (one a window layer)")
        block_flops = flops * warps // 4
        if not spans or serialized:
            out.append((tiles if depth == 0 else frames, 0 if serialized else 32 * warps * between, block_flops))
            continue
        sizes = [loops[i] for i in spans]
        for trips, n in sorted(walks_at[spans[0] >= ahead].items()):
            out.append((n, 32 * warps * (between + sum(t * size for t, size in zip(trips, sizes))), block_flops))
    return tuple(out)


def fused_fwd_cost(grid, window, head_dim: int, bound: float, offsets: str = "uniform") -> Cost | None:
    """The fused halo-dense forward (``dsa_gluon_halo``, compiled for sm_90, not yet run) from its compile:
    issue slots ``_fused_work``'s (its walks at ``offsets``), 256 threads per tile; its dots 64 x 64 x d per chunk of 64 halo keys,
    twice (``S = Q K^T``, ``O = P V``), per frame. None where the issue table lacks the compile."""
    from .dsa_gluon_halo import GLUON_WARPS, gluon_halo_constexprs  # lazy: imports torch

    cx = gluon_halo_constexprs(head_dim, window, bound)
    if (work := _fused_work("fused_fwd", grid, window, head_dim, bound, cx, offsets)) is None:
        return None
    entry, frames, per_thread, records, overlap, first_chunks, barriers = work
    N, K = math.prod(grid), math.prod(window)
    return Cost("fused_fwd", N, K, head_dim, 0.0, tc_flops=sum(n * flops for n, _, flops in overlap),
                dram_bytes=N * (4 * head_dim * 2 + walk_bytes(window)),
                l1_bytes=(frames * cx["NCH"] * 2 + first_chunks) * 64 * head_dim * 2, atomic_bytes=0.0, l2_bytes=records,
                issue=32 * GLUON_WARPS * per_thread, blocks_per_sm=entry.get("blocks_per_sm"), overlap=overlap,
                barriers=barriers)


def fused_bwd_cost(grid, window, head_dim: int, bound: float, offsets: str = "uniform") -> Cost | None:
    """The fused halo-dense backward (``dsa_gluon_halo_bwd_jit``, compiled for sm_90, not yet run) from
    its compile, as ``fused_fwd_cost`` (four frame loops); five dots of 64 x 64 x d per chunk of 64 halo
    keys and frame (dP, S, dV, dQ, dK); the halo's K or V chunks into shared memory three times per frame
    (V, K, K) and the fp32 dk, dv rows read and written per chunk (L1/L2); DRAM: q, k, v, out, dout and
    the records read (``walk_bytes``), dq written, dk, dv and the offsets' gradient in fp32 then cast.
    None where the issue table lacks the compile."""
    from .dsa_gluon_halo import BWD_SAMPLE_CHUNK, GLUON_WARPS, gluon_halo_constexprs  # lazy: imports torch

    cx = dict(gluon_halo_constexprs(head_dim, window, bound), JC=BWD_SAMPLE_CHUNK)
    if (work := _fused_work("fused_bwd", grid, window, head_dim, bound, cx, offsets)) is None:
        return None
    entry, frames, per_thread, records, overlap, first_chunks, barriers = work
    N, K, d = math.prod(grid), math.prod(window), head_dim
    chunks = frames * cx["NCH"]
    return Cost("fused_bwd", N, K, d, 0.0, tc_flops=sum(n * flops for n, _, flops in overlap),
                dram_bytes=N * (6 * d * 2 + 2 * (d * 4 * 2 + d * 2) + K * 3 * (4 * 2 + 2) + walk_bytes(window)),
                l1_bytes=chunks * 64 * d * (3 * 2 + 2 * 2 * 4) + first_chunks * 64 * d * 2, atomic_bytes=0.0,
                l2_bytes=records,
                issue=32 * GLUON_WARPS * per_thread, blocks_per_sm=entry.get("blocks_per_sm"), overlap=overlap,
                barriers=barriers)


PAIRS = 40
"""(batch item, head) pairs one attention call runs when none is given: Wan 14B's 40 heads at batch 1."""

LAUNCH_GAP_S = 2e-6
"""Seconds between two dependent launches on one stream (the first's last block retired, the next's first
blocks started): an assumption, about what back-to-back kernels show on an H100, not a measurement."""


def launches(grid, window, bound: float, pass_: str, pairs: int) -> list[list[int]]:
    """The programs of each launch of a fused pass per stream, in order: the forward's one launch of every
    tile and pair; the backward's colour phases (``dsa_gluon_halo.phase_launches``) for each group of heads
    on its own stream (``dsa_gluon_halo.head_groups``, a batch item's heads)."""
    from .dsa_gluon_halo import TILE_X, TILE_Y, head_groups, phase_launches  # lazy: imports torch

    if pass_ == "fwd":
        return [[grid[0] * -(-grid[1] // TILE_Y) * -(-grid[2] // TILE_X) * pairs]]
    tiles = [n for *_, n in phase_launches(tuple(grid), tuple(window), bound)[1]]
    return [[n * (h1 - h0) for n in tiles] for h0, h1 in head_groups(pairs)]


def launch_schedule(program: float, streams: list[list[int]], slots: int, gap: float = LAUNCH_GAP_S) -> float:
    """Seconds until the last of ``streams``' launches ends (``streams[s]``: the programs of each launch stream
    ``s`` makes, in order), each program ``program`` seconds, on ``slots`` resident blocks: a launch starts
    ``gap`` after its stream's previous one ended, and its programs take the slots that free first, after
    those of every launch that started before it (the block scheduler's order). A launch's last partial
    wave leaves slots idle unless another stream's launch has programs waiting."""
    free = [0.0] * slots
    ready = [(gap, s, 0) for s, launched in enumerate(streams) if launched]
    heapq.heapify(ready)
    end = 0.0
    while ready:
        start, s, i = heapq.heappop(ready)
        done = start
        for _ in range(streams[s][i]):
            finish = max(heapq.heappop(free), start) + program
            heapq.heappush(free, finish)
            done = max(done, finish)
        end = max(end, done)
        if i + 1 < len(streams[s]):
            heapq.heappush(ready, (done + gap, s, i + 1))
    return end


def fused_pass(cost: Cost, grid, window, head_dim: int, bound: float, chip: Chip, pass_: str,
               pairs: int = PAIRS) -> dict:
    """One fused pass's row, per (batch, head) pair of a call of ``pairs``: the fused kernel's roofline terms
    (``_terms``; ``roofline_ms``, its work spread evenly over every SM), its time as its launches run
    (``launch_schedule`` over ``launches``: whole programs, one program's time the roofline's spread over
    the tiles; ``slot_share`` the slots' busy share) and, added to it (``ms``), the order kernel's that
    runs before it (``order_ms``; its DRAM time where its compile is missing): before the forward only,
    the backward takes the forward's order and records (``dsa_triton`` keeps them for it; ``order_ms`` 0)."""
    row = _terms(cost, chip, pass_)
    streams = launches(grid, window, bound, pass_, pairs)
    slots = chip.sms * (cost.blocks_per_sm or 1)
    program = row["ms"] / 1e3 * slots * pairs / sum(map(sum, streams))
    row["roofline_ms"], row["ms"] = row["ms"], 1e3 * launch_schedule(program, streams, slots) / pairs
    row.update(launches=sum(map(len, streams)), streams=len(streams), pairs=pairs,
               slot_share=row["roofline_ms"] / row["ms"])
    order = order_cost(grid, window, head_dim, bound)
    if pass_ != "fwd":
        order_s = 0.0
    elif order is None:
        order_s = math.prod(grid) * order_bytes(window) / chip.hbm
    else:
        order_s = order.seconds(chip)["seconds"]
    row["kernel_ms"], row["order_ms"] = row["ms"], 1e3 * order_s
    row["ms"] = row["kernel_ms"] + row["order_ms"]
    return row


def fused_compiled(grid, window, head_dim: int, bound: float, chip: Chip = CHIPS[0],
                   offsets: str = "uniform", pairs: int = PAIRS) -> dict | None:
    """The compiled fused halo-dense forward and backward (their sm_90 compiles' issue slots, not a run)
    per head of a call of ``pairs`` (batch, head) pairs, beside FlashAttention-3: ``{"passes", "dsa_ms",
    "fa3_ms", "ratio"}``; None where the issue table lacks either compile."""
    fwd = fused_fwd_cost(grid, window, head_dim, bound, offsets)
    bwd = fused_bwd_cost(grid, window, head_dim, bound, offsets)
    if fwd is None or bwd is None:
        return None
    passes = {p: fused_pass(c, grid, window, head_dim, bound, chip, p, pairs) for p, c in (("fwd", fwd), ("bwd", bwd))}
    fa3 = {p: 1e3 * v for p, v in fa3_seconds(math.prod(grid), head_dim, chip).items()}
    dsa = {"fwd": passes["fwd"]["ms"], "bwd": passes["bwd"]["ms"]}
    dsa["total"], fa3["total"] = dsa["fwd"] + dsa["bwd"], fa3["fwd"] + fa3["bwd"]
    return {"how": "the Gluon kernels' sm_90 compiles (not yet run)", "offsets": offsets, "pairs": pairs,
            "passes": passes, "dsa_ms": dsa,
            "fa3_ms": fa3, "ratio": fa3["total"] / dsa["total"]}


def halo_dense_design(grid, window, head_dim: int, bound: float, chip: Chip = CHIPS[0], pairs: int = PAIRS) -> dict:
    """The design estimate of the fused halo-dense forward and backward (``kernels/dsa_halo_dense``)
    for one head, beside FlashAttention-3: the mirror's work counts priced with
    ``DESIGN_ASSUMPTIONS``. Per pass: tensor-core time plus issue time (one block per SM: the
    synchronous dots do not overlap the per-sample instructions), or the shared-memory, L2 (every
    tile's halo read once) or DRAM time where larger. A design figure, not a compiled kernel's."""
    from .dsa_halo_dense import halo_dense_counts  # lazy: imports torch

    c = halo_dense_counts(tuple(grid), tuple(window), head_dim, bound)
    A, N, K = DESIGN_ASSUMPTIONS, math.prod(grid), math.prod(window)
    halo_bytes = c["tiles"] * c["mean_halo_keys"] * head_dim * 2
    rows = {}
    for pass_, macs, corners, halo_reads, dram in (
            ("fwd", c["fwd_macs"], c["fwd_corner_ops"], 2 * halo_bytes, N * (4 * head_dim * 2 + K * 3 * 2)),
            ("bwd", c["bwd_macs"], c["bwd_corner_ops"], 4 * halo_bytes, N * (8 * head_dim * 2 + 2 * K * 3 * 2))):
        terms = {"tc": 2 * macs / (chip.bf16_tc * FA3_MFU[pass_]),
                 "issue": (corners * A["corner_instr"] + c["samples"] * A["sample_instr"]) / chip.issue,
                 "smem": corners * 4 * A["smem_conflict"] / chip.l1,
                 "l2": halo_reads / chip.l2_atomic, "dram": dram / chip.hbm}
        terms["issue+tc"] = (terms["tc"] + terms["issue"]) / A["blocks_per_sm"]
        bound_by = max(("issue+tc", "smem", "l2", "dram"), key=terms.get)
        rows[pass_] = {"ms": 1e3 * terms[bound_by], "bound_by": bound_by,
                       "terms_ms": {k: 1e3 * v for k, v in terms.items()}}
    rows["fwd"]["how"] = rows["bwd"]["how"] = "design estimate (no kernel yet)"
    for pass_, compiled in (("fwd", fused_fwd_cost(grid, window, head_dim, bound)),
                            ("bwd", fused_bwd_cost(grid, window, head_dim, bound))):
        if compiled is not None:  # the Gluon kernel exists: its compile, not the assumptions
            rows[pass_] = {**fused_pass(compiled, grid, window, head_dim, bound, chip, pass_, pairs),
                           "how": "the Gluon kernel's sm_90 compile (not yet run)"}
    fa3 = {p: 1e3 * v for p, v in fa3_seconds(N, head_dim, chip).items()}
    dsa = {"fwd": rows["fwd"]["ms"], "bwd": rows["bwd"]["ms"]}
    dsa["total"], fa3["total"] = dsa["fwd"] + dsa["bwd"], fa3["fwd"] + fa3["bwd"]
    return {"grid": list(grid), "window": list(window), "head_dim": head_dim, "bound": bound, "chip": chip.name,
            "how": "; ".join(f"{p}: {r['how']}" for p, r in rows.items()), "assumptions": A, "counts": c,
            "passes": rows, "dsa_ms": dsa, "fa3_ms": fa3, "ratio": fa3["total"] / dsa["total"]}
