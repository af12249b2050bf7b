"""Part 1, ``correctness``: the Triton DSA kernels against ``dsa_reference`` (fp32 against fp64, bf16 by
the flash rule of kernels/checks.py) and the operator's two identities."""

from __future__ import annotations

import math
import traceback
from typing import TYPE_CHECKING

import torch

from kernels import KernelModes, deformable_slide_attention, dsa_reference
from kernels import checks as t

from .common import BF16_REL_ATOL, FP32_ATOL, FP32_RTOL, Case, Sizes

if TYPE_CHECKING:
    from .run import Run


def _case_offsets(t, case: Case, seed: int):

    if case.offsets == "wild":
        return t.wild_offsets(case.shape, case.window, dtype=torch.float32, seed=seed)
    if case.offsets == "edge":
        return t.edge_offsets(case.shape, case.window, dtype=torch.float32, seed=seed)
    if case.offsets == "uniform":
        K = math.prod(case.window)
        g = torch.Generator().manual_seed(seed)
        return (2 * torch.rand((*case.shape[:5], K, 3), generator=g) - 1) * 1.5
    if case.offsets in ("small", "far_few"):
        K = math.prod(case.window)
        g = torch.Generator().manual_seed(seed)
        off = (2 * torch.rand((*case.shape[:5], K, 3), generator=g) - 1) * 0.9
        if case.offsets == "far_few":  # past the key-side pass's cap: the split mode's flagged queries
            off.view(-1, case.shape[4], K, 3)[::10, :, K // 2, 2] = 3.7
        return off
    raise ValueError(f"unknown offsets kind {case.offsets!r}")


CASE_BOUND = {"uniform": 1.5, "small": 0.9}
"""The bound a case's offsets were drawn within, passed as ``max_offset`` (the other kinds reach
far or are unbounded: the call gets none)."""


def check_case(t, case: Case, dtype, device: str, kernel: str = "gather") -> dict:
    """Triton vs reference for one case in one dtype: max errors and the verdict. ``kernel``:
    "gather" (``KernelModes(halo="gather")``: the gather kernels) or "halo" (``KernelModes(halo="halo")``: the halo
    kernels wherever the case's offsets have a bound, ``CASE_BOUND``; the gather kernels where
    they have none, and the result says so). Far offsets take the split backward."""

    from kernels import dsa_triton as fused  # lazy: imports triton, after --smoke set TRITON_INTERPRET

    q, k, v = (x.to(device) for x in t.make_qkv(case.shape, seed=40))
    offsets = _case_offsets(t, case, seed=41).to(device)
    dout = torch.randn(case.shape, generator=torch.Generator().manual_seed(42)).to(device)
    inputs = [x.to(dtype) for x in (q, k, v, offsets)]
    bound = CASE_BOUND.get(case.offsets)

    def tri(*a):
        return fused.dsa_triton(*a, case.window, block_m=None if kernel in ("halo", "fused") else case.block_m,
                                max_offset=bound, modes=KernelModes(halo=kernel))

    def ref(*a, **kw):
        return dsa_reference(*a, case.window, **kw)

    got = t.grads(tri, inputs, dout)
    ran = kernel if kernel == "gather" or bound is not None else "gather (no bound: the halo kernels need one)"
    if kernel == "fused":  # it runs only where it may (and passed its first-use check): say what ran
        from kernels.dsa_gluon_halo import fused_refusal  # lazy: as above

        ran = "; ".join(f"{p}: fused" if why is None else f"{p}: auto ({why})" for p, why in
                        ((p, fused_refusal(inputs[0], case.window, bound, None, p)) for p in ("forward", "backward")))
    result = {"case": f"{case.name} [{kernel}]", "shape": case.shape, "window": case.window,
              "dtype": str(dtype).replace("torch.", ""), "block_m": case.block_m, "kernel": ran}
    if dtype == torch.float32:
        want = t.grads(ref, [x.double() for x in inputs], dout.double())
        errors, max_err = [], {}
        for name, a, b in zip(t.GRAD_NAMES, got, want):
            diff = (a.double() - b).abs()
            max_err[name] = diff.max().item()
            bad = ~(diff <= FP32_ATOL + FP32_RTOL * b.abs())  # NaN counts as bad
            if bad.any():
                errors.append(f"{name}: {int(bad.sum())} of {b.numel()} beyond "
                              f"atol {FP32_ATOL} + rtol {FP32_RTOL} (max err {max_err[name]:.3g})")
        result.update(rule=f"fp64 reference, atol {FP32_ATOL}, rtol {FP32_RTOL}", max_err=max_err)
    else:
        ref32 = t.grads(ref, [x.float() for x in inputs], dout)
        same = t.grads(lambda *a: ref(*a, upcast=False), inputs, dout)
        errors = t.flash_rule_errors(got, ref32, same, rel_atol=BF16_REL_ATOL)
        max_err = {n: (a.float() - r).abs().max().item() for n, a, r in zip(t.GRAD_NAMES, got, ref32)}
        result.update(rule=f"flash rule vs fp32 reference, rel atol {BF16_REL_ATOL}", max_err=max_err)
    result.update(ok=not errors, errors=errors)
    return result


def check_identities(t, device: str, sz: Sizes) -> list[dict]:
    """The identities of docs/dsa.md through the public API
    with ``backend="triton"`` (fp32)."""


    def on_device(q, k, v, offsets, window, scale=None):
        args = (x.to(device) for x in (q, k, v, offsets))
        out = deformable_slide_attention(*args, window, scale=scale, backend="triton")
        return out.cpu()

    results = []
    # offsets == 0 and window == grid: dense attention (forward and dq, dk, dv)
    for grid in sz.dense_identity_grids:
        name = f"dense identity, grid {grid}"
        try:
            t.assert_dense_identity(on_device, grid, torch.float32, 2e-5, seed=43)
            results.append({"case": name, "dtype": "float32", "ok": True, "errors": []})
        except AssertionError as e:
            results.append({"case": name, "dtype": "float32", "ok": False, "errors": [str(e)[:500]]})
    # offsets == 0: neighborhood attention (window shifted inward at borders)
    shape, window = sz.neighborhood_identity
    q, k, v = t.make_qkv(shape, seed=44)
    offsets = torch.zeros(*shape[:5], math.prod(window), 3)
    out = on_device(q, k, v, offsets, window).double()
    want = t.naive_neighborhood_attention(*(x.double() for x in (q, k, v)), window)
    err = (out - want).abs().max().item()
    ok = bool(err <= 1e-5)
    results.append({"case": f"neighborhood identity, {shape} window {window}", "dtype": "float32",
                    "ok": ok, "max_err": {"out": err},
                    "errors": [] if ok else [f"out: max err {err:.3g} > 1e-05"]})
    return results


def part_correctness(ctx: Run) -> dict:
    # kernels.checks: inputs, identities, the bf16 rule (shared with the tests)
    results = []
    for case in ctx.sizes.cases:
        kernels = ("gather", "halo", "fused") if str(ctx.device).startswith("cuda") else ("gather", "halo")  # fused: GPU
        for kernel, dtype in ((kn, dt) for kn in kernels for dt in (torch.float32, torch.bfloat16)):
            if ctx.past_deadline():
                results.append({"case": f"{case.name} [{kernel}]", "dtype": str(dtype).replace("torch.", ""),
                                "ok": False, "errors": ["skipped: time budget (--budget-s)"]})
                continue
            try:
                results.append(check_case(t, case, dtype, ctx.device, kernel))
            except Exception as e:  # one broken case must not hide the others
                results.append({"case": f"{case.name} [{kernel}]", "dtype": str(dtype).replace("torch.", ""),
                                "ok": False, "errors": [f"raised {type(e).__name__}: {e}"[:500]],
                                "traceback": traceback.format_exc()[-3000:]})
    results += check_identities(t, ctx.device, ctx.sizes)
    return {"ok": all(r["ok"] for r in results), "results": results}

