"""One prepared GPU check: the Triton DSA kernels' correctness on CUDA, the CUDA weight
streaming, then the attention benchmark rows on the GPU, in well under 5 minutes.

    python -m benchmarks.gpu_check --out DIR [--budget-s 240] [--max-tokens 262144]

Parts (each guarded: a failure is recorded and the next part still runs; the results
are rewritten after every part, so a run killed by a time limit still leaves what it
finished):

1. ``correctness``: ``dsa_triton`` forward and the gradients of q, k, v and offsets
   against ``dsa_reference`` on CUDA, per case and dtype. fp32: against the fp64
   reference, ``|tri - ref| <= 2e-5 + 1e-4 |ref|`` (the interpreter tests' tolerance).
   bf16: the flash-attention rule of kernels/checks.py (``flash_rule_errors``, as
   ``test_triton_compiled_on_cuda``). Cases: odd sizes, head dims that are not powers
   of two, several query block sizes, offsets that clamp far outside the volume and
   positions exactly on integers and on clamp bounds; plus both identities of
   docs/architecture.md ("3D-DSA: the operator"; zero offsets: neighborhood attention; zero
   offsets and window == grid: dense).
2. ``streaming``: the compute actor on CUDA with the parameter store in this process
   (width 512, depth 8, bf16 weights): weights copied from the store's shared memory,
   registered as pinned, on the H2D stream; gradients back on the D2H stream. Overlap on
   and off, and on with ``runtime.offload_activations``, must give identical parameters;
   reports H2D GB/s, step time on/off, device memory peak and how much memory was pinned.
3. ``benchmark``: ``benchmarks.attention.measure`` in this process (CUDA peak memory is
   reset per measurement, so no fresh process is needed) for ``dense`` (SDPA restricted
   to the flash backend), ``swin``, ``neighborhood`` and ``dsa`` (Triton), bf16, B=1,
   nh=2, d=32, from 1,024 to 262,144 tokens: time, TFLOP/s, peak memory, the growth
   ratios per 4x tokens and the dsa/dense crossover.
4. ``speedup``: Triton ``dsa`` against the pure-PyTorch reference on the GPU at 65,536
   tokens (16x64x64), forward + backward (goal: at least 3x).

Writes ``DIR/gpu_check.json`` (every number) and ``DIR/gpu_check.md`` (the summary).
Exit status: 0 every part ran and every check passed; 1 a check failed or a part raised;
2 no CUDA device (nothing is run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.attention import (
    GRIDS,
    HEAD_DIM,
    HEADS,
    Row,
    make_row,
    measure,
    summary,
)

REPO = Path(__file__).resolve().parents[1]
BENCH_GRIDS = [g for g in GRIDS if math.prod(g) >= 1024] + [(64, 64, 64)]  # 1k .. 262k
BENCH_KINDS = ("dense", "swin", "neighborhood", "dsa")
SPEEDUP_GRID = (16, 64, 64)  # 65,536 tokens
SPEEDUP_GOAL = 3.0
FP32_RTOL, FP32_ATOL = 1e-4, 2e-5
BF16_REL_ATOL = 1e-4


@dataclass(frozen=True)
class Case:
    """One correctness case: q/k/v ``(B, T, H, W, nh, d)``, a window and an offset kind."""

    name: str
    shape: tuple[int, int, int, int, int, int]
    window: tuple[int, int, int]
    offsets: str  # "wild" (moves, whole tokens, far clamps), "edge" (kinks), "uniform"
    block_m: int | None = None  # None: the launcher's default


CASES = (
    Case("odd sizes, d=64, wild offsets", (2, 5, 9, 11, 3, 64), (3, 5, 5), "wild"),
    Case("d=40, 7x13 planes, block 16", (1, 3, 7, 13, 2, 40), (3, 3, 5), "wild", 16),
    Case("integer / zero / clamp-bound positions", (2, 4, 6, 5, 2, 8), (3, 3, 3), "edge", 32),
    Case("window spans T, d=6, block 64", (2, 5, 3, 7, 2, 6), (5, 1, 3), "wild", 64),
    Case("benchmark shape, uniform [-1.5, 1.5]", (1, 8, 32, 32, 2, 32), (3, 3, 3), "uniform"),
)


# -----------------------------------------------------------------------------
# Part 1: correctness


def _case_offsets(t, case: Case, seed: int):
    import torch

    if case.offsets == "wild":
        return t.wild_offsets(case.shape, case.window, dtype=torch.float32, seed=seed)
    if case.offsets == "edge":
        return t.edge_offsets(case.shape, case.window, dtype=torch.float32, seed=seed)
    if case.offsets == "uniform":
        K = math.prod(case.window)
        g = torch.Generator().manual_seed(seed)
        return (2 * torch.rand((*case.shape[:5], K, 3), generator=g) - 1) * 1.5
    raise ValueError(f"unknown offsets kind {case.offsets!r}")


def check_case(t, case: Case, dtype, device: str) -> dict:
    """Triton vs reference for one case in one dtype: max errors and the verdict."""
    import torch

    from kernels import dsa_reference
    from kernels.dsa_triton import dsa_triton

    q, k, v = (x.to(device) for x in t.make_qkv(case.shape, seed=40))
    offsets = _case_offsets(t, case, seed=41).to(device)
    dout = torch.randn(case.shape, generator=torch.Generator().manual_seed(42)).to(device)
    inputs = [x.to(dtype) for x in (q, k, v, offsets)]

    def tri(*a):
        return dsa_triton(*a, case.window, block_m=case.block_m)

    def ref(*a, **kw):
        return dsa_reference(*a, case.window, **kw)

    got = t.grads(tri, inputs, dout)
    result = {"case": case.name, "shape": case.shape, "window": case.window,
              "dtype": str(dtype).replace("torch.", ""), "block_m": case.block_m}
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


def check_identities(t, device: str) -> list[dict]:
    """The identities of docs/architecture.md ("3D-DSA: the operator") through the public API
    with ``backend="triton"`` (fp32)."""
    import torch

    from kernels import deformable_slide_attention

    def on_device(q, k, v, offsets, window, scale=None):
        args = (x.to(device) for x in (q, k, v, offsets))
        out = deformable_slide_attention(*args, window, scale=scale, backend="triton")
        return out.cpu()

    results = []
    # offsets == 0 and window == grid: dense attention (forward and dq, dk, dv)
    for grid in ((3, 1, 5), (5, 7, 9)):
        name = f"dense identity, grid {grid}"
        try:
            t.assert_dense_identity(on_device, grid, torch.float32, 2e-5, seed=43)
            results.append({"case": name, "dtype": "float32", "ok": True, "errors": []})
        except AssertionError as e:
            results.append({"case": name, "dtype": "float32", "ok": False, "errors": [str(e)[:500]]})
    # offsets == 0: neighborhood attention (window shifted inward at borders)
    shape, window = (2, 4, 7, 6, 2, 16), (3, 5, 3)
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


def part_correctness(device: str = "cuda", cases=CASES) -> dict:
    import torch

    from kernels import checks as t  # inputs, identities, the bf16 rule (shared with the tests)
    results = []
    for case in cases:
        for dtype in (torch.float32, torch.bfloat16):
            try:
                results.append(check_case(t, case, dtype, device))
            except Exception as e:  # one broken case must not hide the others
                results.append({"case": case.name, "dtype": str(dtype).replace("torch.", ""),
                                "ok": False, "errors": [f"raised {type(e).__name__}: {e}"[:500]],
                                "traceback": traceback.format_exc()[-3000:]})
    results += check_identities(t, device)
    return {"ok": all(r["ok"] for r in results), "results": results}


# -----------------------------------------------------------------------------
# Part 2: benchmark rows


@contextlib.contextmanager
def _flash_only():
    """Restrict SDPA to the FlashAttention backend (an error if it cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def part_benchmark(grids, deadline: float, reps: int, slow_s: float) -> list[Row]:
    import torch

    rows = []
    slow_kinds: set[str] = set()
    for grid in grids:
        for kind in BENCH_KINDS:
            if time.monotonic() > deadline:
                res = {"status": "skipped: time budget (--budget-s)"}
            elif kind in slow_kinds:
                res = {"status": f"skipped: a smaller grid took over {slow_s} s"}
            else:
                try:
                    with _flash_only() if kind == "dense" else contextlib.nullcontext():
                        res = {"status": "ok", **measure(kind, grid, "cuda", reps, slow_s, 0)}
                    if kind == "dense":
                        res["backend"] = "sdpa-flash"
                    if res["seconds"] > slow_s:
                        slow_kinds.add(kind)
                except Exception as e:
                    res = {"status": f"error: {type(e).__name__}: {e}"[:200]}
                    torch.cuda.empty_cache()
            row = make_row(kind, grid, "cuda", res)
            rows.append(row)
            print(_row_line(row), flush=True)
    return rows


def _row_line(r: Row) -> str:
    t = f"{r.seconds * 1e3:.3f}" if r.seconds is not None else "-"
    tf = f"{r.gflops_per_s / 1e3:.2f}" if r.gflops_per_s is not None else "-"
    m = f"{r.peak_bytes / 2**20:.1f}" if r.peak_bytes is not None else "-"
    grid = "x".join(map(str, r.grid))
    return f"| {r.kind} | {r.backend} | {grid} | {r.tokens} | {t} | {tf} | {m} | {r.status} |"


# -----------------------------------------------------------------------------
# Part 3: Triton vs the reference on the GPU


def part_speedup(rows: list[Row], reps: int, slow_s: float) -> dict:
    tri = next((r for r in rows if r.kind == "dsa" and r.grid == SPEEDUP_GRID and r.seconds), None)
    if tri is None:  # the benchmark part did not get there: measure it here
        tri = make_row("dsa", SPEEDUP_GRID, "cuda",
                       {"status": "ok", **measure("dsa", SPEEDUP_GRID, "cuda", reps, slow_s, 0)})
    ref = make_row("dsa_ref", SPEEDUP_GRID, "cuda",
                   {"status": "ok", **measure("dsa_ref", SPEEDUP_GRID, "cuda", reps, slow_s, 0)})
    speedup = ref.seconds / tri.seconds
    return {"grid": SPEEDUP_GRID, "tokens": math.prod(SPEEDUP_GRID), "triton": asdict(tri),
            "reference": asdict(ref), "speedup": speedup, "goal": SPEEDUP_GOAL,
            "ok": speedup >= SPEEDUP_GOAL}


# -----------------------------------------------------------------------------
# Report


def environment() -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:
        env["triton"] = f"import failed: {e}"
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def write_report(out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text("\n".join(markdown(report)) + "\n")


def markdown(report: dict) -> list[str]:
    env = report.get("environment", {})
    lines = ["# 3D-DSA GPU check (`python -m benchmarks.gpu_check`)", "",
             "- " + ", ".join(f"{k}: {v}" for k, v in env.items()),
             f"- wall time: {report.get('wall_s', 0):.0f} s", ""]
    for part, info in report.get("parts", {}).items():
        status = "ok" if info.get("ok") else "FAILED"
        lines.append(f"## {part}: {status}")
        lines.append("")
        if "error" in info:
            lines += ["```", info["error"], "```", ""]
        if part == "correctness" and "results" in info:
            lines += ["| case | dtype | ok | max abs err (out dq dk dv doffsets) | problems |",
                      "|---|---|---|---|---|"]
            for r in info["results"]:
                errs = " ".join(f"{v:.2g}" for v in r.get("max_err", {}).values())
                lines.append(f"| {r['case']} | {r['dtype']} | {'yes' if r['ok'] else 'NO'} | "
                             f"{errs} | {'; '.join(r.get('errors', []))} |")
            lines.append("")
        if part == "benchmark" and "rows" in info:
            lines += [f"bf16, B=1, nh={HEADS}, d={HEAD_DIM}, dsa window (3, 3, 3); fwd+bwd.", "",
                      "| kind | backend | grid | tokens | time [ms] | TFLOP/s | peak [MiB] | status |",
                      "|---|---|---|---|---|---|---|---|"]
            lines += [_row_line(Row(**{**r, "grid": tuple(r["grid"])})) for r in info["rows"]]
            lines += ["", *(f"- {s}" for s in info.get("summary", [])), ""]
        if part == "streaming" and "overlap_on" in info:
            for name in ("overlap_on", "overlap_off", "overlap_on_offload_activations"):
                r = info[name]
                lines.append(f"- {name}: {r['step_s']:.3f} s/step, H2D {r['h2d_gbps']:.1f} GB/s, device peak "
                             f"{r['device_peak_mib']:.0f} MiB, pinned {r['pinned_mib']:.0f} MiB")
            lines += [f"- on/off speedup x{info['speedup_on_vs_off']:.2f}; parameters equal on/off: "
                      f"{info['params_equal_on_off']}, with offloaded activations: {info['params_equal_offload']}", ""]
        if part == "speedup" and "speedup" in info:
            lines.append(f"Triton dsa {info['triton']['seconds'] * 1e3:.2f} ms vs reference "
                         f"{info['reference']['seconds'] * 1e3:.2f} ms at {info['tokens']} tokens: "
                         f"**x{info['speedup']:.1f}** (goal >= x{info['goal']:.0f}).")
            lines.append("")
    return lines


def part_streaming(steps: int = 4, width: int = 512, depth: int = 8) -> dict:
    """The compute actor on CUDA with the store in this process (no Ray): bf16 weights streamed
    from pinned shared memory on the H2D stream, gradients back on the D2H stream. Overlap on
    and off, and overlap on with the block inputs offloaded to pinned host memory, must give
    identical parameters; reports H2D GB/s, step time on/off, device memory with and without
    the offload."""
    import tempfile

    import torch

    from actors.compute import ComputeActor, LocalStoreClient
    from actors.decoder import VideoDecoder
    from actors.param_store import ParameterStore
    from megaslide_ray.config import build_config
    from megaslide_ray.trainer import resolve_data

    results = {}
    with tempfile.TemporaryDirectory(prefix="megaslide-gpu-stream-") as tmp:
        for variant, overlap, offload in (("on", True, False), ("off", False, False), ("on_offload", True, True)):
            cfg = build_config("tiny", None, {"model.hidden_size": width, "model.num_heads": 8, "model.depth": depth,
                                              "training.steps": steps, "runtime.overlap": overlap,
                                              "runtime.offload_activations": offload,
                                              "runtime.prefetch_depth": 2, "runtime.state_dir": tmp})
            resolve_data(cfg)
            with VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes) as decoder:
                batches = [decoder.next_batch() for _ in range(steps)]
            w_dtype = "bfloat16" if torch.cuda.is_available() else "float32"  # (CPU: a smoke test)
            store = ParameterStore(cfg, f"{tmp}/run-{variant}", w_dtype)
            compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            rows = []
            try:
                pinned = sum(n for _, n in compute.link.pinning.ranges)
                for k in range(steps):
                    t0 = time.perf_counter()
                    r = compute.train_step(batches[k], k)
                    store.wait_step(k)
                    rows.append((time.perf_counter() - t0, r))
                master = [seg["master"].clone() for seg in store.seg]
            finally:
                compute.close()
                store.close()
            timed = rows[1:]
            h2d_s = sum(r.h2d_seconds for _, r in timed)
            results[variant] = {
                "step_s": statistics.mean(t for t, _ in timed),
                "h2d_gbps": sum(r.h2d_bytes for _, r in timed) / h2d_s / 1e9 if h2d_s else 0.0,
                "losses": [r.loss for _, r in rows], "device_peak_mib": rows[-1][1].device_memory_peak_bytes / 2**20,
                "pinned_mib": pinned / 2**20, "master": master}
    on, off, offloaded = results["on"], results["off"], results["on_offload"]
    on_master = on.pop("master")
    equal = all(torch.equal(a, b) for a, b in zip(on_master, off.pop("master")))
    equal_offload = all(torch.equal(a, b) for a, b in zip(on_master, offloaded.pop("master")))
    finite = all(math.isfinite(x) for x in on["losses"] + off["losses"] + offloaded["losses"])
    return {"ok": equal and equal_offload and finite, "params_equal_on_off": equal,
            "params_equal_offload": equal_offload, "overlap_on": on, "overlap_off": off,
            "overlap_on_offload_activations": offloaded, "speedup_on_vs_off": off["step_s"] / on["step_s"]}


def run_part(report: dict, name: str, out: Path, fn):
    """Run one part; record its result or its traceback; rewrite the report either way."""
    start = time.monotonic()
    print(f"== {name}", flush=True)
    try:
        info = fn()
    except Exception:
        info = {"ok": False, "error": traceback.format_exc()[-4000:]}
        print(info["error"], file=sys.stderr, flush=True)
    info["seconds"] = round(time.monotonic() - start, 1)
    report["parts"][name] = info
    report["wall_s"] = time.monotonic() - report["_start"]
    write_report(out, {k: v for k, v in report.items() if not k.startswith("_")})
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / .md")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="wall-time budget; benchmark rows past it are skipped (default 240)")
    p.add_argument("--max-tokens", type=int, default=262144, help="largest benchmark grid")
    p.add_argument("--reps", type=int, default=5, help="timed reps per benchmark row")
    p.add_argument("--parts", nargs="+", default=["correctness", "streaming", "benchmark", "speedup"],
                   choices=["correctness", "streaming", "benchmark", "speedup"])
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "run it on a GPU machine. Nothing was run.", file=sys.stderr)
        return 2

    start = time.monotonic()
    report = {"_start": start, "environment": environment(), "parts": {},
              "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(report["environment"]), flush=True)
    slow_s = 5.0
    if "correctness" in args.parts:
        run_part(report, "correctness", args.out, part_correctness)
    if "streaming" in args.parts:
        run_part(report, "streaming", args.out, part_streaming)
    rows: list[Row] = []
    if "benchmark" in args.parts:
        grids = [g for g in BENCH_GRIDS if math.prod(g) <= args.max_tokens]
        deadline = start + args.budget_s - 60  # keep a minute for the speedup part

        def bench():
            rows.extend(part_benchmark(grids, deadline, args.reps, slow_s))
            lines = summary(rows)  # growth per 4x tokens, the dsa goal, the crossover
            return {"ok": all(r.status == "ok" for r in rows), "rows": [asdict(r) for r in rows],
                    "summary": lines}

        run_part(report, "benchmark", args.out, bench)
    if "speedup" in args.parts:
        run_part(report, "speedup", args.out, lambda: part_speedup(rows, 3, slow_s))
    ok = all(info.get("ok") for info in report["parts"].values())
    print(f"gpu_check: {'all ok' if ok else 'FAILURES'}; wrote {args.out / 'gpu_check.md'} "
          f"in {time.monotonic() - start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
