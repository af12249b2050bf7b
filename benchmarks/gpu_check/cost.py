"""The kernels' cost model: a prediction, from the shapes and the compile, for the first GPU run.

Per kernel and shape (one batch item, one head; a layer multiplies by its heads): the FLOPs it
executes and on which units, the bytes it moves at each level, and the roofline time -- the
largest of (FLOPs / the units' peak, DRAM bytes / HBM bandwidth, L1 bytes / L1 bandwidth,
atomic bytes / L2 bandwidth) -- on H100 SXM and H200 figures. Against it: FlashAttention-3 on
the same tokens (dense, ``4 N^2 d`` forward, ``10 N^2 d`` backward, at the MFU its paper
reports: 75% forward, 55% backward of the bf16 peak), and the sparse-video anchors (sliding tile
attention, video sparse attention: block-sparse kernels reaching 58-85% of FA3's MFU), here a
block-sparse kernel attending K keys per query at that fraction of FA3's rate.

The gather kernels (``kernels/dsa_triton.py``) are FMA kernels: per (query, sample) the forward
blends 8 corner rows of k and of v (``8 d`` FMAs each, 16 row reads of ``d`` elements from L1/L2)
and takes one dot and one scaled add (``2 d`` FMAs); the backward reads the 16 corner rows again,
takes 16 corner dots (q.k_c, do.v_c), blends k_j, adds ``ds k_j`` to dq and scatters 16 rows of
fp32 atomics (dk, dv). Counting an FMA as 2 FLOPs: forward ``36 d``, backward ``84 d`` per
(query, sample) on the CUDA cores (fp32 FMA peak: 67 TFLOP/s on both chips).

Everything here is a prediction until a GPU run measures it (``python -m benchmarks.gpu_check
--out DIR`` prints both); the figures are datasheet peaks (H100 SXM: 989 TFLOP/s dense bf16, 67
TFLOP/s fp32, 3.35 TB/s HBM3; H200 SXM: same compute, 4.8 TB/s HBM3e), L1 at 128 B per clock per
SM (132 SMs, 1.98 GHz boost: 33 TB/s) and L2 at 5.5 TB/s for fp32 reductions (an assumption,
not a datasheet figure).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_tc: float  # dense bf16 tensor-core FLOP/s
    fp32: float  # CUDA-core fp32 FLOP/s (FMA = 2)
    hbm: float  # B/s
    l1: float  # aggregate L1 / shared-memory B/s
    l2_atomic: float  # B/s of fp32 reductions into L2 (assumed)


CHIPS = (
    Chip("H100", 989e12, 67e12, 3.35e12, 132 * 128 * 1.98e9, 5.5e12),
    Chip("H200", 989e12, 67e12, 4.8e12, 132 * 128 * 1.98e9, 5.5e12),
)
FA3_MFU = {"fwd": 0.75, "bwd": 0.55}
ANCHOR_OF_FA3 = (0.58, 0.85)


@dataclass(frozen=True)
class Cost:
    """One kernel launch's work for one batch item and one head."""

    kernel: str
    tokens: int
    K: int
    head_dim: int
    fma_flops: float  # on CUDA cores
    tc_flops: float  # on tensor cores
    dram_bytes: float
    l1_bytes: float
    atomic_bytes: float

    def seconds(self, chip: Chip) -> dict:
        parts = {"fma": self.fma_flops / chip.fp32, "tc": self.tc_flops / chip.bf16_tc,
                 "dram": self.dram_bytes / chip.hbm, "l1": self.l1_bytes / chip.l1,
                 "atomics": self.atomic_bytes / chip.l2_atomic}
        bound = max(parts, key=parts.get)
        return {"seconds": parts[bound], "bound": bound, **{f"{k}_s": v for k, v in parts.items()}}


def gather_costs(tokens: int, window, head_dim: int, dtype_bytes: int = 2, off_bytes: int | None = None) -> list[Cost]:
    """Forward and backward of the gather kernels for ``tokens`` queries of one head."""
    K = math.prod(window)
    d, N, e = head_dim, tokens, dtype_bytes
    ob = e if off_bytes is None else off_bytes
    row = d * e
    # DRAM: q, k, v, out (+ lse) once, offsets once; the corner rows come from L1/L2 (a head's
    # k and v, 2 N d e bytes, stay in L2 for the grids here: 16 MB at 32k tokens and d = 128)
    fwd = Cost("gather_fwd", N, K, d, fma_flops=36.0 * N * K * d, tc_flops=0.0,
               dram_bytes=N * (4 * row + 4 + 3 * K * ob), l1_bytes=N * K * 16 * row, atomic_bytes=0.0)
    bwd = Cost("gather_bwd", N, K, d, fma_flops=84.0 * N * K * d, tc_flops=0.0,
               dram_bytes=N * (7 * row + 4 + 6 * K * ob + 2 * 2 * d * 4),
               l1_bytes=N * K * 16 * row, atomic_bytes=N * K * 16 * d * 4)
    return [fwd, bwd]


