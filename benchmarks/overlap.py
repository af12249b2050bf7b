"""Does streaming hide the transfers? Step time with overlap off and on, at a simulated link
speed where moving a step's weights takes about as long as the step's compute.

    python -m benchmarks.overlap [--steps 4] [--rounds 1] [--ratios 1.0,0.5] [--models tiny,wide]
                                 [--prefetch-depth 1] [--micro-batches 1,2,4] [--resident-gb 0,0.003]
                                 [--actors 1,2] [--device-shards 0,2] [--skip-memory] [--json]

Every row is one setting: K micro-batches, resident GB, N actors and D device shards (default D = 0,
the product's default, and D = 2).

Micro-batches, resident shards, several actors: every (K, resident_gb) setting runs at the link
speed set from the pure step with one micro-batch and no residency (so T_x = T_c at K=1 with
``--ratios 1.0``); K multiplies the compute per fetched byte, residency takes fetches off the
link. ``--actors N``: N compute actors on one store in threads, each on its own batch and its own
simulated link, sharing the cores (as CPU compute actors of one node do); the link is set from
that N's own K=1 step. ``--device-shards D``: ``runtime.device_shards``, the forward's first D
shards kept and updated in the compute process (the device), so the step boundary's fetches and
returns go. Each row carries the planner's predicted step (``planning/schedule.py``)
at that link speed and the compute rate measured in the setting, its error against the measured
on-time, and what binds by each (link when the on-run's link is busier than the pure compute).

For each model: (1) the pure compute step time T_c (no throttle, weights read in place);
(2) the link speed X = weight bytes staged per step / T_c, so transfer time T_x ~= T_c;
(3) the step time with ``runtime.overlap`` off (fetch, compute, return in sequence) and on
(prefetch thread + gradient-return thread), both at ``runtime.link_gbps = X``.
Overlap efficiency = max(T_c, T_x) / T_on (1.0 = transfers fully hidden); speedup = T_off / T_on.

Schedule model: from the pure run's per-shard compute times (the gaps between the compute
thread's weight takes) and each fetch's bytes at link speed X, ``simulate`` replays the
actor's exact schedule (one link each way, ``prefetch_depth`` fetches ahead, gradients
returned as they appear) with no contention: ``model on s`` is this schedule on an ideal
machine, and ``model eff`` = max(T_c, T_x) / model on. The gap between ``model eff`` and 1.0 is
the schedule itself (the forward does about a fifth of the compute but needs L+2 of the 2L+2
weight fetches, so it is link-bound when the step's transfer time equals its compute time).
The pure runs' compute includes the store's AdamW competing for the cores during the forward,
which a link-bound "on" run hides, so measured on-times can come out below the model.

Memory: peak anonymous RSS growth during the first step of a fresh process (activations, staging
buffers, gradients; the store's state is shared memory and is not counted), depth 4 vs 32 at
the same width, each in its own process so allocator caches from earlier runs do not hide it;
with block inputs kept in the compute process and with ``runtime.offload_activations``
(they then live in a host segment, like the store's state).
Runs the actor classes in one process (no Ray), so only the streaming logic is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.driver import resolve_data
from megaslide_ray.planning.estimate import plan
from megaslide_ray.planning.schedule import schedule_seconds, schedule_waits, step_positions

MODELS = {
    "tiny": {},
    "wide": {"model.hidden_size": "384", "model.num_heads": "6"},
}


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    def __init__(self, period: float = 0.002):
        self.period, self.peak, self._stop = period, 0, threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            time.sleep(self.period)

    def __enter__(self):
        self.base = _rss_anon()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run(overrides: dict, batches, steps: int, measure_memory: bool = False, actors: int = 1) -> dict:
    """``steps`` training steps of ``tiny`` with ``overrides``; ``actors`` compute actors on one
    store, each on its own batch and its own (simulated) link, each in its own thread, as the
    trainer runs them (``runtime.compute_actors``). A step's time is until the slowest is done."""
    cfg = build_config("tiny", None, overrides)
    state = tempfile.mkdtemp(prefix="megaslide-overlap-")
    store = ParameterStore(cfg, state, compute_actors=actors)
    slots = store.grad_slots()
    computes = [ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store, r), "shm", rank=r, grad_slots=slots)
                for r in range(actors)]
    compute = computes[0]
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=actors, initializer=torch.set_num_threads, initargs=(threads,))
    times, peak, timelines, h2d_s = [], 0, [], []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            if measure_memory and step == 0:
                with PeakSampler() as s:
                    r = compute.train_step(batches[step % len(batches)], step)
                peak = s.peak - s.base
            else:
                futures = [pool.submit(c.train_step, batches[(step * actors + i) % len(batches)], step)
                           for i, c in enumerate(computes)]
                r = [f.result() for f in futures][0]
            times.append(time.perf_counter() - t0)
            timelines.append(compute.last_timeline)
            h2d_s.append(r.h2d_seconds)
            # No wait for the store's update here: as in training, it overlaps the next step's
            # forward (whose weight fetches wait for each shard's new version).
        store.wait_step(steps - 1)
        n = compute.n
        order, reuse = compute.step_order()
        device = [p for p, i in enumerate(order) if i in compute.dev]  # device shards: no fetch, no return
        grads = [0 if p in device else compute.infos[i].numel * 4 for p, i in enumerate(order)]
        fetches = [0 if p in reuse else b for p, b in enumerate(grads)]  # reused positions fetch nothing
    finally:
        pool.shutdown()
        for c in computes:
            c.close()
        store.close()
        shutil.rmtree(state, ignore_errors=True)
    return {"seconds": statistics.mean(times[1:]) if len(times) > 1 else times[0],
            "staged_bytes": sum(fetches), "fetch_bytes": fetches, "grad_bytes": grads, "n": n, "device": device,
            "timelines": timelines[1:] or timelines, "h2d_bytes": r.h2d_bytes, "peak_anon_bytes": peak,
            "h2d_seconds": statistics.mean(h2d_s[1:] or h2d_s)}


