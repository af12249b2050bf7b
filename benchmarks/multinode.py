"""Two nodes against one (``runtime.nodes``) on a local Ray cluster: steps/s of the same global
batch, and the bytes the stores send each other per step against the planner's count.

    python -m benchmarks.multinode [--steps 6] [--preset tiny] [--batch 1] [--json] [--SECTION.FIELD VALUE ...]

Runs the main job (Trainer, decoder pool, stores, compute actors) three times on the same global
batch (the same clips): on a one-node Ray (two CPUs) one compute actor of batch ``2 x batch`` with
one torch thread, then with two (both cores); then on a Ray cluster of two nodes on this machine
(``ray.cluster_utils.Cluster``, one CPU each) one compute actor per node of batch ``batch`` with
one thread each. Both nodes share this machine's cores, memory
and object store, so the ratio says what the extra store, the owners' sums and the weights sent
back cost here, not what two machines would gain. The first step (start-up) is left out of the
means. ``network_bytes`` is what the stores reported sending per step (all nodes together);
``planned`` is ``megaslide_ray/planning/scaleout.py``'s per-node count summed over the nodes
(shard l owned by node l % 2).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import ray
from ray.cluster_utils import Cluster

from megaslide_ray.config import build_config, parse_overrides
from megaslide_ray.driver import Trainer, resolve_data
from megaslide_ray.models.registry import build_shard, num_shards
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.planning.scaleout import network_bytes, owner_params, scale_out


def planned_bytes(cfg, nodes: int, wb: int) -> tuple[int, int]:
    """(the planner's bytes for the busiest node, the same formula summed over every node)."""
    counts = [ShardLayout.of(build_shard(cfg, i, "meta"), i).numel for i in range(num_shards(cfg))]
    P = sum(counts)
    busiest = scale_out(counts, wb, 1, nodes, cfg.runtime.grad_slots, 1, 25.0, 0, 0, 0, 0, "").network_bytes
    assert owner_params(counts, nodes) >= P / nodes
    total = sum(network_bytes(P, sum(c for i, c in enumerate(counts) if i % nodes == node), wb, nodes)
                for node in range(nodes))
    return busiest, total


def run(preset: str, nodes: int, batch: int, steps: int, overrides: dict, threads: int = 1) -> dict:
    ov = {"training.steps": steps, "training.log_every": steps, "training.checkpoint_every": 0,
          "runtime.nodes": nodes, "data.batch_size": batch * (2 // nodes), "runtime.compute_threads": threads,
          "runtime.optimizer_threads": 1, **overrides}
    cfg = build_config(preset, None, ov)
    resolve_data(cfg)
    run_dir = tempfile.mkdtemp(prefix="megaslide-mn-")
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    rows = []
    try:
        trainer._last_time = time.perf_counter()
        for step in range(steps):
            rows.append(trainer.train_step(step))
    finally:
        trainer.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    timed = rows[1:]
    s = statistics.mean(r["step_seconds"] for r in timed)
    out = {"nodes": nodes, "compute_threads": threads, "preset": preset, "global_batch": 2 * batch, "seconds_per_step": s, "steps_per_s": 1 / s,
           "network_bytes_per_step": statistics.mean(r["network_bytes"] for r in timed),
           "first_loss": rows[0]["loss"], "last_loss": rows[-1]["loss"]}
    if nodes > 1:
        out["planned_busiest_node"], out["planned_all_nodes"] = planned_bytes(cfg, nodes, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.multinode", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=1, help="clips per compute actor on two nodes (one node: twice)")
    p.add_argument("--json", action="store_true")
    args, rest = p.parse_known_args(argv)
    overrides = parse_overrides(rest)
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="megaslide", logging_level="ERROR")
    try:
        rows = [run(args.preset, 1, args.batch, args.steps, overrides, threads) for threads in (1, 2)]
    finally:
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, namespace="megaslide", logging_level="ERROR")
    try:
        rows.append(run(args.preset, 2, args.batch, args.steps, overrides))
    finally:
        ray.shutdown()
        cluster.shutdown()
    base = rows[0]["steps_per_s"]
    for r in rows:
        r["ratio_to_one_node"] = r["steps_per_s"] / base
        if args.json:
            print(json.dumps(r))
    if not args.json:
        print(f"{'nodes':>5} {'thr':>3} {'batch':>5} {'s/step':>8} {'steps/s':>8} {'ratio':>6} {'net B/step':>11} "
              f"{'planned':>11} {'loss first->last':>18}")
        for r in rows:
            print(f"{r['nodes']:>5} {r['compute_threads']:>3} {r['global_batch']:>5} {r['seconds_per_step']:>8.3f} {r['steps_per_s']:>8.3f} "
                  f"{r['ratio_to_one_node']:>6.2f} {r['network_bytes_per_step']:>11,.0f} "
                  f"{r.get('planned_all_nodes', 0):>11,} {r['first_loss']:>8.4f} -> {r['last_loss']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
