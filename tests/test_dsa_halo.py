"""The halo kernels (``kernels/dsa_triton_halo.py``: the forward's and the backward's query-side
products on tensor cores) against the reference and against the gather kernels.

The kernels run under the Triton CPU interpreter in a child pytest (``test_interp_*``, started by
``test_halo_kernels_under_interpreter``). Shapes are tiny because the interpreter is slow; they
still cover every border on each axis, two query tiles along x, several given bounds,
offsets up to 2.7 with whole-token moves, a slab, and both identities (zero offsets:
neighborhood attention; the window the whole grid: dense attention). The launch plan is checked
in the parent, without the interpreter.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from kernels import KernelModes, dsa_reference
from kernels.checks import (
    assert_bf16_flash_rule,
    assert_dense_identity,
    assert_grads_close,
    assert_interpreter_tests_pass,
    bounded_offsets,
    grads,
    make_qkv,
    naive_neighborhood_attention,
)

INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_halo_kernels_under_interpreter"
)


class Launches:
    """Stands in for a Triton kernel (``kernel[grid](...)``) or a launcher (``launch(...)``): each
    call appends ``(name, *what(grid, args))`` to ``calls`` and runs nothing."""

    def __init__(self, calls: list, name: str, what=lambda grid, args: ()):
        self.calls, self.name, self.what = calls, name, what

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append((self.name, *self.what(grid, a)))

    def __call__(self, *a, **k):
        self.calls.append((self.name, *self.what(None, a)))


@pytest.mark.slow  # about 4 min: every Triton interpreter child runs in the slow half
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_halo_kernels_under_interpreter():
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__)


# -----------------------------------------------------------------------------
# Launch plan (parent process)


def test_plan_covers_every_corner_and_chunks_the_scores(monkeypatch):
    """The key-column run holds every x corner a bounded sample of the tile can reach; the band
    holds every corner relative to its query's window; the scores' scratch is chunked."""
    pytest.importorskip("triton")
    import kernels.dsa_triton_halo as HALO
    from kernels.dsa_triton_pull import pull_span

    for window in ((3, 5, 5), (3, 7, 7), (1, 3, 3), (1, 1, 61)):
        for bound in (0.0, 0.6, 1.5, 3.0):
            elo, ehi = pull_span(bound)
            cfg = HALO.halo_config(128, window, elo, ehi)
            kw = window[2]
            assert cfg["KWP"] >= kw and cfg["UP"] >= kw + elo + ehi
            # queries x0 .. x0 + BX - 1 (interior: s_x = x - kw // 2): corners from s_x(x0) - EHI
            # to s_x(x0 + BX - 1) + kw - 1 + ELO, all inside [cx0, cx0 + XP)
            assert (cfg["BX"] - 1) + (kw - 1) + elo + ehi < cfg["XP"]
    assert HALO.halo_config(128, (3, 7, 7), 2, 2)["XP"] == 64  # the Wan row (52 tokens) in one tile
    def tile(hw):
        cfg = HALO.halo_config(128, (3, 7, 7), 2, 2, hw=hw)
        return cfg["BX"], cfg["RY"]

    assert tile((30, 52)) == (52, 1)  # Wan2.1 480p: one row a tile
    assert tile((15, 26)) == (26, 2)  # Wan2.2 TI2V-5B 480p: two 26-token rows fill 52 of 64 lanes
    assert tile((45, 80)) == (40, 1)  # 720p: rows in two tiles of 40
    assert tile((2, 5)) == (5, 2)  # no more rows than the image has
    cfg3 = HALO.halo_config(128, (3, 7, 7), 4, 3, hw=(30, 52))  # offsets up to 3: 51 queries a row at most
    assert (cfg3["BX"], cfg3["RY"]) == (26, 2)  # halves of rows, two a tile: 52 lanes, not 51 + 1
    calls = []
    monkeypatch.setattr(HALO, "SCORE_BUDGET_BYTES", 27 * 100 * 4 * 3)

    monkeypatch.setattr(HALO, "_dsa_halo_scores", Launches(calls, "scores", lambda grid, a: (grid, a[15])))
    monkeypatch.setattr(HALO, "_dsa_halo_rows", Launches(calls, "out", lambda grid, a: (grid, a[15])))
    q = torch.zeros(2, 4, 5, 5, 4, 8)  # B 2, nh 4: 8 (batch, head) pairs of 100 tokens
    lse = torch.zeros(2, 4, 100)
    HALO.halo_forward(q, q, q, torch.zeros(*q.shape[:5], 27, 3), (3, 3, 3), 1.0, 1.0,
                      (100, 4, 5, 5, 4, 100, 4, 0, 0), torch.empty_like(q), lse)
    assert [c[0] for c in calls] == ["scores", "out"] * 3  # chunks of 3, 3, 2 pairs
    assert [c[1][1] for c in calls[::2]] == [3, 3, 2] and [c[2] for c in calls[::2]] == [0, 3, 6]


def test_auto_takes_the_halo_kernels_where_the_cost_model_predicts_them_faster(monkeypatch):
    """``auto``: per pass, bf16 within the pull bound and predicted faster (Wan's grid and window at
    d 128: offsets up to 0 -- neighborhood attention -- and up to 1 take the halo kernels for both
    passes; at 1.5, the presets' bound, the forward only: the backward's query side, whose dots
    cannot overlap its other instructions at one block per SM, is predicted faster on the gather
    kernels; offsets in (2, 3) the gather kernels); fp32 and a bound past the cap take the gather
    kernels; "halo" forces."""
    pytest.importorskip("triton")
    import kernels.dsa_triton as DT

    win = (3, 7, 7)
    q16 = torch.empty(1, 21, 30, 52, 1, 128, dtype=torch.bfloat16, device="meta")
    q32 = torch.empty(1, 21, 30, 52, 1, 128, device="meta")
    for pass_ in ("fwd", "bwd"):
        for bound in (0.0, 1.0):
            halo, why = DT.halo_choice(pass_, q16, win, bound, "max_offset")
            assert halo and "cost model" in why and "halo" in why, why
        halo, why = DT.halo_choice(pass_, q16, win, 1.5, "max_offset")
        assert halo == (pass_ == "fwd") and "cost model" in why, why
        halo, why = DT.halo_choice(pass_, q16, win, 2.5, "max_offset")
        assert not halo and "cost model" in why, why
        halo, why = DT.halo_choice(pass_, q32, win, 0.0, "max_offset")
        assert not halo and "fp32" in why
        halo, why = DT.halo_choice(pass_, q16, win, None, "offsets up to 3.5 exceed the key-side pass's 3.0")
        assert not halo and "exceed" in why
        assert DT.halo_choice(pass_, q16, win, 0.0, "", block_m=16)[0] is False
    assert DT.halo_choice("bwd", q32, win, 1.5, "max_offset", modes=KernelModes(halo="halo"))[0] is True
    assert DT.halo_choice("fwd", q16, win, 0.0, "max_offset", modes=KernelModes(halo="gather")) == (
        False, "halo mode gather")


def _launch_scratch(monkeypatch, q, off, bound, modes=None):
    """(forward scratch, backward scratch, kernels launched): every allocation ``_dsa_fwd_launch``
    and ``_dsa_bwd_launch`` make, kernels stubbed, less their outputs (out, lse; dq, dk, dv,
    d(offsets)), with budgets small enough that the Wan grid's scratch comes in chunks."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import kernels.dsa_triton as DT
    import kernels.dsa_triton_halo as HALO
    import kernels.dsa_triton_pull as P

    B, T, H, W, nh, d = q.shape
    N, K = T * H * W, off.shape[-2]
    monkeypatch.setattr(P, "REC_BUDGET_BYTES", 5 * K * N * 4 * 2)  # 2 pairs per chunk of 6
    monkeypatch.setattr(HALO, "SCORE_BUDGET_BYTES", K * N * 4 * 4)  # 4 pairs per chunk of 6
    calls = []
    for mod, name in ((HALO, "_dsa_halo_scores"), (HALO, "_dsa_halo_rows"), (DT, "_dsa_fwd_tuned"),
                      (DT, "_dsa_bwd_tuned"), (DT, "_dsa_bwd_pull_tuned"), (DT, "_dsa_bwd_split_tuned"), (DT, "pull_launch"),
                      (DT, "halo_backward_query")):
        monkeypatch.setattr(mod, name, Launches(calls, name))

    class Allocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("empty", "zeros", "empty_like", "zeros_like", "_to_copy", "empty_strided"):
                self.bytes += out.numel() * out.element_size()
            return out

    lse = torch.empty(B, nh, N, device=q.device)
    win = (3, 7, 7)
    with Allocations() as fwd:
        DT._dsa_fwd_launch(q, q, q, off, win, d ** -0.5, None, None, bound, modes or KernelModes())
    with Allocations() as bwd:
        DT._dsa_bwd_launch(q, q, q, off, q, q, lse, win, d ** -0.5, None, None, bound, modes or KernelModes())
    outputs_fwd = q.numel() * 2 + lse.numel() * 4  # out (bf16), lse (fp32)
    outputs_bwd = 3 * q.numel() * 2 + off.numel() * 2  # dq, dk, dv, d(offsets) (bf16)
    return fwd.bytes - outputs_fwd, bwd.bytes - outputs_bwd, [c[0] for c in calls]


