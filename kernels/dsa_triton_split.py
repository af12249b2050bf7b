"""The gather backward's split mode: dk and dv by the key-side pass for most queries, by fp32
atomics for the few whose offsets reach past the bound it runs at.

Why
  The key-side pass (``dsa_triton_pull``) covers offsets up to ``PULL_MAX_OFFSET`` (3 tokens). An
  unbounded offset head (``attention.max_offset`` 0) trains to per-call extents of
  3-6 tokens (benchmarks/RESULTS.md, "The offsets' extent per call"), so one far sample sent the
  whole call to the atomic mode: ``16 d`` fp32 atomics per (query, sample), the largest term of the
  backward's cost, and a result that differs from run to run. Yet most queries stay close: in that
  study's models 4-9% of the (query, head) pairs had an offset past 3 tokens and 8-17% past 2.5
  (up to 35% and 58% in the worst call).

How
  1. Per (batch, query, head) the largest ``|offset|`` over its samples (``query_extents``: a max
     and a min reduction, no ``|offsets|`` copy), and the share of pairs past each candidate bound
     (one host sync).
  2. The bound ``b`` (one per span class up to ``PULL_MAX_OFFSET``) whose predicted time is the
     smallest (``dsa_cost.choose_split``: the query-side pass, the key-side pass at ``b``, and the
     flagged share of what the atomic mode's scatter costs), if it beats the atomic mode's.
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
from .dsa_cost import choose_split
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


def split_plan(q: torch.Tensor, offsets: torch.Tensor, win, extent: float, slab=None,
               force: bool = False) -> SplitPlan | None:
    """The split mode for a backward whose offsets' ``extent`` (finite, past ``PULL_MAX_OFFSET``) sends it
    to the atomic mode, or None where the atomic mode is predicted faster (``force``: taken anyway)
    or no bound fits the slab. Measures every query's extent (``query_extents``; a host sync)."""
    if offsets.device.type == "meta" or not math.isfinite(extent) or extent <= PULL_MAX_OFFSET:
        return None
    ext = query_extents(offsets)
    counts = torch.stack([(ext > b).sum() for b in SPLIT_BOUNDS]).tolist()
    total = max(1, ext.numel())
    shares = {b: c / total for b, c in zip(SPLIT_BOUNDS, counts)}
    for b in list(shares):  # a slab's held frames must hold every corner the bound allows
        if pull_bound(offsets, b, slab, win[0], win[2])[0] is None:
            del shares[b]
    if not shares:
        return None
    bound, why = choose_split(tuple(q.shape[1:4]), tuple(win), q.shape[-1], q.element_size(), shares, extent,
                              force)
    if bound is None:
        return None
    return SplitPlan(bound, (ext > bound).to(torch.int8).contiguous(), why)


def split_chunk(pairs: int, window, tokens: int, key_tokens: int, head_dim: int) -> int:
    """(batch, head) pairs per launch of the split mode: a pair's records and its atomics' fp32 dk, dv
    together within ``REC_BUDGET_BYTES``."""
    per_pair = REC_FIELDS * math.prod(window) * tokens * 4 + 2 * key_tokens * head_dim * 4
    return pairs_within(pairs, per_pair, P.REC_BUDGET_BYTES)
