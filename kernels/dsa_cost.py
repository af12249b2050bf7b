"""The 3D-DSA kernels' cost model: per kernel and shape, the work (FLOPs on each unit, bytes at
each level) and the roofline time on H100/H200 figures. ``benchmarks/gpu_check/cost.py`` prints
it against FlashAttention-3 and the sparse-video anchors; ``choose_halo`` uses it to pick, per
pass, between the halo kernels (``dsa_triton_halo``: tensor cores) and the gather kernels
(``dsa_triton``: CUDA cores).

Per kernel and shape (one batch item, one head; a layer multiplies by its heads): the roofline
time is the largest of FLOPs / the units' peak, DRAM bytes / HBM bandwidth, L1 bytes / L1
bandwidth, atomic bytes / L2 bandwidth and issue slots / the issue rate. The figures are
datasheet peaks (H100 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 3.35 TB/s HBM3; H200 SXM:
same compute, 4.8 TB/s HBM3e), L1 at 128 B per clock per SM (132 SMs, 1.98 GHz boost: 33 TB/s)
and L2 at 5.5 TB/s for fp32 reductions (an assumption, not a datasheet figure); the issue rate
is one instruction per lane and clock on each of the 4 schedulers of every SM (128 lanes: 33.5 T
lane instructions per second, half the fp32 FLOP rate).

Issue slots, from the compile. Every instruction a thread runs takes an issue slot: the FMAs, and
also the index arithmetic, tents, selections, gathers and layout changes around them. Where the
issue table (``dsa_issue_sm90.json``, written by ``python -m benchmarks.gpu_check.issue_table``
from an sm_90 compile) has a kernel's config, its slots are the PTX instructions per loop level
times the loops' trip counts times the threads: the gather kernels' loops are the window's slots
and the 8 corners; the halo passes' are the window's ``(jt, jy)`` groups and the key rows a group
touches; the key-side pass's, its candidate query rows and their slots. This replaces the
per-operation estimates below, which undercounted the gather forward 5.7x (36 d FLOPs per (query,
sample) counted; its PTX issues ``~13 k`` lane instructions per (query, sample) at d 128). Shapes the table lacks (other head dims, windows, fp32) fall back to the
estimates, for every kernel compared at once so a choice never weighs one measure against the other.

The gather kernels are FMA kernels: per (query, sample) the forward blends 8 corner rows of k and
of v (``8 d`` FMAs each, 16 row reads of ``d`` elements from L1/L2) and takes one dot and one
scaled add (``2 d`` FMAs); the backward reads the 16 corner rows again, takes 16 corner dots
(q.k_c, do.v_c), blends k_j, adds ``ds k_j`` to dq and scatters 16 rows of fp32 atomics (dk, dv).
Counting an FMA as 2 FLOPs: forward ``36 d``, backward ``84 d`` per (query, sample).

Everything here is a prediction until a GPU run measures it (``python -m benchmarks.gpu_check
--out DIR`` prints both).
"""

from __future__ import annotations

import functools
import json
import math

from .dsa_fused_cost import PAIRS, fused_compiled, halo_dense_design
from .dsa_roofline import (  # noqa: F401 - the roofline's names, long imported from here
    CHIPS,
    FA3_MFU,
    ISSUE_FILE,
    ISSUE_KERNELS,
    Chip,
    Cost,
    _terms,
    fa3_seconds,
    issue_blocks,
    issue_key,
    issue_slots,
    issue_table,
)


def _gather_issue(kernel: str, tokens: int, window, head_dim: int, dtype_bytes: int) -> float | None:
    """The issue slots of a gather kernel over ``tokens`` queries: the table's fastest config (the
    autotuner's pick), loops over the window's slots and the 8 corners; None where the table lacks it."""
    if dtype_bytes != 2:
        return None
    K = math.prod(window)
    found = [issue_slots(key, math.ceil(tokens / e["constexprs"]["BLOCK_M"]), (K, 8)) for key, e in issue_table().items()
             if e["kernel"] == kernel and e["head_dim"] == head_dim and tuple(e["window"]) == tuple(window)]
    return min(found) if found else None


