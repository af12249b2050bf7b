"""The gather backward's split mode (``kernels/dsa_triton_split.py``): the key-side pass for the
queries within a bound, fp32 atomics for the few whose offsets reach past it.

The plan (which queries, which bound, against the atomic mode) runs in the parent at the Wan grid;
the kernels under the Triton CPU interpreter in a child pytest (``test_interp_*``, started by
``test_split_kernels_under_interpreter``), against the reference and the atomic mode.
"""

from __future__ import annotations

import logging
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


def test_split_plan_flags_the_far_queries_at_the_bound_it_picks():
    """2% of one head's queries 4 tokens out at the Wan grid: the plan runs the key-side pass at
    a bound within the cap, flags exactly the queries past it (those 2%), and says why, with
    both modes' predicted times; the same call forced (``force``) agrees."""
    pytest.importorskip("triton")
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET
    from kernels.dsa_triton_split import SPLIT_BOUNDS, split_plan

    q, off = _wan_offsets(50, 4.0)
    plan = split_plan(q, off, WAN_WINDOW, 4.0)
    assert plan is not None and plan.bound in SPLIT_BOUNDS and plan.bound <= PULL_MAX_OFFSET
    want = torch.zeros(q.shape[:5], dtype=torch.int8)
    want.view(-1, 4)[::50, 1] = 1
    assert plan.flags.dtype == torch.int8 and torch.equal(plan.flags, want)
    assert "atomic mode's" in plan.why and "0.5% of the (query, head) pairs" in plan.why, plan.why
    forced = split_plan(q, off, WAN_WINDOW, 4.0, force=True)
    assert forced.bound == plan.bound and torch.equal(forced.flags, plan.flags)


def test_split_plan_leaves_the_atomic_mode_where_most_queries_reach_far():
    """Every query 4 tokens out: atomics for all beat the split mode (None), unless forced; an
    extent within the cap, a non-finite one or meta tensors have no plan."""
    pytest.importorskip("triton")
    from kernels.dsa_triton_split import split_plan

    q, off = _wan_offsets(1, 4.0)
    off.fill_(4.0)  # every query of every head
    assert split_plan(q, off, WAN_WINDOW, 4.0) is None
    forced = split_plan(q, off, WAN_WINDOW, 4.0, force=True)
    assert forced is not None and bool(forced.flags.all())
    assert split_plan(q, off, WAN_WINDOW, 3.0) is None
    assert split_plan(q, off, WAN_WINDOW, float("nan")) is None
    assert split_plan(q.to("meta"), off.to("meta"), WAN_WINDOW, 4.0) is None


def test_split_plan_keeps_a_slab_within_its_held_frames():
    """A slab whose k, v hold only the frames offsets up to 1 reach: the bounds past that would
    need frames it lacks, so the plan takes 1 (or none)."""
    pytest.importorskip("triton")
    from kernels.dsa_reference import slab_kv_frames
    from kernels.dsa_triton_split import split_plan

    window, frames, q0, q1 = (3, 3, 3), 12, 5, 7
    a, b = slab_kv_frames(q0, q1, frames, window[0], 1.0)
    q = torch.empty(1, q1 - q0, 8, 64, 1, 16)
    off = torch.zeros(*q.shape[:5], 27, 3)
    off.view(-1, 27, 3)[::40, 3, 2] = 3.5
    plan = split_plan(q, off, window, 3.5, slab=(b - a, frames, q0, a), force=True)
    assert plan is not None and plan.bound == 1.0
    whole = split_plan(q, off, window, 3.5, slab=(frames, frames, q0, 0), force=True)
    assert whole is not None and whole.bound >= plan.bound


def test_the_split_cost_model_weighs_the_flagged_share():
    """``choose_split``: fewer flagged queries, a faster split mode; the bound it picks is the one
    with the smallest predicted time; all queries flagged, the atomic mode."""
    pytest.importorskip("triton")
    from kernels.dsa_cost import choose_split
    from kernels.dsa_triton_split import SPLIT_BOUNDS

    def ms(why):
        return float(why.split(" ms vs")[0].rsplit(" ", 1)[1])

    few = {b: 0.2 / b for b in SPLIT_BOUNDS}
    many = {b: 0.6 / b for b in SPLIT_BOUNDS}
    b_few, why_few = choose_split(WAN_GRID, WAN_WINDOW, 128, 2, few, 4.0)
    b_many, why_many = choose_split(WAN_GRID, WAN_WINDOW, 128, 2, many, 4.0)
    assert b_few is not None and b_many is not None and ms(why_few) < ms(why_many)
    for b in SPLIT_BOUNDS:  # each bound alone costs no less than the pick
        alone, why = choose_split(WAN_GRID, WAN_WINDOW, 128, 2, {b: few[b]}, 4.0, force=True)
        assert alone == b and ms(why) >= ms(why_few)
    assert choose_split(WAN_GRID, WAN_WINDOW, 128, 2, {b: 1.0 for b in SPLIT_BOUNDS}, 4.0)[0] is None