WAN = dict(B=1, nh=6, d=128, grid=(21, 30, 52))  # the Wan grid, 3x7x7, six heads


def _far_few(shape) -> torch.Tensor:
    """bf16 offsets of ``shape`` on the CPU: zero, but 4 tokens along x for every 50th token of each
    head (2% of the queries past the key-side pass's cap: the split mode's case)."""
    off = torch.zeros(shape, dtype=torch.bfloat16)
    off.view(shape[0], -1, *shape[4:])[:, ::50, :, :, 2] = 4.0
    return off


@pytest.mark.parametrize("bound,fwd_kernel,bwd_mode", [
    (0.0, "halo", "pull"),  # neighborhood attention: the halo forward's scores, the records
    (1.5, "halo", "pull"),  # the presets' bound: the halo forward's scores, the records
    (2.5, "gather", "pull"),  # the records only
    (4.0, "gather", "split"),  # past the key-side pass's cap: records at the cap, fp32 dk and dv, flags
    (None, "gather", "split"),  # unbounded offsets: the same
])
def test_scratch_bytes_is_what_the_launchers_allocate(monkeypatch, bound, fwd_kernel, bwd_mode):
    """``scratch_bytes`` (the planner's term) against every allocation the forward and backward
    launchers make, on the meta device at the Wan grid: the call runs at the bound given. Without a
    bound (or past the cap) it also covers the atomic mode, which runs where no split bound fits a
    slab (here forced with ``KernelModes(dkv="atomic")``)."""
    pytest.importorskip("triton")
    from kernels.dsa_scratch import scratch_bytes

    B, nh, d, grid = WAN["B"], WAN["nh"], WAN["d"], WAN["grid"]
    q = torch.empty(B, *grid, nh, d, dtype=torch.bfloat16, device="meta")
    off = torch.empty(*q.shape[:5], 147, 3, dtype=torch.bfloat16, device="meta")
    fwd, bwd, ran = _launch_scratch(monkeypatch, q, off, bound)
    assert ("_dsa_halo_scores" in ran) == (fwd_kernel == "halo")
    assert ("_dsa_fwd_tuned" in ran) == (fwd_kernel == "gather")
    assert ("_dsa_bwd_split_tuned" in ran) == (bwd_mode == "split") and "pull_launch" in ran
    assert "_dsa_bwd_tuned" not in ran and bwd > 0
    N = 21 * 30 * 52
    atomic = 0
    if bwd_mode == "split":
        with monkeypatch.context() as m:
            _, atomic, ran_a = _launch_scratch(m, q, off, bound, KernelModes(dkv="atomic"))
        assert "_dsa_bwd_tuned" in ran_a and "pull_launch" not in ran_a and atomic > 0
    assert scratch_bytes(B, nh, grid, N, (3, 7, 7), d, bound) == max(fwd, bwd, atomic)
    assert scratch_bytes(B, nh, grid, N, (3, 7, 7), d, bound, backward=False) == fwd


