"""Does streaming hide the transfers? Step time with overlap off and on, at a simulated link
speed where moving a step's weights takes about as long as the step's compute.

    python -m benchmarks.overlap [--steps 4] [--json] [--skip-memory]

For each model: (1) the pure compute step time T_c (no throttle, weights read in place);
(2) the link speed X = weight bytes staged per step / T_c, so transfer time T_x ~= T_c;
(3) the step time with ``runtime.overlap`` off (fetch, compute, return in sequence) and on
(prefetch thread + gradient-return thread), both at ``runtime.link_gbps = X``.
Overlap efficiency = max(T_c, T_x) / T_on (1.0 = transfers fully hidden); speedup = T_off / T_on.

Memory: peak anonymous RSS growth during the first step of a fresh process (activations, staging
buffers, gradients; the store's state is shared memory and is not counted), depth 4 vs 32 at
the same width, each in its own process so allocator caches from earlier runs do not hide it.
Runs the actor classes in one process (no Ray), so only the streaming logic is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.trainer import resolve_data

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
    times, peak = [], 0
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            if measure_memory and step == 0:
                with PeakSampler() as s:
                    compute.train_step(batches[step % len(batches)], step)
                peak = s.peak - s.base
            else:
                compute.train_step(batches[step % len(batches)], step)
            store.wait_step(step)
            times.append(time.perf_counter() - t0)
        order = list(range(compute.n)) + list(range(cfg.model.depth, -1, -1))
        staged = sum(compute.infos[i].numel for i in order) * 4
        grads = sum(info.numel for info in compute.infos) * 4
    finally:
        compute.close()
        store.close()
    return {"seconds": statistics.mean(times[1:]) if len(times) > 1 else times[0],
            "staged_bytes": staged, "grad_bytes": grads, "peak_anon_bytes": peak}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--memory-depth", type=int, help=argparse.SUPPRESS)  # one measurement, in a child
    args = p.parse_args(argv)
    base_cfg = resolve_data(build_config("tiny"))
    with VideoDecoder(base_cfg.data, 0, base_cfg.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(2)]
    common = {"data.manifest": base_cfg.data.manifest, "training.steps": str(args.steps)}
    if args.memory_depth:
        r = run({**common, "model.depth": str(args.memory_depth), "runtime.link_gbps": "100"}, batches, 1,
                measure_memory=True)
        print(r["peak_anon_bytes"])
        return 0
    rows = []
    for name, model in MODELS.items():
        ov = {**common, **model}
        pure = run(ov, batches, args.steps)
        gbps = pure["staged_bytes"] / pure["seconds"] / 1e9
        transfer = pure["staged_bytes"] / (gbps * 1e9)
        off = run({**ov, "runtime.link_gbps": str(gbps), "runtime.overlap": "false"}, batches, args.steps)
        on = run({**ov, "runtime.link_gbps": str(gbps), "runtime.overlap": "true"}, batches, args.steps)
        rows.append({"model": name, "compute_s": pure["seconds"], "link_gbps": gbps, "transfer_s": transfer,
                     "off_s": off["seconds"], "on_s": on["seconds"],
                     "efficiency": max(pure["seconds"], transfer) / on["seconds"],
                     "speedup": off["seconds"] / on["seconds"], "staged_mb": pure["staged_bytes"] / 1e6})
    mem = []
    if not args.skip_memory:
        import subprocess
        import sys

        for depth in (4, 32):
            out = subprocess.run([sys.executable, "-m", "benchmarks.overlap", "--memory-depth", str(depth)],
                                 capture_output=True, text=True, check=True).stdout
            mem.append({"model": f"tiny depth {depth}", "peak_anon_mb": float(out.split()[-1]) / 1e6})
    if args.json:
        for r in rows + mem:
            print(json.dumps(r))
        return 0
    print(f"{'model':<8}{'compute s':>10}{'link GB/s':>11}{'transfer s':>11}{'off s':>8}{'on s':>8}"
          f"{'efficiency':>12}{'on/off speedup':>16}")
    for r in rows:
        print(f"{r['model']:<8}{r['compute_s']:>10.3f}{r['link_gbps']:>11.3f}{r['transfer_s']:>11.3f}"
              f"{r['off_s']:>8.3f}{r['on_s']:>8.3f}{r['efficiency']:>12.2f}{r['speedup']:>16.2f}")
    for m in mem:
        print(f"{m['model']:<16} peak working memory during a step: {m['peak_anon_mb']:.1f} MB")
    if len(mem) == 2:
        print(f"peak working memory depth 32 / depth 4: {mem[1]['peak_anon_mb'] / mem[0]['peak_anon_mb']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