def gather_costs(tokens: int, window, head_dim: int, dtype_bytes: int = 2, off_bytes: int | None = None,
                 issue: bool = True) -> list[Cost]:
    """Forward and backward (its atomic mode) of the gather kernels for ``tokens`` queries of one
    head. ``issue``: count their issue slots from the issue table where it has them."""
    K = math.prod(window)
    d, N, e = head_dim, tokens, dtype_bytes
    ob = e if off_bytes is None else off_bytes
    row = d * e
    # DRAM: q, k, v, out (+ lse) once, offsets once; the corner rows come from L1/L2 (a head's
    # k and v, 2 N d e bytes, stay in L2 for the grids here: 16 MB at 32k tokens and d = 128)
    fwd = Cost("gather_fwd", N, K, d, fma_flops=36.0 * N * K * d, tc_flops=0.0,
               dram_bytes=N * (4 * row + 4 + 3 * K * ob), l1_bytes=N * K * 16 * row, atomic_bytes=0.0,
               issue=_gather_issue("gather_fwd", N, window, d, e) if issue else None)
    bwd = Cost("gather_bwd", N, K, d, fma_flops=84.0 * N * K * d, tc_flops=0.0,
               dram_bytes=N * (7 * row + 4 + 6 * K * ob + 2 * 2 * d * 4),
               l1_bytes=N * K * 16 * row, atomic_bytes=N * K * 16 * d * 4,
               issue=_gather_issue("gather_bwd_atomic", N, window, d, e) if issue else None)
    return [fwd, bwd]


def pull_costs(grid, window, head_dim: int, bound: float, dtype_bytes: int = 2, issue: bool = True) -> list[Cost]:
    """The gather backward in its pull mode for one head: the query-side pass (the atomic mode's
    work without the scatter: ``52 d`` FLOPs per (query, sample) instead of ``84 d``, plus one
    20-byte record written per (query, sample)) and the key-side pass (``dsa_triton_pull``: two
    launches, dk and dv). Per key tile of ``BX`` keys and per launch, the key-side pass walks
    about ``(KT E)(KH E) KW`` slot iterations (``E = ELO + EHI + 1`` base offsets per axis; all
    counted as reaching the tile, the worst case). Each iteration does ``~20`` lane operations
    on ``QXP`` candidates and ``~6`` per element on the ``(BXP, QXP)`` weight tile, reading 4
    record fields from L1. At bf16 the x tents go to a band of ``UP`` columns per candidate
    (``~6`` lane operations per band element), placed on the tile once per row (a gather and a
    transpose: ``~4`` per element of the ``(BXP, QXP)`` weight tile); fp32 builds the tile itself
    (``~6`` per element per slot). Each candidate row costs two tensor-core dots, the high and low
    halves: ``2 x 2 BXP QXP d`` FLOPs. Lane operations count as FMA issue slots (2 FLOPs). ``issue``:
    each pass's issue slots from the issue table where it has them (the key-side pass's loops: the
    candidate query frames and rows, then the slots of each that can reach the tile)."""
    from .dsa_triton_pull import pull_config, pull_span  # lazy: imports triton

    T, H, W = grid
    K = math.prod(window)
    kt, kh, kw = window
    N, d, e = math.prod(grid), head_dim, dtype_bytes
    elo, ehi = pull_span(bound)
    span = elo + ehi + 1
    cfg = pull_config(d, window, elo, ehi)
    bxp, qxp = cfg["BXP"], cfg["QXP"]
    tiles = T * H * math.ceil(W / cfg["BX"])
    rows = min(T, kt + span - 1) * min(H, kh + span - 1)
    iters = min(T, kt * span) * min(H, kh * span) * kw
    if dtype_bytes == 4:
        lane_ops = iters * (20 * qxp + 6 * bxp * qxp)
    else:
        lane_ops = iters * (20 * qxp + 6 * qxp * cfg["UP"]) + rows * 4 * bxp * qxp
    per_launch = dict(fma_flops=2.0 * lane_ops * tiles, tc_flops=2 * 2.0 * rows * bxp * qxp * d * tiles,
                      dram_bytes=N * K * 4 * 4 + 2 * N * d * e, l1_bytes=tiles * (iters * qxp * 4 * 4 + rows * qxp * d * e),
                      atomic_bytes=0.0)
    slots = None
    keys = [issue_key(k, d, window, {"QXP": qxp, "UP": cfg["UP"], "JC": cfg["JC"]}, cfg["num_warps"])
            for k in ("pull_dk", "pull_dv")]
    if issue and dtype_bytes == 2:  # loops: candidate frames, rows, then their slots' jt, jy, jx chunks
        it, iy = min(T, kt * span), min(H, kh * span)
        rt, ry = min(T, kt + span - 1), min(H, kh + span - 1)
        trips = (rt, ry, it / rt, iy / ry, math.ceil(kw / cfg["JC"]))
        found = [issue_slots(key, tiles, trips) for key in keys]
        slots = None if None in found else sum(found)
    blocks = [issue_blocks(key) for key in keys]
    key_side = Cost("pull_dk+dv", N, K, d, **{k: 2 * v for k, v in per_launch.items()}, issue=slots,
                    blocks_per_sm=None if None in blocks else min(blocks))
    row = d * e
    query_side = Cost("gather_bwd_pull", N, K, d, fma_flops=52.0 * N * K * d, tc_flops=0.0,
                      dram_bytes=N * (7 * row + 4 + 6 * K * e) + N * K * 20, l1_bytes=N * K * 16 * row,
                      atomic_bytes=0.0, issue=_gather_issue("gather_bwd_pull", N, window, d, e) if issue else None)
    return [query_side, key_side]


