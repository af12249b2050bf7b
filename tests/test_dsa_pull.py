"""The gather kernels' key-side dk/dv pass (``kernels/dsa_triton_pull.py``) against the reference.

The kernels run under the Triton CPU interpreter in a child pytest (``test_interp_*``, started by
``test_pull_kernels_under_interpreter``, as in tests/test_dsa.py). Shapes are tiny because the
interpreter is slow, but they still cover every border on each axis, several key tiles along x,
offsets up to the bound (whole-token moves included). The mode choice
(``pull_bound``) and the launch plan run in the parent, without Triton's interpreter.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kernels import KernelModes, dsa_reference
from kernels.checks import (
    GRAD_NAMES,
    assert_bf16_flash_rule,
    assert_grads_close,
    assert_interpreter_tests_pass,
    bounded_offsets,
    grads,
    make_qkv,
    naive_neighborhood_attention,
)
from kernels.dsa_reference import dsa_slab

INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_pull_kernels_under_interpreter"
)


@pytest.mark.slow  # about 4 min: every Triton interpreter child runs in the slow half
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_pull_kernels_under_interpreter():
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__)


# -----------------------------------------------------------------------------
# Mode choice and plan (parent process)


def test_span_covers_every_corner_a_bounded_offset_reaches():
    """A sample with base b and |offset| <= bound has corners floor(p), floor(p) + 1: every key it
    weighs lies in [b - EHI, b + ELO] (searched over positions on a fine grid)."""
    pytest.importorskip("triton")
    from kernels.dsa_triton_pull import pull_span

    for bound in (0.0, 0.3, 1.0, 1.5, 2.0, 2.7):
        elo, ehi = pull_span(bound)
        b = 10
        for o in torch.linspace(-bound, bound, 1001).tolist():
            p = b + o
            i0 = int(p // 1)
            f = p - i0
            keys = [i0] + ([i0 + 1] if f > 0 else [])
            assert all(b - ehi <= n <= b + elo for n in keys), (bound, o, keys, elo, ehi)
        # and the span is no wider than needed: its ends are reached
        assert elo == int(bound // 1) + 1 and ehi == -int(-bound // 1)


def test_pull_bound_picks_the_mode_and_says_why():
    pytest.importorskip("triton")
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET, bound_refusal, pull_bound

    off = torch.zeros(1, 3, 4, 5, 1, 9, 3)
    assert pull_bound(off, 1.5) == (1.5, "max_offset")
    off[0, 1, 2, 3, 0, 4, 1] = -0.75
    assert pull_bound(off, None) == (None, "no max_offset (unbounded offsets)")  # never measured
    bound, why = pull_bound(off, PULL_MAX_OFFSET + 1)
    assert bound is None and "exceed" in why and "4" in why
    bound, why = pull_bound(off, float("nan"))
    assert bound is None and "non-finite" in why
    # a slab: k, v hold frames [2, 7) of 10; queries frames [3, 5), window_t 3, bound 1.5 reach [0, 8]
    slab_off = torch.zeros(1, 2, 4, 5, 1, 27, 3)
    bound, why = pull_bound(slab_off, 1.5, slab=(5, 10, 3, 2), window_t=3)
    assert bound is None and "[2, 7)" in why
    assert pull_bound(slab_off, 1.5, slab=(9, 10, 3, 0), window_t=3) == (1.5, "max_offset")
    # a window as wide as a large grid (the dense identity): the candidate run would not fit
    bound, why = pull_bound(off[..., :0, :], 1.5, window_w=101)
    assert bound is None and "too wide" in why
    # the same refusals from a number alone (the planner's scratch term has no offsets tensor)
    assert bound_refusal(1.5, window_w=7) is None
    assert "exceed" in bound_refusal(PULL_MAX_OFFSET + 1) and "too wide" in bound_refusal(1.5, window_w=101)
    assert "non-finite" in bound_refusal(float("inf"))


def test_plan_fits_the_candidate_run_and_chunks_the_records(monkeypatch):
    pytest.importorskip("triton")
    import kernels.dsa_triton_pull as P

    with pytest.raises(ValueError, match="at most 96"):
        P.pull_config(128, (1, 1, 95), *P.pull_span(1.5))
    for window in ((3, 5, 5), (3, 7, 7), (1, 3, 3), (1, 1, 61)):
        for bound in (0.0, 1.5, 3.0):
            elo, ehi = P.pull_span(bound)
            cfg = P.pull_config(128, window, elo, ehi)
            assert cfg["BX"] >= 32 and cfg["BX"] <= cfg["BXP"] == 64
            assert cfg["BX"] + window[2] - 1 + elo + ehi <= cfg["QXP"]
    monkeypatch.setattr(P, "REC_BUDGET_BYTES", 5 * 27 * 100 * 4 * 3)
    assert P.rec_chunk(8, (3, 3, 3), 100) == 3
    assert P.rec_chunk(2, (3, 3, 3), 100) == 2
    assert P.rec_chunk(8, (3, 3, 3), 10**6) == 1


# -----------------------------------------------------------------------------
# Kernels under the interpreter


def _run(window, shape, bound, given, seed=12, dtype=torch.float32, modes=None):
    from kernels.dsa_triton import dsa_triton

    q, k, v = (x.to(dtype) for x in make_qkv(shape, seed=seed))
    off = bounded_offsets(shape, window, bound, seed=seed + 1, dtype=dtype)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 2))
    got = grads(lambda *a: dsa_triton(*a, window, block_m=16, max_offset=bound if given else None, modes=modes),
                (q, k, v, off), dout)
    return got, (q, k, v, off), dout


@pytest.mark.parametrize("grid,window,bound,given", [
    ((3, 4, 5), (3, 3, 3), 1.5, True),  # every border on every axis; the window spans T
    ((1, 3, 62), (1, 3, 3), 0.6, True),  # two key tiles along x (60 + 2 keys)
    ((4, 3, 6), (3, 1, 3), 2.7, True),  # near the cap: corners three tokens out
])
@interpreter_only
def test_interp_fp32_pull_matches_reference(grid, window, bound, given, caplog):
    import kernels.dsa_triton_pull as P

    shape = (1, *grid, 1, 4)
    P._LOGGED.clear()  # the mode is logged once per reason and process
    with caplog.at_level(logging.INFO, logger="kernels.dsa_triton_pull"):
        got, inputs, dout = _run(window, shape, bound, given)
    assert any("key-side pass" in r.getMessage() for r in caplog.records)
    want = grads(lambda *a: dsa_reference(*a, window), inputs, dout)
    assert_grads_close(got, want)
    # the same call with dk, dv by atomics: the two modes agree
    atomic, _, _ = _run(window, shape, bound, given, modes=KernelModes(dkv="atomic"))
    assert_grads_close(got, atomic, "pull vs atomic")


@interpreter_only
def test_interp_fp32_error_is_no_more_than_the_fp32_references_own():
    """Where the fp32 kernel and the fp32 reference differ by more than 1e-6 (the offsets' gradient
    sums corner terms of opposite sign, values up to ~12 here), both are measured against the
    reference in float64: the kernel is within twice the fp32 reference's own error (plus 1e-7),
    so the difference is rounding, not a wrong term."""
    window, shape = (1, 1, 3), (1, 1, 2, 62, 1, 8)
    for seed in (12, 13):
        got, inputs, dout = _run(window, shape, 0.6, True, seed=seed)
        r32 = grads(lambda *a: dsa_reference(*a, window), inputs, dout)
        r64 = grads(lambda *a: dsa_reference(*a, window), [x.double() for x in inputs], dout.double())
        for name, a, b, c in zip(GRAD_NAMES, got, r32, r64):
            err = (a.double() - c).abs().max().item()
            own = (b.double() - c).abs().max().item()
            assert err <= 2 * own + 1e-7, f"seed {seed} {name}: kernel {err:.3g} vs the fp32 reference's {own:.3g}"


@interpreter_only
def test_interp_pull_is_deterministic():
    """Every key is summed by one program in a fixed order: two runs agree bit for bit."""
    window, shape = (1, 3, 3), (1, 2, 3, 5, 1, 4)
    first, _, _ = _run(window, shape, 1.5, True, seed=40)
    second, _, _ = _run(window, shape, 1.5, True, seed=40)
    for name, a, b in zip(GRAD_NAMES, first, second):
        assert torch.equal(a, b), name


@interpreter_only
def test_interp_bf16_pull_flash_rule():
    window, shape = (1, 3, 3), (1, 2, 4, 5, 1, 8)
    got, inputs, dout = _run(window, shape, 1.5, True, seed=14, dtype=torch.bfloat16)
    assert_bf16_flash_rule(got, inputs, dout, window, "pull")


@interpreter_only
def test_interp_bf16_slots_at_once_match_one_at_a_time(monkeypatch):
    """bf16's key-side pass puts ``JC`` window slots at once onto its band (at window width 5 and
    the bound 1.5: a chunk of 4 and a masked chunk of 1): the gradients as with one slot at a time,
    to bf16's rounding of dk and dv (a slot mapped wrong would be off by whole terms)."""
    import kernels.dsa_triton_pull as P

    window, shape = (1, 3, 5), (1, 2, 4, 7, 1, 8)
    assert P.pull_config(8, window, *P.pull_span(1.5))["JC"] == 4
    chunked, _, _ = _run(window, shape, 1.5, True, seed=16, dtype=torch.bfloat16)
    real = P.pull_config
    monkeypatch.setattr(P, "pull_config", lambda *a, **k: dict(real(*a, **k), JC=1))
    single, _, _ = _run(window, shape, 1.5, True, seed=16, dtype=torch.bfloat16)
    for name, a, b in zip(GRAD_NAMES, chunked, single):
        assert torch.isfinite(a.float()).all(), name
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3, msg=name)


