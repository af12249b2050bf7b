"""Write the cost model's issue table: how many PTX instructions each kernel's threads issue per
loop level, measured from an sm_90 compile of every config ``auto`` chooses between.

    python -m benchmarks.gpu_check.issue_table [--out kernels/dsa_issue_sm90.json]

``kernels.dsa_cost`` counts a kernel's work in issue slots from these counts and the loops' trip
counts (the window's slots, the 8 corners, the key rows a halo group touches), so the gather kernels
(FMA work, index arithmetic, corner loads) and the halo kernels (tensor-core dots, the band, the
gathers and layout changes around them) are held to the same measure: the instructions the
compiler emitted, not a guess per operation. Compiled for bf16 at the presets' head dims (64, 128)
and windows (3x5x5, 3x7x7), at every bound class up to the key-side pass's cap (the halo passes'
configs follow the bound), with one and two image rows a halo tile (``GRIDS``). About 15 minutes
on 2 shared cores (most of it the fused kernels' 14 compiles); rerun after changing a kernel (the test
``tests/test_compile_sm90.py::test_sm90_compile_only_check_passes_at_the_preset_shapes``
fails until then).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.gpu_check import compile as aot

SHAPES = [("bf16", d, w) for d in (64, 128) for w in ((3, 5, 5), (3, 7, 7))]
# the grid is a run-time argument but for the halo kernels' rows per tile (``dsa_triton_halo.halo_tile``): one at
# Wan2.1's 480p rows (52 tokens), two at Wan2.2 TI2V-5B's (26)
GRIDS = ((21, 30, 52), (21, 15, 26))


def _by_depth(counts: dict) -> dict:
    """``{depth: value}`` as the table's JSON keeps it: string keys, in depth order."""
    return {str(k): v for k, v in sorted(counts.items())}


def measure(shapes=SHAPES, kernels=None, progress=print, grids=GRIDS) -> dict:
    """``{issue_key: {"kernel", "head_dim", "window", "constexprs", "warps", "depths": {depth:
    instructions}, "guarded": {depth: [instructions of each conditional region]}, "loops": {depth >= 2:
    [instructions of each nested loop]}, "mma_groups": [[depth, instructions issued while the group runs,
    flops per warpgroup, [nested loops]], ...], "mma_serialized" (ptxas serialized the wgmma: no overlap), "outer_walks": [instructions of each depth-1 loop holding
    none], "barriers": the block-wide barriers among them, as "depths", "loops" and "outer_walks" count
    instructions, "blocks_per_sm"}}`` (resident blocks per SM, from registers and shared memory) for the kernels ``dsa_cost`` counts (``ISSUE_KERNELS``), compiled for sm_90
    at ``shapes``."""
    import triton  # lazy: the compile imports it anyway

    from kernels import aot_variants
    from kernels.dsa_cost import ISSUE_KERNELS, issue_key
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET

    table = {}
    # every bound class up to the key-side pass's cap (a call runs at its max_offset: any of them)
    bounds = [k / 2 for k in range(int(2 * PULL_MAX_OFFSET), -1, -1)]
    for (dtype, d, window), grid, bound in ((s, g, b) for g in grids for s in shapes for b in bounds):
        shape = aot.AotShape(dtype, d, window, grid, bound)
        for spec in aot_variants(shape):
            name = spec["kernel"]
            if name not in (kernels or ISSUE_KERNELS) or (spec.get("archs") and "sm_90" not in spec["archs"]):
                continue
            key = issue_key(name, d, window, spec["constexprs"], spec["num_warps"])
            if key in table:
                continue
            rec = aot.compile_variant(aot.Variant(**spec), "sm_90", shape)
            if not rec.loop_instr:
                raise RuntimeError(f"{key}: no PTX counted ({'; '.join(rec.problems)})")
            consts = {k: v for k, v in spec["constexprs"].items() if isinstance(v, (bool, int))}
            table[key] = {"kernel": name, "head_dim": d, "window": list(window), "constexprs": consts,
                          "warps": spec["num_warps"], "depths": _by_depth(rec.loop_instr),
                          "guarded": _by_depth(rec.guarded),
                          "loops": _by_depth({k: v for k, v in rec.loops.items() if k >= 2}),
                          "mma_groups": rec.mma_groups, "mma_serialized": bool(rec.mma_serialized),
                          "outer_walks": rec.outer_walks,
                          "barriers": {"depths": _by_depth(rec.barriers["depths"]),
                                       "loops": _by_depth(rec.barriers["loops"]),
                                       "outer_walks": rec.barriers["outer_walks"]},
                          "blocks_per_sm": rec.blocks_per_sm}
            if progress:
                progress(f"{key}: {spec['num_warps']} warps, {rec.loop_instr}")
    return {"arch": "sm_90", "triton": triton.__version__, "dtype": "bf16", "entries": table}


def main(argv=None) -> int:
    from kernels.dsa_cost import ISSUE_FILE

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ISSUE_FILE)
    args = p.parse_args(argv)
    table = measure()
    args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(table['entries'])} entries -> {args.out.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