class _HaloWork:
    """The halo passes' shared terms for one head at one bound (``halo_costs``): the launchers'
    config, the tiles and their (tile, group) visits, a row's dot and bytes, the lane operations per
    group and per row, and the key rows a window row's samples touch (``r``; ``r_grad`` with the
    rows the offsets' gradient reaches)."""

    def __init__(self, grid, window, head_dim: int, bound: float, rows: int | None, dtype_bytes: int, issue: bool):
        from .dsa_triton_halo import halo_config  # lazy: imports triton
        from .dsa_triton_pull import pull_span  # lazy: imports triton

        T, H, W = grid
        self.H = H
        self.window, self.dtype_bytes, self.issue = window, dtype_bytes, issue
        self.kt, self.kh, self.kw = kt, kh, kw = window
        self.K = kt * kh * kw
        self.N, self.d, self.e = math.prod(grid), head_dim, dtype_bytes
        d, e = head_dim, dtype_bytes
        elo, ehi = pull_span(bound)
        span = elo + ehi + 1
        worst = min(span, T) * min(span, H)
        self.r = r = worst if rows is None else min(rows, worst)
        self.r_grad = min(worst, 4 * r)  # the upper corners' rows: up to twice per axis
        self.cfg = cfg = halo_config(d, window, elo, ehi, hw=(H, W))
        self.bxp, self.xp, self.kwp, self.up = bxp, xp, kwp, up = cfg["BXP"], cfg["XP"], cfg["KWP"], cfg["UP"]
        bx, ry = cfg["BX"], cfg["RY"]
        self.ry = ry
        self.visits = T * math.ceil(H / ry) * math.ceil(W / bx) * kt * kh  # (tile, group) pairs
        self.dot = 2.0 * bxp * xp * d
        self.row_bytes = xp * d * e
        self.group_lane = 60 * bxp * kwp
        self.band_lane = kw * (4 * bxp * kwp + 6 * bxp * up) + 4 * bxp * xp
        self.row = d * e
        self.tiles = self.visits // (kt * kh)
        self.frames = min(span, T)
        self.shape = {"XP": xp, "KWP": kwp, "RY": ry}

    def widen(self, rows_, extra=0):
        """A group's key rows: a tile's RY image rows reach RY - 1 more per frame."""
        return self.frames * min(self.H, extra + self.ry - 1 + rows_ / self.frames)

    def cost(self, name, tc, lane, l1, dram, rows_run, consts, warps, groups=None):
        """One pass's ``Cost``, its issue slots from the issue table where it has the config."""
        groups = self.kh if groups is None else groups
        slots = None
        key = issue_key(name, self.d, self.window, consts, warps)
        if self.issue and self.dtype_bytes == 2:
            # kw: the rows pass's slot loop (no BAND3)
            slots = issue_slots(key, self.tiles, (self.kt, groups, self.frames, rows_run / self.frames, self.kw))
        return Cost(name, self.N, self.K, self.d, fma_flops=2.0 * lane, tc_flops=tc, dram_bytes=dram, l1_bytes=l1,
                    atomic_bytes=0.0, issue=slots, blocks_per_sm=issue_blocks(key))

    def grouped(self, name, gy, rows, dots, lane_per_row, l1_per_row, dram, warps):
        """The scores pass and the backward's two sweeps take GY window rows a group: a group's key rows
        are its frames times the rows its GY window rows reach (each window row's r / frames, widened
        by the GY - 1 rows between them)."""
        kh = self.kh
        blocks = [min(gy, kh - j) for j in range(0, kh, gy)]
        r_gy = sum(self.widen(rows, b - 1) for b in blocks) / len(blocks)  # key rows a group, on average
        v = self.visits * len(blocks) // kh
        return self.cost(name, v * r_gy * dots * self.dot, v * (gy * self.group_lane + r_gy * lane_per_row * gy),
                         v * r_gy * l1_per_row, dram, r_gy, dict(self.shape, GY=gy), warps, len(blocks))

    def rows_pass(self, name):
        """The output and dq: the same rows pass, over v and over k."""
        N, K, e, row, visits = self.N, self.K, self.e, self.row, self.visits
        r_rows = self.widen(self.r)
        return self.cost(name, visits * r_rows * self.dot, visits * (self.group_lane + r_rows * self.band_lane),
                         visits * r_rows * self.row_bytes, N * (row + 3 * K * e + 4 * K) + N * row, r_rows,
                         dict(self.shape, UP=self.up), self.cfg["rows_warps"])