@interpreter_only
def test_interp_offsets_beyond_the_given_bound_give_nan_dq_for_their_queries():
    from kernels.dsa_triton import dsa_triton

    window, shape = (1, 3, 3), (1, 2, 3, 5, 1, 4)
    q, k, v = make_qkv(shape, seed=50)
    off = bounded_offsets(shape, window, 0.5, seed=51)
    off[0, 1, 2, 1, 0, 4, 2] = 1.6  # query (t 1, y 2, x 1) breaks the bound 0.5 (base x 1: not clamped)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(52))
    _, dq, dk, dv, _ = grads(lambda *a: dsa_triton(*a, window, block_m=16, max_offset=0.5), (q, k, v, off), dout)
    bad = dq[0, :, :, :, 0].isnan().any(-1)
    assert bad[1, 2, 1] and int(bad.sum()) == 1, bad.nonzero()
    assert not dk.isnan().any() and not dv.isnan().any()


@interpreter_only
def test_interp_zero_offsets_are_neighborhood_attention():
    from kernels.dsa_triton import dsa_triton

    window, shape = (3, 3, 3), (1, 3, 4, 5, 1, 4)
    q, k, v = make_qkv(shape, seed=60)
    off = torch.zeros(*shape[:5], 27, 3)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(61))
    got = grads(lambda *a: dsa_triton(*a, window, block_m=16, max_offset=0.0), (q, k, v, off), dout)
    want = grads(lambda q, k, v, o: naive_neighborhood_attention(q, k, v, window) + 0 * o.sum(), (q, k, v, off), dout)
    assert_grads_close(got[:4], want[:4])  # out, dq, dk, dv


@interpreter_only
def test_interp_slab_pull_matches_reference():
    """Queries of frames [4, 6) of 10 against the frames they reach with offsets up to 1.0."""
    from kernels.dsa_reference import slab_kv_frames
    from kernels.dsa_triton import dsa_triton_slab

    window, frames, q0, q1, bound = (3, 3, 3), 10, 4, 6, 1.0
    a, b = slab_kv_frames(q0, q1, frames, window[0], bound)
    assert (a, b) != (0, frames)  # the slab holds part of the clip
    H, W, nh, d = 3, 5, 2, 4
    q, _, _ = make_qkv((1, q1 - q0, H, W, nh, d), seed=70)
    _, k, v = make_qkv((1, b - a, H, W, nh, d), seed=71)
    off = bounded_offsets(q.shape, window, bound, seed=72)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(73))
    got = grads(lambda *x: dsa_triton_slab(*x, window, q0, a, frames, max_offset=bound), (q, k, v, off), dout)
    want = grads(lambda *x: dsa_slab(*x, window, q0, a, frames), (q, k, v, off), dout)
    assert_grads_close(got, want)