NO_SYNC = ("tolist", "item", "__bool__", "__float__", "__int__", "__index__", "numpy")
"""The tensor methods that read a value back to the host (on a GPU: a sync)."""


@pytest.mark.parametrize("max_offset,fwd,bwd_query,key_bound", [
    (1.0, "halo", "halo", 1.0),  # both passes on the halo kernels, the key-side pass at the bound
    (1.5, "halo", "gather", 1.5),  # the presets' clamp: the halo forward, the gather query side (the cost model)
    (2.75, "gather", "gather", 2.75),  # the gather kernels there, the key-side pass at the bound
    (4.0, "gather", "split", 3.0),  # past the key-side pass's cap: the split mode at the cap
    (None, "gather", "split", 3.0),  # unbounded offsets: the same
])
def test_a_call_runs_at_its_given_bound_without_a_host_sync(monkeypatch, max_offset, fwd, bwd_query, key_bound):
    """The bound a call runs at is its ``max_offset``, a constant of the config: the same kernels
    and key-side bound whatever the offsets hold (zero, or up to 1.4), and nothing read back to the
    host in the forward or the backward (every value-reading tensor method raises). Kernels stubbed
    (CPU tensors at the Wan grid)."""
    pytest.importorskip("triton")
    import kernels.dsa_triton as DT
    import kernels.dsa_triton_halo as HALO

    calls = []
    bound_at = lambda i: lambda grid, args: (args[i],)  # noqa: E731
    for mod, name, what in ((DT, "halo_forward", bound_at(6)), (DT, "halo_backward_query", bound_at(10)),
                            (DT, "pull_launch", bound_at(6)), (DT, "_dsa_fwd_tuned", lambda g, a: ()),
                            (DT, "_dsa_bwd_pull_tuned", lambda g, a: ()), (DT, "_dsa_bwd_tuned", lambda g, a: ()),
                            (DT, "_dsa_bwd_split_tuned", lambda g, a: ()), (HALO, "_dsa_halo_rows", lambda g, a: ())):
        monkeypatch.setattr(mod, name, Launches(calls, name, what))
    monkeypatch.setattr(DT, "_check_launch", lambda *a: None)  # CPU tensors reach the (stubbed) launches

    q, k, v = (torch.zeros(1, 21, 30, 52, 1, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def run(extent):
        off = torch.zeros(*q.shape[:5], 147, 3, dtype=torch.bfloat16)
        off[..., 5, 0], off[..., 9, 2] = extent, -extent
        off.requires_grad_(True)
        out = DT.dsa_triton(q, k, v, off, (3, 7, 7), max_offset=max_offset)
        calls.clear()
        with monkeypatch.context() as m:
            for name in NO_SYNC:
                m.setattr(torch.Tensor, name, lambda *a, _n=name, **k: pytest.fail(f"host sync: Tensor.{_n}"))
            out = DT.dsa_triton(q, k, v, off, (3, 7, 7), max_offset=max_offset)
            out.float().sum().backward()
        return {c[0]: c[1:] for c in calls}

    ran = run(0.0)
    assert ran == run(1.375)  # the offsets' values change nothing
    assert ("halo_forward" in ran) == (fwd == "halo") and ("_dsa_fwd_tuned" in ran) == (fwd == "gather")
    assert ("halo_backward_query" in ran) == (bwd_query == "halo")
    assert ("_dsa_bwd_pull_tuned" in ran) == (bwd_query == "gather")
    assert ("_dsa_bwd_split_tuned" in ran) == (bwd_query == "split")
    assert ran["pull_launch"] == (key_bound,)
    if fwd == "halo":
        assert ran["halo_forward"] == (max_offset,)


def test_cost_model_counts_the_halo_work_the_offsets_reach():
    """The halo kernels' predicted time grows with the rows each group touches and is largest at
    the bound's worst case; the gather kernels' does not depend on the offsets."""
    pytest.importorskip("triton")
    from kernels.dsa_cost import CHIPS, halo_costs

    grid, win = (21, 30, 52), (3, 7, 7)

    def total(rows, bound=1.5):
        return sum(c.seconds(CHIPS[0])["seconds"] for p in halo_costs(grid, win, 128, bound, rows).values() for c in p)

    assert total(1) < total(4) < total(9) < total(25) == total(None) == total(100)
    assert total(None, 0.0) == total(4, 0.0)  # at bound 0 every group touches at most 2 x 2 rows


def test_cost_model_weighs_issue_slots_counted_from_the_compile(monkeypatch):
    """Where the issue table has every kernel ``choose_halo`` weighs, their lanes are the PTX
    instructions per loop level times the loops' trips times the threads; a shape it lacks for any
    of them weighs them all on the estimate, never one measure against the other."""
    pytest.importorskip("triton")
    import math

    import kernels.dsa_cost as C
    import kernels.dsa_roofline as R

    assert R._per_thread({"0": 10, "1": 5, "2": 2}, (3, 8)) == 10 + 3 * (5 + 8 * 2)
    grid, win = (21, 30, 52), (3, 7, 7)
    N, K = math.prod(grid), math.prod(win)
    real = C.issue_table()
    assert all(any(key.startswith(f"{k} d128 w3x7x7 ") for key in real) for k in C.ISSUE_KERNELS)
    C._choose_halo.cache_clear()
    assert all("issue slots from the sm_90 compile" in why for _, why in C.choose_halo(grid, win, 128, 1.5).values())
    assert all("estimated" in why for _, why in C.choose_halo(grid, win, 32, 1.5).values())  # d 32: not in it

    fake = {C.issue_key("gather_fwd", 128, win, {"BLOCK_M": 16}, 4): dict(
        kernel="gather_fwd", head_dim=128, window=list(win), constexprs={"BLOCK_M": 16}, warps=4,
        depths={"0": 10, "1": 5, "2": 2})}
    monkeypatch.setattr(C, "issue_table", lambda: fake)
    monkeypatch.setattr(R, "issue_table", lambda: fake)  # where issue_slots reads it
    C._choose_halo.cache_clear()
    fwd = C.gather_costs(N, win, 128)[0]
    assert fwd.issue == math.ceil(N / 16) * 4 * 32 * (10 + K * (5 + 8 * 2))
    assert fwd.seconds(C.CHIPS[0])["issue_s"] == fwd.issue / C.CHIPS[0].issue
    assert C.halo_costs(grid, win, 128, 1.5)["fwd"][0].issue is None  # not in the fake table
    assert all("estimated" in why for _, why in C.choose_halo(grid, win, 128, 1.5).values())
    C._choose_halo.cache_clear()


# -----------------------------------------------------------------------------
# Kernels under the interpreter


HALO = KernelModes(halo="halo")
"""The halo kernels whatever the cost model says, fp32 too (``auto`` gives fp32 the gather kernels:
the halo kernels' fp32 dots spill on the GPU), so the 1e-6 checks run on them."""


def _run(window, shape, bound, given, seed=12, dtype=torch.float32, mode="halo"):
    import kernels.dsa_triton as DT

    q, k, v = (x.to(dtype) for x in make_qkv(shape, seed=seed))
    off = bounded_offsets(shape, window, bound, seed=seed + 1, dtype=dtype)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 2))
    got = grads(lambda *a: DT.dsa_triton(*a, window, max_offset=bound if given else None,
                                         modes=KernelModes(halo=mode)), (q, k, v, off), dout)
    return got, (q, k, v, off), dout


