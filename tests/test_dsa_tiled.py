"""The tiled Triton 3D-DSA kernels (``kernels/dsa_triton_tiled.py``) against the reference.

No GPU here: the kernels run under the Triton CPU interpreter (TRITON_INTERPRET=1 must be set
before triton is first imported), so the ``test_interp_*`` tests run in a child pytest started
by ``test_tiled_kernels_under_interpreter``, as in tests/test_dsa.py. Shapes are tiny; the
cases cover d 64 and 128, window (3, 5, 5), nh 3, B 2, odd grid sizes, every border, halos
smaller than the grid (several tiles, halo origins inside the grid), offsets up to +-40
(the halo then exceeds the tile budget: the logged fallback to the gather kernel), the dense
and neighborhood identities, and the bf16 flash-attention tolerance rule.

Planner tests (pure Python) run in the parent.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch

from kernels import dsa_reference, resolve_dsa_backend
from kernels.checks import (
    GRAD_NAMES,
    assert_dense_identity,
    assert_interpreter_tests_pass,
    edge_offsets,
    grads,
    make_qkv,
    naive_neighborhood_attention,
    reference_flash_errors,
    wild_offsets,
)

INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_tiled_kernels_under_interpreter"
)


@pytest.mark.slow  # about 50 s: the default run stays under 10 minutes (`.ci/run` runs the slow half too)
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_tiled_kernels_under_interpreter():
    """Run the ``test_interp_*`` tests below in a child process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__, "not slow")


@pytest.mark.slow
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_tiled_kernels_under_interpreter_slow():
    """The heavier interpreter cases (d 128, B 2, nh 3, window (3, 5, 5))."""
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__, "slow")


# -----------------------------------------------------------------------------
# Planner (no kernels)


def _tiled_module():
    pytest.importorskip("triton")
    import importlib

    return importlib.import_module("kernels.dsa_triton_tiled")


