"""CPU AdamW against this machine's memory bandwidth: which implementation should the store use?

    python -m benchmarks.adamw [--json] [--sizes 1e6,1e7,1e8] [--threads N]

AdamW on the host is memory-bound: a few FLOPs per parameter against 28-32 bytes moved. So
the figure of merit is the fraction of the machine's STREAM triad bandwidth an update reaches.

1. Triad ``a = b + s * c`` over three large fp32 arrays (``torch.add(b, c, alpha=s, out=a)``,
   one pass, every thread), best of several repetitions. Counted as STREAM counts it:
   3 arrays x 4 bytes per element (2 reads + 1 write; write-allocate traffic not counted).
   Beside it, in-place ``a += b`` counted the same way (12 B per element): the write lands
   on a line just read, as AdamW's writes of master, m and v do, so no write-allocate read
   is hidden in it. On this kind of machine it runs well above the triad, and so can AdamW.
2. One full AdamW update of a flat shard (``master``, ``m``, ``v`` fp32) from a gradient,
   then writing the compute copy ``w``, for each implementation:

   foreach     ``torch.optim.AdamW(foreach=True)`` + ``w.copy_(master)``   (the baseline)
   fused       ``torch.optim.AdamW(fused=True)`` + ``w.copy_(master)``
   store       the store's path: ``torch.optim.adamw.adamw(..., fused=True)`` on the flat
               buffer + ``w.copy_(master)``
   bf16-alloc  bf16 grad -> ``g.float()`` (a fresh allocation per shard) -> fused -> bf16 ``w``
   store-bf16  the store on CUDA runs: the same, upcasting into its preallocated fp32 buffer
   compiled    the store's ``compiled`` kernel (``optim.adamw compiled``): ``torch.compile``
               of ``actors.param_store.adamw_single_pass`` (fp32 w, holding the grad on entry)
   compiled-bf16  the same reading a bf16 grad and writing a bf16 w
   deepspeed   DeepSpeed's ``DeepSpeedCPUAdam`` + ``w.copy_(master)``, only if
               ``deepspeed`` imports (it is not a project dependency)

   Bytes counted per parameter are the useful ones of a single pass: read g, master, m, v and
   write master, m, v, w. fp32 g and w: 4 + 12 + 12 + 4 = 32 B; bf16 g and w: 2 + 12 + 12 + 2
   = 28 B. Implementations that make more passes move more bytes than they are credited.

Timing: every figure is the best of 3 rounds x several calls; within a round each variant in
turn gets an untimed warm-up call and then its timed calls, so a burst of load from another
process spoils one round, not a whole variant. The bandwidth references are measured at the
start and at the end (best of both). Absolute GB/s hold for this machine at this moment only;
compare the ratios.

Each variant's result (master, m, v after three steps, and w) is compared with
``torch.optim.AdamW(foreach=True)`` on 1e6 parameters: max |x - ref| / max |ref| over the
four tensors (bf16 variants against a reference fed the same bf16-rounded gradients; their
w is compared in bf16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Callable

import torch
from torch.optim.adamw import adamw as adamw_functional

from megaslide_ray.training.adamw import adamw_scalars, adamw_single_pass

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
TRIAD_NUMEL = 1 << 27          # 512 MiB per fp32 array: far beyond any cache
TRIAD_REPS = 4
ROUNDS = 3                     # every variant is timed in 3 separate rounds (min over all)
CHECK_STEPS = 3
CHECK_NUMEL = 10**6


@dataclass(frozen=True)
class Row:
    bench: str                 # "triad" or "adamw"
    variant: str
    numel: int
    bytes_per_param: int               # counted bytes per element (see module docstring)
    seconds: float | None = None       # best of reps; None when skipped
    gbps: float | None = None          # counted bytes / seconds / 1e9
    params_per_s: float | None = None
    frac_triad: float | None = None    # gbps / triad gbps
    speedup_vs_foreach: float | None = None
    max_rel_diff: float | None = None  # vs torch.optim.AdamW(foreach=True), CHECK_NUMEL, 3 steps
    skipped: str = ""                  # reason, when the variant did not run
    frac_rmw: float | None = None      # gbps / in-place a += b gbps


# ---------------------------------------------------------------------------------------------
# Buffers and the implementations
# ---------------------------------------------------------------------------------------------


@dataclass
class Shard:
    """One flat shard's state, as the store keeps it."""
    master: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    g32: torch.Tensor
    g16: torch.Tensor
    w32: torch.Tensor
    w16: torch.Tensor

    @classmethod
    def random(cls, numel: int, seed: int = 0) -> "Shard":
        gen = torch.Generator().manual_seed(seed)
        master = torch.randn(numel, generator=gen)
        g32 = torch.randn(numel, generator=gen)
        return cls(master=master, m=0.01 * torch.randn(numel, generator=gen),
                   v=1e-4 * torch.rand(numel, generator=gen), g32=g32, g16=g32.bfloat16(),
                   w32=master.clone(), w16=master.bfloat16())

    def clone(self) -> "Shard":
        return Shard(**{k: t.clone() for k, t in vars(self).items()})


