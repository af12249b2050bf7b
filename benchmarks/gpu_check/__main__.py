"""One prepared GPU check: the Triton DSA kernels' correctness on CUDA, pinned transfers, weight
streaming, the attention operators and a paper-width model, in under 6 minutes on one GPU.

    python -m benchmarks.gpu_check --out DIR [--budget-s 330] [--parts ...]
    python -m benchmarks.gpu_check --out DIR --smoke     # every part on the CPU at tiny sizes

Needs only torch, triton, numpy and safetensors: no Ray, no video decoding (batches are
synthetic: random uint8 clips and caption bytes from ``megaslide_ray.data.captions``); the store
and the compute actor run in this process. Parts, in order; each is guarded (a failure is
recorded and the next part still runs), each has a share of ``--budget-s`` (a part that would
start too late is skipped, loops inside a part stop at its deadline), and the results are
rewritten after every part and marked ``running`` before it, so a killed run still reports:

1. ``correctness``: the fused kernels ``dsa_triton`` with the gather kernels and with the halo
   kernels (``KernelModes``; each row says which ran: the halo kernels need a bound, which the cases
   with far or unbounded offsets lack), forward and the gradients of q, k, v and offsets against ``dsa_reference``, per case,
   kernel and dtype. fp32: against the fp64 reference,
   ``|tri - ref| <= 2e-5 + 1e-4 |ref|``. bf16: the flash-attention rule of kernels/checks.py.
   Cases: odd sizes, head dims that are not powers of two, several query block sizes, offsets
   that clamp far outside the volume, positions on integers and clamp bounds; plus both
   identities of docs/dsa.md.
2. ``pinning``: a 2 GiB shared-memory segment registered in 256 MiB pieces
   (``actors/pinned.py``: ``HostPinning``, copies cut at the pieces): host->device and
   device->host GB/s against a ``pin_memory()`` buffer and a pageable one; the data arrive
   intact; whether ``is_pinned()`` sees registered memory; a refused registration (the same
   memory registered twice) falls back, and the CUDA error it left is cleared (a kernel
   launches after it).
3. ``streaming``: the compute actor with the store in this process on a small model (width
   512, depth 4, bf16 weights): overlap on, on again, off, and on with offloaded activations,
   on the same synthetic batches. Compared with ``on`` under the tolerance below; the
   ``on again`` run measures the device's own run-to-run noise.
4. ``attention``: 3D-DSA forward and backward timed apart -- ``dsa`` (the public ``triton``
   path as ``auto`` runs it: halo or gather per pass by the cost model, ``max_offset`` 1.5), ``dsa_gather`` (the gather kernel, same offsets, dk/dv by the key-side
   pass), ``dsa_gather_atomic`` (the same, dk/dv by fp32 atomics), ``dsa_gather_split``
   (unbounded offsets, 5% of the queries 4 tokens out: dk/dv by the split mode), ``dsa_halo`` (the halo
   kernels: the forward and the backward's query side on tensor cores), ``dsa_fused`` (GPU only: the
   fused halo-dense forward where Triton >= 3.8 builds it and its first-use check passes) -- against flash SDPA
   (``sdpa_kernel(FLASH_ATTENTION)``) and against the neighborhood case (zero offsets) at
   paper-like shapes: d = 128, nh = 8 (the paper's 44-96 heads scale time linearly and leave
   TFLOP/s as they are), K = 27 and 75, 16k / 64k / 256k tokens, bf16; TFLOP/s and the
   dense/DSA crossover (log-log interpolation between grids, extrapolated past the last one
   with dense ~ N^2 and DSA ~ N).
5. ``model``: a paper-width model (width 5120, 40 heads, 2 blocks, patch (1, 2, 2), window
   (3, 5, 5), bf16, ~1.1B parameters, ~18 GB of store) streamed with overlap on and off at a
   short clip (4x64x64 pixels: 4k tokens, transfer-bound) and a long one (16x128x128: 65k
   tokens, compute-bound): step time, per-stream busy seconds from CUDA events (H2D copies,
   D2H copies, compute on the default stream), H2D GB/s, peak device memory per step against
   ``megaslide_ray.planning`` for the same config, MFU from the planner's FLOPs (model FLOPs:
   linear + attention; HFU adds the recompute) against the GPU's dense bf16 peak.
6. ``speedup``: Triton ``dsa`` against the pure-PyTorch reference at 65,536 tokens
   (nh = 2, d = 32), forward + backward (goal: at least 3x).

The streaming tolerance. The four runs execute the same kernels on the same inputs in the same
order; only the transfer schedule differs, and on the CPU they are bit-identical (the tests use
``torch.equal``). On CUDA, reductions whose order is not fixed differ run to run: the Triton
backward adds dk and dv with fp32 atomics, and library kernels (cuDNN's weight gradients) may
too. Each accumulates in fp32 and is stored in bf16: two orders of an fp32 sum of M terms
differ by about M 2^-24 of the terms (2^-16 for M ~ 200), far below a bf16 ulp, so after
rounding they agree or differ by one ulp, at most 2^-7 of the value (bf16 keeps 8 significant
bits). Such a tensor differs by at most 2^-7 in relative L2. The backward hands dx from shard
to shard, and each shard's gradient is linear in it, so to first order the relative differences
add along the L + 2 shards: a shard's gradient differs by at most (L + 2) 2^-7. This part runs
AdamW with eps = 1, above every clipped gradient element, where the update ``m / (sqrt(v) +
eps)`` moves relatively by at most the gradient's relative change, plus as much again through
the clipping coefficient and sqrt(v): so each shard's parameter update (final minus initial
parameters) may differ by at most ``TOL = 2 (L + 2) 2^-7`` in relative L2 (0.094 at depth 4;
the trajectories' coupling through changed weights is second order over 3 small steps), and
the squared gradient norms of step 0 (same weights everywhere) by 2 (L + 2) 2^-7 as well. A
stream race (weights read mid-copy, a buffer overwritten by the next prefetch) gives
differences of order 1. The run-to-run noise measured by ``on again`` must stay under the same
bound (a check of the derivation); the report gives it and each variant's margin. The step-0
loss comes from a forward without atomics and is reported exactly.

``--smoke`` runs every part on the CPU at tiny sizes through the same code (the CUDA calls
aside: no streams, events or registration; a stand-in registration runs the piece logic), the
Triton kernels under ``TRITON_INTERPRET=1`` (set before triton is imported), and writes the
same JSON; ``tests/test_gpu_check.py`` runs it with ray, decord, av and diffusers unimportable.

Writes ``DIR/gpu_check.json`` (every number) and ``DIR/gpu_check.md`` (the summary).
Exit status: 0 every part ran and every check passed; 1 a check failed, a part raised or was
skipped for time; 2 no CUDA device and no ``--smoke``, or something the check needs is missing
(``requirements``: torch >= 2.6, Triton >= 3.2, numpy, safetensors, and for a GPU run a C
compiler; all named in one message): nothing is run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .requirements import exit_if_missing

if __name__ == "__main__":  # before torch, triton or the parts are imported: name what is missing
    exit_if_missing(sys.argv[1:])

import torch  # noqa: E402

from . import compile as compile_aot  # noqa: E402
from . import cost
from .attention import part_attention
from .common import PARTS, SMOKE, Sizes
from .correctness import part_correctness
from .model import part_model, part_speedup
from .pinning import part_pinning
from .run import Run, environment
from .streaming import part_streaming

PRESET_HEADS = {64: 8, 128: 12}
"""Heads per layer for the cost model's per-layer times: head dim 128 -> 12 (Wan2.1 1.3B; the paper's
presets have 44-96, Wan 14B 40: time scales with heads), head dim 64 -> 8 (a videodit width of 512)."""


def compile_only(args) -> int:
    """Compile every kernel config for the targets, print the table and the cost model's predictions."""
    archs = args.arch or ["sm_90"]
    shapes = compile_aot.preset_shapes(full=args.full)[:args.limit_shapes]
    t0 = time.monotonic()
    print("\n".join(compile_aot.table([])), flush=True)
    records = compile_aot.run(archs, shapes, timeout_s=args.timeout_s)
    ok, bad = compile_aot.verdict(records)
    wall = time.monotonic() - t0
    preds = cost.predictions(shapes, PRESET_HEADS)
    print("\nCost model (a prediction; benchmarks/gpu_check/cost.py):\n" + "\n".join(cost.table(preds)))
    print(f"\ncompile-only: {len(records)} compiles for {', '.join(archs)} in {wall:.0f} s: "
          + ("every config the product may pick launches, without spills" if ok else f"{len(bad)} FAILED:\n  "
             + "\n  ".join(bad)), flush=True)
    print(compile_aot.picked_cores(records), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ok": ok, "wall_s": round(wall, 1), "archs": archs,
                                         "records": compile_aot.as_json(records), "predictions": preds}, indent=1))
    return 0 if ok else 1