@pytest.mark.parametrize(
    "grid,window,radius",
    [((21, 60, 104), (3, 5, 5), 0), ((21, 60, 104), (3, 5, 5), 1), ((5, 9, 11), (3, 5, 5), 40),
     ((1, 45, 45), (1, 3, 3), 2), ((3, 1, 5), (3, 1, 5), 0)],
)
def test_plan_fits_the_budget_and_covers_every_sample(grid, window, radius):
    """Brute force: for every tile of the plan, every corner of every sample with offsets in
    [-R, R] lies inside the halo the kernel stages (its origin formula, mirrored here)."""
    mod = _tiled_module()
    plan = mod.plan_tiles(grid, window, radius)
    assert plan is not None
    assert plan.m * plan.columns <= mod.MAX_TILE_ELEMS
    assert plan.hty_p >= plan.halo[0] * plan.halo[1] and plan.hx_p >= plan.halo[2]
    for axis in range(3):
        size, k, b, ext = grid[axis], window[axis], plan.tile[axis], plan.halo[axis]
        assert ext <= size
        pos = torch.arange(size)
        starts = (pos - k // 2).clamp(0, size - k)
        for c0 in range(0, size, b):
            s0 = starts[c0].item()
            origin = min(max(s0 - radius, 0), size - ext)
            tile_starts = starts[c0:c0 + b]
            lo = (tile_starts.min() - radius).clamp(0, size - 1).item()  # floor of the lowest position
            hi = min(tile_starts.max().item() + k - 1 + radius + 1, size - 1)  # upper corner
            assert origin <= lo and hi <= origin + ext - 1, (axis, c0, origin, lo, hi, ext)


def test_plan_refuses_halos_beyond_the_budget():
    mod = _tiled_module()
    assert mod.plan_tiles((21, 60, 104), (3, 5, 5), 40) is None
    assert mod.plan_tiles((1, 45, 45), (1, 3, 3), 40) is None
    assert mod.plan_tiles((1, 45, 45), (1, 3, 3), 40, max_tile_elems=1 << 20) is not None


def test_triton_gather_is_a_backend():
    q = torch.empty(1, 3, 3, 3, 1, 4)
    assert resolve_dsa_backend(q, "triton_gather") == "triton_gather"
    assert resolve_dsa_backend(q, "triton") == "triton"


def test_backend_is_an_argument_not_an_environment_variable(monkeypatch):
    """``backend=None`` is ``auto`` (here, a CPU path); the old environment variable is ignored;
    a name that is no backend is refused with the choices."""
    q = torch.empty(1, 3, 3, 3, 1, 4)
    monkeypatch.setenv("MEGASLIDE_DSA_BACKEND", "reference")
    assert resolve_dsa_backend(q, None) == resolve_dsa_backend(q, "auto") in ("matrix", "cpu")
    with pytest.raises(ValueError, match="triton_gather"):
        resolve_dsa_backend(q, "bogus")


def test_auto_on_cuda_picks_the_kernel_the_compile_check_passes(caplog):
    """``pick_cuda_kernel``: the gather kernel (its configs compile for sm_90 without spills at the
    presets' shapes: tests/test_compile_sm90.py), with the reason; logged once per run."""
    import kernels

    path, why = kernels.pick_cuda_kernel(torch.empty(1, 3, 3, 3, 1, 128))
    assert path == "triton_gather" and "sm_90" in why and "spills" in why
    q = torch.empty(1, 3, 3, 3, 1, 128)
    kernels._WARNED.discard("pick:cpu:triton_gather")
    with caplog.at_level(logging.INFO, logger="kernels"):
        kernels._log_pick(q, path, why)
        kernels._log_pick(q, path, why)
    msgs = [r.getMessage() for r in caplog.records if "picks" in r.getMessage()]
    assert len(msgs) == 1 and "triton_gather" in msgs[0] and why in msgs[0], msgs


# -----------------------------------------------------------------------------
# Kernels under the interpreter


def _rel_errors(got, want):
    return {name: ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()
            for name, a, b in zip(GRAD_NAMES, got, want)}


def _fallbacks():
    from kernels import dsa_triton_tiled as mod

    return sum(mod.FALLBACKS.values())


FP32_CASES = [
    # name, (B, T, H, W, nh, d), window, offsets kind, bound passed as max_offset (None: measured)
    pytest.param("d64 w355 nh3 wild", (1, 3, 5, 7, 3, 64), (3, 5, 5), "wild", None, id="d64-w355-nh3"),
    pytest.param("kinks and clamp bounds", (2, 3, 5, 4, 2, 6), (3, 3, 3), "edge", None, id="kinks-B2"),
    pytest.param("halo inside grid, measured bound", (1, 4, 11, 13, 1, 8), (3, 3, 3), "small", None,
                 id="halo-inside-measured"),
    pytest.param("halo inside grid, max_offset", (1, 2, 17, 19, 1, 16), (1, 5, 5), "small", 1.5,
                 id="halo-inside-max-offset"),
    pytest.param("d128 w355 nh3 B2 wild", (2, 3, 5, 5, 3, 128), (3, 5, 5), "wild", None, id="d128-w355-nh3-B2",
                 marks=pytest.mark.slow),
]


def _offsets(kind, shape, window, dtype=torch.float32, seed=51):
    if kind == "wild":
        return wild_offsets(shape, window, dtype=dtype, seed=seed)
    if kind == "edge":
        return edge_offsets(shape, window, dtype=dtype, seed=seed)
    K = math.prod(window)
    g = torch.Generator().manual_seed(seed)
    return (1.5 * torch.tanh(2 * torch.randn((*shape[:5], K, 3), generator=g))).to(dtype)


@pytest.mark.parametrize("name,shape,window,kind,bound", FP32_CASES)
@interpreter_only
def test_interp_fp32_matches_reference(name, shape, window, kind, bound):
    from kernels import dsa_triton_tiled as mod

    grid = shape[1:4]
    q, k, v = make_qkv(shape, seed=50)
    offsets = _offsets(kind, shape, window)
    plan, why = mod.tiled_plan_for(q, offsets, window, bound)
    assert plan is not None, why
    if kind == "small":  # several tiles whose halos start inside the grid
        assert any(h < s for h, s in zip(plan.halo, grid)), plan
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(52))
    before = _fallbacks()
    got = grads(lambda *a: mod.dsa_triton_tiled(*a, window, max_offset=bound), (q, k, v, offsets), dout)
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
    assert _fallbacks() == before, "took the gather kernel"
    errs = _rel_errors(got, want)
    assert all(e <= 1e-5 for e in errs.values()), errs