def _hyper() -> dict:
    return dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def make_torch_optim(s: Shard, flavour: str) -> Callable[[], None]:
    """torch.optim.AdamW over ``s.master`` (a Parameter sharing its storage), its state
    pointed at ``s.m`` / ``s.v`` so every variant works on the same buffers."""
    p = torch.nn.Parameter(s.master)
    p.grad = s.g32
    opt = torch.optim.AdamW([p], **_hyper(), **{flavour: True})
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": s.m, "exp_avg_sq": s.v}

    def step() -> None:
        opt.step()
        s.w32.copy_(s.master)
    return step


def make_store(s: Shard) -> Callable[[], None]:
    """Exactly what ``ParameterStore._apply_update`` does on a CPU (fp32 w) run."""
    st = torch.tensor(0.0)

    def step() -> None:
        adamw_functional([s.master], [s.g32], [s.m], [s.v], [], [st], fused=True, amsgrad=False,
                         beta1=BETAS[0], beta2=BETAS[1], lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                         maximize=False)
        s.w32.copy_(s.master)
    return step


def make_bf16_alloc(s: Shard) -> Callable[[], None]:
    """The ``bf16-alloc`` row (the store's path before it kept a scratch buffer): the bf16
    landing buffer is upcast into a fresh fp32 tensor (``g.float()``) every update, fused
    AdamW, then w = bf16(master)."""
    st = torch.tensor(0.0)

    def step() -> None:
        g = s.g16.float()
        adamw_functional([s.master], [g], [s.m], [s.v], [], [st], fused=True, amsgrad=False,
                         beta1=BETAS[0], beta2=BETAS[1], lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                         maximize=False)
        s.w16.copy_(s.master)
    return step


def make_store_bf16(s: Shard) -> Callable[[], None]:
    """The ``store-bf16`` row, what the store does on a CUDA run: as ``bf16-alloc`` but
    upcasting into one preallocated fp32 buffer (``ParameterStore._grad32``); the difference
    is what the per-update allocation (fresh pages, faulted in every time) costs."""
    st = torch.tensor(0.0)
    scratch = torch.empty_like(s.master)

    def step() -> None:
        scratch.copy_(s.g16)
        adamw_functional([s.master], [scratch], [s.m], [s.v], [], [st], fused=True, amsgrad=False,
                         beta1=BETAS[0], beta2=BETAS[1], lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS,
                         maximize=False)
        s.w16.copy_(s.master)
    return step


