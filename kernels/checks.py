"""Checks for attention kernels: independent implementations, test inputs, tolerance rules.

Used by the tests (``tests/test_dsa.py``, ``tests/test_swin.py``)
and by the GPU check
(``benchmarks/gpu_check/``), which must run on a machine without pytest or the tests
folder. Nothing here is used by training.

- ``naive_neighborhood_attention`` / ``dense_attention``: implementations that share no code
  with the kernels (a loop per query; torch SDPA), the two identities' right-hand sides.
- ``make_qkv`` and three offset makers: ``off_kink_offsets`` (positions strictly between
  integers, for finite differences), ``edge_offsets`` (every special case of the operator's
  piecewise definition), ``wild_offsets`` (small, whole-token and far, clamped moves).
- ``grads``: output and input gradients of a function for a given output gradient.
- ``flash_rule_errors``: the flash-attention tolerance rule for low-precision results;
  ``reference_flash_errors``: that rule for a kernel's results against ``dsa_reference``.
- ``assert_dense_identity``: zero offsets and a whole-grid window give dense attention.
- ``assert_interpreter_tests_pass``: a test file's ``test_interp_*`` tests in a child pytest
  under the Triton CPU interpreter (the tests' way to run the Triton kernels without a GPU).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from .dsa_reference import dsa_reference, window_base_positions

GRAD_NAMES = ("out", "dq", "dk", "dv", "doffsets")


def naive_neighborhood_attention(q, k, v, window, scale=None):
    """Loop-per-query 3D neighborhood attention, non-causal, dilation 1.

    The window is centred on the query and shifted inward where it would leave the
    volume, so every query sees exactly kt*kh*kw keys.
    """
    B, T, H, W, nh, d = q.shape
    kt, kh, kw = window
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty_like(q)

    def start(i, w, size):
        return min(max(i - w // 2, 0), size - w)

    for t, y, x in itertools.product(range(T), range(H), range(W)):
        st, sy, sx = start(t, kt, T), start(y, kh, H), start(x, kw, W)
        keys = k[:, st:st + kt, sy:sy + kh, sx:sx + kw].reshape(B, -1, nh, d)
        vals = v[:, st:st + kt, sy:sy + kh, sx:sx + kw].reshape(B, -1, nh, d)
        s = torch.einsum("bhd,bjhd->bhj", q[:, t, y, x], keys) * scale
        out[:, t, y, x] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), vals)
    return out


def dense_attention(q, k, v, scale=None):
    """Attention over all T*H*W tokens with torch SDPA; channels-last in and out."""
    B, T, H, W, nh, d = q.shape
    flat = [x.reshape(B, T * H * W, nh, d).transpose(1, 2) for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*flat, scale=scale)
    return out.transpose(1, 2).reshape(B, T, H, W, nh, d)


def bounded_offsets(shape, window, bound, seed=3, dtype=torch.float32):
    """Offsets for ``shape`` (q's) and ``window`` in ``[-bound, bound]``, a sixth of them whole-token
    moves (corners exactly on keys): the bounded kernels' (pull, halo) test input."""
    B, T, H, W, nh, _ = shape
    K = window[0] * window[1] * window[2]
    g = torch.Generator().manual_seed(seed)
    off = (torch.rand((B, T, H, W, nh, K, 3), generator=g) * 2 - 1) * bound
    whole = torch.rand(off.shape, generator=g) < 0.15
    moves = torch.where(off.round().abs() <= bound, off.round(), off.trunc())  # whole moves within the bound too
    return torch.where(whole, moves, off).to(dtype)


def make_qkv(shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype).requires_grad_(requires_grad) for _ in range(3)]


def off_kink_offsets(shape, window, span, dtype=torch.float64, seed=1):
    """Offsets whose positions sit strictly between integers (fraction in [0.15, 0.85]).

    Base positions are integers, so the position fraction equals the offset fraction;
    no sample lies on a floor kink or exactly on a clamp bound, and finite differences
    see the same piecewise-linear branch as autograd. ``span`` controls how far
    samples go: large spans push positions outside the volume (clamped, gradient 0).
    """
    B, T, H, W, nh, _ = shape
    K = window[0] * window[1] * window[2]
    g = torch.Generator().manual_seed(seed)
    whole = torch.randint(-span, span + 1, (B, T, H, W, nh, K, 3), generator=g)
    frac = 0.15 + 0.7 * torch.rand((B, T, H, W, nh, K, 3), generator=g)
    return (whole + frac).to(dtype)


def edge_offsets(shape, window, dtype=torch.float64, seed=20):
    """Offsets hitting every special case of the operator's piecewise definition.

    Mixes fractional moves, exact integers (incl. zero: positions exactly on a floor
    kink, exactly 0 or size-1), far moves (clamped) and moves to exactly -base (p = 0).
    """
    B, T, H, W, nh, _ = shape
    K = window[0] * window[1] * window[2]
    g = torch.Generator().manual_seed(seed)
    full = (B, T, H, W, nh, K, 3)
    off = torch.randn(full, generator=g, dtype=torch.float64) * 1.5
    kind = torch.randint(0, 5, full, generator=g)
    off = torch.where(kind == 1, off.round(), off)  # integer: on a kink
    off = torch.where(kind == 2, torch.zeros_like(off), off)
    off = torch.where(kind == 3, off.sign() * 20.5, off)  # clamped
    base = window_base_positions((T, H, W), window).to(torch.float64)[None, :, :, :, None]
    upper = torch.tensor([T - 1, H - 1, W - 1], dtype=torch.float64)
    to_edge = torch.where(torch.rand(full, generator=g) < 0.5, -base, upper - base)
    off = torch.where(kind == 4, to_edge, off)  # exactly onto a clamp bound
    return off.to(dtype)