def pull_costs(grid, window, head_dim: int, bound: float, dtype_bytes: int = 2) -> list[Cost]:
    """The gather backward in its pull mode for one head: the query-side pass (the atomic mode's
    work without the scatter: ``52 d`` FLOPs per (query, sample) instead of ``84 d``, plus one
    20-byte record written per (query, sample)) and the key-side pass (``dsa_triton_pull``: two
    launches, dk and dv). Per key tile of ``BX`` keys and per launch, the key-side pass walks
    about ``(KT E)(KH E) KW`` slot iterations (``E = ELO + EHI + 1`` base offsets per axis; all
    counted as reaching the tile, the worst case). Each iteration does ``~20`` lane operations
    on ``QXP`` candidates and ``~6`` per element on the ``(BXP, QXP)`` weight tile, reading 4
    record fields from L1. Each candidate row costs two tensor-core dots, the high and low
    halves: ``2 x 2 BXP QXP d`` FLOPs. Lane operations count as FMA issue slots (2 FLOPs)."""
    from kernels.dsa_triton_pull import pull_config, pull_span  # lazy: imports triton

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
    lane_ops = iters * (20 * qxp + 6 * bxp * qxp)
    per_launch = dict(fma_flops=2.0 * lane_ops * tiles, tc_flops=2 * 2.0 * rows * bxp * qxp * d * tiles,
                      dram_bytes=N * K * 4 * 4 + 2 * N * d * e, l1_bytes=tiles * (iters * qxp * 4 * 4 + rows * qxp * d * e),
                      atomic_bytes=0.0)
    key_side = Cost("pull_dk+dv", N, K, d, **{k: 2 * v for k, v in per_launch.items()})
    row = d * e
    query_side = Cost("gather_bwd_pull", N, K, d, fma_flops=52.0 * N * K * d, tc_flops=0.0,
                      dram_bytes=N * (7 * row + 4 + 6 * K * e) + N * K * 20, l1_bytes=N * K * 16 * row,
                      atomic_bytes=0.0)
    return [query_side, key_side]


def flash_seconds(tokens: int, head_dim: int, chip: Chip) -> dict:
    """FlashAttention-3 on the same tokens, dense, one head: forward and backward."""
    f = 4.0 * tokens * tokens * head_dim
    return {"fwd": f / (chip.bf16_tc * FA3_MFU["fwd"]), "bwd": 2.5 * f / (chip.bf16_tc * FA3_MFU["bwd"])}


def anchor_seconds(tokens: int, K: int, head_dim: int, chip: Chip) -> dict:
    """A block-sparse kernel (sliding tile / video sparse attention) over K keys per query at
    58-85% of FA3's MFU: (best, worst) forward and backward seconds, one head."""
    f = 4.0 * tokens * K * head_dim
    out = {}
    for pass_, mult in (("fwd", 1.0), ("bwd", 2.5)):
        rate = chip.bf16_tc * FA3_MFU[pass_]
        out[pass_] = (mult * f / (rate * ANCHOR_OF_FA3[1]), mult * f / (rate * ANCHOR_OF_FA3[0]))
    return out


def predictions(shapes, heads: dict | None = None) -> list[dict]:
    """One row per (shape, chip, pass): the kernel's roofline time and what bounds it, FA3 dense,
    the anchors, per head and per layer (``heads``: the layer's head count per head dim)."""
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET  # lazy: imports triton (pull_costs does too)

    rows = []
    for s in shapes:
        N = math.prod(s.grid)
        K = math.prod(s.window)
        nh = (heads or {}).get(s.head_dim, 1)
        e = 2 if s.dtype == "bf16" else 4
        costs = list(zip(gather_costs(N, s.window, s.head_dim, e), ("fwd", "bwd")))
        if s.max_offset is not None and s.max_offset <= PULL_MAX_OFFSET:  # the backward mode that runs there
            costs += [(c, "bwd") for c in pull_costs(s.grid, s.window, s.head_dim, s.max_offset, e)]
        for chip in CHIPS:
            fl = flash_seconds(N, s.head_dim, chip)
            an = anchor_seconds(N, K, s.head_dim, chip)
            for c, pass_ in costs:
                t = c.seconds(chip)
                rows.append({"shape": s.label, "chip": chip.name, "kernel": c.kernel, "pass": pass_, "heads": nh,
                             "ms_per_layer": 1e3 * t["seconds"] * nh, "bound": t["bound"],
                             "flash_ms_per_layer": 1e3 * fl[pass_] * nh,
                             "anchor_ms_per_layer": [1e3 * x * nh for x in an[pass_]],
                             "vs_flash": fl[pass_] / t["seconds"], "cost": asdict(c),
                             "terms_ms": {k[:-2]: 1e3 * v * nh for k, v in t.items() if k.endswith("_s")}})
    return rows


def table(rows: list[dict]) -> list[str]:
    out = ["| shape | chip | kernel | heads | predicted ms/layer | bound by | fma / l1 / dram / atomics ms | "
           "FA3 dense ms | anchors ms | dense/DSA |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tm = r["terms_ms"]
        out.append(f"| {r['shape']} | {r['chip']} | {r['kernel']} | {r['heads']} | {r['ms_per_layer']:.2f} | "
                   f"{r['bound']} | {tm['fma']:.2f} / {tm['l1']:.2f} / {tm['dram']:.2f} / {tm['atomics']:.2f} | "
                   f"{r['flash_ms_per_layer']:.2f} | {r['anchor_ms_per_layer'][0]:.3g}-{r['anchor_ms_per_layer'][1]:.3g} | "
                   f"x{r['vs_flash']:.2f} |")
    return out