def simulate(pure: dict, gbps: float, depth: int, overlap: bool = True) -> float:
    """Step time of the actor's schedule on an ideal machine (``planning.schedule``): compute
    times from the pure run's timelines (each position's mean over the timed steps), fetch and
    gradient-return times = bytes / link."""
    return schedule_seconds(*_positions(pure, gbps), depth, overlap, pure.get("device", ()))


def model_waits(pure: dict, gbps: float, depth: int) -> dict[str, float]:
    """Where ``simulate``'s overlapped step exceeds its compute: the step boundary's ``fill`` and
    ``drain`` and the ``stalls`` between (``planning.schedule.schedule_waits``)."""
    _, fetch, comp, grad = _positions(pure, gbps)
    return schedule_waits(fetch, comp, grad, depth, pure.get("device", ()))


def _positions(pure: dict, gbps: float) -> tuple[float, list[float], list[float], dict[int, float]]:
    """``simulate``'s inputs: the time before the first position, each position's fetch and
    compute seconds, and the gradients' return seconds after their positions."""
    sizes, n = pure["grad_bytes"], pure["n"]
    P = len(sizes)
    pre, comp = 0.0, [0.0] * P
    for start, takes, end in pure["timelines"]:
        pre += (takes[0][0] - start) / len(pure["timelines"])
        for p in range(P):
            nxt = takes[p + 1][0] if p + 1 < P else end
            comp[p] += (nxt - takes[p][1]) / len(pure["timelines"])
    fetch = [b / (gbps * 1e9) for b in pure["fetch_bytes"]]
    # gradients: the head's after its position (n - 1), each backward position's after its own
    grad = {p: sizes[p] / (gbps * 1e9) for p in [n - 1, *range(n, P)]}
    return pre, fetch, comp, grad


