"""The roofline the DSA kernels' cost models share (``dsa_cost``: the kernels ``auto`` weighs;
``dsa_fused_cost``: the fused halo-dense pair): chips and their peaks, FlashAttention-3's figures,
one launch's work (``Cost``) and its time, and the issue table of PTX counts from the sm_90
compiles. ``dsa_cost``'s docstring says what each figure is and where it comes from."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

ISSUE_FILE = Path(__file__).with_name("dsa_issue_sm90.json")
ISSUE_KERNELS = ("gather_fwd", "gather_bwd_pull", "gather_bwd_atomic", "halo_scores", "halo_out", "halo_bwd_v",
                 "halo_bwd_k", "halo_dq", "pull_dk", "pull_dv", "fused_fwd", "fused_bwd", "fused_order")
"""The kernels the issue table holds: those ``choose_halo`` weighs, the key-side pass the pull
mode adds, and the atomic mode's backward (the per-head totals), and the fused halo-dense forward and backward (Gluon;
compiled, not yet picked) with the Triton kernel that writes their sample order and records."""


@dataclass(frozen=True)
class Chip:
    name: str
    bf16_tc: float  # dense bf16 tensor-core FLOP/s
    fp32: float  # CUDA-core fp32 FLOP/s (FMA = 2)
    hbm: float  # B/s
    l2_atomic: float  # B/s of fp32 reductions into L2 (assumed)
    l2: float = 5.5e12  # B/s of reads served by L2 (assumed, as the reductions)
    sms: int = 132  # streaming multiprocessors (the slots a launch's blocks take in waves)
    clock: float = 1.98e9  # boost clock, Hz

    @property
    def l1(self) -> float:
        """Aggregate L1 / shared-memory B/s: 128 B per clock and SM."""
        return self.sms * 128 * self.clock

    @property
    def issue(self) -> float:
        """Lane instructions per second: 4 schedulers x 32 lanes per SM and clock."""
        return self.sms * 128 * self.clock


BARRIER_CYCLES = 20
"""Cycles a block-wide barrier (``bar.sync``) holds its block's warps: the warps' last shared-memory
operations performed and the release, with the warps arriving together. An assumption (no GPU has measured
it here); warps that arrive apart add their skew. At one resident block per SM nothing issues meanwhile."""


CHIPS = (
    Chip("H100", 989e12, 67e12, 3.35e12, 5.5e12),
    Chip("H200", 989e12, 67e12, 4.8e12, 5.5e12),
)


FA3_MFU = {"fwd": 0.75, "bwd": 0.55}
"""FlashAttention-3's MFU as its paper reports it on H100 (bf16, head dim 128): the dense baseline."""


def fa3_seconds(tokens: int, head_dim: int, chip: Chip) -> dict:
    """FlashAttention-3 on the same tokens, dense, one head: forward (``4 N^2 d`` FLOPs) and backward
    (2.5x the forward's) at ``FA3_MFU`` of the bf16 peak."""
    f = 4.0 * tokens * tokens * head_dim
    return {"fwd": f / (chip.bf16_tc * FA3_MFU["fwd"]), "bwd": 2.5 * f / (chip.bf16_tc * FA3_MFU["bwd"])}


def issue_key(kernel: str, head_dim: int, window, constexprs: dict, warps: int) -> str:
    """The issue table's key for a compile: the kernel, head dim, window, the constexprs that change
    its code (tile sizes and widths; the bound and the grid are run-time arguments) and the warps."""
    cfg = ",".join(f"{k}={constexprs[k]}" for k in ("BLOCK_M", "XP", "QXP", "KWP", "UP", "JC", "RY", "GY", "ELO", "EHI")
                   if k in constexprs)
    return f"{kernel} d{head_dim} w{'x'.join(map(str, window))} {cfg} warps={warps}"


@functools.lru_cache(maxsize=1)
def issue_table() -> dict:
    """The issue table's entries (``{}`` when the file is missing)."""
    try:
        return json.loads(ISSUE_FILE.read_text())["entries"]
    except FileNotFoundError:
        return {}


