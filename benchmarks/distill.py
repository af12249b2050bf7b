"""What distillation from the dense teacher costs a streamed step (``training.distill_weight``).

    python -m benchmarks.distill [--steps 6] [--preset tiny] [--weight 1.0] [--json] [--SECTION.FIELD VALUE ...]

The parameter store and the compute actor run in this process (no Ray) on the same batches,
started from the same dense weights (a random dense model of the preset, written to a temporary
safetensors file and given as ``training.init_from``), once with ``distill_weight = 0`` and once
with ``--weight``. Per step (the first of each run left out): the step's compute seconds, the
teacher's forward (``teacher_seconds``) and the host -> device bytes; the ratio on / off beside
the planner's prediction of the same ratio (its FLOPs executed with and without the teacher's
forward) and the teacher's host bytes against ``plan``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config, parse_overrides
from megaslide_ray.driver import resolve_data
from megaslide_ray.models.registry import build_model, teacher_config
from megaslide_ray.planning.estimate import plan


def run(cfg, batches: list, root: Path) -> tuple[list, int]:
    """The streamed steps of ``cfg`` on ``batches``; their results and the store's teacher bytes."""
    store = ParameterStore(cfg, str(root / f"run-{cfg.training.distill_weight}"), init_from=cfg.training.init_from)
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        results = []
        for step, batch in enumerate(batches):
            results.append(compute.train_step(batch, step))
            store.wait_step(step)
        return results, store.teacher_bytes()
    finally:
        compute.close()
        store.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--weight", type=float, default=1.0)
    p.add_argument("--json", action="store_true")
    args, extra = p.parse_known_args(argv)
    root = Path(tempfile.mkdtemp(prefix="megaslide-distill-"))
    over = {"attention.kind": "dsa", **parse_overrides(extra), "training.steps": args.steps,
            "runtime.state_dir": str(root), "training.init_from": str(root / "dense.safetensors")}
    off = build_config(args.preset, None, over)
    resolve_data(off)
    dense = build_model(teacher_config(off))
    g = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in dense.state_dict().items()},
              over["training.init_from"])
    on = build_config(args.preset, None, {**over, "data.manifest": off.data.manifest,
                                           "training.distill_weight": args.weight})
    with VideoDecoder(off.data, off.training.seed, off.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(args.steps)]
    rows = []
    for name, cfg in (("off", off), ("on", on)):
        results, teacher_bytes = run(cfg, batches, root)
        later = results[1:] or results
        planned = plan(cfg, w_dtype="float32")
        rows.append({"distill": name, "preset": args.preset, "seconds_per_step": statistics.mean(r.seconds for r in later),
                     "teacher_seconds": statistics.mean(r.teacher_seconds for r in later),
                     "h2d_bytes": later[-1].h2d_bytes, "teacher_bytes": teacher_bytes,
                     "planned_teacher_bytes": planned.teacher_bytes, "planned_flops": planned.flops_executed,
                     "last_loss": results[-1].loss, "last_distill_loss": results[-1].distill_loss})
    ratio, planned_ratio = (rows[1]["seconds_per_step"] / rows[0]["seconds_per_step"],
                            rows[1]["planned_flops"] / rows[0]["planned_flops"])
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"ratio_on_off": ratio, "planned_ratio_on_off": planned_ratio,
                          "teacher_share": rows[1]["teacher_seconds"] / rows[1]["seconds_per_step"]}))
        return 0
    print(f"{'distill':<8}{'s/step':>10}{'teacher s':>11}{'teacher MB':>12}{'planned MB':>12}{'distill loss':>14}")
    for r in rows:
        print(f"{r['distill']:<8}{r['seconds_per_step']:>10.3f}{r['teacher_seconds']:>11.3f}"
              f"{r['teacher_bytes'] / 1e6:>12.2f}{r['planned_teacher_bytes'] / 1e6:>12.2f}{r['last_distill_loss']:>14.5f}")
    share = rows[1]["teacher_seconds"] / rows[1]["seconds_per_step"]
    print(f"step time on / off: {ratio:.2f}; the teacher's forward is {share:.0%} of a step with it (planned from "
          f"FLOPs: on / off {planned_ratio:.2f}; CPU fp32, weights read in place)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
