"""Data-parallel compute actors on one node: steps/s and samples/s with 1, 2, 3 compute actors
(``runtime.compute_actors``) sharing one parameter store, each with the same batch (weak scaling:
the global batch grows with N), against the one-actor run of the same invocation.

    python -m benchmarks.dataparallel [--actors 1 2 3] [--steps 8] [--preset tiny] [--json] [--SECTION.FIELD VALUE ...]

Each run is the main job (Trainer, decoder pool, store, N compute actors through Ray). On a CPU
node the actors share the cores: each gets ``cores / N`` torch threads (``runtime.compute_threads``,
unless given), so the ratio says what the store's summing, the slot waits and the extra actors
cost, not what N GPUs would gain. The first step (start-up) is left out of the means. Columns:
seconds per step, steps/s, samples/s (global batch / s), the samples/s ratio to one actor, the
store's summing time per step and the slowest actor's wait for a gradient slot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import ray

from megaslide_ray.config import build_config, parse_overrides
from megaslide_ray.driver import Trainer, resolve_data


def run(preset: str, actors: int, steps: int, overrides: dict) -> dict:
    cores = os.cpu_count() or 1
    ov = {"training.steps": steps, "training.log_every": steps, "runtime.compute_actors": actors,
          "runtime.compute_threads": max(1, cores // actors), **overrides}
    cfg = build_config(preset, None, ov)
    resolve_data(cfg)
    ray.init(address="local", num_cpus=cfg.ray.num_cpus or None, include_dashboard=False, namespace="megaslide",
             logging_level="ERROR")
    run_dir = tempfile.mkdtemp(prefix="megaslide-dp-")
    try:
        trainer = Trainer(cfg, run_dir=run_dir, progress=False)
        rows = []
        try:
            trainer._last_time = time.perf_counter()
            for step in range(steps):
                rows.append(trainer.train_step(step))
        finally:
            trainer.close()
    finally:
        ray.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    timed = rows[1:]
    s = statistics.mean(r["step_seconds"] for r in timed)
    batch = actors * cfg.data.batch_size * cfg.training.micro_batches
    return {"actors": actors, "preset": preset, "global_batch": batch, "seconds_per_step": s, "steps_per_s": 1 / s,
            "samples_per_s": batch / s, "reduce_seconds": statistics.mean(r["reduce_seconds"] for r in timed),
            "grad_slot_wait_seconds": statistics.mean(r["grad_slot_wait_seconds"] for r in timed),
            "compute_threads": cfg.runtime.compute_threads, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dataparallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--json", action="store_true")
    args, extra = p.parse_known_args(argv)
    overrides = parse_overrides(extra)
    results = [run(args.preset, n, args.steps, overrides) for n in args.actors]
    base = next((r for r in results if r["actors"] == 1), results[0])
    for r in results:
        r["samples_per_s_ratio"] = r["samples_per_s"] / base["samples_per_s"]
    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    print(f"{'actors':>6}{'batch':>7}{'s/step':>9}{'steps/s':>9}{'samples/s':>11}{'ratio':>7}{'sum s':>8}"
          f"{'slot wait':>11}")
    for r in results:
        print(f"{r['actors']:>6}{r['global_batch']:>7}{r['seconds_per_step']:>9.3f}{r['steps_per_s']:>9.2f}"
              f"{r['samples_per_s']:>11.2f}{r['samples_per_s_ratio']:>7.2f}{r['reduce_seconds']:>8.3f}"
              f"{r['grad_slot_wait_seconds']:>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