@interpreter_only
def test_interp_bf16_flash_rule():
    """|tiled - ref32| <= 2 |torch_bf16 - ref32| + atol, every output and gradient."""
    from kernels import dsa_triton_tiled as mod

    window = (3, 5, 5)
    shape = (1, 3, 5, 5, 3, 64)
    q, k, v = (x.bfloat16() for x in make_qkv(shape, seed=53))
    offsets = wild_offsets(shape, window, dtype=torch.bfloat16, seed=54)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(55))
    inputs = (q, k, v, offsets)
    before = _fallbacks()
    got = grads(lambda *a: mod.dsa_triton_tiled(*a, window), inputs, dout)
    assert _fallbacks() == before
    for name, a in zip(GRAD_NAMES, got):
        assert a.dtype == torch.bfloat16, name
    errors = reference_flash_errors(got, inputs, dout, window, rel_atol=1e-4)
    assert not errors, "tiled: " + "; ".join(errors)


def _offsets_40(shape, K, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand((*shape[:5], K, 3), generator=g) * 2 - 1) * 40


@interpreter_only
def test_interp_offsets_40_fall_back_with_a_log(caplog, monkeypatch):
    """+-40 on a 17 x 41 plane: no tile's halo fits the budget -> the gather kernel, logged once
    (window, head dim, reason); its result is the operator's (gradients: tests/test_dsa.py)."""
    from kernels import dsa_triton_tiled as mod

    monkeypatch.setattr(mod, "_FALLBACK_LOGGED", set())
    window = (1, 1, 3)
    shape = (1, 1, 17, 41, 1, 4)
    q, k, v = make_qkv(shape, seed=56)
    offsets = _offsets_40(shape, 3, seed=57)
    plan, why = mod.tiled_plan_for(q, offsets, window)
    assert plan is None and "exceeds" in why
    before = mod.FALLBACKS.get("halo", 0)
    with caplog.at_level(logging.WARNING, logger=mod.__name__):
        out = mod.dsa_triton_tiled(q, k, v, offsets, window)
        mod.dsa_triton_tiled(q, k, v, offsets, window)
    assert mod.FALLBACKS["halo"] == before + 2
    msgs = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(msgs) == 1 and "halo" in msgs[0] and "gather kernel" in msgs[0], msgs
    torch.testing.assert_close(out, dsa_reference(q, k, v, offsets, window), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@interpreter_only
def test_interp_offsets_40_tiled_when_the_budget_allows(monkeypatch):
    """The same +-40 plane with the tile budget raised: the tiled kernel runs (halo = the
    whole plane) and matches the reference, forward and every gradient."""
    from kernels import dsa_triton_tiled as mod

    monkeypatch.setattr(mod, "MAX_TILE_ELEMS", 1 << 20)
    window = (1, 3, 3)
    shape = (2, 1, 17, 41, 1, 4)
    q, k, v = make_qkv(shape, seed=56)
    offsets = _offsets_40(shape, 9, seed=57)
    plan, _ = mod.tiled_plan_for(q, offsets, window)
    assert plan is not None and plan.halo == (1, 17, 41)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(58))
    before = _fallbacks()
    got = grads(lambda *a: mod.dsa_triton_tiled(*a, window), (q, k, v, offsets), dout)
    assert _fallbacks() == before
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
    errs = _rel_errors(got, want)
    assert all(e <= 1e-5 for e in errs.values()), errs


@interpreter_only
def test_interp_offsets_40_window_355_halo_is_the_grid():
    """+-40 with window (3, 5, 5) on a small odd grid: the halo clamps to the grid, tiled runs."""
    from kernels import dsa_triton_tiled as mod

    window = (3, 5, 5)
    shape = (1, 3, 7, 9, 3, 16)
    q, k, v = make_qkv(shape, seed=59)
    offsets = _offsets_40(shape, 75, seed=60)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(61))
    before = _fallbacks()
    got = grads(lambda *a: mod.dsa_triton_tiled(*a, window), (q, k, v, offsets), dout)
    assert _fallbacks() == before
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)
    errs = _rel_errors(got, want)
    assert all(e <= 1e-5 for e in errs.values()), errs