def _per_thread(depths: dict, trips) -> float:
    """Instructions one thread issues: the count at each loop depth times the trips of its loops
    (``trips[i]``: iterations of depth ``i + 1`` per iteration of depth ``i``)."""
    total, reps = 0.0, 1.0
    for depth in range(max(map(int, depths)) + 1):
        if depth:
            reps *= trips[depth - 1]
        total += depths.get(str(depth), 0) * reps
    return total


def issue_slots(key: str, programs: float, trips) -> float | None:
    """Lane issue slots of ``programs`` launches of the table's ``key``, or None where the table lacks it."""
    entry = issue_table().get(key)
    if entry is None:
        return None
    return programs * 32 * entry["warps"] * _per_thread(entry["depths"], trips)


def issue_blocks(key: str) -> int | None:
    """Resident blocks per SM of the table's ``key`` (its sm_90 compile), or None where unknown."""
    return issue_table().get(key, {}).get("blocks_per_sm")


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
    issue: float | None = None  # lane issue slots from the compile (``issue_slots``); None: the FMA estimate
    blocks_per_sm: int | None = None  # resident blocks per SM (the compile's registers and shared memory)
    l2_bytes: float = 0.0  # reads served by L2 (data re-read past what L1 holds beside the shared memory)
    overlap: tuple = ()  # asynchronous dots: ``(times, lanes, flops)``, a group of ``flops`` running ``times``
    # while its warps issue ``lanes`` lane instructions (``benchmarks.gpu_check.compile.mma_groups``)
    barriers: float = 0.0  # block-wide barriers the launch's blocks pass, summed over blocks (``compile.barriers``)

    def hidden_seconds(self, chip: Chip) -> float:
        """The time the asynchronous dots and the instructions issued meanwhile overlap: per group the
        shorter of the two (the tensor cores and the schedulers both busy), summed."""
        return sum(n * min(lanes / chip.issue, flops / chip.bf16_tc) for n, lanes, flops in self.overlap)

    def seconds(self, chip: Chip) -> dict:
        """The roofline time: the largest term. A kernel with tensor-core dots adds ``issue+tc``: the warps
        that issue a ``wgmma`` wait for it, so beyond what they issue before that wait (``overlap``,
        nothing for a synchronous dot) only other resident blocks overlap a block's dots with
        instructions: at best ``(lanes + tc - overlap + barriers) / blocks`` per SM; at one block per SM (or
        where the occupancy is unknown) the two add up, less the overlap, plus the time the block's warps
        wait at its barriers (``BARRIER_CYCLES`` each; counted where the compile's are known)."""
        lanes = {"fma": self.fma_flops / chip.fp32} if self.issue is None else {"issue": self.issue / chip.issue}
        hidden = self.hidden_seconds(chip)
        parts = {**lanes, "tc": self.tc_flops / chip.bf16_tc,
                 "dram": self.dram_bytes / chip.hbm, "l1": self.l1_bytes / chip.l1,
                 "atomics": self.atomic_bytes / chip.l2_atomic}
        if self.l2_bytes:
            parts["l2"] = self.l2_bytes / chip.l2
        if self.barriers:  # each holds its SM's warps; other resident blocks issue meanwhile
            parts["barriers"] = self.barriers * BARRIER_CYCLES / (chip.clock * chip.sms)
        if self.tc_flops:
            parts["issue+tc"] = (next(iter(lanes.values())) + parts["tc"] - hidden
                                 + parts.get("barriers", 0.0)) / max(1, self.blocks_per_sm or 1)
        bound = max(parts, key=parts.get)
        extra = {"overlap_s": hidden} if self.overlap else {}
        return {"seconds": parts[bound], "bound": bound, **{f"{k}_s": v for k, v in parts.items()}, **extra}


def _terms(cost: Cost, chip: Chip, pass_: str) -> dict:
    t = cost.seconds(chip)
    return {"kernel": cost.kernel, "pass": pass_, "ms": 1e3 * t["seconds"], "bound_by": t["bound"],
            "blocks_per_sm": cost.blocks_per_sm, "terms_ms": {k[:-2]: 1e3 * v for k, v in t.items() if k.endswith("_s")}}