@pytest.mark.parametrize("grid,window,bound,given", [
    ((3, 3, 4), (3, 3, 3), 1.5, True),  # every border on every axis; the window spans T
    ((1, 3, 62), (1, 3, 3), 0.6, True),  # two query tiles along x (31 + 31), two rows each
    ((3, 2, 5), (3, 1, 3), 2.7, True),  # near the cap: corners three tokens out
    ((2, 5, 20), (1, 3, 5), 1.5, True),  # tiles of three 20-token rows: the second holds two
])
@interpreter_only
def test_interp_fp32_halo_matches_reference_and_the_gather_kernels(grid, window, bound, given, caplog):
    import kernels.dsa_triton_pull as P

    shape = (1, *grid, 1, 4)
    P._LOGGED.clear()  # the forward is logged once per reason and process
    with caplog.at_level(logging.INFO, logger="kernels.dsa_triton_pull"):
        got, inputs, dout = _run(window, shape, bound, given)
    assert any("halo kernels on tensor cores" in r.getMessage() for r in caplog.records)
    want = grads(lambda *a: dsa_reference(*a, window), inputs, dout)
    assert_grads_close(got, want)
    gather, _, _ = _run(window, shape, bound, given, mode="gather")  # the gather kernels on the same call
    assert_grads_close(got, gather, "halo vs gather")


