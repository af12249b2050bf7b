"""The compile-only check (``python -m benchmarks.gpu_check --compile-only``): every Triton kernel
config the product may launch, compiled ahead of time for sm_90 on this CPU machine (Triton's
bundled ptxas), must launch (shared memory within a Hopper block's limit) and must not spill.

The fast tests check the parsing and the verdict on fixed inputs; the slow ones compile (about
half a minute on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import compile as aot

ROOT = Path(__file__).resolve().parents[1]

PTXAS_LOG = """ptxas info    : Compiling entry function '_dsa_fwd' for 'sm_90a'
ptxas info    : Function properties for _dsa_fwd
    696 bytes stack frame, 824 bytes spill stores, 700 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 696 bytes cumulative stack size
"""

PTX = """
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r1}, %rd1, %rd2, p, 1, 1, 0, 1;
	mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};
	@%p3 red.global.add.f32 [%rd4], %f5;
	atom.global.gpu.acq_rel.add.f32 %f6, [%rd5], %f7;
	red.global.add.s32 [%rd4], %r5;
"""


def _record(**kw):
    base = dict(kernel="k", arch="sm_90", shape="s", dtype="bf16", head_dim=128, window=[3, 7, 7], grid=[21, 30, 52],
                max_offset=1.5, config="c", num_warps=4, num_stages=1, may_pick=True)
    return aot.Record(**{**base, **kw})


def test_ptxas_log_and_ptx_are_read():
    assert aot.parse_ptxas_log(PTXAS_LOG) == {"regs": 255, "stack": 696, "spill_stores": 824, "spill_loads": 700}
    got = aot.count_ptx(PTX)
    assert got == {"wgmma": 1, "mma_sync": 1, "dot": "wgmma", "wgmma_not_16bit": 0, "atomics_f32": 2,
                   "loop_instr": {0: 5}, "guarded": {}, "loops": {}, "mma_groups": [], "outer_walks": [],
                   "barriers": {"depths": {}, "loops": {}, "outer_walks": []}}
    tf32 = PTX.replace("m64n128k16.f32.bf16.bf16", "m64n128k8.f32.tf32.tf32")
    assert aot.count_ptx(tf32)["wgmma_not_16bit"] == 1
    serialized = PTXAS_LOG + ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions "
                              "are serialized due to the presence of Extern calls in the function '_dsa_fwd'\n")
    assert "serialized due to" in aot.parse_ptxas_log(serialized)["mma_serialized"]
    ttir = "%1 = tt.dot %a, %b, %c : tensor<64x16xbf16>\n%2 = tt.dot %d, %e, %f\n"
    ttgir = "%1 = ttng.warp_group_dot %a, %b, %c\n%2 = tt.dot %d, %e, %f\n"
    assert aot.count_dots(ttir, ttgir) == {"tt_dots": 2, "mma_dots": 1}
    assert aot.count_ptx("fma.rn.f32 %f1, %f2, %f3, %f4;")["dot"] == "-"
    assert aot.count_ptx("tcgen05.mma.cta_group::1.kind::f16 [%r1], %rd2, %rd3, %r4, p;")["dot"] == "tcgen05"


LOOPS_PTX = """
	mov.b32 	%r1, 0;
	bra.uni 	$L__BB0_1;
$L__BB0_3:                              //   in Loop: Header=BB0_1 Depth=1
	.loc	1 12 5
	add.s32 	%r1, %r1, 1;
	@!%p2 bra 	$L__BB0_4;
$L__BB0_1:                              // =>This Loop Header: Depth=1
                                        //     Child Loop BB0_2 Depth 2
	mov.b32 	%r2, 0;
$L__BB0_2:                              //   Parent Loop BB0_1 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
	fma.rn.f32 	%r3, %r4, %r5, %r3;
	add.s32 	%r2, %r2, 1;
	@%p1 bra 	$L__BB0_2;
// %bb.5:                               //   in Loop: Header=BB0_1 Depth=1
	mul.f32 	%r6, %r3, %r7;
	bra.uni 	$L__BB0_3;