def halo_costs(grid, window, head_dim: int, bound: float, rows: int | None = None, dtype_bytes: int = 2,
               issue: bool = True) -> dict:
    """The halo kernels (``dsa_triton_halo``) for one head: ``{"fwd": [scores, out], "bwd": [the
    query side's sweep v, its sweep k, dq]}``. ``rows``: key rows a window row's samples touch, on
    average; default the worst case at the bound (``(ELO + EHI + 1)^2``, clipped to the grid). Per
    tile of ``BXP`` query rows and per (group, touched row):

    - scores: one ``(BXP, XP, d)`` dot, ``~20`` lane operations per sample slot (the gather, the
      tents, the blend), one key row from L1; a group is ``GY`` window rows (``scores_gy``), whose
      samples reach ``GY - 1`` more key rows than one window row's;
    - out and dq: one dot, the band (``~4`` per slot element to pick the slot, ``~6`` per band
      element, for each of the ``KW`` slots) and its placement (``~4`` per ``(BXP, XP)`` element);
    - the backward's query side: two launches of one sweep each (``dO V_row^T``, then ``q K_row^T``;
      ``GY`` window rows a group, ``bwd_gy``) and ``~30`` lane operations per slot, over the rows
      the corners touch or whose weight's derivative reaches (the offsets' gradient needs the upper
      corners' rows too: up to twice per axis);
    - per group, ``~60`` lane operations per slot for the positions.

    A tile is ``RY`` image rows where they are narrower than its lanes (``dsa_triton_halo.halo_tile``): each
    group then reaches ``RY - 1`` more key rows per frame.

    DRAM: q, k, v, out once, offsets once per pass, the scores' scratch (forward, ``4 K`` bytes
    per token written and read) and the records (backward, ``20 K`` written, ``4 K`` read).

    ``issue``: each pass's issue slots from the issue table where it has the config, the loops
    being the ``KT`` x ``ceil(KH / GY)`` groups, then the touched rows' frames and rows (``r`` rows: frames
    ``min(span, T)``, ``r`` over that rows each; the backward's query side at ``r_grad`` rows), then
    (the rows pass without ``BAND3``) the ``KW`` slots."""
    w = _HaloWork(grid, window, head_dim, bound, rows, dtype_bytes, issue)
    N, K, e, row, cfg = w.N, w.K, w.e, w.row, w.cfg
    scores = w.grouped("halo_scores", cfg["scores_gy"], w.r, 1, 20 * w.bxp * w.kwp, w.row_bytes,
                       N * (row + 3 * K * e + 4 * K + 4) + N * row, cfg["scores_warps"])
    out = w.rows_pass("halo_out")
    # the backward's query side: sweep v (dO V_row^T) and sweep k (q K_row^T, the records), over the
    # rows the corners touch or whose weight's derivative reaches
    sweeps = [w.grouped(name, gy, w.r_grad, 1, 30 * w.bxp * w.kwp, w.row_bytes + w.bxp * w.d * e, dram,
                        cfg["bwd_warps"])
              for name, gy, dram in (("halo_bwd_v", cfg["bwd_gy"][0], N * (2 * row + 3 * K * e + 16 * K)),
                                     ("halo_bwd_k", cfg["bwd_gy"][1], N * (row + 6 * K * e + 36 * K + 4)))]
    return {"fwd": [scores, out], "bwd": [*sweeps, w.rows_pass("halo_dq")]}


