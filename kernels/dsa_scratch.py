"""The device memory the 3D-DSA Triton launchers allocate besides their inputs and outputs: the
planner's term for it (``megaslide_ray.planning.terms``)."""

from __future__ import annotations

import math
from typing import Sequence

from . import dsa_triton as DT
from .dsa_cost import choose_halo
from .dsa_modes import AUTO, KernelModes
from .dsa_triton_halo import score_chunk
from .dsa_triton_pull import REC_FIELDS, bound_refusal, rec_chunk
from .dsa_triton_split import split_chunk

__all__ = ["scratch_bytes"]


def scratch_bytes(batch: int, heads: int, grid: Sequence[int], key_tokens: int, window: Sequence[int],
                  head_dim: int, max_offset: float | None, dtype_bytes: int = 2, backward: bool = True,
                  modes: KernelModes = AUTO) -> int:
    """The most device memory one call's launchers allocate besides their inputs, outputs and the
    log-sum-exp (for the planner): the forward's and the backward's peaks, whichever is larger.
    ``grid``: the queries' (T, H, W); ``key_tokens``: the keys (a slab's, or the grid's);
    ``max_offset``: the bound the caller passes, which a call runs at (None: unbounded offsets, the
    gather forward and the split backward, or the atomic one where no split bound fits a slab);
    ``modes``: the kernel families the call runs (``dsa_modes``; the product runs ``auto``).

    - the halo forward, where ``auto`` takes it: the scores, ``4 K`` bytes per token and head, the
      (batch, head) pairs in chunks within ``SCORE_BUDGET_BYTES``;
    - the pull mode's backward: the records, ``4 REC_FIELDS K`` bytes per token and head, in chunks
      within ``REC_BUDGET_BYTES`` (the halo query side writes the same records);
    - the atomic mode's backward: fp32 dk and dv, ``8 d`` bytes per key and head, in chunks within
      ``ATOMIC_BUDGET_BYTES``;
    - the split mode's (``dsa_triton_split``; no bound, or one past the key-side pass's cap): both,
      for chunks within ``REC_BUDGET_BYTES`` together, and a flag byte per query and head.
    """
    win = tuple(int(w) for w in window)
    K, N, pairs = math.prod(win), math.prod(grid), batch * heads
    bound = None if max_offset is None or bound_refusal(float(max_offset), window_w=win[2]) else float(max_offset)
    fwd = 0
    if bound is not None and dtype_bytes < 4 and modes.halo != "gather" and (
            modes.halo == "halo" or choose_halo(tuple(grid), win, head_dim, bound, dtype_bytes)["fwd"][0]):
        fwd = score_chunk(pairs, K, N) * K * N * 4
    if not backward:
        return fwd
    records = rec_chunk(pairs, win, N) * REC_FIELDS * K * N * 4
    atomic = DT.atomic_chunk(pairs, key_tokens, head_dim) * key_tokens * head_dim * 4 * 2
    # the split mode: a chunk's records and its atomics' fp32 sums, and its flags (a byte per query and head)
    split = split_chunk(pairs, win, N, key_tokens, head_dim) * (
        REC_FIELDS * K * N * 4 + key_tokens * head_dim * 4 * 2) + pairs * N
    if modes.dkv == "atomic":
        bwd = atomic
    elif bound is not None:  # the given bound takes the pull mode
        bwd = records
    else:  # none given, or one past the cap: the split mode, or the atomic one where no split bound fits a slab
        bwd = max(atomic, split)
    return max(fwd, bwd)