@interpreter_only
def test_interp_compile_failures_fall_back_with_a_log(caplog, monkeypatch):
    """A tiled kernel that cannot compile (forward or backward) runs the gather kernel, logged;
    the gather backward reads the tiled forward's log-sum-exp."""
    import triton

    from kernels import dsa_triton_tiled as mod

    monkeypatch.setattr(mod, "_FALLBACK_LOGGED", set())
    window = (3, 3, 3)
    shape = (1, 3, 4, 5, 1, 8)
    q, k, v = make_qkv(shape, seed=62)
    offsets = wild_offsets(shape, window, seed=63)
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(64))
    want = grads(lambda *a: dsa_reference(*a, window), (q, k, v, offsets), dout)

    def boom(*a, **kw):
        raise triton.OutOfResources(300000, 232448, "shared memory")

    with caplog.at_level(logging.WARNING, logger=mod.__name__):
        monkeypatch.setattr(mod, "_bwd", boom)
        got = grads(lambda *a: mod.dsa_triton_tiled(*a, window), (q, k, v, offsets), dout)
        assert _rel_errors(got, want)["dk"] <= 1e-5
        monkeypatch.setattr(mod, "_fwd", boom)
        got = grads(lambda *a: mod.dsa_triton_tiled(*a, window), (q, k, v, offsets), dout)
    reasons = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(reasons) == 2 and "compile-backward" in reasons[0] and "(compile:" in reasons[1], reasons
    errs = _rel_errors(got, want)
    assert all(e <= 1e-5 for e in errs.values()), errs


@interpreter_only
def test_interp_nan_offsets_fall_back():
    from kernels import dsa_triton_tiled as mod

    shape = (1, 2, 3, 3, 2, 4)
    q, k, v = make_qkv(shape, seed=65)
    offsets = torch.zeros(*shape[:5], 1, 3)
    offsets[0, 1, 2, 0, 1, 0, 1] = float("nan")
    before = mod.FALLBACKS.get("halo", 0)
    out = mod.dsa_triton_tiled(q, k, v, offsets, (1, 1, 1))
    assert mod.FALLBACKS["halo"] == before + 1
    clean = offsets.nan_to_num(0.0)
    keep = torch.ones(shape[:5], dtype=torch.bool)
    keep[0, 1, 2, 0, 1] = False  # queries are independent: the others are the operator's
    torch.testing.assert_close(out[keep], dsa_reference(q, k, v, clean, (1, 1, 1))[keep])


def _bounded_case(seed):
    """q, k, v and offsets within [-1, 1] (some exactly at the bound) on a grid whose halos of
    radius 1 start inside it: (1, 2, 13, 15, 2, 8), window (1, 3, 3)."""
    shape, window = (1, 2, 13, 15, 2, 8), (1, 3, 3)
    q, k, v = make_qkv(shape, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    offsets = torch.tanh(2 * torch.randn((*shape[:5], 9, 3), generator=g))
    offsets[0, 1, 4, 6, 0, 3] = torch.tensor([0.0, 1.0, -1.0])
    dout = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 2))
    return shape, window, (q, k, v, offsets), dout


@interpreter_only
def test_interp_max_offset_through_the_public_entry():
    """``deformable_slide_attention(..., backend="triton", max_offset=m)``: the tiled kernel sizes
    its halo from ``ceil(m)``, not from the offsets (no measuring), and matches the reference,
    forward and every gradient; a bound that is not a number >= 0 is refused."""
    from kernels import deformable_slide_attention
    from kernels import dsa_triton_tiled as mod

    shape, window, inputs, dout = _bounded_case(seed=80)
    plan, _ = mod.tiled_plan_for(inputs[0], torch.zeros_like(inputs[3]), window, 1.0)
    assert plan.radius == 1 and any(h < s for h, s in zip(plan.halo, shape[1:4])), plan
    before = _fallbacks()
    got = grads(lambda *a: deformable_slide_attention(*a, window, backend="triton", max_offset=1.0), inputs, dout)
    assert _fallbacks() == before, "took the gather kernel"
    want = grads(lambda *a: dsa_reference(*a, window), inputs, dout)
    errs = _rel_errors(got, want)
    assert all(e <= 1e-5 for e in errs.values()), errs
    for bad in (-0.5, float("nan")):
        with pytest.raises(ValueError, match="max_offset"):
            mod.dsa_triton_tiled(*inputs, window, max_offset=bad)