def test_predict_call_follows_the_choices_the_launchers_make():
    """``predict_call`` (what ``offset_extent --predict`` prices): up to the key-side pass's cap the
    forward and the backward's query side on the kernels ``choose_halo`` picks at the call's bound,
    the key-side pass after; past it the gather forward and the split mode at the bound and time
    ``choose_split`` gives, or the atomic mode where every query is far; a given ``max_offset``
    above the extent tightened to it, one below it taken."""
    pytest.importorskip("triton")
    from kernels.dsa_cost import choose_halo, choose_split, predict_call, split_seconds
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET
    from kernels.dsa_triton_split import SPLIT_BOUNDS

    few = {b: 0.2 / b for b in SPLIT_BOUNDS}
    for extent in (0.0, 0.7, 1.0, 1.5, 2.0, 2.5, PULL_MAX_OFFSET):
        got = predict_call(WAN_GRID, WAN_WINDOW, 128, extent, few)
        pick = choose_halo(WAN_GRID, WAN_WINDOW, 128, extent)
        assert got["bound"] == extent
        assert got["fwd"][0] == ("halo" if pick["fwd"][0] else "gather")
        assert got["bwd"][0] == ("halo+pull" if pick["bwd"][0] else "gather+pull")
        fwd_ms = float(pick["fwd"][1].split("halo " if pick["fwd"][0] else "gather ")[-1].split(" ms")[0])
        assert f"{1e3 * got['fwd'][1]:.3g}" == f"{fwd_ms:.3g}"
    near, mid = (predict_call(WAN_GRID, WAN_WINDOW, 128, e, few) for e in (0.5, 1.5))
    assert near["fwd"][1] < mid["fwd"][1] and near["bwd"][1] < mid["bwd"][1]  # a wider bound, more work

    b_few, why = choose_split(WAN_GRID, WAN_WINDOW, 128, 2, few, 4.0)
    far = predict_call(WAN_GRID, WAN_WINDOW, 128, 4.0, few)
    assert far["fwd"][0] == "gather" and far["bwd"][0] == f"split at {b_few:g}"
    assert far["atomic"] == split_seconds(WAN_GRID, WAN_WINDOW, 128, 2, few)[1] > far["bwd"][1]
    assert "atomic" not in mid  # within the cap the atomic mode is not weighed
    assert f"{1e3 * far['bwd'][1]:.3g} ms vs" in why
    assert predict_call(WAN_GRID, WAN_WINDOW, 128, 4.0, {b: 1.0 for b in SPLIT_BOUNDS})["bwd"][0] == "atomic"
    assert predict_call(WAN_GRID, WAN_WINDOW, 128, 5.0, few, max_offset=1.5) == predict_call(
        WAN_GRID, WAN_WINDOW, 128, 1.5, few)
    assert predict_call(WAN_GRID, WAN_WINDOW, 128, 1.2, few, max_offset=1.5)["bound"] == 1.2


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


def _mode(monkeypatch, mode):
    import kernels.dsa_triton as DT
    import kernels.dsa_triton_pull as P

    monkeypatch.setattr(DT, "DKV_MODE", mode)
    P._LOGGED.clear()  # the mode is logged once per reason and process


@pytest.mark.parametrize("given", [None, 6.0])  # measured; a bound past the cap given
@interpreter_only
def test_interp_fp32_split_matches_reference(given, monkeypatch, caplog):
    _mode(monkeypatch, "split")
    with caplog.at_level(logging.INFO, logger="kernels.dsa_triton_pull"):
        got, inputs, dout = _run(given=given)
    said = [r.getMessage() for r in caplog.records if "dk, dv by" in r.getMessage()]
    assert said and "fp32 atomics for the queries" in said[0], said
    for name, x in zip(GRAD_NAMES, got):
        assert torch.isfinite(x).all(), name  # no NaN dq: the far queries are scattered, not refused
    assert_grads_close(got, grads(lambda *a: dsa_reference(*a, WINDOW), inputs, dout))


@interpreter_only
def test_interp_bf16_split_flash_rule(monkeypatch):
    _mode(monkeypatch, "split")
    got, inputs, dout = _run(torch.bfloat16, seed=84)
    assert_bf16_flash_rule(got, inputs, dout, WINDOW, "split")


@interpreter_only
def test_interp_slab_split_matches_reference(monkeypatch):
    """Queries of frames [4, 6) of 10 against the frames offsets up to 3.5 reach; two queries past
    the cap along x."""
    from kernels.dsa_reference import slab_kv_frames
    from kernels.dsa_triton import dsa_triton_slab

    _mode(monkeypatch, "split")
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
