"""Attention kinds vs token count: time, peak memory and FLOPs of forward + backward.

    python -m benchmarks.attention [--json] [--plot PATH.png] [--min-tokens N] [--max-tokens N]
                                   [--rounds R] [--device cpu|cuda]

Kinds (the ``attention.kind`` choices of the model):

- ``dense``: ``F.scaled_dot_product_attention`` over all ``N = T*H*W`` tokens;
- ``swin``: ``kernels.swin.swin_attention_3d``, shifted windows (the odd blocks of a stack);
- ``neighborhood``: the 3D-DSA operator with offsets fixed at zero;
- ``dsa``: the 3D-DSA operator with random offsets in [-1.5, 1.5] that require grad;
- ``dsa_ref`` (CPU only, small grids): ``dsa`` through the ``reference`` backend;
- ``dsa_matrix`` (CPU only, small grids): ``dsa`` through the ``matrix`` backend (two dense
  products through an N x N interpolation matrix, ``kernels/dsa_matrix.py``), which ``auto``
  picks on CPU up to ``kernels.MATRIX_MAX_TOKENS`` tokens: the summary says where it stops
  being faster than the linear ``cpu`` path.

On CPU the other DSA kinds use the ``cpu`` backend (the model's CPU path: chunked, hand-written
backward, bounded memory); on CUDA ``triton``.
Shapes: B=1, nh=2, d=32; DSA window (3, 3, 3) (K=27), swin window (2, 4, 4) (V=32).
fp32 on CPU, bf16 on CUDA.

Clock: ``--clock wall`` (default) times each rep with ``time.perf_counter``; ``--clock
cpu`` (CPU only) with ``time.process_time``, the CPU time of the measuring process: with
one thread that is the work itself, and unlike wall time it does not count the time the
process waits for a core that other processes hold (on the shared 2-core CI box wall time
at load 7 was 3-5x the CPU time and its growth ratios were meaningless).

CPU threads: ``--threads`` (default 1) intra-op threads per measurement. On a small
shared box another process's threads make OpenMP oversubscribe: every parallel region
then waits for a descheduled thread, and small ops slow down ~40x (seen on the 2-core
CI machine: DSA fwd+bwd at 256 tokens 1.4 s with 2 threads, 0.03 s with 1). One thread
measures the work, not the parallel scaling; pass ``--threads 2`` on an idle machine.

Each (kind, grid) is measured in a fresh subprocess: one warm-up forward+backward, then
the median of a few reps. Peak memory is what the forward+backward adds on top of the
inputs: on CPU ``ru_maxrss`` (the process's peak resident set) after the reps minus
``ru_maxrss`` after imports and input creation (torch's CPU allocator is not tracked, a
fresh process makes the high-water mark belong to this one measurement); on CUDA
``torch.cuda.max_memory_allocated()`` minus the bytes allocated before.

FLOP accounting (analytic, forward; ``fwd+bwd = 3.5 x forward``, FlashAttention's
convention: 2 matmuls forward, 5 in a recomputing backward):

- dense:               ``4 * N^2 * d * nh * B``                (QK^T and PV)
- swin:                ``4 * Np * V * d * nh * B``             (Np: tokens after padding)
- dsa, neighborhood:   ``(4 + 32) * N * K * d * nh * B``       (attention over K samples,
  plus trilinear interpolation of k and v: 8 corners x (mul + add) x 2 tensors = 32 per
  sample and channel; the operator interpolates even when the offsets are zero).

Growth: for every kind, time(4N)/time(N) and memory(4N)/memory(N) for every measured 4x
pair with N >= ``--growth-from`` (default 4096: 4096 -> 16384 and 8192 -> 32768), and
whether ``dsa`` meets the linear-growth goal (at most x4.6 in time and memory per 4x).

Machines are noisy; read ratios within one run (docs/architecture.md, "Measuring").
``--rounds R`` repeats every measurement in R fresh processes and keeps the median time and
memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# Grids (T, H, W) in increasing token count; every grid is 4x the tokens of the one two
# places earlier, so growth ratios time(4N)/time(N) can be read at several sizes.
GRIDS = [
    (4, 8, 8),      # 256
    (8, 8, 8),      # 512
    (4, 16, 16),    # 1024
    (8, 16, 16),    # 2048
    (4, 32, 32),    # 4096
    (8, 32, 32),    # 8192
    (16, 32, 32),   # 16384
    (8, 64, 64),    # 32768
    (16, 64, 64),   # 65536
    (32, 64, 64),   # 131072
]
KINDS = ("dense", "swin", "neighborhood", "dsa", "dsa_ref", "dsa_matrix")
CPU_ONLY = ("dsa_ref", "dsa_matrix")
BATCH, HEADS, HEAD_DIM = 1, 2, 32
DSA_WINDOW = (3, 3, 3)
SWIN_WINDOW = (2, 4, 4)
OFFSET_MAGNITUDE = 1.5
FWD_BWD_FACTOR = 3.5
GROWTH_GOAL = 4.6  # dsa: 4x tokens -> at most this factor in time and in peak memory


@dataclass(frozen=True)
class Row:
    kind: str
    backend: str
    grid: tuple[int, int, int]
    tokens: int
    seconds: float | None  # median fwd+bwd wall time; None when not measured
    peak_bytes: int | None  # extra peak memory of fwd+bwd over the inputs
    flops: float  # analytic fwd+bwd FLOPs
    gflops_per_s: float | None
    reps: int
    status: str  # "ok", "skipped: ...", "timeout ...", "error: ..."
    rounds: int = 1  # fresh-process measurements behind the medians
    clock: str = "wall"  # "wall" or "cpu" (process CPU time): what ``seconds`` measures


# -----------------------------------------------------------------------------
# FLOPs


def attention_flops(kind: str, grid: tuple[int, int, int]) -> float:
    """Analytic forward+backward FLOPs (see the module docstring)."""
    N = math.prod(grid)
    per_token_head = BATCH * HEADS * HEAD_DIM
    if kind == "dense":
        fwd = 4 * N * N * per_token_head
    elif kind == "swin":
        padded = math.prod(-(-g // min(w, g)) * min(w, g) for g, w in zip(grid, SWIN_WINDOW))
        V = math.prod(min(w, g) for g, w in zip(grid, SWIN_WINDOW))
        fwd = 4 * padded * V * per_token_head
    else:  # dsa, dsa_ref, dsa_matrix, neighborhood
        K = math.prod(DSA_WINDOW)
        fwd = (4 + 32) * N * K * per_token_head
    return FWD_BWD_FACTOR * fwd


# -----------------------------------------------------------------------------
# One measurement (runs in its own process)


def _backend(kind: str, device: str) -> str:
    if kind == "dense":
        return "sdpa"
    if kind == "swin":
        return "sdpa-windows"
    if kind == "dsa_ref":
        return "reference"
    if kind == "dsa_matrix":
        return "matrix"
    return "triton" if device == "cuda" else "cpu"


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def measure(
    kind: str, grid: tuple[int, int, int], device: str, reps: int, slow_s: float, threads: int,
    clock: str = "wall",
) -> dict:
    """Median fwd+bwd seconds and extra peak bytes of one kind on one grid.

    ``clock``: "wall" (perf_counter) or "cpu" (process_time; CPU device only).
    """
    if clock not in ("wall", "cpu") or (clock == "cpu" and device != "cpu"):
        raise ValueError(f"clock must be 'wall', or 'cpu' on the cpu device; got {clock!r} on {device}")
    timer = time.process_time if clock == "cpu" else time.perf_counter
    import torch
    import torch.nn.functional as F

    if threads > 0:
        torch.set_num_threads(threads)

    from kernels import deformable_slide_attention
    from kernels.swin import swin_attention_3d

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(0)
    shape = (BATCH, *grid, HEADS, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(shape, generator=gen).to(device, dtype)
    K = math.prod(DSA_WINDOW)
    offsets = None
    if kind in ("dsa", "dsa_ref", "dsa_matrix"):
        u = torch.rand((*shape[:5], K, 3), generator=gen)
        offsets = ((2 * u - 1) * OFFSET_MAGNITUDE).to(device, dtype).requires_grad_()
    elif kind == "neighborhood":
        offsets = torch.zeros((*shape[:5], K, 3), device=device, dtype=dtype)
    backend = _backend(kind, device)
    leaves = [t for t in (q, k, v, offsets) if t is not None and t.requires_grad]

    def step() -> None:
        for t in leaves:
            t.grad = None
        if kind == "dense":
            N = math.prod(grid)
            flat = [x.reshape(BATCH, N, HEADS, HEAD_DIM).transpose(1, 2) for x in (q, k, v)]
            out = F.scaled_dot_product_attention(*flat).transpose(1, 2).reshape(shape)
        elif kind == "swin":
            out = swin_attention_3d(q, k, v, SWIN_WINDOW, shift=True)
        else:
            out = deformable_slide_attention(q, k, v, offsets, DSA_WINDOW, backend=backend)
        out.backward(grad_out)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()  # wall time must include the queued kernels

    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _peak_rss_bytes()  # after imports and inputs: the baseline high-water mark

    t0 = timer()
    step()
    sync()
    warm = timer() - t0
    # slow cases: one timed rep after the warm-up keeps the sweep inside its budget
    n = reps if warm < slow_s else 1
    times = []
    for _ in range(n):
        t0 = timer()
        step()
        sync()
        times.append(timer() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _peak_rss_bytes() - base
    return {"seconds": statistics.median(times), "peak_bytes": int(peak), "reps": n,
            "backend": backend, "clock": clock}


# -----------------------------------------------------------------------------
# The sweep (driver process)


def _run_isolated(kind, grid, device, reps, slow_s, threads, timeout_s, clock="wall") -> dict:
    cmd = [
        sys.executable, "-m", "benchmarks.attention", "--worker", kind, *map(str, grid),
        "--device", device, "--reps", str(reps), "--slow-seconds", str(slow_s),
        "--threads", str(threads), "--clock", clock,
    ]
    env = os.environ.copy()
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)  # also caps the OpenMP pool before torch starts
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"status": f"error: {last[:120]}"}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


def make_row(kind: str, grid: tuple[int, int, int], device: str, res: dict) -> Row:
    """A result row from one measurement's dict (``measure`` output plus ``status``)."""
    sec = res.get("seconds")
    flops = attention_flops(kind, grid)
    return Row(
        kind=kind, backend=res.get("backend", _backend(kind, device)), grid=grid,
        tokens=math.prod(grid), seconds=sec, peak_bytes=res.get("peak_bytes"), flops=flops,
        gflops_per_s=(flops / sec / 1e9) if sec else None, reps=res.get("reps", 0),
        status=res["status"], rounds=res.get("rounds", 1 if sec is not None else 0),
        clock=res.get("clock", "wall"),
    )