def span_class(bound: float) -> tuple[float, str]:
    """The offsets' bounds that reach the same keys as ``bound`` (``pull_span``: the integer part
    and whether there is a fraction) as one representative and a label: ``n`` for a whole ``n``,
    ``n + 0.5`` for ``(n, n + 1)``. The kernels' work, and so the cost model, depend on the bound
    only through it: a bound measured per call maps onto a handful of classes."""
    n = math.floor(bound)
    if bound == n:
        return float(n), f"offsets up to {n:g}"
    return n + 0.5, f"offsets in ({n:g}, {n + 1:g})"


def choose_halo(grid, window, head_dim: int, bound: float, dtype_bytes: int = 2) -> dict:
    """Per pass, whether the halo kernels are predicted faster than the gather kernels at this
    shape on H100 figures, with the offsets at the worst the bound allows (every group touching
    every row its span reaches): ``{"fwd": (bool, why), "bwd": (bool, why)}``. The backward
    compares the query sides only: both modes run the same key-side pass after them. Bounds of
    one ``span_class`` get one answer (and one reason to log)."""
    return _choose_halo(tuple(grid), tuple(window), head_dim, *span_class(float(bound)), dtype_bytes)


def halo_seconds(grid, window, head_dim: int, bound: float, dtype_bytes: int = 2) -> tuple[dict, str]:
    """The two sides ``choose_halo`` weighs, per head on H100 figures, with the offsets at the worst
    ``bound`` allows: ``({"fwd": (gather s, halo s), "bwd": (the pull mode's query side s, halo's
    query side s)}, how)``; ``how`` says whether they are the compile's issue slots or estimated
    lane operations (one measure for every kernel weighed)."""
    N = math.prod(grid)
    chip = CHIPS[0]

    def kernels(issue: bool):
        halo = halo_costs(grid, window, head_dim, bound, dtype_bytes=dtype_bytes, issue=issue)
        return {"fwd": (gather_costs(N, window, head_dim, dtype_bytes, issue=issue)[0], halo["fwd"]),
                "bwd": (pull_costs(grid, window, head_dim, bound, dtype_bytes, issue=issue)[0], halo["bwd"])}

    costs = kernels(True)
    measured = all(c.issue is not None for gather, halo in costs.values() for c in (gather, *halo))
    if not measured:
        costs = kernels(False)
    how = "issue slots from the sm_90 compile" if measured else "estimated lane operations"
    return {pass_: (gather.seconds(chip)["seconds"], sum(c.seconds(chip)["seconds"] for c in halo))
            for pass_, (gather, halo) in costs.items()}, how