@interpreter_only
def test_interp_bf16_halo_flash_rule(caplog):
    """bf16: P and dS in bf16 for ``P @ V`` and ``dS @ K``, as flash attention."""
    import kernels.dsa_triton_pull as P

    window, shape = (1, 3, 3), (1, 2, 4, 5, 1, 8)
    P._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="kernels.dsa_triton_pull"):
        got, inputs, dout = _run(window, shape, 1.5, True, seed=14, dtype=torch.bfloat16)
    assert any("halo kernels on tensor cores" in r.getMessage() for r in caplog.records)
    assert_bf16_flash_rule(got, inputs, dout, window, "halo")


@interpreter_only
def test_interp_offsets_beyond_the_given_bound_give_nan_out_for_their_queries():
    from kernels.dsa_triton import dsa_triton

    window, shape = (1, 3, 3), (1, 2, 3, 5, 1, 4)
    q, k, v = make_qkv(shape, seed=50)
    off = bounded_offsets(shape, window, 0.5, seed=51)
    off[0, 1, 2, 1, 0, 4, 2] = 1.6  # query (t 1, y 2, x 1) breaks the bound 0.5 (base x 1: not clamped)
    out = dsa_triton(q, k, v, off, window, max_offset=0.5, modes=HALO)
    bad = out[0, :, :, :, 0].isnan().any(-1)
    assert bad[1, 2, 1] and int(bad.sum()) == 1, bad.nonzero()


