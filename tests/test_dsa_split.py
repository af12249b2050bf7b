"""The gather backward's split mode (``kernels/dsa_triton_split.py``): the key-side pass for the
queries within a bound, fp32 atomics for the few whose offsets reach past it.

The plan (which queries, which bound, against the atomic mode) runs in the parent at the Wan grid;
the kernels under the Triton CPU interpreter in a child pytest (``test_interp_*``, started by
``test_split_kernels_under_interpreter``), against the reference and the atomic mode.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from kernels import dsa_reference
from kernels.checks import (
    GRAD_NAMES,
    assert_bf16_flash_rule,
    assert_grads_close,
    assert_interpreter_tests_pass,
    bounded_offsets,
    grads,
    make_qkv,
)
from kernels.dsa_reference import dsa_slab

INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_split_kernels_under_interpreter"
)


@pytest.mark.slow  # a Triton interpreter child: the slow half
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_split_kernels_under_interpreter():
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__)


def far_few(shape, window, near: float, far: dict, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Offsets within ``near`` (``bounded_offsets``), but ``far``: {(t, y, x, head, slot, axis): value}."""
    off = bounded_offsets(shape, window, near, seed=seed, dtype=dtype)
    for (t, y, x, h, j, a), value in far.items():
        off[0, t, y, x, h, j, a] = value
    return off


# -----------------------------------------------------------------------------
# The plan (parent process)


def test_query_extents_are_each_query_and_heads_largest_offset():
    pytest.importorskip("triton")
    from kernels.dsa_triton_split import query_extents

    off = torch.randn(2, 3, 4, 5, 2, 9, 3, generator=torch.Generator().manual_seed(0)) * 2
    torch.testing.assert_close(query_extents(off), off.abs().amax(dim=(-2, -1)), rtol=0, atol=0)
    off[1, 2, 3, 4, 1, 8, 0] = -7.0  # a negative extreme
    assert query_extents(off)[1, 2, 3, 4, 1] == 7.0


WAN_GRID, WAN_WINDOW = (21, 30, 52), (3, 7, 7)


def _wan_offsets(every: int, value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q (bf16, CPU, values unused) and bf16 offsets at the Wan grid with four heads: zero, but
    ``value`` along x in one sample of every ``every``-th token of head 1."""
    q = torch.empty(1, *WAN_GRID, 4, 128, dtype=torch.bfloat16)
    off = torch.zeros(*q.shape[:5], 147, 3, dtype=torch.bfloat16)
    off.view(-1, 4, 147, 3)[::every, 1, 5, 2] = value
    return q, off


def test_split_plan_flags_the_far_queries_at_the_cap():
    """2% of one head's queries 4 tokens out at the Wan grid, offsets unbounded (or bounded past the
    cap): the plan runs the key-side pass at its cap and flags exactly the queries past it, on the
    device (meta tensors too: nothing is read back); a bound within the cap has no plan (the pull
    mode takes the call whole)."""
    pytest.importorskip("triton")
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET
    from kernels.dsa_triton_split import split_plan

    q, off = _wan_offsets(50, 4.0)
    want = torch.zeros(q.shape[:5], dtype=torch.int8)
    want.view(-1, 4)[::50, 1] = 1
    for max_offset in (None, 4.0, float("inf")):
        plan = split_plan(off, WAN_WINDOW, max_offset)
        assert plan is not None and plan.bound == PULL_MAX_OFFSET
        assert plan.flags.dtype == torch.int8 and torch.equal(plan.flags, want)
        assert "flagged on the device" in plan.why
    off.fill_(4.0)  # every query far: still the split mode, every query flagged
    assert bool(split_plan(off, WAN_WINDOW, None).flags.all())
    assert split_plan(off, WAN_WINDOW, PULL_MAX_OFFSET) is None and split_plan(off, WAN_WINDOW, 1.5) is None
    meta = split_plan(off.to("meta"), WAN_WINDOW, None)
    assert meta.bound == PULL_MAX_OFFSET and meta.flags.device.type == "meta"


def test_split_plan_keeps_a_slab_within_its_held_frames():
    """A slab whose k, v hold only the frames offsets up to 1 reach: the plan takes the largest bound
    whose corners they hold (not the cap, which needs frames they lack); the whole grid's frames, the cap."""
    pytest.importorskip("triton")
    from kernels.dsa_reference import slab_kv_frames
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET, pull_bound
    from kernels.dsa_triton_split import SPLIT_BOUNDS, split_plan

    window, frames, q0, q1 = (3, 3, 3), 12, 5, 7
    a, b = slab_kv_frames(q0, q1, frames, window[0], 1.0)
    q = torch.empty(1, q1 - q0, 8, 64, 1, 16)
    off = torch.zeros(*q.shape[:5], 27, 3)
    off.view(-1, 27, 3)[::40, 3, 2] = 3.5
    slab = (b - a, frames, q0, a)
    plan = split_plan(off, window, None, slab=slab)
    assert plan is not None and 1.0 <= plan.bound < PULL_MAX_OFFSET
    larger = [x for x in SPLIT_BOUNDS if x > plan.bound]  # the largest bound whose corners the slab holds
    assert pull_bound(off, plan.bound, slab, 3, 3)[0] == plan.bound
    assert larger and pull_bound(off, larger[0], slab, 3, 3)[0] is None
    assert torch.equal(plan.flags.view(-1)[::40], torch.ones_like(plan.flags.view(-1)[::40]))
    whole = split_plan(off, window, None, slab=(frames, frames, q0, 0))
    assert whole is not None and whole.bound == PULL_MAX_OFFSET