def make_compiled(s: Shard, bf16: bool, compiled_fn) -> Callable[[], None]:
    """The store's ``compiled`` kernel: ``actors.param_store.adamw_single_pass`` (one pass that
    reads the gradient from w, and master, m, v, and writes master, m, v, w), called exactly as
    the store calls it. In the timed calls w holds the previous call's weights in place of a
    gradient (same bytes moved); ``max_rel_diff`` puts each step's gradient into w first."""
    w = s.w16 if bf16 else s.w32
    hyper = SimpleNamespace(betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    count = [0]

    def step() -> None:
        k = count[0]
        count[0] += 1
        compiled_fn(w, s.master, s.m, s.v, *adamw_scalars(hyper, k, 1.0, LR))
    return step


def make_deepspeed(s: Shard, cls) -> Callable[[], None]:
    p = torch.nn.Parameter(s.master)
    p.grad = s.g32
    opt = cls([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    opt.state[p] = {"step": 0, "exp_avg": s.m, "exp_avg_sq": s.v}

    def step() -> None:
        opt.step()
        s.w32.copy_(s.master)
    return step


@dataclass
class Variant:
    name: str
    bf16: bool
    make: Callable[[Shard], Callable[[], None]] | None
    skipped: str = ""

    @property
    def bytes_per_param(self) -> int:
        return 28 if self.bf16 else 32


class _Timeout(Exception):
    pass


def _compile_variant(timeout_s: int, numel: int) -> tuple[object | None, str, float]:
    """torch.compile the single-pass function and run it once (compiles both dtypes), under
    a SIGALRM deadline. Returns (function, reason if skipped, seconds)."""
    def on_alarm(signum, frame):
        raise _Timeout()

    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout_s)
    try:
        fn = torch.compile(adamw_single_pass, dynamic=True, fullgraph=True)
        probe = Shard.random(numel, seed=1)
        make_compiled(probe, False, fn)()
        make_compiled(probe, True, fn)()
        return fn, "", time.perf_counter() - t0
    except _Timeout:
        return None, f"torch.compile did not finish within {timeout_s} s", time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - any compiler failure means: skip, with the reason
        return None, f"torch.compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}", \
            time.perf_counter() - t0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _deepspeed_class() -> tuple[object | None, str]:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415 - optional, slow import
        # building the op (JIT, first use only) happens on construction; try it on a tiny shard
        make_deepspeed(Shard.random(16), DeepSpeedCPUAdam)()
        return DeepSpeedCPUAdam, ""
    except ImportError as e:
        return None, f"deepspeed is not installed ({e}); it is not a project dependency"
    except Exception as e:  # noqa: BLE001
        return None, f"DeepSpeedCPUAdam failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def build_variants(compile_timeout: int, try_deepspeed: bool) -> tuple[list[Variant], dict]:
    info: dict = {}
    fn, why, secs = _compile_variant(compile_timeout, 1 << 16)
    info["compile_seconds"] = round(secs, 1)
    ds_cls, ds_why = (_deepspeed_class() if try_deepspeed else (None, "not tried (--no-deepspeed)"))
    variants = [
        Variant("foreach", False, lambda s: make_torch_optim(s, "foreach")),
        Variant("fused", False, lambda s: make_torch_optim(s, "fused")),
        Variant("store", False, make_store),
        Variant("bf16-alloc", True, make_bf16_alloc),
        Variant("store-bf16", True, make_store_bf16),
        Variant("compiled", False, (lambda s: make_compiled(s, False, fn)) if fn else None, why),
        Variant("compiled-bf16", True, (lambda s: make_compiled(s, True, fn)) if fn else None, why),
        Variant("deepspeed", False, (lambda s: make_deepspeed(s, ds_cls)) if ds_cls else None, ds_why),
    ]
    return variants, info


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def best_of_rounds(fns: dict[str, Callable[[], None]], reps: int, rounds: int = ROUNDS) -> dict[str, float]:
    """Best time of each function over ``rounds`` rounds; in each round every function in turn
    gets one untimed warm-up call (first touch, lazy state, compiled-code load, waking the
    thread pool) and then ``reps`` timed calls. A burst of load from another process thus
    spoils one round of a variant, not all of its samples."""
    best = {name: math.inf for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def bandwidth_references(numel: int = TRIAD_NUMEL, reps: int = TRIAD_REPS) -> dict[str, tuple[float, float]]:
    """name -> (GB/s, seconds) of two memory-bound loops, both counted at 12 B per element:
    ``triad``  a = b + s * c: 2 reads and 1 write to a third array (STREAM's kernel);
    ``rmw``    a += b in place: 2 reads, the write going to a line just read. AdamW's pattern is
               mostly this one (master, m, v are read and written back in place), and it
               avoids the write-allocate read that triad's output stream costs uncounted."""
    a = torch.zeros(numel)  # zeros, not empty: fault every page in before timing
    b = torch.full((numel,), 1.0)
    c = torch.full((numel,), 2.0)
    best = best_of_rounds({"triad": lambda: torch.add(b, c, alpha=3.0, out=a),
                           "rmw": lambda: a.add_(b)}, reps)
    return {name: (12 * numel / secs / 1e9, secs) for name, secs in best.items()}


def max_rel_diff(variant: Variant) -> float:
    """Three steps of ``variant`` vs torch.optim.AdamW(foreach=True) from the same state."""
    base = Shard.random(CHECK_NUMEL, seed=2)
    grads = [torch.randn(base.master.numel(), generator=torch.Generator().manual_seed(10 + k))
             for k in range(CHECK_STEPS)]
    if variant.bf16:  # the reference sees the same rounded gradients
        grads = [g.bfloat16().float() for g in grads]
    ref, mine = base.clone(), base.clone()
    ref_step, my_step = make_torch_optim(ref, "foreach"), variant.make(mine)
    for g in grads:
        ref.g32.copy_(g)
        mine.g32.copy_(g)
        mine.g16.copy_(g)  # exact: g is already bf16-representable for bf16 variants
        mine.w32.copy_(g)  # the store's gradient lands in w (the compiled kernel reads it there;
        mine.w16.copy_(g)  # every variant overwrites w with the new weights)
        ref_step()
        my_step()
    pairs = [(mine.master, ref.master), (mine.m, ref.m), (mine.v, ref.v)]
    pairs.append((mine.w16.float(), ref.master.bfloat16().float()) if variant.bf16 else (mine.w32, ref.master))
    return max(float((x - r).abs().max() / r.abs().max()) for x, r in pairs)


def reps_for(numel: int) -> int:
    return max(3, min(10, int(3e8 // numel)))


def run(sizes: list[int], compile_timeout: int = 240, try_deepspeed: bool = True,
        log=lambda msg: print(msg, file=sys.stderr)) -> tuple[list[Row], dict]:
    load_before = os.getloadavg()[0]
    refs = bandwidth_references()
    log(f"triad {refs['triad'][0]:.2f} GB/s, in-place a += b {refs['rmw'][0]:.2f} GB/s "
        f"({torch.get_num_threads()} threads)")
    variants, info = build_variants(compile_timeout, try_deepspeed)
    checks = {v.name: max_rel_diff(v) for v in variants if v.make is not None}
    timed: dict[int, dict[str, float]] = {}
    for numel in sizes:
        shard = Shard.random(numel)
        timed[numel] = best_of_rounds({v.name: v.make(shard) for v in variants if v.make is not None},
                                      reps_for(numel))
        for name, secs in timed[numel].items():
            log(f"  {name:<18} {numel:>11,}  {secs * 1e3:9.2f} ms")
        del shard
    # the references again at the end, best of both: the machine's bandwidth, not its noise
    for name, (gbps, secs) in bandwidth_references().items():
        if secs < refs[name][1]:
            refs[name] = (gbps, secs)
    tri, rmw = refs["triad"][0], refs["rmw"][0]
    info = {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "triad_gbps": round(tri, 2),
            "rmw_gbps": round(rmw, 2), **info,
            # other processes on the machine skew every figure: record how busy it was
            "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    rows = [Row("bandwidth", label, TRIAD_NUMEL, 12, refs[name][1], refs[name][0], TRIAD_NUMEL / refs[name][1],
                refs[name][0] / tri, frac_rmw=refs[name][0] / rmw)
            for name, label in (("triad", "triad a=b+s*c"), ("rmw", "in-place a+=b"))]
    for numel in sizes:
        best = timed[numel]
        for v in variants:
            if v.make is None:
                rows.append(Row("adamw", v.name, numel, v.bytes_per_param, skipped=v.skipped))
                continue
            secs = best[v.name]
            gbps = v.bytes_per_param * numel / secs / 1e9
            rows.append(Row("adamw", v.name, numel, v.bytes_per_param, secs, gbps, numel / secs, gbps / tri,
                            best["foreach"] / secs, checks[v.name], frac_rmw=gbps / rmw))
    return rows, info


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def render(rows: list[Row], info: dict) -> str:
    head = (f"{'variant':<19}{'params':>12}{'ms':>10}{'Mparam/s':>10}{'B/param':>8}{'GB/s':>8}"
            f"{'% triad':>8}{'% rmw':>7}{'x foreach':>10}{'rel diff*':>11}")
    out = [f"threads {info['threads']}, torch {info['torch']} ({info['cpu_capability']}), "
           f"torch.compile warm-up {info.get('compile_seconds', '-')} s, load average before/after "
           f"{info['loadavg_1min']}", head, "-" * len(head)]
    for r in rows:
        if r.skipped:
            out.append(f"{r.variant:<19}{r.numel:>12,}  skipped: {r.skipped}")
            continue
        diff = "" if r.max_rel_diff is None else f"{r.max_rel_diff:.1e}"
        speed = "" if r.speedup_vs_foreach is None else f"{r.speedup_vs_foreach:.2f}"
        out.append(f"{r.variant:<19}{r.numel:>12,}{r.seconds * 1e3:>10.2f}{r.params_per_s / 1e6:>10.0f}"
                   f"{r.bytes_per_param:>8}{r.gbps:>8.2f}{100 * r.frac_triad:>7.0f}%{100 * r.frac_rmw:>6.0f}%{speed:>10}{diff:>11}")
    out.append(f"* max |x - ref| / max |ref| over master, m, v, w after {CHECK_STEPS} steps on {CHECK_NUMEL:,} "
               f"params vs torch.optim.AdamW(foreach=True)\n"
               f"% triad, % rmw: the bytes in B/param per second against triad {info['triad_gbps']} GB/s and "
               f"in-place a+=b {info['rmw_gbps']} GB/s (both counted at 12 B per element)")
    return "\n".join(out)


def _parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--sizes {text!r}: give comma-separated counts, e.g. 1e6,1e7,1e8") from None
    if not sizes or min(sizes) <= 0:
        raise SystemExit(f"--sizes {text!r}: every size must be a positive count")
    return sizes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.adamw", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e6,1e7,1e8", help="shard sizes in parameters, comma-separated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    ap.add_argument("--compile-timeout", type=int, default=240, help="seconds torch.compile may take")
    ap.add_argument("--no-deepspeed", action="store_true", help="do not try DeepSpeedCPUAdam")
    ap.add_argument("--json", action="store_true", help="one JSON object per result row")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    rows, info = run(_parse_sizes(args.sizes), args.compile_timeout, not args.no_deepspeed)
    if args.json:
        for r in rows:
            print(json.dumps({**asdict(r), **info}))
    else:
        print(render(rows, info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