$L__BB0_4:
	st.global.b32 	[%rd1], %r6;
	ret;
"""


def test_ptx_instructions_are_counted_by_loop_depth():
    """A block's depth is its innermost loop's (LLVM's block comments; a fall-through block is headed
    by ``// %bb.N:``); labels, directives and comments are not instructions."""
    assert aot.loop_instructions(LOOPS_PTX) == {0: 4, 1: 5, 2: 3}
    assert aot.loop_bodies(LOOPS_PTX) == {1: [5], 2: [3]}  # each loop's own code, not its nested loop's


GUARDED_PTX = """
	mov.b32 	%r1, 0;
	bra.uni 	$L__BB0_1;
$L__BB0_5:                              //   in Loop: Header=BB0_1 Depth=1
	add.s32 	%r1, %r1, 1;
	setp.lt.s32 	%p3, %r1, 8;
	@!%p3 bra 	$L__BB0_6;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	setp.lt.s32 	%p1, %r1, %r9;
	@%p1 bra 	$L__BB0_3;
// %bb.2:                               //   in Loop: Header=BB0_1 Depth=1
	add.f32 	%r2, %r2, %r3;
	mul.f32 	%r2, %r2, %r3;
$L__BB0_3:                              //   in Loop: Header=BB0_1 Depth=1
	setp.gt.s32 	%p2, %r1, %r8;
	@%p2 bra 	$L__BB0_5;
// %bb.4:                               //   in Loop: Header=BB0_1 Depth=1
	fma.rn.f32 	%r4, %r4, %r5, %r4;
	bra.uni 	$L__BB0_5;
$L__BB0_6:
	ret;
"""


def test_the_code_a_loop_runs_under_a_condition_is_found():
    """An ``if`` without ``else`` inside a loop (the fused kernels' window layers, skipped in the frames
    they cannot reach): the fall-through blocks up to the branch's target, counted per region; the
    loop's exit and back edges are no regions, nor is a loop nested in the body."""
    assert aot.guarded_regions(GUARDED_PTX) == {1: [2, 2]}  # the second ends by jumping to the latch
    assert aot.loop_instructions(GUARDED_PTX) == {0: 3, 1: 11}
    assert aot.guarded_regions(LOOPS_PTX) == {}


MMA_PTX = """
	mov.b32 	%r1, 0;
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%r2,%r3}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%r2,%r3}, %rd3, %rd4, 1, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	ld.global.v4.b32 	{%r4, %r5, %r6, %r7}, [%rd5];
	add.s64 	%rd5, %rd5, 16;
	wgmma.wait_group.sync.aligned 0;
	st.shared.b32 	[%r8], %r2;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r9,%r10}, %rd6, %rd7, 1, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 0;
	add.s32 	%r1, %r1, 1;
	setp.lt.s32 	%p1, %r1, 4;
	@%p1 bra 	$L__BB0_1;
// %bb.2:
	ret;
"""


def test_the_instructions_an_asynchronous_dot_overlaps_are_counted():
    """A group's instructions between its commit and the wait that retires it, its flops per warpgroup
    (``2 m n k`` each ``mma_async``) and its loop depth; a synchronous dot (the wait at once) overlaps none."""
    assert aot.mma_groups(MMA_PTX) == [[1, 2, 2 * 2 * 64 * 32 * 16, []], [1, 0, 2 * 64 * 128 * 16, []]]
    assert aot.mma_groups(LOOPS_PTX) == []


SPANNING_PTX = """
	mov.b32 	%r1, 0;
	bra.uni 	$L__BB0_1;
$L__BB0_4:                              //   in Loop: Header=BB0_1 Depth=1
	wgmma.wait_group.sync.aligned 0;
	add.s32 	%r1, %r1, 1;
	@%p1 bra 	$L__BB0_5;
$L__BB0_1:                              // =>This Loop Header: Depth=1
                                        //     Child Loop BB0_3 Depth 2
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r2}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	setp.lt.s32 	%p2, %r1, %r9;
	@%p2 bra 	$L__BB0_4;
// %bb.2:                               //   in Loop: Header=BB0_1 Depth=1
	mov.b32 	%r3, 0;
$L__BB0_3:                              //   Parent Loop BB0_1 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
	ld.shared.b32 	%r4, [%r3];
	add.s32 	%r3, %r3, 4;
	@%p3 bra 	$L__BB0_3;
// %bb.6:                               //   in Loop: Header=BB0_1 Depth=1
	mov.b32 	%r5, 1;
	bra.uni 	$L__BB0_4;
$L__BB0_5:
	ret;
"""


TWO_WAITS_PTX = """
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r2}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%r3}, %rd3, %rd4, 1, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	ld.global.b32 	%r4, [%rd5];
	add.s32 	%r5, %r4, 1;
	wgmma.wait_group.sync.aligned 1;
	st.global.b32 	[%rd6], %r2;
	wgmma.wait_group.sync.aligned 0;
	@%p1 bra 	$L__BB0_1;
// %bb.2:
	ret;
"""


def test_a_wait_that_leaves_a_group_running_splits_the_overlap():
    """``wait_group 1`` retires the older group and leaves the newer running: the instructions before it
    overlap the first (and count there only), those after it the second: no instruction is counted twice."""
    assert aot.mma_groups(TWO_WAITS_PTX) == [[1, 2, 2 * 64 * 64 * 16, []], [1, 1, 2 * 64 * 128 * 16, []]]


IF_ELSE_PTX = """
$L__BB0_1:                              // =>This Inner Loop Header: Depth=1
	wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%r2}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	@%p2 bra 	$L__BB0_3;
// %bb.2:                               //   in Loop: Header=BB0_1 Depth=1
	add.s32 	%r3, %r3, 1;
	bra.uni 	$L__BB0_4;
$L__BB0_3:                              //   in Loop: Header=BB0_1 Depth=1
	add.s32 	%r3, %r3, 2;
	add.s32 	%r3, %r3, 3;
$L__BB0_4:                              //   in Loop: Header=BB0_1 Depth=1
	mov.b32 	%r4, %r3;
	wgmma.wait_group.sync.aligned 0;
	@%p1 bra 	$L__BB0_1;
// %bb.5:
	ret;
"""


def test_neither_branch_of_an_if_else_counts_as_issued_on_every_path():
    """The ``then`` blocks are skipped by the conditional branch, the ``else`` blocks by the unconditional
    jump past them: only the branch, the join's move (and no ``else`` instruction) count."""
    assert aot.mma_groups(IF_ELSE_PTX) == [[1, 2, 2 * 64 * 64 * 16, []]]


def test_a_dot_that_runs_over_a_nested_loop_counts_the_loop_apart():
    """LLVM puts the frame loop's latch (here the wait) before its header: the group is followed in the
    order an iteration runs. What a forward branch may skip is not counted as issued meanwhile; the nested
    loop (a sample walk, its trips data-dependent) is listed by its place among its depth's loops. A loop
    holding none is an inner loop (at depth 1 in the fused kernels: a walk before the frame loops)."""
    assert aot.mma_groups(SPANNING_PTX) == [[1, 2, 2 * 64 * 64 * 16, [0]]]  # the first loop of depth 2
    assert aot.loop_bodies(SPANNING_PTX) == {1: [11], 2: [3]}
    assert aot.inner_loops(SPANNING_PTX, 2) == [3] and aot.inner_loops(SPANNING_PTX, 1) == []  # it holds one
    assert aot.inner_loops(LOOPS_PTX, 2) == [3] and aot.inner_loops(GUARDED_PTX, 1) == [11]


BARRIERS_PTX = (LOOPS_PTX.replace("\tmov.b32 \t%r1, 0;", "\tbar.sync \t0;\n\tmov.b32 \t%r1, 0;")  # depth 0
                .replace("\tadd.s32 \t%r1, %r1, 1;", "\tbar.sync \t0;\n\tadd.s32 \t%r1, %r1, 1;")  # depth 1
                .replace("\tfma.rn.f32", "\tbar.sync \t0;\n\tbarrier.sync \t0;\n\tfma.rn.f32"))  # depth 2


def test_the_barriers_are_counted_where_the_instructions_are():
    """``barriers``: the block-wide barriers by loop depth, per nested loop and per walk before the frame
    loops, in the same places ``loop_instructions``, ``loop_bodies`` and ``inner_loops`` count instructions
    (a fall-through block without a barrier still opens its loop's count); the cost model prices each."""
    got = aot.barriers(BARRIERS_PTX)
    assert got == {"depths": {0: 1, 1: 1, 2: 2}, "loops": {2: [2]}, "outer_walks": []}
    assert aot.loop_instructions(BARRIERS_PTX) == {0: 5, 1: 6, 2: 5}  # LOOPS_PTX's and the barriers'
    assert aot.loop_bodies(BARRIERS_PTX) == {1: [6], 2: [5]}
    assert aot.barriers(LOOPS_PTX) == {"depths": {}, "loops": {2: [0]}, "outer_walks": []}
    assert aot.barriers(GUARDED_PTX)["outer_walks"] == [0]  # one walk before the frame loops, no barrier in it


def test_a_variant_listed_at_two_shapes_is_compiled_once(monkeypatch):
    """The fused kernels compile the same at every Wan grid (the grid is a run-time argument): the check
    compiles such a variant once and repeats its measurements at the other shapes; another constexpr is
    another compile."""
    import kernels

    def variants(shape):
        return [dict(kernel="k", fn=variants, signature={"X": "*bf16", "BLOCK": "constexpr"},
                     constexprs={"BLOCK": 64 if shape.grid[0] < 30 else 128}, num_warps=4, num_stages=1,
                     config="c", tensor_cores=False)]

    compiled = []

    def fake_compile(variant, arch, shape, timeout_s=0):
        compiled.append(shape.label)
        rec = aot._record(variant, arch, shape)
        rec.regs, rec.loop_instr, rec.ok = 40, {0: 7}, True
        return rec

    monkeypatch.setattr(kernels, "aot_variants", variants)
    monkeypatch.setattr(aot, "compile_variant", fake_compile)
    shapes = [aot.AotShape("bf16", 128, (3, 7, 7), g, 1.5, label=f"s{g[0]}") for g in ((21, 30, 52), (21, 15, 26),
                                                                                      (31, 45, 80))]
    recs = aot.run(["sm_90"], shapes, progress=None)
    assert compiled == ["s21", "s31"]
    assert [r.shape for r in recs] == ["s21", "s21", "s31"] and recs[1].grid == [21, 15, 26]
    assert recs[1].regs == 40 and recs[1].loop_instr == {0: 7} and recs[1].ok and "the compile of s21" in recs[1].note


def test_each_target_wants_its_own_tensor_core_instruction():
    for cc, dot, ok in ((90, "wgmma", True), (90, "tcgen05", False), (100, "tcgen05", True), (100, "wgmma", False)):
        rec = _record(regs=128, spill_stores=0, spill_loads=0, smem=128, dot=dot)
        aot.judge(rec, tensor_cores=True, cc=cc)
        assert rec.ok is ok, (cc, dot, rec.problems)


@pytest.mark.parametrize("fields,problem", [
    (dict(regs=128, spill_stores=0, spill_loads=0, smem=327_680), "cannot launch"),
    (dict(regs=255, spill_stores=824, spill_loads=700, smem=128), "spills"),
    (dict(regs=128, spill_stores=0, spill_loads=0, smem=128, dot="mma.sync"), "not wgmma"),
    (dict(regs=None, smem=128), "no ptxas register report"),
    (dict(regs=128, spill_stores=0, spill_loads=0, smem=128, dot="wgmma", tt_dots=4, mma_dots=3),
     "1 of 4 dots not lowered to wgmma"),
    (dict(regs=128, spill_stores=0, spill_loads=0, smem=128, dot="wgmma", wgmma_not_16bit=2),
     "without bf16/fp16 operands"),
    (dict(regs=128, spill_stores=0, spill_loads=0, smem=128, dot="wgmma",
          mma_serialized="Potential Performance Loss: wgmma.mma_async instructions are serialized"), "serialized"),
])
def test_verdict_fails_what_cannot_launch_spills_or_misses_wgmma(fields, problem):
    rec = _record(**fields)
    aot.judge(rec, tensor_cores=True, cc=90)
    assert not rec.ok and any(problem in p for p in rec.problems), rec.problems
    ok, bad = aot.verdict([rec])
    assert not ok and len(bad) == 1
    rec.may_pick = False  # listed for information: does not fail the check
    assert aot.verdict([rec])[0]


def test_clean_record_and_blocks_per_sm():
    rec = _record(regs=128, spill_stores=0, spill_loads=0, smem=64, dot="-")
    aot.judge(rec, tensor_cores=False, cc=90)
    assert rec.ok and rec.blocks_per_sm == 4  # 128 regs x 128 threads: 4 blocks in 64k registers
    assert aot.blocks_per_sm(regs=64, warps=4, smem=120_000, cc=90) == 1  # two would need 242 KB


def test_gather_autotune_lists_are_what_the_check_compiles():
    pytest.importorskip("triton")
    from kernels import aot_variants, dsa_triton, dsa_triton_variants

    shape = aot.preset_shapes()[0]
    from kernels.dsa_triton_pull import pull_config, pull_span

    variants = aot_variants(shape)
    listed = [(v["kernel"], v["constexprs"]["BLOCK_M"], v["num_warps"], v["num_stages"]) for v in variants
              if v["kernel"].startswith("gather")]
    tuned = ([("gather_fwd", c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in dsa_triton.FWD_CONFIGS]
             + [("gather_bwd_pull", c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in dsa_triton.BWD_PULL_CONFIGS]
             + [("gather_bwd_atomic", c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in dsa_triton.BWD_CONFIGS]
             + [("gather_bwd_split", c.kwargs["BLOCK_M"], c.num_warps, c.num_stages) for c in dsa_triton.BWD_PULL_CONFIGS])
    assert listed == tuned
    # the key-side pass: the launcher's config on each target (pull_config's cc), for dk and for dv,
    # at the bound a call runs at (the given one: nothing is measured), once
    bounds = dsa_triton_variants.bounds_run(shape.max_offset)
    assert bounds == [1.5]
    assert dsa_triton_variants.bounds_run(None) == dsa_triton_variants.bounds_run(4.0) == []
    for arch, cc in (("sm_90", 90), ("sm_100", 100)):
        pulls = [(v["kernel"], v["constexprs"]["BXP"], v["constexprs"]["QXP"], v["constexprs"]["UP"], v["num_warps"],
                  v["maxnreg"]) for v in variants if v["kernel"].startswith("pull") and arch in v["archs"]]
        launched = [(k, cfg["BXP"], cfg["QXP"], cfg["UP"], cfg["num_warps"], cfg["maxnreg"])
                    for cfg in (pull_config(shape.head_dim, shape.window, *pull_span(b), cc=cc) for b in bounds)
                    for k in ("pull_dk", "pull_dv")]
        assert len(set(pulls)) == len(pulls) and set(pulls) == set(launched)
        assert len(pulls) == 2  # 3x5x5 at 1.5: one config each for dk and dv
    assert pull_config(128, (3, 7, 7), 2, 2, fp32=True, cc=100)["maxnreg"] == 255  # fp32 on sm_100: no 128 cap
    # the halo kernels: the launchers' one config per pass and target (halo_config's cc), the rows
    # pass with its register limit, every pass picked (bf16)
    from kernels.dsa_triton_halo import halo_config

    for arch, cc in (("sm_90", 90), ("sm_100", 100)):
        halos = [(v["kernel"], v["constexprs"]["XP"], v["constexprs"]["KWP"], v["constexprs"].get("UP"), v["num_warps"],
                  v["maxnreg"], v["may_pick"]) for v in variants if v["kernel"].startswith("halo") and arch in v["archs"]]
        launched = []
        for b in bounds:
            cfg = halo_config(shape.head_dim, shape.window, *pull_span(b), cc=cc)
            launch = {"halo_scores": (None, cfg["scores_warps"], None),
                      "halo_out": (cfg["UP"], cfg["rows_warps"], cfg["rows_maxnreg"]),
                      "halo_bwd_v": (None, cfg["bwd_warps"], None),
                      "halo_bwd_k": (None, cfg["bwd_warps"], None),
                      "halo_dq": (cfg["UP"], cfg["rows_warps"], cfg["rows_maxnreg"])}
            launched += [(k, cfg["XP"], cfg["KWP"], up, w, r, True) for k, (up, w, r) in launch.items()]
        assert len(set(halos)) == len(halos) and set(halos) == set(launched)
    assert halo_config(128, (3, 7, 7), 2, 2, cc=90)["rows_maxnreg"] is None  # sm_90: ptxas chooses (no spills)


def test_the_gather_kernels_are_listed_as_picked_only_where_auto_may_take_them(monkeypatch):
    """The compile-only check's ``may_pick`` for the gather kernels follows ``auto`` (``choose_halo`` at
    the shape's bound): at the Wan shape (d 128, 3x7x7, bound 1.5) the halo forward is predicted
    faster, so the gather forward is listed for the record only, and the backward's query side on
    the gather kernels; fp32 takes them everywhere; the atomic and split backward modes only where the bound passes the
    key-side pass's cap (or none is given, when the pull mode's query side never runs), and then the
    key-side pass that adds the split mode's
    atomics too, once per target (its constexprs are one at every bound the split mode picks)."""
    pytest.importorskip("triton")
    from kernels import aot_variants

    def picked(dtype, d, window, bound=1.5):
        shape = aot.AotShape(dtype, d, window, (21, 30, 52), bound)
        return {v["kernel"]: v.get("may_pick", True) for v in aot_variants(shape) if v["kernel"].startswith("gather")}

    from kernels.dsa_cost import choose_halo

    for d, window in ((128, (3, 7, 7)), (64, (3, 5, 5))):  # the pull mode's gather passes exactly where auto takes them
        pick = choose_halo((21, 30, 52), window, d, 1.5)
        assert picked("bf16", d, window) == {"gather_fwd": not pick["fwd"][0], "gather_bwd_pull": not pick["bwd"][0],
                                             "gather_bwd_atomic": False, "gather_bwd_split": False}
    notes = [v["note"] for v in aot_variants(aot.AotShape("bf16", 128, (3, 7, 7), (21, 30, 52), 1.5))
             if v["kernel"] == "gather_fwd"]
    assert notes and all("not picked: the cost model predicts the halo kernels faster" in n for n in notes)
    assert picked("bf16", 128, (3, 7, 7), bound=2.5)["gather_fwd"] is True  # offsets in (2, 3): the gather kernels
    assert picked("bf16", 128, (3, 7, 7), bound=4.0)["gather_bwd_atomic"] is True  # past the cap
    for bound in (4.0, None):  # past the cap, or unbounded: the gather forward, the split mode (atomics where
        # no split bound fits a slab), the split mode's key-side pass; the pull mode's query side never
        assert picked("bf16", 128, (3, 7, 7), bound=bound) == {
            "gather_fwd": True, "gather_bwd_pull": False, "gather_bwd_atomic": True, "gather_bwd_split": True}
        acc = [(v["kernel"], v["archs"]) for v in aot_variants(aot.AotShape("bf16", 128, (3, 7, 7), (21, 30, 52), bound))
               if v["kernel"].endswith("+acc")]
        assert sorted(acc) == [(k, (a,)) for k in ("pull_dk+acc", "pull_dv+acc") for a in ("sm_100", "sm_90")]
    assert not any(v["kernel"].endswith("+acc") for v in aot_variants(aot.AotShape("bf16", 128, (3, 7, 7),
                                                                                    (21, 30, 52), 1.5)))
    assert set(picked("fp32", 128, (3, 7, 7)).values()) == {True, False}  # fp32: gather (the atomic mode not at 1.5)
    assert picked("fp32", 128, (3, 7, 7))["gather_fwd"] is True


@pytest.mark.core
@pytest.mark.slow  # about 2 min on 2 cores: every config at the presets' shapes, for sm_90
@pytest.mark.child_process
def test_sm90_compile_only_check_passes_at_the_preset_shapes(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--compile-only", "--arch", "sm_90",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    recs = report["records"]
    shapes = {(r["head_dim"], tuple(r["window"])) for r in recs}
    assert shapes == {(d, w) for d in (64, 128) for w in ((3, 5, 5), (3, 7, 7))}
    from kernels.dsa_gluon_halo import gluon_halo_refusal

    # the Gluon kernels, where Triton builds them, and the Triton kernel that sorts their samples
    fused = set() if gluon_halo_refusal() else {"fused_fwd", "fused_bwd", "fused_order"}
    assert {r["kernel"] for r in recs} == {"gather_fwd", "gather_bwd_pull", "gather_bwd_atomic", "gather_bwd_split",
                                           "pull_dk", "pull_dv", "pull_dk+acc", "pull_dv+acc", "halo_scores", "halo_out",
                                           "halo_bwd_v", "halo_bwd_k", "halo_dq"} | fused
    # the fused kernels (not picked yet): clean by the same rules, every dot of the source a bf16 wgmma (the
    # forward's 2 per chunk of 64 halo keys, the backward's 5, unrolled over the frame's 6 chunks, and a
    # frame's first chunks of S (three; dP's and S's first in the backward) once more before the frame loop),
    # no float atomics
    for r in recs:
        if r["kernel"] in ("fused_fwd", "fused_bwd"):
            dots = {"fused_fwd": 12 + 3, "fused_bwd": 30 + 2}[r["kernel"]]
            assert r["ok"] and r["mma_dots"] == r["tt_dots"] == dots and r["wgmma_not_16bit"] == 0, r
            assert not r["mma_serialized"] and r["atomics_f32"] == 0, r
    for r in recs:
        assert r["ok"] and r["spill_stores"] == 0 and r["smem"] <= aot.SMEM_PER_BLOCK[90], r
        if r["kernel"] in ("gather_bwd_pull",) or r["kernel"].startswith(("pull", "halo")):
            assert r["atomics_f32"] == 0, r  # the backward that runs at this bound: no float atomics
        if r["kernel"].startswith("pull"):  # its products on Hopper's tensor cores, 2 blocks per SM
            assert r["dot"] == "wgmma" and r["blocks_per_sm"] >= 2, r
        if r["kernel"].startswith("halo"):  # on Hopper's tensor cores; 8 warps resident per SM at least
            assert r["dot"] == "wgmma" and r["blocks_per_sm"] * r["num_warps"] >= 8, r
    assert report["predictions"] and all(p["ms_per_layer"] > 0 for p in report["predictions"])
    assert "every config the product may pick launches" in proc.stdout
    # at every GPU preset's shape (head dim 128, offsets clamped at 1.5) every config auto may pick runs
    # on tensor cores; with unbounded offsets (attention.max_offset 0) the gather kernels may run too
    # (offsets in (2, 3) and past the cap)
    presets = {p for r in recs for p in r["presets"]}
    assert presets == {"dit-105b", "dit-33b", "dit-28b", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-t2v-a14b",
                       "wan2.2-ti2v-5b", "wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "wan2.1-flf2v-14b-720p",
                       "wan2.2-i2v-a14b", "wan2.2-ti2v-5b-i2v"}
    at_presets = [r for r in recs if r["presets"] and r["may_pick"]]
    assert at_presets and {r["kernel"] for r in at_presets if r["dot"] == "wgmma"} >= {"pull_dk", "pull_dv"}
    from kernels.dsa_cost import choose_halo

    for r in at_presets:  # a gather pass is listed as picked only where the cost model prefers it to the
        # halo kernels at the preset's shape; the halo kernels (listed wherever their bound allows them:
        # KernelModes(halo="halo") forces them) are on tensor cores
        if r["kernel"].startswith("gather"):
            pass_ = "fwd" if r["kernel"] == "gather_fwd" else "bwd"
            assert not choose_halo(tuple(r["grid"]), tuple(r["window"]), r["head_dim"], r["max_offset"])[pass_][0], r
        if r["kernel"].startswith("halo"):
            assert r["dot"] == "wgmma", r
    # every dot of every picked tensor-core config on wgmma with bf16 operands, none serialized by ptxas
    mma = [r for r in recs if r["may_pick"] and r["dot"] == "wgmma"]
    assert mma and all(r["mma_dots"] == r["tt_dots"] > 0 and r["wgmma_not_16bit"] == 0 and not r["mma_serialized"]
                       for r in mma), [r for r in mma if r["mma_dots"] != r["tt_dots"] or r["wgmma_not_16bit"]]
    cuda = {(r["kernel"], r["max_offset"]) for r in recs if r["may_pick"] and r["head_dim"] == 128 and r["dot"] != "wgmma"}
    assert {k for k, b in cuda if b is None} == {"gather_fwd", "gather_bwd_atomic", "gather_bwd_split"}
    assert {k for k, b in cuda if b is not None} <= {"gather_fwd", "gather_bwd_pull"}  # where the model prefers them
    assert "configs the product may pick at the presets' shapes" in proc.stdout
    # the cost model's issue table holds what these compiles issue: a kernel changed without
    # rerunning `python -m benchmarks.gpu_check.issue_table` fails here
    import triton

    from kernels.dsa_cost import ISSUE_FILE, ISSUE_KERNELS, issue_key

    table = json.loads(ISSUE_FILE.read_text())
    if table["triton"] != triton.__version__:
        pytest.skip(f"the issue table was counted with triton {table['triton']}, this is {triton.__version__}")
    checked = set()
    for r in recs:
        if r["arch"] == "sm_90" and r["kernel"] in ISSUE_KERNELS:
            key = issue_key(r["kernel"], r["head_dim"], r["window"], r["constexprs"], r["num_warps"])
            assert key in table["entries"], key
            assert table["entries"][key]["depths"] == {str(k): v for k, v in r["loop_instr"].items()}, key
            assert table["entries"][key]["guarded"] == {str(k): v for k, v in r["guarded"].items()}, key
            assert table["entries"][key]["loops"] == {str(k): v for k, v in r["loops"].items() if int(k) >= 2}, key
            assert table["entries"][key]["blocks_per_sm"] == r["blocks_per_sm"], key
            if r["kernel"].startswith("fused_"):  # the cost model overlaps their asynchronous dots
                assert table["entries"][key]["mma_groups"] == r["mma_groups"], key
                assert table["entries"][key]["outer_walks"] == r["outer_walks"], key
            checked.add(r["kernel"])
    assert checked == set(ISSUE_KERNELS) - ({"fused_fwd", "fused_bwd"} - fused)


@pytest.mark.core
@pytest.mark.slow
@pytest.mark.child_process
def test_a_spilling_config_fails_the_check():
    """The check can fail: the gather forward at 64 queries per program and 4 warps spills at d 128."""
    pytest.importorskip("triton")
    from kernels import aot_variants

    shape = [s for s in aot.preset_shapes() if s.head_dim == 128 and s.window == (3, 7, 7)][0]
    spec = dict(aot_variants(shape)[0])
    spec.update(constexprs=dict(spec["constexprs"], BLOCK_M=64), num_warps=4, config="BLOCK_M=64")
    rec = aot.compile_variant(aot.Variant(**spec), "sm_90", shape, timeout_s=300)
    assert not rec.ok and rec.spill_stores > 0, aot.table_line(rec)