@interpreter_only
def test_interp_zero_offsets_are_neighborhood_attention():
    from kernels.dsa_triton import dsa_triton

    window, shape = (3, 3, 3), (1, 3, 3, 5, 1, 4)
    q, k, v = make_qkv(shape, seed=60)
    off = torch.zeros(*shape[:5], 27, 3)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(61))
    got = grads(lambda *a: dsa_triton(*a, window, max_offset=0.0, modes=HALO), (q, k, v, off), dout)
    want = grads(lambda q, k, v, o: naive_neighborhood_attention(q, k, v, window) + 0 * o.sum(), (q, k, v, off), dout)
    assert_grads_close(got[:4], want[:4])  # out, dq, dk, dv


@interpreter_only
def test_interp_zero_offsets_full_window_is_dense_attention():
    """The window the whole grid (3, 1, 5), offsets zero (the bound given: 0): dense attention
    against fp64 SDPA, forward and the q, k, v gradients."""
    from kernels.dsa_triton import dsa_triton

    def attn(q, k, v, offsets, window, scale):
        return dsa_triton(q, k, v, offsets, window, scale=scale, max_offset=0.0, modes=HALO)

    assert_dense_identity(attn, (3, 1, 5), torch.float32, 2e-5, seed=38)


@interpreter_only
def test_interp_slab_halo_matches_reference():
    """Queries of frames [4, 6) of 10 against the frames they reach with offsets up to 1.0."""
    from kernels.dsa_reference import dsa_slab, slab_kv_frames
    from kernels.dsa_triton import dsa_triton_slab

    window, frames, q0, q1, bound = (3, 3, 3), 10, 4, 6, 1.0
    a, b = slab_kv_frames(q0, q1, frames, window[0], bound)
    assert (a, b) != (0, frames)  # the slab holds part of the clip
    H, W, nh, d = 3, 4, 1, 4
    q, _, _ = make_qkv((1, q1 - q0, H, W, nh, d), seed=70)
    _, k, v = make_qkv((1, b - a, H, W, nh, d), seed=71)
    off = bounded_offsets(q.shape, window, bound, seed=72)
    got = dsa_triton_slab(q, k, v, off, window, q0, a, frames, max_offset=bound, modes=HALO)
    want = dsa_slab(q, k, v, off, window, q0, a, frames)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kernel_modes_are_an_argument_checked_before_any_launch():
    """The kernel families are chosen per call (``KernelModes``), not by module state: a mode that
    does not exist, or a bare string, is refused naming it."""
    pytest.importorskip("triton")
    from kernels.dsa_triton import dsa_triton

    with pytest.raises(ValueError, match="halo='tiled'"):
        KernelModes(halo="tiled")
    with pytest.raises(ValueError, match="dkv='pull'"):
        KernelModes(dkv="pull")
    q, k, v = make_qkv((1, 3, 3, 3, 1, 4))
    with pytest.raises(TypeError, match="KernelModes"):
        dsa_triton(q, k, v, torch.zeros(1, 3, 3, 3, 1, 27, 3), (3, 3, 3), max_offset=1.0, modes="halo")