def part_compile(ctx: Run) -> dict:
    """The compile-only table and the cost model, beside the measured parts: a child process (it
    needs uninterpreted Triton, and --smoke interprets it in this one), at the presets' shapes (the
    smoke run: the first shape only)."""
    path = ctx.out / "compile_only.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--compile-only", "--json", str(path)]
    if ctx.sizes.compile_shapes is not None:
        cmd += ["--limit-shapes", str(ctx.sizes.compile_shapes)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                          timeout=min(1500.0, max(60.0, ctx.deadline - time.monotonic())))  # 1500: a hang guard
    if not path.is_file():
        return {"ok": False, "error": (proc.stdout[-2000:] + proc.stderr[-2000:])}
    report = json.loads(path.read_text())
    return {"ok": report["ok"] and proc.returncode == 0, "wall_s": report["wall_s"], "archs": report["archs"],
            "records": report["records"], "predictions": report["predictions"]}


PART_FUNCS = {"correctness": part_correctness, "pinning": part_pinning, "streaming": part_streaming,
              "attention": part_attention, "model": part_model, "speedup": part_speedup, "compile": part_compile}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", type=Path, help="folder for gpu_check.json / .md (required unless --compile-only)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall-time budget; parts and rows past their share are skipped (default 330 on a GPU; "
                        "none with --smoke, whose job is to run every part however slow the CPU)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--smoke", action="store_true",
                   help="every part on the CPU at tiny sizes (Triton under TRITON_INTERPRET=1)")
    p.add_argument("--compile-only", action="store_true",
                   help="compile every Triton kernel config for --arch (no GPU needed), print the table and the "
                        "cost model; exit 1 if a config the product may pick cannot launch or spills")
    p.add_argument("--arch", action="append", choices=sorted(compile_aot.ARCHS),
                   help="--compile-only target, repeatable (default sm_90)")
    p.add_argument("--full", action="store_true",
                   help="--compile-only: also fp32, zero offsets and the other Wan grids (documented sweep)")
    p.add_argument("--json", type=Path, help="--compile-only: write one record per kernel and config here")
    p.add_argument("--limit-shapes", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout-s", type=float, default=compile_aot.COMPILE_TIMEOUT_S,
                   help="--compile-only: seconds one compile may take (default %(default)s)")
    args = p.parse_args(argv)
    exit_if_missing(sys.argv[1:] if argv is None else list(argv))
    if args.compile_only:
        return compile_only(args)
    if args.out is None:
        p.error("--out is required (or --compile-only)")

    if args.smoke:  # before anything imports triton: its kernels are then interpreted on the CPU
        if "triton" in sys.modules:
            print("gpu_check --smoke: triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
            return 1
        os.environ["TRITON_INTERPRET"] = "1"


    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "run it on a GPU machine, or --smoke on the CPU. Nothing was run.", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else f"cuda:{torch.cuda.current_device()}"
    parts = tuple(x for x in PARTS if x in args.parts)
    budget_s = args.budget_s if args.budget_s is not None else (math.inf if args.smoke else 330.0)
    run = Run(out=args.out, sizes=SMOKE if args.smoke else Sizes(), device=device, budget_s=budget_s,
              parts=parts)
    run.report = {"environment": environment(device), "smoke": args.smoke, "parts": {},
                  "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(run.report["environment"]), flush=True)
    for name in parts:
        run.run_part(name, PART_FUNCS[name])
    ok = all(info.get("ok") for info in run.report["parts"].values())
    run.report["ok"] = ok
    run.write()
    print(f"gpu_check: {'all ok' if ok else 'FAILURES'}; wrote {args.out / 'gpu_check.md'} "
          f"in {time.monotonic() - run.start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