def wild_offsets(shape, window, dtype=torch.float32, seed=11):
    """Offsets mixing small moves, whole-token moves and far-outside (clamped) samples."""
    B, T, H, W, nh, _ = shape
    K = window[0] * window[1] * window[2]
    g = torch.Generator().manual_seed(seed)
    off = torch.randn((B, T, H, W, nh, K, 3), generator=g) * 1.5
    far = torch.rand((B, T, H, W, nh, K, 3), generator=g) < 0.1
    off = torch.where(far, off.sign() * 9.5, off)
    whole = torch.rand((B, T, H, W, nh, K, 3), generator=g) < 0.1
    off = torch.where(whole, off.round(), off)
    return off.to(dtype)


def grads(fn, inputs, dout):
    """``(fn(*inputs), *d/d inputs)`` for the output gradient ``dout`` (cast to the output's
    dtype); the inputs are detached copies, so the caller's tensors are left alone."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    return (out, *torch.autograd.grad(out, leaves, dout.to(out.dtype)))


def assert_grads_close(got, want, label: str = "", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """``got`` and ``want`` (out and gradients, ``GRAD_NAMES`` order; a shorter pair compares the
    first ones) agree within ``rtol``, ``atol`` (fp32 kernels against the reference: 1e-5, 1e-6)."""
    for name, a, b in zip(GRAD_NAMES, got, want):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=f"{label} {name}".strip())


def flash_rule_errors(got, ref32, same, rel_atol):
    """flash-attention tolerance rule, per tensor, on max abs errors:
    ``|got - ref32| <= 2 |same - ref32| + rel_atol * (1 + |ref32|)``, ``same`` being the
    reference computed in got's dtype. One message per violation (empty: all hold).
    """
    errors = []
    for name, a, r, b in zip(GRAD_NAMES, got, ref32, same):
        err = (a.float() - r.float()).abs().max().item()
        bound = 2 * (b.float() - r.float()).abs().max().item() + rel_atol * (1 + r.abs().max().item())
        if not err <= bound:  # NaN fails too
            errors.append(f"{name}: err {err:.3g} > bound {bound:.3g}")
    return errors


def reference_flash_errors(got, inputs, dout, window, rel_atol):
    """``flash_rule_errors`` of ``got`` (a kernel's output and gradients, ``grads`` order, on
    ``inputs = (q, k, v, offsets)`` for ``dout``) against ``dsa_reference`` in fp32 (``ref32``)
    and in the inputs' own dtype (``same``, ``upcast=False``)."""
    ref32 = grads(lambda *a: dsa_reference(*a, window), [x.float() for x in inputs], dout)
    same = grads(lambda *a: dsa_reference(*a, window, upcast=False), inputs, dout)
    return flash_rule_errors(got, ref32, same, rel_atol)


def assert_dense_identity(attn, grid, dtype, tol, seed, scale=0.3):
    """``attn(q, k, v, offsets, window, scale)`` with zero offsets and window == grid is
    dense attention: forward and the gradients of q, k, v against fp64 SDPA.

    B=2, nh=2, d=8; ``grid`` must be odd on every axis (windows are odd).
    """
    shape = (2, *grid, 2, 8)
    q, k, v = make_qkv(shape, dtype, seed=seed)
    K = grid[0] * grid[1] * grid[2]
    offsets = torch.zeros(*shape[:5], K, 3, dtype=dtype)
    dout = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = attn(*leaves, offsets, grid, scale)
    assert out.dtype == dtype
    got = (out, *torch.autograd.grad(out, leaves, dout.to(dtype)))
    leaves64 = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = dense_attention(*leaves64, scale=scale)
    want = (ref, *torch.autograd.grad(ref, leaves64, dout))
    for name, a, b in zip("out dq dk dv".split(), got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=f"{grid} {name}")


def assert_bf16_flash_rule(got, inputs, dout, window, label: str) -> None:
    """Low-precision results ``got`` (out and the gradients) keep bf16 and meet the flash rule
    against the fp32 reference (``reference_flash_errors``, ``rel_atol`` 1e-3)."""
    for name, a in zip(GRAD_NAMES, got):
        assert a.dtype == torch.bfloat16, f"{label}: {name} is {a.dtype}"
    errors = reference_flash_errors(got, inputs, dout, window, rel_atol=1e-3)
    assert not errors, f"{label}: " + "; ".join(errors)


def assert_interpreter_tests_pass(test_file, marker: str | None = None, timeout: float = 1500) -> None:
    """Run the ``test_interp_*`` tests of ``test_file`` (under ``tests/``) in a child pytest with
    ``TRITON_INTERPRET=1``; assert that it passed and
    skipped none. ``marker``: the child's ``-m`` expression (default: the project's ``addopts``).

    triton decides "interpreted or compiled" for every ``@triton.jit`` function when it is
    decorated -- triton.language's own helpers included, at ``import triton`` -- so the variable
    must be set before triton is first imported: hence a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    marks = ["-m", marker] if marker is not None else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marks, "-k", "test_interp_",
           str(test_file)]
    proc = subprocess.run(cmd, cwd=Path(test_file).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=timeout)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, f"interpreter tests failed ({summary}):\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}"
    assert " passed" in summary and "skipped" not in summary, summary