@functools.lru_cache(maxsize=256)
def _choose_halo(grid, window, head_dim: int, bound: float, label: str, dtype_bytes: int) -> dict:
    seconds, how = halo_seconds(grid, window, head_dim, bound, dtype_bytes)
    out = {}
    for pass_, (gather_s, halo_s) in seconds.items():
        faster = halo_s < gather_s
        out[pass_] = (faster, f"cost model at {label} ({how}): halo {1e3 * halo_s:.3g} ms vs gather "
                              f"{1e3 * gather_s:.3g} ms per head ({'x'.join(map(str, grid))}, d {head_dim}, "
                              f"window {'x'.join(map(str, window))})")
    return out


def call_breakdown(grid, window, head_dim: int, bound: float | None, dtype_bytes: int = 2, chip: Chip = CHIPS[0],
                   far_share: float | None = None) -> dict:
    """The kernels ``auto`` runs for one call of a whole clip at ``bound`` (its ``max_offset``; None:
    unbounded) and the predicted time per head on ``chip``, kernel by kernel with each roofline term,
    beside FlashAttention-3 (``fa3_seconds``) on the same tokens. Up to ``PULL_MAX_OFFSET``: per pass
    the halo or the gather kernels (``choose_halo``), then the key-side pass; without a bound or past
    the cap, the gather forward and the split backward at the cap, which needs ``far_share`` (the
    share of (query, head) pairs with an offset past the cap): its scatter is that share of what the
    atomic mode costs beyond the query-side pass. Every kernel in one measure: the compile's issue
    slots where the table has them all, else the estimates."""
    from .dsa_triton_pull import PULL_MAX_OFFSET  # lazy: imports triton

    grid, window = tuple(grid), tuple(window)
    N = math.prod(grid)
    bounded = bound is not None and float(bound) <= PULL_MAX_OFFSET
    at = float(bound) if bounded else PULL_MAX_OFFSET
    if not bounded and far_share is None:
        raise ValueError(f"bound {bound} is unbounded or past the key-side pass's cap {PULL_MAX_OFFSET:g}: the "
                         "split backward's time needs far_share, the share of (query, head) pairs past the cap")
    pick = choose_halo(grid, window, head_dim, at, dtype_bytes) if bounded else None

    def kernels(issue: bool):
        gather_fwd, gather_atomic = gather_costs(N, window, head_dim, dtype_bytes, issue=issue)
        query, key = pull_costs(grid, window, head_dim, at, dtype_bytes, issue=issue)
        halo = halo_costs(grid, window, head_dim, at, dtype_bytes=dtype_bytes, issue=issue) if bounded else None
        fwd = halo["fwd"] if bounded and pick["fwd"][0] else [gather_fwd]
        bwd = (halo["bwd"] if bounded and pick["bwd"][0] else [query]) + [key]
        return fwd, bwd, query, gather_atomic

    fwd, bwd, query, atomic = kernels(True)
    how = "issue slots from the sm_90 compile"
    if any(c.issue is None for c in (*fwd, *bwd, query, atomic)):
        fwd, bwd, query, atomic = kernels(False)
        how = "estimated lane operations"
    rows = [_terms(c, chip, "fwd") for c in fwd] + [_terms(c, chip, "bwd") for c in bwd]
    if not bounded:  # the split mode: the flagged share of the atomic mode's scatter
        scatter = max(0.0, atomic.seconds(chip)["seconds"] - query.seconds(chip)["seconds"])
        rows.append({"kernel": "split scatter", "pass": "bwd", "ms": 1e3 * far_share * scatter, "bound_by": "atomics",
                     "blocks_per_sm": None, "terms_ms": {"share": far_share, "atomic_scatter": 1e3 * scatter}})
    dsa = {p: sum(r["ms"] for r in rows if r["pass"] == p) for p in ("fwd", "bwd")}
    fa3 = {p: 1e3 * v for p, v in fa3_seconds(N, head_dim, chip).items()}
    dsa["total"], fa3["total"] = dsa["fwd"] + dsa["bwd"], fa3["fwd"] + fa3["bwd"]
    modes = {"fwd": "halo" if bounded and pick["fwd"][0] else "gather",
             "bwd": (("halo+pull" if pick["bwd"][0] else "gather+pull") if bounded else f"split at {at:g}")}
    return {"grid": list(grid), "window": list(window), "head_dim": head_dim, "bound": bound, "chip": chip.name,
            "dtype_bytes": dtype_bytes, "how": how, "modes": modes, "kernels": rows, "dsa_ms": dsa, "fa3_ms": fa3,
            "ratio": fa3["total"] / dsa["total"], "atomic_bwd_ms": 1e3 * atomic.seconds(chip)["seconds"]}