def test_predict_call_follows_the_choices_the_launchers_make():
    """``predict_call`` (what ``offset_extent --predict`` prices): a bound within the key-side pass's
    cap runs the forward and the backward's query side on the kernels ``choose_halo`` picks at it,
    the key-side pass after; without a bound or past the cap, the gather forward and the split
    mode at the cap: the query-side pass and the key-side pass at the cap, and the share past it
    of what the atomic mode's backward costs beyond the query-side pass, beside the atomic mode's."""
    pytest.importorskip("triton")
    from kernels.dsa_cost import CHIPS, choose_halo, gather_costs, predict_call, pull_costs
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET
    from kernels.dsa_triton_split import SPLIT_BOUNDS

    few = {b: 0.2 / b for b in SPLIT_BOUNDS}
    for bound in (0.0, 0.7, 1.0, 1.5, 2.0, 2.5, PULL_MAX_OFFSET):
        got = predict_call(WAN_GRID, WAN_WINDOW, 128, few, max_offset=bound)
        pick = choose_halo(WAN_GRID, WAN_WINDOW, 128, bound)
        assert got["bound"] == bound and "atomic" not in got
        assert got["fwd"][0] == ("halo" if pick["fwd"][0] else "gather")
        assert got["bwd"][0] == ("halo+pull" if pick["bwd"][0] else "gather+pull")
        fwd_ms = float(pick["fwd"][1].split("halo " if pick["fwd"][0] else "gather ")[-1].split(" ms")[0])
        assert f"{1e3 * got['fwd'][1]:.3g}" == f"{fwd_ms:.3g}"
    near, mid = (predict_call(WAN_GRID, WAN_WINDOW, 128, few, max_offset=b) for b in (0.5, 1.5))
    assert near["fwd"][1] < mid["fwd"][1] and near["bwd"][1] < mid["bwd"][1]  # a wider bound, more work
    chip = CHIPS[0]
    query, key = (c.seconds(chip)["seconds"] for c in pull_costs(WAN_GRID, WAN_WINDOW, 128, PULL_MAX_OFFSET))
    atomic = gather_costs(21 * 30 * 52, WAN_WINDOW, 128)[1].seconds(chip)["seconds"]
    split = query + key + few[PULL_MAX_OFFSET] * (atomic - query)
    for max_offset in (None, 4.0):
        far = predict_call(WAN_GRID, WAN_WINDOW, 128, few, max_offset=max_offset)
        assert far["fwd"][0] == "gather" and far["bwd"][0] == f"split at {PULL_MAX_OFFSET:g}"
        assert math.isclose(far["bwd"][1], split) and math.isclose(far["atomic"], atomic)
    worse = predict_call(WAN_GRID, WAN_WINDOW, 128, {b: 0.5 for b in SPLIT_BOUNDS})
    assert worse["bwd"][1] > far["bwd"][1]  # more queries flagged, more atomics