def _ints(text: str, flag: str, low: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give comma-separated integers, e.g. {flag} 1,2") from None
    if any(v < low for v in values):
        raise SystemExit(f"{flag} {text!r}: every value must be >= {low}")
    return values


def _floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give comma-separated numbers, e.g. {flag} 0,0.004") from None
    if any(not v >= 0 for v in values):
        raise SystemExit(f"{flag} {text!r}: every value must be >= 0")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--prefetch-depth", type=int, default=1, help="runtime.prefetch_depth of the overlap-on run")
    p.add_argument("--rounds", type=int, default=1, help="repeat pure/off/on this many times; medians")
    p.add_argument("--ratios", default="1.0,0.5",
                   help="transfer time / compute time of one micro-batch (K=1, no residency) at which to set the "
                        "link (comma-separated)")
    p.add_argument("--micro-batches", default="1", help="training.micro_batches K to run (comma-separated)")
    p.add_argument("--resident-gb", default="0", help="runtime.resident_gb to run (comma-separated, decimal GB)")
    p.add_argument("--actors", default="1", help="compute actors N on one store (comma-separated)")
    p.add_argument("--device-shards", default="0,2",
                   help="runtime.device_shards D to run (comma-separated; the forward's first D shards updated on "
                        "the device; default both the product's default 0 and 2, shard 0 and block 1)")
    p.add_argument("--memory-depth", type=int, help=argparse.SUPPRESS)  # one measurement, in a child
    p.add_argument("--memory-offload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models {args.models!r}: unknown {unknown}; use a subset of {','.join(MODELS)}")
    args.ks = _ints(args.micro_batches, "--micro-batches", 1)
    args.residents = _floats(args.resident_gb, "--resident-gb")
    args.ns = _ints(args.actors, "--actors", 1)
    args.devices = _ints(args.device_shards, "--device-shards", 0)
    args.ratio_list = _floats(args.ratios, "--ratios")
    if 0 in args.ratio_list:
        raise SystemExit(f"--ratios {args.ratios!r}: every ratio must be > 0")
    return args


def dram_gbps() -> float:
    """The host's copy bandwidth (read + write bytes per second of a 64 MB copy, best of 3): the
    planner's ``dram_gbps`` for this machine."""
    src, dst = torch.empty(16 * 2**20), torch.empty(16 * 2**20)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def decode_batches(base_cfg, k: int, count: int) -> list:
    """``count`` decoder batches of ``k`` micro-batches (``k x data.batch_size`` clips each)."""
    data = dataclasses.replace(base_cfg.data, batch_size=base_cfg.data.batch_size * k)
    with VideoDecoder(data, 0, base_cfg.model.caption_max_bytes) as dec:
        return [dec.next_batch() for _ in range(count)]


def measure(name: str, actors: int, args, common: dict, base_cfg, dram: float) -> list[dict]:
    """The rows of model ``name`` with ``actors`` compute actors: the link speeds from the pure
    step at K=1 without residency, then pure, off and on runs of every (K, resident_gb) setting,
    in rounds (medians per run kind, so a drift of the machine's speed hits every kind alike),
    each held against the schedule model and the planner at its link speed and the compute rate
    measured in that setting (the planner's FLOPs of the step / its pure time; and, beside it, the
    rate measured at K=1 without residency, which leaves the planner to scale the compute by FLOPs)."""
    ov = {**common, **MODELS[name], "runtime.compute_actors": str(actors)}
    if actors > 1:  # the actors share the cores, as CPU compute actors of one node do
        ov["runtime.compute_threads"] = str(max(1, (os.cpu_count() or 1) // actors))

    def setting(k: int, resident: float, device: int = 0, **more) -> dict:
        return {**ov, "training.micro_batches": str(k), "runtime.resident_gb": str(resident),
                "runtime.device_shards": str(device), **more}

    settings = [(k, r, d) for k in args.ks for r in args.residents for d in args.devices]
    batches = {k: decode_batches(base_cfg, k, 2 * actors) for k in {1, *args.ks}}
    base = run(setting(1, 0.0), batches[1], args.steps, actors=actors)
    links = {ratio: base["staged_bytes"] / (ratio * base["seconds"]) / 1e9 for ratio in args.ratio_list}
    pures = {s: [base] if s == (1, 0.0, 0) else [] for s in settings}
    offs = {(s, ratio): [] for s in settings for ratio in links}
    ons = {(s, ratio): [] for s in settings for ratio in links}
    depth = args.prefetch_depth
    for rnd in range(args.rounds):
        for s in settings:
            if rnd or s != (1, 0.0, 0):
                pures[s].append(run(setting(*s), batches[s[0]], args.steps, actors=actors))
            for ratio, gbps in links.items():
                link = {"runtime.link_gbps": str(gbps), "runtime.prefetch_depth": str(depth)}
                offs[s, ratio].append(run(setting(*s, **link, **{"runtime.overlap": "false"}), batches[s[0]],
                                          args.steps, actors=actors)["seconds"])
                ons[s, ratio].append(run(setting(*s, **link, **{"runtime.overlap": "true"}), batches[s[0]],
                                         args.steps, actors=actors))
    def rate(s: tuple, runs: list) -> float:  # the planner's FLOPs of setting s / its measured pure step
        return sum(step_positions(build_config("tiny", None, setting(*s)), 4).flops) / \
            statistics.median(r["seconds"] for r in runs) / 1e12

    k1 = rate((1, 0.0, 0), pures.get((1, 0.0, 0), [base]))
    rows = []
    for s in settings:
        cfg = build_config("tiny", None, setting(*s, **{"runtime.prefetch_depth": str(depth)}))
        for ratio, gbps in links.items():
            plans = [plan(cfg, "float32", pcie_gbps=gbps, dram_gbps=dram, device_tflops=t)
                     for t in (rate(s, pures[s]), k1)]
            rows.append(_row(name, actors, s, ratio, gbps, pures[s], offs[s, ratio], ons[s, ratio], depth,
                             plans, args.rounds))
    return rows


def _row(name: str, actors: int, s: tuple, ratio: float, gbps: float, pures: list, offs: list, ons: list,
         depth: int, plans: list, rounds: int) -> dict:
    """One setting's row: measured medians, the schedule model, the planner's step (``plans``: at the
    compute rate measured in this setting, and at the one measured at K=1 without residency)."""
    p, p1 = plans
    compute = statistics.median(r["seconds"] for r in pures)
    pooled = {**pures[0], "timelines": [t for r in pures for t in r["timelines"]]}
    transfer = pures[0]["staged_bytes"] / (gbps * 1e9)
    off_s, on_s = statistics.median(offs), statistics.median(r["seconds"] for r in ons)
    best = max(compute, transfer)
    model_on = simulate(pooled, gbps, depth)
    link_busy = statistics.median(r["h2d_seconds"] for r in ons)  # the on runs' throttled copies, per step
    return {"model": name, "actors": actors, "micro_batches": s[0], "resident_gb": s[1], "device_shards": s[2],
            "ratio": ratio,
            "compute_s": compute, "link_gbps": gbps, "transfer_s": transfer, "off_s": off_s, "on_s": on_s,
            "efficiency": best / on_s, "speedup": off_s / on_s, "staged_mb": pures[0]["staged_bytes"] / 1e6,
            "rounds": rounds, "on_s_each": [r["seconds"] for r in ons], "off_s_each": offs,
            "compute_s_each": [r["seconds"] for r in pures], "prefetch_depth": depth,
            "model_off_s": simulate(pooled, gbps, depth, overlap=False), "model_on_s": model_on,
            "model_efficiency": best / model_on,
            **{f"model_{k}_s": v for k, v in model_waits(pooled, gbps, depth).items()},
            "unbounded_prefetch_efficiency": best / simulate(pooled, gbps, len(pures[0]["grad_bytes"])),
            "plan_step_s": p.step_s, "plan_off_s": p.step_off_s, "plan_error": p.step_s / on_s - 1,
            "plan_binding": p.step_binding, "plan_compute_s": p.time_terms["compute"],
            "plan_device_tflops": p.device_tflops, "plan_dram_gbps": p.dram_gbps,
            "plan_k1_rate_step_s": p1.step_s, "plan_k1_rate_error": p1.step_s / on_s - 1,
            "binding": "link" if link_busy > compute else "compute", "link_busy_s": link_busy}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_cfg = resolve_data(build_config("tiny"))
    common = {"data.manifest": base_cfg.data.manifest, "training.steps": str(args.steps)}
    if args.memory_depth:
        batches = decode_batches(base_cfg, 1, 1)
        r = run({**common, "model.depth": str(args.memory_depth), "runtime.link_gbps": "100",
                 "runtime.offload_activations": str(args.memory_offload).lower()}, batches, 1, measure_memory=True)
        print(r["peak_anon_bytes"])
        return 0
    rows = []
    dram = dram_gbps()
    for name in args.models.split(","):
        for actors in args.ns:
            rows += measure(name, actors, args, common, base_cfg, dram)
    mem = []
    if not args.skip_memory:
        import subprocess
        import sys

        for malloc in ("default", "mmap"):
            # mmap: blocks over 64 KiB are mapped and unmapped one by one, so RSS follows the live
            # tensors; the default heap keeps freed blocks and adds its fragmentation.
            env = {**os.environ, **({"MALLOC_MMAP_THRESHOLD_": "65536"} if malloc == "mmap" else {})}
            for offload in (False, True):
                for d in (4, 32):
                    cmd = [sys.executable, "-m", "benchmarks.overlap", "--memory-depth", str(d)]
                    out = subprocess.run(cmd + ["--memory-offload"] * offload, capture_output=True, text=True,
                                         check=True, env=env).stdout
                    mem.append({"model": f"tiny depth {d}", "offload_activations": offload, "malloc": malloc,
                                "peak_anon_mb": float(out.split()[-1]) / 1e6})
    if args.json:
        for r in rows + mem:
            print(json.dumps(r))
        return 0
    print_rows(rows)
    for m in mem:
        where = "offloaded to host" if m["offload_activations"] else "kept in the process"
        print(f"{m['model']:<14} malloc {m['malloc']:<8} block inputs {where:<20} peak working memory "
              f"during a step: {m['peak_anon_mb']:.1f} MB")
    for malloc in ("default", "mmap"):
        for offload in (False, True):
            pair = [m["peak_anon_mb"] for m in mem if m["offload_activations"] == offload and m["malloc"] == malloc]
            if len(pair) == 2:
                print(f"peak working memory depth 32 / depth 4, malloc {malloc}, "
                      f"offload_activations={str(offload).lower()}: {pair[1] / pair[0]:.2f}")
    return 0


def print_rows(rows: list[dict]) -> None:
    print(f"{'model':<6}{'N':>3}{'K':>3}{'D':>3}{'res GB':>8}{'T_x/T_c':>8}{'compute s':>10}{'transfer s':>11}"
          f"{'off s':>8}{'on s':>8}{'eff':>6}{'speedup':>8}{'model on s':>11}{'model eff':>10}{'plan s':>8}{'plan err':>9}"
          f"{'binds (measured / plan)':>25}")
    for r in rows:
        print(f"{r['model']:<6}{r['actors']:>3}{r['micro_batches']:>3}{r['device_shards']:>3}"
              f"{r['resident_gb']:>8.4g}{r['ratio']:>8.2f}{r['compute_s']:>10.3f}{r['transfer_s']:>11.3f}{r['off_s']:>8.3f}{r['on_s']:>8.3f}"
              f"{r['efficiency']:>6.2f}{r['speedup']:>8.2f}{r['model_on_s']:>11.3f}{r['model_efficiency']:>10.2f}"
              f"{r['plan_step_s']:>8.3f}{r['plan_error']:>+9.0%}{r['binding'] + ' / ' + r['plan_binding']:>25}")
    for r in rows:
        print(f"{r['model']} N={r['actors']} K={r['micro_batches']} D={r['device_shards']} resident "
              f"{r['resident_gb']:g} GB @ {r['ratio']:.2f}: link {r['link_gbps'] * 1e3:.3g} MB/s; compute " + ", ".join(f"{x:.2f}" for x in r["compute_s_each"])
              + "; off " + ", ".join(f"{x:.2f}" for x in r["off_s_each"])
              + "; on " + ", ".join(f"{x:.2f}" for x in r["on_s_each"])
              + f"; model eff with unlimited prefetch {r['unbounded_prefetch_efficiency']:.2f}"
              + f"; model's compute waits: boundary {r['model_fill_s']:.2f} + {r['model_drain_s']:.2f} s (first "
              f"fetches + last gradients), stalls {r['model_stalls_s']:.2f} s")


if __name__ == "__main__":
    raise SystemExit(main())