@interpreter_only
def test_interp_offsets_beyond_max_offset_are_refused_with_nan():
    """A ``max_offset`` below some offsets: the queries holding an offset beyond ``ceil(max_offset)``
    (or a NaN one) get NaN output and dq, NaN d offsets (but where a position was clamped: 0,
    as in the reference), and dk / dv turn NaN (loud, like a non-finite loss) -- never a
    silently wrong value; every other query's output, dq and d offsets are the reference's. An
    offset between ``max_offset`` and its ceiling is computed exactly."""
    from kernels import dsa_triton_tiled as mod

    shape, window, (q, k, v, offsets), dout = _bounded_case(seed=83)
    # beyond ceil(1.0): with tiles of 2 rows, the halo of rows 6-7 holds rows 4-10, and this
    # sample (row 5 - 2.5) lies in rows 2-3: computed anyway, it would be silently wrong
    offsets[0, 0, 6, 7, 1, 1] = torch.tensor([0.0, -2.5, 0.0])
    offsets[0, 1, 0, 14, 0, 8, 1] = -1.75  # at the corner of the grid
    offsets[0, 1, 11, 2, 1, 0, 0] = float("nan")
    refused = torch.zeros(shape[:5], dtype=torch.bool)
    refused[0, 0, 6, 7, 1] = refused[0, 1, 0, 14, 0] = refused[0, 1, 11, 2, 1] = True
    inputs = (q, k, v, offsets)
    before = _fallbacks()
    out, dq, dk, dv, doff = grads(lambda *a: mod.dsa_triton_tiled(*a, window, max_offset=1.0), inputs, dout)
    assert _fallbacks() == before, "took the gather kernel"
    assert out[refused].isnan().all() and dq[refused].isnan().all()
    assert doff[refused].isnan().flatten(1).any(1).all()
    assert dk.isnan().any() and dv.isnan().any()
    clean = offsets.nan_to_num(0.0)
    w_out, w_dq, _, _, w_doff = grads(lambda *a: dsa_reference(*a, window), (q, k, v, clean), dout)
    keep = ~refused  # queries are independent in the output, dq and d offsets
    for name, a, b in (("out", out, w_out), ("dq", dq, w_dq), ("doffsets", doff, w_doff)):
        torch.testing.assert_close(a[keep], b[keep], rtol=1e-5, atol=1e-5, msg=name)
    # the same offsets under a bound of 1.5 (ceil 2): 1.75 is inside the halo; only 2.5 and NaN refused
    out = mod.dsa_triton_tiled(q, k, v, offsets, window, max_offset=1.5)
    refused[0, 1, 0, 14, 0] = False
    assert out[refused].isnan().all() and not out[~refused].isnan().any()
    torch.testing.assert_close(out[~refused], w_out[~refused], rtol=1e-5, atol=1e-5)


@interpreter_only
def test_interp_identities_through_the_public_api():
    """backend='triton' (tiled): zero offsets + whole-grid window == dense attention (forward,
    dq, dk, dv vs fp64 SDPA), zero offsets == neighborhood attention."""
    from kernels import deformable_slide_attention

    before = _fallbacks()

    def attn(q, k, v, offsets, window, scale):
        return deformable_slide_attention(q, k, v, offsets, window, scale=scale, backend="triton")

    assert_dense_identity(attn, (3, 5, 3), torch.float32, 2e-5, seed=67)
    shape, window = (1, 3, 6, 7, 3, 8), (3, 5, 5)
    q, k, v = make_qkv(shape, seed=68)
    offsets = torch.zeros(*shape[:5], 75, 3)
    out = deformable_slide_attention(q, k, v, offsets, window, backend="triton", max_offset=0.0)
    ref = naive_neighborhood_attention(*(x.double() for x in (q, k, v)), window)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert _fallbacks() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiled_compiled_on_cuda():
    from kernels import dsa_triton_tiled as mod

    window = (3, 5, 5)
    for shape, scale_off in (((2, 5, 9, 11, 3, 64), 1.0), ((1, 5, 16, 16, 3, 128), 0.0)):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = (x.cuda().to(dtype) for x in make_qkv(shape, seed=69))
            offsets = (wild_offsets(shape, window, seed=70) * scale_off).cuda().to(dtype)
            dout = torch.randn(shape, device="cuda")
            before = _fallbacks()
            got = grads(lambda *a: mod.dsa_triton_tiled(*a, window), (q, k, v, offsets), dout)
            assert _fallbacks() == before
            errors = reference_flash_errors(got, (q, k, v, offsets), dout, window, rel_atol=1e-4)
            assert not errors, f"{dtype}: " + "; ".join(errors)