# -----------------------------------------------------------------------------
# Kernels under the interpreter

GRID, WINDOW = (3, 4, 6), (3, 3, 3)
FAR = {(1, 2, 3, 0, 13, 2): 4.3, (0, 0, 5, 0, 2, 1): -3.6, (2, 3, 0, 0, 20, 0): 3.2, (1, 1, 1, 0, 0, 2): -5.0}
"""Four queries (of 72) with one offset past the key-side pass's cap, one at a border (x 5, y 0);
the rest within 0.9."""


def _run(dtype=torch.float32, given=None, seed=80):
    from kernels.dsa_triton import dsa_triton

    shape = (1, *GRID, 1, 4)
    q, k, v = (x.to(dtype) for x in make_qkv(shape, seed=seed))
    off = far_few(shape, WINDOW, 0.9, FAR, seed + 1, dtype)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 2))
    got = grads(lambda *a: dsa_triton(*a, WINDOW, block_m=16, max_offset=given), (q, k, v, off), dout)
    return got, (q, k, v, off), dout


def _fresh_log():
    import kernels.dsa_triton_pull as P

    P._LOGGED.clear()  # the mode is logged once per reason and process


@pytest.mark.parametrize("given", [None, 6.0])  # unbounded; a bound past the cap given
@interpreter_only
def test_interp_fp32_split_matches_reference(given, monkeypatch, caplog):
    _fresh_log()
    with caplog.at_level(logging.INFO, logger="kernels.dsa_triton_pull"):
        got, inputs, dout = _run(given=given)
    said = [r.getMessage() for r in caplog.records if "dk, dv by" in r.getMessage()]
    assert said and "fp32 atomics for the queries" in said[0], said
    for name, x in zip(GRAD_NAMES, got):
        assert torch.isfinite(x).all(), name  # no NaN dq: the far queries are scattered, not refused
    assert_grads_close(got, grads(lambda *a: dsa_reference(*a, WINDOW), inputs, dout))


@interpreter_only
def test_interp_bf16_split_flash_rule(monkeypatch):
    _fresh_log()
    got, inputs, dout = _run(torch.bfloat16, seed=84)
    assert_bf16_flash_rule(got, inputs, dout, WINDOW, "split")


@interpreter_only
def test_interp_slab_split_matches_reference(monkeypatch):
    """Queries of frames [4, 6) of 10 against the frames offsets up to 3.5 reach; two queries past
    the cap along x."""
    from kernels.dsa_reference import slab_kv_frames
    from kernels.dsa_triton import dsa_triton_slab

    _fresh_log()
    window, frames, q0, q1 = (3, 3, 3), 10, 4, 6
    a, b = slab_kv_frames(q0, q1, frames, window[0], 3.5)
    H, W, nh, d = 3, 6, 1, 4
    q, _, _ = make_qkv((1, q1 - q0, H, W, nh, d), seed=90)
    _, k, v = make_qkv((1, b - a, H, W, nh, d), seed=91)
    off = far_few(q.shape, window, 0.8, {(0, 1, 2, 0, 4, 2): 3.5, (1, 2, 5, 0, 26, 2): -3.4}, 92)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(93))
    got = grads(lambda *x: dsa_triton_slab(*x, window, q0, a, frames, max_offset=None), (q, k, v, off), dout)
    want = grads(lambda *x: dsa_slab(*x, window, q0, a, frames), (q, k, v, off), dout)
    assert_grads_close(got, want)
