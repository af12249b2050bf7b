"""The gather backward's split mode: dk and dv by the key-side pass for most queries, by fp32
atomics for the few whose offsets reach past the bound it runs at.

Why
  The key-side pass (``dsa_triton_pull``) covers offsets up to ``PULL_MAX_OFFSET`` (3 tokens). An
  unbounded offset head (``attention.max_offset`` 0) may reach further, and one far sample would
  send the whole call to the atomic mode: ``16 d`` fp32 atomics per (query, sample), the largest
  term of the backward's cost, and a result that differs from run to run. This mode sends only the
  queries past the bound to the atomics; the others, usually most of them, stay with the key-side
  pass.

How
  1. The key-side pass runs at its cap, ``PULL_MAX_OFFSET`` (a slab: the largest of ``SPLIT_BOUNDS``
     whose corners its held frames hold). Per (batch, query, head) the largest ``|offset|`` over
     its samples (``query_extents``: a max and a min reduction, no ``|offsets|`` copy) flags the
     queries past it, on the device: nothing is read back, so the call makes no host sync.
  2. The cost model prices this mode at a share of flagged pairs (``dsa_cost.call_breakdown``'s
     ``far_share``: the query-side pass, the key-side pass at the cap and that share of the atomic
     mode's scatter); the offline study (``benchmarks.studies.offset_extent --predict``) measures
     the shares. The launcher does not weigh them per call, which would need them on the host.
  3. The query-side pass (``dsa_triton._dsa_bwd`` with ``SPLIT``) writes the records of every
     query, with ``ds`` and ``a`` zeroed for the flagged ones (``|offset| > b``), and scatters the
     flagged queries' samples to their corners with fp32 atomics into per-chunk buffers. A program
     with no flagged query skips the scatter. The key-side pass at ``b`` adds those buffers to
     its sums before the one rounding to dk's dtype (``ACCUM``).
  An unflagged query's samples all lie within ``b``, so the key-side pass sees every corner they
  reach; a flagged one's records weigh nothing there. dq and d(offsets) are the same for both.

The result is deterministic where no flagged query's corners land; keys that receive atomics add
them in the order they came. Slab calls take the split mode only where the held frames hold every
corner ``b`` allows (``pull_bound``).

Verification status (Caution)
  Verified under the Triton CPU interpreter against ``dsa_reference`` (tests/test_dsa_split.py)
  and compiled for sm_90 and sm_100 (``python -m benchmarks.gpu_check --compile-only``: the presets'
  unbounded shape); not yet run on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import dsa_triton_pull as P
from .dsa_triton_pull import PULL_MAX_OFFSET, REC_FIELDS, pairs_within, pull_bound

__all__ = ["SplitPlan", "split_plan", "split_chunk", "query_extents", "SPLIT_BOUNDS"]

SPLIT_BOUNDS = tuple(b / 2 for b in range(2, int(2 * PULL_MAX_OFFSET) + 1))
"""The bounds the split mode may run the key-side pass at: one per span class (``dsa_cost.span_class``
counts ``n`` and ``(n, n + 1)`` apart) from 1 token up to ``PULL_MAX_OFFSET``."""


@dataclass
class SplitPlan:
    bound: float  # the key-side pass's bound
    flags: torch.Tensor  # int8 (B, Tq, H, W, nh): 1 for a query with an offset past it
    why: str


def query_extents(offsets: torch.Tensor) -> torch.Tensor:
    """``max |offset|`` per (batch, query, head): ``(B, T, H, W, nh)`` from ``(B, T, H, W, nh, K, 3)``,
    through a max and a min (no ``|offsets|`` copy, which is as large as the offsets)."""
    o = offsets.detach()
    return torch.maximum(o.amax(dim=(-2, -1)), -o.amin(dim=(-2, -1)))


def split_plan(offsets: torch.Tensor, win, max_offset: float | None = None, slab=None) -> SplitPlan | None:
    """The split mode for a backward the key-side pass cannot take whole: offsets without a bound
    (``max_offset`` None or non-finite) or bounded past ``PULL_MAX_OFFSET``. The largest bound of
    ``SPLIT_BOUNDS`` that fits the window and the slab (``pull_bound``), and the queries past it
    flagged on the device (``query_extents``: no host sync); None where no bound fits (the atomic
    mode runs) or where ``max_offset`` is within the cap (the pull mode takes the call whole)."""
    if max_offset is not None and math.isfinite(max_offset) and max_offset <= PULL_MAX_OFFSET:
        return None
    for bound in sorted(SPLIT_BOUNDS, reverse=True):
        if pull_bound(offsets, bound, slab, win[0], win[2])[0] is not None:
            break
    else:
        return None
    flags = (query_extents(offsets) > bound).to(torch.int8).contiguous()
    src = "no max_offset" if max_offset is None or not math.isfinite(max_offset) else f"max_offset {max_offset:g}"
    return SplitPlan(bound, flags, f"{src}: the key-side pass at {bound:g}, fp32 atomics for the queries past it "
                                   "(flagged on the device)")


def split_chunk(pairs: int, window, tokens: int, key_tokens: int, head_dim: int) -> int:
    """(batch, head) pairs per launch of the split mode: a pair's records and its atomics' fp32 dk, dv
    together within ``REC_BUDGET_BYTES``."""
    per_pair = REC_FIELDS * math.prod(window) * tokens * 4 + 2 * key_tokens * head_dim * 4
    return pairs_within(pairs, per_pair, P.REC_BUDGET_BYTES)
