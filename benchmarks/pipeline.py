"""Pipeline overhead: the main job (three Ray actors, shards, store AdamW) against the same model
trained in one process with ``torch.optim.AdamW`` on the same batches.

    python -m benchmarks.pipeline [--steps 12] [--preset tiny] [--json] [--SECTION.FIELD VALUE ...]

Both runs use every core for torch. The first step of each run (start-up, allocator warm-up) is
left out of the means. The overhead ratio = streamed s/step / in-process s/step; on one CPU
node the pipeline adds actor calls, per-shard version waits and block recomputation
(activation checkpointing: about one extra forward per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import ray

from actors.decoder import VideoDecoder
from megaslide_ray.config import build_config, parse_overrides
from megaslide_ray.driver import Trainer, resolve_data
from megaslide_ray.training.baseline import InProcessTrainer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--json", action="store_true")
    args, extra = p.parse_known_args(argv)
    overrides = {**parse_overrides(extra), "training.steps": args.steps, "training.log_every": args.steps}
    cfg = build_config(args.preset, None, overrides)
    resolve_data(cfg)

    # -- in-process baseline on the batches the streamed run will see
    with VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(args.steps)]
    base = InProcessTrainer(cfg)
    base_steps = [base.train_step(b) for b in batches]
    del base

    # -- the main job
    ray.init(address="local", num_cpus=cfg.ray.num_cpus or None, include_dashboard=False, namespace="megaslide",
             logging_level="ERROR")
    try:
        run_dir = tempfile.mkdtemp(prefix="megaslide-bench-")
        trainer = Trainer(cfg, run_dir=run_dir, progress=False)
        rows = []
        try:
            trainer._last_time = time.perf_counter()
            for step in range(args.steps):
                rows.append(trainer.train_step(step))
        finally:
            trainer.close()
    finally:
        ray.shutdown()

    tokens = cfg.data.batch_size * cfg.tokens_per_sample
    stream_s = statistics.mean(r["step_seconds"] for r in rows[1:])
    base_s = statistics.mean(s.seconds for s in base_steps[1:])
    results = [
        {"run": "in_process", "preset": args.preset, "tokens_per_step": tokens, "seconds_per_step": base_s,
         "tokens_per_s": tokens / base_s, "first_loss": base_steps[0].loss, "last_loss": base_steps[-1].loss},
        {"run": "streamed_actors", "preset": args.preset, "tokens_per_step": tokens, "seconds_per_step": stream_s,
         "tokens_per_s": tokens / stream_s, "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"],
         "compute_seconds": statistics.mean(r["compute_seconds"] for r in rows[1:]),
         "weight_wait_seconds": statistics.mean(r["weight_wait_seconds"] for r in rows[1:]),
         "optimizer_seconds": statistics.mean(r["optimizer_seconds"] for r in rows[1:]),
         "overhead_ratio": stream_s / base_s},
    ]
    if args.json:
        for r in results:
            print(json.dumps(r))
    else:
        print(f"{'run':<18}{'s/step':>10}{'tokens/s':>12}{'loss first->last':>22}")
        for r in results:
            print(f"{r['run']:<18}{r['seconds_per_step']:>10.3f}{r['tokens_per_s']:>12.0f}"
                  f"{r['first_loss']:>12.4f} -> {r['last_loss']:.4f}")
        s = results[1]
        print(f"overhead ratio (streamed / in-process): {s['overhead_ratio']:.2f}  "
              f"[compute {s['compute_seconds']:.3f} s, weight waits {s['weight_wait_seconds']:.3f} s, "
              f"store AdamW {s['optimizer_seconds']:.3f} s per step]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
