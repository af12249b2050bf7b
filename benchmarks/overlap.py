"""Does streaming hide the transfers? Step time with overlap off and on, at a simulated link
speed where moving a step's weights takes about as long as the step's compute.

    python -m benchmarks.overlap [--steps 4] [--rounds 1] [--ratios 1.0,0.5] [--models tiny,wide]
                                 [--prefetch-depth 1] [--skip-memory] [--json]

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
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.driver import resolve_data

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


def run(overrides: dict, batches, steps: int, measure_memory: bool = False) -> dict:
    cfg = build_config("tiny", None, overrides)
    state = tempfile.mkdtemp(prefix="megaslide-overlap-")
    store = ParameterStore(cfg, state)
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    times, peak, timelines = [], 0, []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            if measure_memory and step == 0:
                with PeakSampler() as s:
                    r = compute.train_step(batches[step % len(batches)], step)
                peak = s.peak - s.base
            else:
                r = compute.train_step(batches[step % len(batches)], step)
            times.append(time.perf_counter() - t0)
            timelines.append(compute.last_timeline)
            # No wait for the store's update here: as in training, it overlaps the next step's
            # forward (whose weight fetches wait for each shard's new version).
        store.wait_step(steps - 1)
        n = compute.n
        order, reuse = compute.step_order()
        grads = [compute.infos[i].numel * 4 for i in order]
        fetches = [0 if p in reuse else b for p, b in enumerate(grads)]  # reused positions fetch nothing
    finally:
        compute.close()
        store.close()
        shutil.rmtree(state, ignore_errors=True)
    return {"seconds": statistics.mean(times[1:]) if len(times) > 1 else times[0],
            "staged_bytes": sum(fetches), "fetch_bytes": fetches, "grad_bytes": grads, "n": n,
            "timelines": timelines[1:] or timelines, "h2d_bytes": r.h2d_bytes, "peak_anon_bytes": peak}


def simulate(pure: dict, gbps: float, depth: int, overlap: bool = True) -> float:
    """Step time of the actor's schedule on an ideal machine (see the module docstring):
    compute times from the pure run's timelines (each position's mean over the timed steps),
    fetch and gradient-return times = bytes / link."""
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
    grad = {n - 1: sizes[n - 1], **{p: sizes[p] for p in range(n, P)}}
    if not overlap:
        return pre + sum(fetch) + sum(comp) + sum(b / (gbps * 1e9) for b in grad.values())
    link = pre
    f_end, c_start, c_end = [0.0] * P, [0.0] * P, [0.0] * P
    ret = 0.0
    for p in range(P):
        submit = pre if p <= depth else c_start[p - depth]
        if fetch[p]:  # a kept shard (fetch 0) neither waits for nor uses the link
            f_end[p] = max(link, submit) + fetch[p]
            link = f_end[p]
        c_start[p] = max(c_end[p - 1] if p else pre, f_end[p])
        c_end[p] = c_start[p] + comp[p]
        if p in grad:
            ret = max(ret, c_end[p]) + grad[p] / (gbps * 1e9)
    return max(c_end[-1], ret)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    p.add_argument("--prefetch-depth", type=int, default=1, help="runtime.prefetch_depth of the overlap-on run")
    p.add_argument("--rounds", type=int, default=1, help="repeat pure/off/on this many times; medians")
    p.add_argument("--ratios", default="1.0,0.5",
                   help="transfer time / compute time at which to set the link (comma-separated)")
    p.add_argument("--memory-depth", type=int, help=argparse.SUPPRESS)  # one measurement, in a child
    p.add_argument("--memory-offload", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    base_cfg = resolve_data(build_config("tiny"))
    with VideoDecoder(base_cfg.data, 0, base_cfg.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(2)]
    common = {"data.manifest": base_cfg.data.manifest, "training.steps": str(args.steps)}
    if args.memory_depth:
        r = run({**common, "model.depth": str(args.memory_depth), "runtime.link_gbps": "100",
                 "runtime.offload_activations": str(args.memory_offload).lower()}, batches, 1, measure_memory=True)
        print(r["peak_anon_bytes"])
        return 0
    rows = []
    depth = args.prefetch_depth
    ratios = [float(r) for r in args.ratios.split(",")]
    for name in args.models.split(","):
        ov = {**common, **MODELS[name]}
        pure = run(ov, batches, args.steps)
        links = {ratio: pure["staged_bytes"] / (ratio * pure["seconds"]) / 1e9 for ratio in ratios}
        # Rounds: pure, then off and on at each link speed, again and again; medians per run kind,
        # so a drift of the machine's speed hits every kind alike. The link speeds stay as set
        # from the first pure run.
        pures, offs, ons = [pure], {r: [] for r in ratios}, {r: [] for r in ratios}
        for k in range(args.rounds):
            if k:
                pures.append(run(ov, batches, args.steps))
            for ratio, gbps in links.items():
                link = {"runtime.link_gbps": str(gbps), "runtime.prefetch_depth": str(depth)}
                offs[ratio].append(run({**ov, **link, "runtime.overlap": "false"}, batches, args.steps)["seconds"])
                ons[ratio].append(run({**ov, **link, "runtime.overlap": "true"}, batches, args.steps)["seconds"])
        compute = statistics.median(r["seconds"] for r in pures)
        pooled = {**pure, "timelines": [t for r in pures for t in r["timelines"]]}
        for ratio, gbps in links.items():
            transfer = pure["staged_bytes"] / (gbps * 1e9)
            off_s, on_s = statistics.median(offs[ratio]), statistics.median(ons[ratio])
            best = max(compute, transfer)
            model_on = simulate(pooled, gbps, depth)
            rows.append({"model": name, "ratio": transfer / compute, "compute_s": compute, "link_gbps": gbps,
                         "transfer_s": transfer, "off_s": off_s, "on_s": on_s, "efficiency": best / on_s,
                         "speedup": off_s / on_s, "staged_mb": pure["staged_bytes"] / 1e6, "rounds": args.rounds,
                         "on_s_each": ons[ratio], "off_s_each": offs[ratio],
                         "compute_s_each": [r["seconds"] for r in pures],
                         "prefetch_depth": depth, "model_off_s": simulate(pooled, gbps, depth, overlap=False),
                         "model_on_s": model_on, "model_efficiency": best / model_on,
                         "unbounded_prefetch_efficiency": best / simulate(pooled, gbps, len(pure["grad_bytes"]))})
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
    print(f"{'model':<8}{'T_x/T_c':>8}{'compute s':>10}{'link GB/s':>11}{'transfer s':>11}{'off s':>8}{'on s':>8}"
          f"{'efficiency':>12}{'on/off speedup':>16}{'model off s':>13}{'model on s':>12}{'model eff':>11}")
    for r in rows:
        print(f"{r['model']:<8}{r['ratio']:>8.2f}{r['compute_s']:>10.3f}{r['link_gbps']:>11.3f}{r['transfer_s']:>11.3f}"
              f"{r['off_s']:>8.3f}{r['on_s']:>8.3f}{r['efficiency']:>12.2f}{r['speedup']:>16.2f}"
              f"{r['model_off_s']:>13.3f}{r['model_on_s']:>12.3f}{r['model_efficiency']:>11.2f}")
    if rows:
        print(f"prefetch_depth {depth}; model eff with unlimited prefetch: "
              + ", ".join(f"{r['model']}@{r['ratio']:.2f} {r['unbounded_prefetch_efficiency']:.2f}" for r in rows))
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


if __name__ == "__main__":
    raise SystemExit(main())
