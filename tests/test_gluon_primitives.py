"""What the fused halo-dense kernels (``kernels/dsa_halo_dense.py``'s algorithm) need from the GPU,
checked on this CPU machine by compiling for sm_90: a scatter-add into shared memory (the
probabilities and dS onto the halo), a gather from shared memory (the samples' corner scores) and
``wgmma`` on a bf16 operand built in shared memory (``P V_halo``). Plain Triton cannot index shared
memory; Triton's Gluon dialect can, from Triton 3.7 (gather, scatter) and 3.8 (atomic scatter-add).

The probe below is not a product kernel: it holds the Triton in use to the primitives the design
relies on, and shows what they become (``red.shared.add.f32``, ``ld.shared``, ``wgmma``)."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
gluon_core = pytest.importorskip("triton.experimental.gluon.language._core")
if not hasattr(gluon_core.shared_memory_descriptor, "atomic_scatter_add"):
    pytest.skip(f"Triton {triton.__version__}'s Gluon has no shared-memory atomic scatter-add (from 3.8): the "
                "fused halo-dense kernels cannot be built on it", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia import hopper  # noqa: E402


@gluon.jit
def _probe(IDX, VAL, B, OUT, M: gl.constexpr, NH: gl.constexpr, KS: gl.constexpr, D: gl.constexpr):
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    P = gl.allocate_shared_memory(gl.float32, [M, NH], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    P.store(gl.zeros([M, NH], gl.float32, blk))
    gl.barrier()
    rows = gl.arange(0, M, layout=gl.SliceLayout(1, blk))
    cols = gl.arange(0, KS, layout=gl.SliceLayout(0, blk))
    idx = gl.load(IDX + rows[:, None] * KS + cols[None, :])
    P.atomic_scatter_add(gl.load(VAL + rows[:, None] * KS + cols[None, :]), idx, 1)  # samples onto the halo
    gl.barrier()
    corner = P.gather(idx, 1)  # the halo back at the samples' corners
    a_s = gl.allocate_shared_memory(gl.bfloat16, [M, NH], gl.NVMMASharedLayout.get_default_for([M, NH], gl.bfloat16),
                                    P.load(blk).to(gl.bfloat16))
    brows = gl.arange(0, NH, layout=gl.SliceLayout(1, blk))
    bcols = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    b_s = gl.allocate_shared_memory(gl.bfloat16, [NH, D], gl.NVMMASharedLayout.get_default_for([NH, D], gl.bfloat16),
                                    gl.load(B + brows[:, None] * D + bcols[None, :]))
    hopper.fence_async_shared()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    acc = hopper.warpgroup_mma(a_s, b_s, gl.zeros([M, D], gl.float32, mma))
    gl.store(OUT + rows[:, None] * D + bcols[None, :], gl.convert_layout(acc, blk))
    gl.store(VAL + rows[:, None] * KS + cols[None, :], corner)


def test_gluon_scatter_gather_and_wgmma_compile_for_sm90():
    sig = {"IDX": "*i32", "VAL": "*fp32", "B": "*bf16", "OUT": "*fp32",
           "M": "constexpr", "NH": "constexpr", "KS": "constexpr", "D": "constexpr"}
    src = GluonASTSource(_probe, sig, constexprs={"M": 64, "NH": 256, "KS": 128, "D": 128})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert re.search(r"red\.shared[.a-z:]*\.add\.f32", ptx), "the scatter-add did not become a shared-memory reduction"
    assert "ld.shared" in ptx
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx)) == 256 // 16
    assert "atom.global" not in ptx and "red.global" not in ptx