def _median_of_rounds(results: list[dict]) -> dict:
    """Median time and peak memory over fresh-process rounds; the first failure if none ran."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return results[0]
    return {
        **ok[0],
        "seconds": statistics.median(r["seconds"] for r in ok),
        "peak_bytes": int(statistics.median(r["peak_bytes"] for r in ok)),
        "rounds": len(ok),
    }


def sweep(args) -> list[Row]:
    rows = []
    grids = [g for g in GRIDS if args.min_tokens <= math.prod(g) <= args.max_tokens]
    kinds = [k for k in args.kinds if not (k in CPU_ONLY and args.device == "cuda")]
    for grid in grids:
        N = math.prod(grid)
        for kind in kinds:
            option, cap = {
                "dense": ("--dense-max-tokens", args.dense_max_tokens),
                "dsa_ref": ("--reference-max-tokens", args.reference_max_tokens),
                "dsa_matrix": ("--matrix-max-tokens", args.matrix_max_tokens),
            }.get(kind, (None, None))
            if cap is not None and N > cap:
                res = {"status": f"skipped: N > {cap} ({option})"}
            else:
                res = _median_of_rounds([
                    _run_isolated(kind, grid, args.device, args.reps, args.slow_seconds,
                                  args.threads, args.timeout, args.clock)
                    for _ in range(args.rounds)
                ])
            row = make_row(kind, grid, args.device, res)
            rows.append(row)
            if args.json:
                print(json.dumps(asdict(row)), flush=True)
            else:
                print(_format_row(row), flush=True)
    return rows


# -----------------------------------------------------------------------------
# Reading the results


def _format_header() -> str:
    return (f"{'kind':<13}{'backend':<13}{'grid':<14}{'tokens':>8}{'time [s]':>11}"
            f"{'peak [MiB]':>12}{'GFLOP':>10}{'GFLOP/s':>9}  status")


def _format_row(r: Row) -> str:
    t = f"{r.seconds:.4f}" if r.seconds is not None else "-"
    m = f"{r.peak_bytes / 2**20:.1f}" if r.peak_bytes is not None else "-"
    gf = f"{r.gflops_per_s:.2f}" if r.gflops_per_s is not None else "-"
    grid = "x".join(map(str, r.grid))
    return (f"{r.kind:<13}{r.backend:<13}{grid:<14}{r.tokens:>8}{t:>11}{m:>12}"
            f"{r.flops / 1e9:>10.2f}{gf:>9}  {r.status}")


def _measured(rows: list[Row], kind: str) -> dict[int, Row]:
    return {r.tokens: r for r in rows if r.kind == kind and r.seconds is not None}


def growth(rows: list[Row], kind: str, min_tokens: int = 0) -> list[tuple[int, float, float | None]]:
    """``(N, time(4N)/time(N), mem(4N)/mem(N))`` for every measured 4x pair of ``kind``.

    Pairs with ``N >= min_tokens``; if there are none, the largest pair (small sweeps).
    """
    m = _measured(rows, kind)
    pairs = sorted(n for n in m if 4 * n in m)
    if not pairs:
        return []
    pairs = [n for n in pairs if n >= min_tokens] or pairs[-1:]
    out = []
    for n in pairs:
        a, b = m[n], m[4 * n]
        mem = (b.peak_bytes / a.peak_bytes) if (a.peak_bytes and b.peak_bytes and a.peak_bytes > 0) else None
        out.append((n, b.seconds / a.seconds, mem))
    return out


def growth_goal(rows: list[Row], min_tokens: int, kind: str = "dsa") -> str:
    """Whether ``kind`` grows linearly: every 4x pair at most GROWTH_GOAL in time and memory."""
    g = growth(rows, kind, min_tokens)
    if not g:
        return f"{kind} growth goal: no measured 4x pair"
    bad = [f"{n}->{4 * n} time x{tr:.2f}" for n, tr, _ in g if tr > GROWTH_GOAL]
    bad += [f"{n}->{4 * n} memory x{mr:.2f}" for n, _, mr in g if mr is not None and mr > GROWTH_GOAL]
    pairs = ", ".join(f"{n}->{4 * n}" for n, _, _ in g)
    if bad:
        return f"{kind} growth goal (<= x{GROWTH_GOAL} per 4x tokens): NOT met ({'; '.join(bad)})"
    return f"{kind} growth goal (<= x{GROWTH_GOAL} per 4x tokens, time and memory): met for {pairs}"


def crossover(rows: list[Row], fast: str = "dsa", slow: str = "dense") -> str:
    """Token count where ``fast`` becomes faster than ``slow`` (log-log interpolation)."""
    a, b = _measured(rows, fast), _measured(rows, slow)
    common = sorted(set(a) & set(b))
    if not common:
        return f"no grid where both {fast} and {slow} were measured"
    ratio = [(n, a[n].seconds / b[n].seconds) for n in common]  # < 1: fast wins
    if ratio[0][1] <= 1:
        return f"{fast} already faster at the smallest grid (N={ratio[0][0]})"
    for (n0, r0), (n1, r1) in zip(ratio, ratio[1:]):
        if r0 > 1 >= r1:
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            n = math.exp(math.log(n0) + f * (math.log(n1) - math.log(n0)))
            return f"~{n:,.0f} tokens ({fast}/{slow} time {r0:.2f} at N={n0}, {r1:.2f} at N={n1})"
    msg = f"not reached up to N={common[-1]} ({fast}/{slow} time {ratio[-1][1]:.2f} there)"
    # extrapolate with the last two points of each (power laws), clearly marked
    if len(common) >= 2:
        n0, n1 = common[-2], common[-1]
        ea = math.log(a[n1].seconds / a[n0].seconds) / math.log(n1 / n0)
        eb = math.log(b[n1].seconds / b[n0].seconds) / math.log(n1 / n0)
        if eb > ea:
            n = n1 * ratio[-1][1] ** (1 / (eb - ea))
            msg += f"; power-law extrapolation: ~{n:,.0f} tokens"
    return msg


def _matrix_max_tokens() -> int:
    from kernels.dsa_matrix import MATRIX_MAX_TOKENS

    return MATRIX_MAX_TOKENS


def summary(rows: list[Row], growth_from: int = 4096) -> list[str]:
    lines = []
    for kind in ("dsa", "neighborhood", "swin", "dense", "dsa_ref", "dsa_matrix"):
        if not any(r.kind == kind for r in rows):
            continue
        g = growth(rows, kind, growth_from)
        if not g:
            lines.append(f"{kind}: no measured 4x pair")
            continue
        parts = []
        for n, tr, mr in g:
            mem = f"x{mr:.2f}" if mr is not None else "n/a"
            parts.append(f"N={n} -> {4 * n}: time x{tr:.2f}, memory {mem}")
        lines.append(f"{kind}: " + "; ".join(parts))
    if any(r.kind == "dsa" for r in rows):
        lines.append(growth_goal(rows, growth_from))
    lines.append(f"crossover (dsa faster than dense): {crossover(rows)}")
    if any(r.kind == "dsa_matrix" for r in rows):
        lines.append(f"crossover (the linear cpu path faster than the matrix path): "
                     f"{crossover(rows, 'dsa', 'dsa_matrix')} (kernels.MATRIX_MAX_TOKENS: {_matrix_max_tokens()})")
    return lines


def plot(rows: list[Row], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind in dict.fromkeys(r.kind for r in rows):
        m = sorted(_measured(rows, kind).values(), key=lambda r: r.tokens)
        if not m:
            continue
        label = f"{kind} ({m[0].backend})"
        ax_t.plot([r.tokens for r in m], [r.seconds for r in m], "o-", label=label)
        mem = [(r.tokens, r.peak_bytes / 2**20) for r in m if r.peak_bytes and r.peak_bytes > 0]
        if mem:
            ax_m.plot(*zip(*mem), "o-", label=label)
    # faint slope guides through the largest measured dsa / dense points: ~N and ~N^2
    for kind, power in (("dsa", 1), ("dense", 2)):
        m = sorted(_measured(rows, kind).values(), key=lambda r: r.tokens)
        if len(m) >= 2:
            n1, t1 = m[-1].tokens, m[-1].seconds
            xs = [m[0].tokens, n1]
            ax_t.plot(xs, [t1 * (x / n1) ** power for x in xs], ":", color="gray", lw=1)
            ax_t.annotate(f"~N^{power}", (xs[0], t1 * (xs[0] / n1) ** power), fontsize=7, color="gray")
    clock = rows[0].clock if rows else "wall"
    t_label = "forward+backward " + ("CPU time [s]" if clock == "cpu" else "time [s]")
    for ax, ylabel in ((ax_t, t_label), (ax_m, "extra peak memory [MiB]")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N = T*H*W")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_title("time (median)")
    ax_m.set_title("peak memory over inputs")
    ax_t.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -----------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per result row")
    p.add_argument("--plot", metavar="PATH.png", help="save time and memory vs tokens (log-log)")
    p.add_argument("--max-tokens", type=int, default=32768, help="largest grid to measure")
    p.add_argument("--min-tokens", type=int, default=0, help="smallest grid to measure")
    p.add_argument("--rounds", type=int, default=1,
                   help="fresh-process measurements per (kind, grid); reports their medians")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time reps by wall clock or by the process's CPU time (cpu device only)")
    p.add_argument("--growth-from", type=int, default=4096,
                   help="report growth ratios for every 4x pair from this many tokens up")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--dense-max-tokens", type=int, default=32768,
                   help="skip dense above this many tokens (quadratic time)")
    p.add_argument("--reference-max-tokens", type=int, default=8192,
                   help="skip dsa_ref above this many tokens (O(N*K*d) autograd graph)")
    p.add_argument("--matrix-max-tokens", type=int, default=4096,
                   help="skip dsa_matrix above this many tokens (O(N^2) memory)")
    p.add_argument("--reps", type=int, default=3, help="timed reps after one warm-up")
    p.add_argument("--slow-seconds", type=float, default=4.0,
                   help="a warm-up slower than this is followed by a single timed rep")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per measurement (default: 1 on CPU, "
                        "torch's default on CUDA; 0 = torch's default)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-measurement limit [s]")
    p.add_argument("--worker", nargs=4, metavar=("KIND", "T", "H", "W"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.threads is None:
        args.threads = 1 if args.device == "cpu" else 0
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.clock == "cpu" and args.device != "cpu":
        p.error("--clock cpu measures CPU time; on cuda use the default --clock wall")
    if args.worker:
        kind, *grid = args.worker
        res = measure(kind, tuple(int(g) for g in grid), args.device, args.reps,
                      args.slow_seconds, args.threads, args.clock)
        print(json.dumps(res))
        return

    start = time.perf_counter()
    if not args.json:
        print(f"B={BATCH} nh={HEADS} d={HEAD_DIM}; dsa window {DSA_WINDOW}, swin window "
              f"{SWIN_WINDOW} (shifted); {args.device}, "
              f"{'bf16' if args.device == 'cuda' else 'fp32'}; fwd+bwd FLOPs = "
              f"{FWD_BWD_FACTOR} x forward; threads={args.threads or 'default'}; "
              f"rounds={args.rounds}; clock={args.clock}")
        print(_format_header())
    rows = sweep(args)
    lines = summary(rows, args.growth_from)
    if args.json:  # stdout stays one JSON object per row; the reading goes to stderr
        print("\n".join(lines), file=sys.stderr)
    else:
        print()
        print("\n".join(lines))
        print(f"sweep wall time: {time.perf_counter() - start:.0f} s")
    if args.plot:
        plot(rows, args.plot, f"attention fwd+bwd, B={BATCH} nh={HEADS} d={HEAD_DIM}, {args.device}, "
                              f"threads={args.threads or 'default'}, clock={args.clock}, "
                              f"rounds={args.rounds}")


if __name__ == "__main__":
    main()