def predict_call(grid, window, head_dim: int, shares: dict, dtype_bytes: int = 2,
                 max_offset: float | None = None) -> dict:
    """What the ``auto`` kernel modes (``dsa_modes``) run for one call of a whole clip and the predicted time
    per head on H100 figures (``call_breakdown``): ``{"bound", "fwd": (kernel, s), "bwd": (mode, s)}``,
    past the cap also ``"atomic"``: the atomic mode's backward s, for comparison. Kernels "halo" and
    "gather"; modes "halo+pull" and "gather+pull" (that query side, then the key-side pass) and
    "split at B". A call runs at its ``max_offset`` (nothing is measured); without a bound or past
    the cap the split mode's flagged share is ``shares[PULL_MAX_OFFSET]`` (the share of (query, head)
    pairs past it: a trained model's, e.g. from ``benchmarks.studies.offset_extent``)."""
    from .dsa_triton_pull import PULL_MAX_OFFSET  # lazy: imports triton

    b = call_breakdown(grid, window, head_dim, max_offset, dtype_bytes, far_share=shares.get(PULL_MAX_OFFSET))
    out = {"bound": max_offset, "fwd": (b["modes"]["fwd"], b["dsa_ms"]["fwd"] / 1e3),
           "bwd": (b["modes"]["bwd"], b["dsa_ms"]["bwd"] / 1e3)}
    if b["modes"]["bwd"].startswith("split"):
        out["atomic"] = b["atomic_bwd_ms"] / 1e3
    return out


# -----------------------------------------------------------------------------
# Command line: python -m kernels.dsa_cost --grid 21x30x52 --window 3x7x7 --head-dim 128 --bound 1.5


def _dims(text: str, n: int, name: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) != n or min(dims) <= 0:
        raise SystemExit(f"--{name} {text!r}: give {n} positive integers joined by x (e.g. "
                         f"{'21x30x52' if n == 3 else '3x7x7'})")
    return dims


