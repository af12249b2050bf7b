"""The sample order's Triton kernel (``kernels/dsa_order.py``) against its definitions in torch
(``kernels.dsa_halo_dense.sample_order`` and ``sample_records``), under the Triton CPU interpreter in a child pytest
(``test_interp_*``, started by ``test_order_kernel_under_interpreter``): random offsets within the
bound, at every border, exactly at the bound, and past it on each axis; bf16 and fp32 offsets; the
Wan window and a small one; bounds 1.5 and 2.7; more rows than one program takes."""

from __future__ import annotations

import os

import pytest
import torch

from kernels.checks import assert_interpreter_tests_pass

INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_order_kernel_under_interpreter"
)


@pytest.mark.slow  # a Triton interpreter child: the slow half runs them all
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_order_kernel_under_interpreter():
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__)


def _offsets(grid, window, bound, nh, dtype, seed):
    """Offsets uniform within ``bound``, a sixth of them whole moves to the bound, and some past it on
    each axis (up to twice the bound: past the reach in the clip's middle, clamped back at its ends)."""
    g = torch.Generator().manual_seed(seed)
    K = window[0] * window[1] * window[2]
    off = (torch.rand((2, *grid, nh, K, 3), generator=g) * 2 - 1) * bound
    edge = torch.rand(off.shape, generator=g) < 0.15
    off = torch.where(edge, torch.sign(off) * bound, off)
    far = torch.rand(off.shape, generator=g) < 0.01
    return torch.where(far, off * 2, off).to(dtype)


@interpreter_only
@pytest.mark.parametrize("grid,window,bound,dtype,tile", [
    ((4, 9, 10), (3, 7, 7), 1.5, torch.bfloat16, (1, 8, 8)),
    ((4, 6, 7), (3, 3, 3), 2.7, torch.float32, (2, 4, 4)),
])
def test_interp_the_kernel_writes_the_torch_order_and_records(grid, window, bound, dtype, tile):
    from kernels.dsa_halo_dense import RECORD_PAD, STARTS_AT, sample_order, sample_records, time_reach
    from kernels.dsa_order import ORDER_BLOCK_ROWS, sample_order_kernel

    off = _offsets(grid, window, bound, 2, dtype, seed=3)
    assert 2 * grid[0] * grid[1] * grid[2] * 2 > ORDER_BLOCK_ROWS  # several programs, a partial last one
    want = sample_order(off, window, bound)
    got, rec = sample_order_kernel(off, window, bound, tile)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    want_rec = sample_records(off, window, bound, tile)
    assert rec.dtype == want_rec.dtype and rec.shape == want_rec.shape
    assert torch.equal(rec, want_rec)  # fractions compared by their bits
    pad = torch.empty(0, dtype=torch.int32).set_(rec.untyped_storage())[rec.numel():]
    assert pad.numel() == RECORD_PAD * 4 and not pad.any()  # what a walk's last chunk may read past the end
    in_reach = want[..., STARTS_AT + sum(time_reach(bound))]  # the samples within their reach, per row
    assert (in_reach < window[1] * window[2]).any() and (in_reach == window[1] * window[2]).any()
