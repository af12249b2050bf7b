"""The fault matrix: one injected failure per run, through the real Ray actors; does the run
recover, do its final parameters equal the uninterrupted run's, and what did recovery cost?

    python -m benchmarks.faults [--steps 4] [--json] [--only compute.mid_backward ...] [--nodes 2]

Each row kills (or hangs) one actor at one point of a step (``megaslide_ray/runtime/faults.py``), in
step 3 of a 4-step run that checkpoints every 2 steps (the checkpoint fault: in the step-2
checkpoint), on a small model. Columns:

* ``recovered``: the run reached its last step;
* ``equal``: every shard's final fp32 master weights are bit-identical to the uninterrupted run
  (``None`` for a decoder hang: the file that hung is skipped from then on, so that run trains
  on other clips by design; its other columns still count);
* ``restarts`` / ``rollbacks``: actor failures recovered from / checkpoint restores;
* ``recover_s``: driver time spent recovering (waiting for a restarted store, replacing the
  compute actor, replacing a decoder incl. the watchdog's timeout, or rebuilding from a
  checkpoint), as the pipeline measures it;
* ``extra_s``: the run's wall time minus the uninterrupted run's (includes redone work and
  new worker processes), the baseline measured in the same invocation.

``--nodes M`` runs the matrix on a run on M nodes (``runtime.nodes``): a local Ray cluster of M
node managers on this machine (``ray.cluster_utils.Cluster``, one CPU each, each node its own
store and state directory), batch 1 per node. The compute and store faults fire on the last node
(``/M-1`` in the spec), the checkpoint fault in node 0's store (it writes them); equal means
bit-identical to the uninterrupted M-node run. Its last row loses a whole node (``lose_node``: the
node's Ray node manager is killed mid-backward): that run must stop with ``NodeLostError`` and
the ``--resume`` command (``stopped`` column), not recover.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import ray
import torch

from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver import Trainer
from megaslide_ray.runtime import faults
from megaslide_ray.state.checkpoint import read_checkpoint_shards

SMALL = {"model.depth": 2, "model.hidden_size": 64, "model.num_heads": 2, "model.caption_dim": 32,
         "model.patch_size": "2,8,8", "data.num_frames": 8, "data.height": 32, "data.width": 32,
         "training.checkpoint_every": 2, "optim.grad_clip": 0.05, "data.decode_timeout_s": 5.0,
         "runtime.max_restarts": 3}

FAULTS = [
    ("compute.before_weights", "exit"),
    ("compute.after_weights", "exit"),
    ("compute.mid_forward", "exit"),
    ("compute.mid_backward", "exit"),
    ("store.mid_update", "exit"),
    ("store.mid_shard_update", "exit"),
    ("store.mid_checkpoint", "exit"),  # fires in the checkpoint of --checkpoint-fault-step
    ("decoder.mid_batch", "exit"),
    ("decoder.mid_batch", "hang"),
]


NODE_FAULTS = [  # (point, action, node: None for any)
    ("compute.mid_forward", "exit", -1),
    ("compute.mid_backward", "exit", -1),
    ("store.after_last_report", "exit", -1),
    ("store.mid_update", "exit", -1),
    ("store.mid_update", "exit", 0),
    ("store.mid_shard_update", "exit", -1),
    ("store.mid_checkpoint", "exit", None),
    ("decoder.mid_batch", "exit", None),
    ("compute.mid_backward", "lose_node", -1),  # last: the cluster has a node less after it
]

HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}
"""A lost node is noticed within seconds (Ray's defaults take about half a minute)."""


def start_cluster(nodes: int):
    """A local Ray cluster of ``nodes`` node managers, one CPU each; connects this process."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "_system_config": HEALTH_CHECK})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace="megaslide", logging_level="ERROR")
    return cluster


def run_once(cfg, root: Path, name: str, spec: str) -> dict:
    run_dir = root / name
    if spec:
        os.environ[faults.ENV_SPEC] = spec
        os.environ[faults.ENV_DIR] = str(root / f"{name}-faults")
    t0 = time.perf_counter()
    trainer = None
    try:
        trainer = Trainer(cfg, run_dir=str(run_dir), progress=False)
        summary = trainer.train()
        wall = time.perf_counter() - t0
        return {"summary": summary, "wall": wall, "recover_s": trainer.pipeline.recovery_seconds,
                "params": read_checkpoint_shards(Path(summary.checkpoint)), "error": ""}
    except Exception as e:  # noqa: BLE001 - a failed recovery is a result here
        return {"summary": None, "wall": time.perf_counter() - t0, "recover_s": float("nan"), "params": None,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", "resume": "--resume" in str(e)}
    finally:
        if trainer is not None:
            trainer.close()
        os.environ.pop(faults.ENV_SPEC, None)
        os.environ.pop(faults.ENV_DIR, None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fault-step", type=int, default=3, help="1-based step the fault fires in")
    p.add_argument("--checkpoint-fault-step", type=int, default=2,
                   help="store.mid_checkpoint fires in the checkpoint after this step (one is written every 2)")
    p.add_argument("--only", nargs="*", default=None, help="fault points to run (default: all)")
    p.add_argument("--nodes", type=int, default=1, help="a run on this many nodes of a local Ray cluster (default 1)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="megaslide-faults-bench-"))
    manifest = ensure_demo_dataset(root / "cache", num_videos=6)
    over = {**SMALL, "data.manifest": str(manifest), "training.steps": args.steps}
    if args.nodes > 1:  # (the state under the run's folder: a lost node's store leaves its own behind)
        over.update({"runtime.nodes": args.nodes, "data.batch_size": 1, "runtime.state_dir": str(root)})
    cfg = build_config("tiny", None, over)
    cluster = None
    if args.nodes > 1:
        cluster = start_cluster(args.nodes)
        matrix = [(point, action, args.nodes - 1 if node == -1 else node) for point, action, node in NODE_FAULTS]
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="megaslide", logging_level="ERROR")
        matrix = [(point, action, None) for point, action in FAULTS]
    rows = []
    try:
        base = run_once(cfg, root, "baseline", "")
        if base["error"]:
            raise SystemExit(f"the uninterrupted run failed: {base['error']}")
        for point, action, node in matrix:
            if args.only and point not in args.only:
                continue
            at = args.checkpoint_fault_step if point == "store.mid_checkpoint" else args.fault_step
            spec = f"{point}@{at}" + ("" if node is None else f"/{node}") + f":{action}"
            name = spec.replace(":", "-").replace("@", "-").replace("/", "-node")
            r = run_once(cfg, root, name, spec)
            s = r["summary"]
            equal = (r["params"] is not None and len(r["params"]) == len(base["params"])
                     and all(torch.equal(a, b) for a, b in zip(r["params"], base["params"])))
            if action == "hang":  # the hung file is skipped from then on: other data by design
                equal = None
            lost = action == "lose_node"
            row = {"fault": spec, "fired": faults.fired(spec, directory=root / f"{name}-faults"),
                   "recovered": bool(s and s.last_step == args.steps), "equal": None if lost else equal,
                   "stopped": (r["error"].startswith("NodeLostError") and r.get("resume", False)) if lost else None,
                   "restarts": s.restarts if s else None, "rollbacks": s.rollbacks if s else None,
                   "recover_s": round(r["recover_s"], 2), "extra_s": round(r["wall"] - base["wall"], 2),
                   "error": r["error"]}
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    if not args.json:
        print(f"uninterrupted run: {base['wall']:.1f} s for {args.steps} steps")
        print(f"{'fault':38s} {'fired':>5s} {'recovered':>9s} {'equal':>5s} {'restarts':>8s} {'rollbacks':>9s} "
              f"{'recover_s':>9s} {'extra_s':>8s}")
        for r in rows:
            print(f"{r['fault']:38s} {str(r['fired']):>5s} {str(r['recovered']):>9s} {str(r['equal']):>5s} "
                  f"{str(r['restarts']):>8s} {str(r['rollbacks']):>9s} {r['recover_s']:>9.2f} {r['extra_s']:>8.2f}"
                  + (f"  stopped with --resume: {r['stopped']}" if r["stopped"] is not None else "")
                  + (f"  {r['error']}" if r["error"] else ""))
    return 0 if all((r["stopped"] if r["stopped"] is not None else r["recovered"] and r["equal"] is not False)
                    and r["fired"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