def main(argv=None) -> int:
    """Print the cost model's prediction for one call (per head): the kernels ``auto`` runs, each
    roofline term, the forward and backward against FlashAttention-3 on the same tokens."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kernels.dsa_cost", description=main.__doc__)
    p.add_argument("--grid", default="21x30x52", help="token grid TxHxW (default: Wan 480p, 21x30x52)")
    p.add_argument("--window", default="3x7x7", help="DSA window kt x kh x kw (default 3x7x7)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bound", type=float, default=1.5,
                   help="attention.max_offset the call runs at (default 1.5, the GPU presets'); negative: unbounded")
    p.add_argument("--far-share", type=float, default=None,
                   help="unbounded or past the cap: the share of (query, head) pairs with an offset past 3 tokens "
                        "(the split backward's atomics; the adaptation study measured 0.04-0.09)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--chip", choices=[c.name for c in CHIPS], default=CHIPS[0].name)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    p.add_argument("--heads", type=int, default=PAIRS,
                   help=f"(batch, head) pairs of the call (default {PAIRS}: Wan 14B's heads); the fused kernels' "
                        "launches take the GPU's slots in whole programs")
    p.add_argument("--design", action="store_true",
                   help="also the fused halo-dense kernels' design estimate (no kernel yet; JSON key 'design')")
    a = p.parse_args(argv)
    grid, window = _dims(a.grid, 3, "grid"), _dims(a.window, 3, "window")
    if a.head_dim <= 0:
        p.error(f"--head-dim {a.head_dim}: give a positive head dim (128 for Wan and the dit-* presets)")
    if a.heads < 1:
        p.error(f"--heads {a.heads}: give the call's (batch, head) pairs, at least 1 (40 for Wan 14B)")
    if a.far_share is not None and not 0.0 <= a.far_share <= 1.0:
        p.error(f"--far-share {a.far_share}: give a share between 0 and 1")
    bound = None if a.bound < 0 else a.bound
    chip = next(c for c in CHIPS if c.name == a.chip)
    try:
        b = call_breakdown(grid, window, a.head_dim, bound, 2 if a.dtype == "bf16" else 4, chip, a.far_share)
    except ValueError as e:
        p.error(str(e))
    if a.design:
        if bound is None:
            p.error("--design needs a bound (the halo is sized by attention.max_offset)")
        b["design"] = halo_dense_design(grid, window, a.head_dim, bound, chip, a.heads)
    if bound is not None:  # the compiled fused halo-dense kernels, where the issue table has them
        b["fused"] = fused_compiled(grid, window, a.head_dim, bound, chip, pairs=a.heads)  # offsets uniform in the bound
        zero = fused_compiled(grid, window, a.head_dim, bound, chip, offsets="zero", pairs=a.heads)
        if b["fused"] is not None and zero is not None:
            b["fused"]["at_zero_offsets"] = {"dsa_ms": zero["dsa_ms"], "ratio": zero["ratio"]}
    if a.json:
        print(json.dumps(b))
        return 0
    print(f"{a.dtype}, grid {a.grid}, window {a.window}, head dim {a.head_dim}, bound "
          f"{'unbounded' if bound is None else f'{bound:g}'}, {a.chip}, per head ({b['how']}):")
    for r in b["kernels"]:
        terms = ", ".join(f"{k} {v:.3g}" for k, v in r["terms_ms"].items() if v)
        print(f"  {r['pass']:>3} {r['kernel']:<16} {r['ms']:8.3f} ms  bound by {r['bound_by']:<9} ({terms})")
    d, f = b["dsa_ms"], b["fa3_ms"]
    print(f"  DSA  fwd {d['fwd']:.3f} + bwd {d['bwd']:.3f} = {d['total']:.3f} ms ({b['modes']['fwd']}, {b['modes']['bwd']})")
    print(f"  FA3  fwd {f['fwd']:.3f} + bwd {f['bwd']:.3f} = {f['total']:.3f} ms (dense, {FA3_MFU['fwd']:.0%}/"
          f"{FA3_MFU['bwd']:.0%} MFU)")
    print(f"  FA3 / DSA: {b['ratio']:.2f}x")
    if b.get("fused"):
        g = b["fused"]
        for pass_, r in g["passes"].items():
            terms = ", ".join(f"{k} {v:.3g}" for k, v in r["terms_ms"].items() if v)
            print(f"  fused halo-dense {pass_}: {r['ms']:.3f} ms, bound by {r['bound_by']} ({terms})")
        print(f"  fused halo-dense fwd + bwd: {g['dsa_ms']['total']:.3f} ms, FA3 / fused {g['ratio']:.2f}x "
              f"({g['how']}; offsets uniform within the bound; per head of a call of {g['pairs']})")
        z = g["at_zero_offsets"]
        print(f"  fused halo-dense at zero offsets: {z['dsa_ms']['total']:.3f} ms, FA3 / fused {z['ratio']:.2f}x")
    if a.design:
        g = b["design"]
        for pass_, r in g["passes"].items():
            terms = ", ".join(f"{k} {v:.3g}" for k, v in r["terms_ms"].items())
            print(f"  halo-dense {pass_}: {r['ms']:.3f} ms, bound by {r['bound_by']} ({terms}; {r['how']})")
        print(f"  halo-dense ({g['counts']['tiles']} tiles, {g['counts']['phases']} colour phases): "
              f"{g['dsa_ms']['total']:.3f} ms, FA3 / halo-dense {g['ratio']:.2f}x (no kernel of it has run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
