"""The device memory the 3D-DSA Triton launchers allocate besides their inputs and outputs: the
planner's term for it (``megaslide_ray.planning.terms``)."""

from __future__ import annotations

import math
from typing import Sequence

from . import dsa_triton as DT
from .dsa_cost import choose_halo
from .dsa_triton_halo import score_chunk
from .dsa_triton_pull import REC_FIELDS, bound_refusal, rec_chunk
from .dsa_triton_split import split_chunk

__all__ = ["scratch_bytes"]


def scratch_bytes(batch: int, heads: int, grid: Sequence[int], key_tokens: int, window: Sequence[int],
                  head_dim: int, max_offset: float | None, dtype_bytes: int = 2, backward: bool = True) -> int:
    """The most device memory one call's launchers allocate besides their inputs, outputs and the
    log-sum-exp (for the planner): the forward's and the backward's peaks, whichever is larger.
    ``grid``: the queries' (T, H, W); ``key_tokens``: the keys (a slab's, or the grid's);
    ``max_offset``: the bound the caller passes (None: measured at run time, so the larger of
    the two backward modes, and the halo forward wherever it may run at small offsets). With
    ``TIGHTEN_BOUND`` a call may run at any bound below the given one (``tightened_bound``), so
    the halo forward counts wherever it may run at small offsets, and a bound past the key-side
    pass's cap counts the records too.

    - the halo forward, where ``auto`` takes it: the scores, ``4 K`` bytes per token and head, the
      (batch, head) pairs in chunks within ``SCORE_BUDGET_BYTES``;
    - the pull mode's backward: the records, ``4 REC_FIELDS K`` bytes per token and head, in chunks
      within ``REC_BUDGET_BYTES`` (the halo query side writes the same records);
    - the atomic mode's backward: fp32 dk and dv, ``8 d`` bytes per key and head, in chunks within
      ``ATOMIC_BUDGET_BYTES``;
    - the split mode's (``dsa_triton_split``; offsets past the key-side pass's cap): both, for
      chunks within ``REC_BUDGET_BYTES`` together, and a flag byte per query and head.
    """
    DKV_MODE, HALO_MODE, TIGHTEN_BOUND = DT.DKV_MODE, DT.HALO_MODE, DT.TIGHTEN_BOUND  # switches: read per call
    win = tuple(int(w) for w in window)
    K, N, pairs = math.prod(win), math.prod(grid), batch * heads
    bound = None if max_offset is None or bound_refusal(float(max_offset), window_w=win[2]) else float(max_offset)
    # measured offsets may be small on any call (a fresh offset head: 0), where the halo is likeliest
    measured = max_offset is None or TIGHTEN_BOUND
    halo_bound = 0.0 if measured else bound
    fwd = 0
    if halo_bound is not None and dtype_bytes < 4 and HALO_MODE != "gather" and (
            HALO_MODE == "halo" or choose_halo(tuple(grid), win, head_dim, float(halo_bound), dtype_bytes)["fwd"][0]):
        fwd = score_chunk(pairs, K, N) * K * N * 4
    if not backward:
        return fwd
    records = rec_chunk(pairs, win, N) * REC_FIELDS * K * N * 4
    atomic = DT.atomic_chunk(pairs, key_tokens, head_dim) * key_tokens * head_dim * 4 * 2
    # the split mode: a chunk's records and its atomics' fp32 sums, and its flags (a byte per query and head)
    split = split_chunk(pairs, win, N, key_tokens, head_dim) * (
        REC_FIELDS * K * N * 4 + key_tokens * head_dim * 4 * 2) + pairs * N
    if DKV_MODE == "atomic":
        bwd = atomic
    elif bound is not None:  # the given bound takes the pull mode, and so does any bound below it
        bwd = records
    else:  # none given, or one past the cap: any mode, the split mode where the offsets are measured
        bwd = max(records, atomic, split) if measured else max(atomic, split)
    return max(fwd, bwd)
