"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``).

* The store pinned to one node, the compute actor to the other: the compute actor sees a different
  node id and moves weights and gradients as object refs; the result equals the single-process
  shared-memory run.
* A run on two nodes (``runtime.nodes = 2``, ``pipelines/multinode.py``): one store per node, each
  node's compute actor beside its store (shared memory); the owners sum the nodes' gradients and
  send the new weights back. It equals a one-node run of the same global batch (fp32, 1e-6
  relative), each node holds the optimizer state of its own shards only, the bytes the stores send
  are the planner's count, a checkpoint of two nodes resumes on one (and one node's on two), and
  a lost node stops with the ``--resume`` command. (Recovery from a dead actor on two nodes:
  ``tests/test_multinode_faults.py``.)
"""

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import ray
import torch
from conftest import CLI_SMALL, EXACT, run_cli
from ray.cluster_utils import Cluster

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver import Trainer
from megaslide_ray.planning.scaleout import scale_out
from megaslide_ray.runtime import faults
from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_shards
from megaslide_ray.state.segments import map_segment
from pipelines.multinode import (
    NodeLostError,
    NodeStores,
    NodesUnavailableError,
    StoreCallError,
    alive_nodes,
    on_node,
    pick_nodes,
)
from pipelines.store_client import RayStoreClient

SMALL = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
         "training.steps": 3}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"store_node": 1}})
    c.add_node(num_cpus=1, resources={"compute_node": 1})
    ray.init(address=c.address, namespace="megaslide-test", logging_level="ERROR")
    yield c
    ray.shutdown()
    c.shutdown()


def test_two_nodes_use_object_refs_and_match_single_node(cluster, tmp_path):
    manifest = str(ensure_demo_dataset(tmp_path / "cache", num_videos=4))
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path)})
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(3)]

    # Single process, shared memory.
    store = ParameterStore(cfg, str(tmp_path / "local"))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    for step, b in enumerate(batches):
        compute.train_step(b, step)
        store.wait_step(step)
    expected = [s["w"].clone() for s in store.seg]
    compute.close()
    store.close()

    # Two nodes.
    remote_store = ray.remote(ParameterStore).options(
        num_cpus=0, max_concurrency=16, resources={"store_node": 0.1}).remote(cfg, str(tmp_path / "remote"))
    infos = ray.get(remote_store.shard_infos.remote())
    store_node = ray.get(remote_store.status.remote()).node_id
    remote_compute = ray.remote(ComputeActor).options(num_cpus=1, resources={"compute_node": 0.1}).remote(
        cfg, infos, RayStoreClient(remote_store), "auto", store_node)
    try:
        assert ray.get(remote_compute.transport_name.remote()) == "object_ref"
        assert ray.get(remote_compute.node_id.remote()) != store_node
        for step, b in enumerate(batches):
            ray.get(remote_compute.train_step.remote(ray.put(b), step))
            ray.get(remote_store.wait_step.remote(step))
        for i, exp in enumerate(expected):
            raw = ray.get(remote_store.get_weights.remote(i, len(batches)))
            got = torch.from_numpy(np.array(raw)).view(torch.float32)
            assert torch.equal(got, exp), f"shard {i} differs between the two-node and single-node runs"
    finally:
        ray.get(remote_store.close.remote())
        ray.kill(remote_compute)
        ray.kill(remote_store)


# -- runtime.nodes = 2 ------------------------------------------------------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def two(cluster, tmp_path_factory):
    """The demo manifest and its first ``STEPS`` global batches of 2 clips (one decoder). (On the
    4-video set the head's weights are so ill-conditioned after 3 steps that even two compute actors
    on one node differ from one actor of batch 2 by 4e-5: fp32 rounding that AdamW amplifies.)"""
    root = tmp_path_factory.mktemp("two")
    manifest = str(ensure_demo_dataset(root / "cache", num_videos=6))  # the data of test_dataparallel.py
    cfg = build_config("tiny", None, {**EXACT, "data.manifest": manifest, "data.batch_size": 2})
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(STEPS)]
    return manifest, batches


def config(manifest, state_dir, **extra):
    return build_config("tiny", None, {**EXACT, "data.manifest": manifest, "runtime.state_dir": str(state_dir),
                                       **extra})


def half(batch: dict, r: int) -> dict:
    """Clip r of a batch of two: node r's batch slot."""
    return {k: v[r:r + 1] if np.ndim(v) and len(v) == 2 else v for k, v in batch.items()}


def one_node(cfg, run_dir, batches, first_step=0, resume=None):
    """One store and one compute actor in this process, batch 2: the weights after ``batches``."""
    store = ParameterStore(cfg, run_dir, resume_checkpoint=resume)
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        for step, b in enumerate(batches, first_step):
            compute.train_step(b, step)
            store.wait_step(step)
        return [s["w"].clone() for s in store.seg]
    finally:
        compute.close()
        store.close()


class TwoNodes:
    """A store and a compute actor on each of the cluster's two nodes."""

    def __init__(self, cfg, run_dir, resume=None, fault=None):
        """``fault``: (spec, directory) of a fault for node 1's compute actor (runtime/faults.py)."""
        self.nodes = pick_nodes(2)
        self.stores = NodeStores(cfg, run_dir, self.nodes, {}, resume_checkpoint=resume)
        self.computes = []
        for r, node in enumerate(self.nodes):
            infos = ray.get(self.stores.handles[r].shard_infos.remote())
            env = ({"runtime_env": {"env_vars": {faults.ENV_SPEC: fault[0], faults.ENV_DIR: fault[1]}}}
                   if fault and r == 1 else {})
            self.computes.append(ray.remote(ComputeActor).options(num_cpus=1, **on_node(node["NodeID"]), **env).remote(
                cfg, infos, RayStoreClient(self.stores.handles[r]), "auto", node["NodeID"], 0, None, r, 2))
        self.updates = []

    def step(self, step, batch):
        ray.get([c.train_step.remote(ray.put(half(batch, r)), step) for r, c in enumerate(self.computes)])
        self.updates.append(self.stores.wait_step(step))

    def weights(self, node, version):
        h = self.stores.handles[node]
        infos = ray.get(h.shard_infos.remote())
        return [torch.from_numpy(np.array(ray.get(h.get_weights.remote(i, version)))).view(torch.float32)
                for i in range(len(infos))]

    def close(self):
        for c in self.computes:
            ray.kill(c)
        self.stores.close()


def assert_close(got, want, rtol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        rel = float((a - b).norm() / b.norm())
        assert rel < rtol, f"shard {i}: relative difference {rel:.2e}"


@pytest.mark.slow  # 14 s of Ray drill, run by CI every time (core): the object-ref equality test above stays in the default run
@pytest.mark.core
def test_two_nodes_equal_one_node_of_the_same_global_batch(two, tmp_path):
    manifest, batches = two
    cfg1 = config(manifest, tmp_path, **{"data.batch_size": 2})
    want = one_node(cfg1, str(tmp_path / "one"), batches)
    initial = one_node(cfg1, str(tmp_path / "init"), [])
    cfg2 = config(manifest, tmp_path, **{"data.batch_size": 1, "runtime.nodes": 2})
    run = TwoNodes(cfg2, str(tmp_path / "two"))
    try:
        assert ray.get(run.computes[0].node_id.remote()) != ray.get(run.computes[1].node_id.remote())
        assert all(ray.get(c.transport_name.remote()) == "shm" for c in run.computes)
        for step, b in enumerate(batches):
            run.step(step, b)
        for node in (0, 1):  # every node holds the same w: the owners' updates reached the other
            assert_close(run.weights(node, STEPS), want)
        assert min(float((a - b).norm() / b.norm()) for a, b in zip(want, initial)) > 1e-3  # it trained

        # Host state: w of every shard, master/m/v of the owned ones only (shard l on node l % 2).
        statuses = run.stores.status()
        numels = [info.numel for info in ray.get(run.stores.handles[0].shard_infos.remote())]
        P = sum(numels)
        for node, st in enumerate(statuses):
            own = sum(n for i, n in enumerate(numels) if i % 2 == node)
            assert st.state_bytes == 4 * P + 12 * own
            files = {f.name for f in Path(st.state_dir).iterdir()}
            for i in range(len(numels)):
                for kind in ("master", "m", "v"):
                    assert (f"shard_{i:04d}.{kind}" in files) == (i % 2 == node), (node, i, kind)
                assert f"shard_{i:04d}.w" in files
            held = sum((Path(st.state_dir) / f).stat().st_size for f in files if f.startswith("shard_"))
            assert held == 4 * P + 12 * own
        assert statuses[0].state_dir != statuses[1].state_dir

        # Bytes sent between the nodes per step: the planner's network term (busiest node).
        plan = scale_out(numels, 4, 1, 2, cfg2.runtime.grad_slots, 1, 25.0, 0, 0, 0, 0, "")
        for combined, per_node in run.updates:
            sent = [r.network_bytes for r in per_node]
            for node in (0, 1):
                own = sum(n for i, n in enumerate(numels) if i % 2 == node)
                assert sent[node] == 4 * ((P - own) + own)
            assert max(sent) == plan.network_bytes
            assert combined.network_bytes == sum(sent)
    finally:
        run.close()


@pytest.mark.slow  # 20 s: three runs; the two-node equality tests stay in the default run
def test_a_two_node_checkpoint_resumes_on_one_node_and_back(two, tmp_path):
    manifest, batches = two
    cfg1 = config(manifest, tmp_path, **{"data.batch_size": 2})
    want = one_node(cfg1, str(tmp_path / "one"), batches)
    cfg2 = config(manifest, tmp_path, **{"data.batch_size": 1, "runtime.nodes": 2})
    run_dir = tmp_path / "two"
    run = TwoNodes(cfg2, str(run_dir))
    try:
        for step, b in enumerate(batches[:2]):
            run.step(step, b)
        path = run.stores.save_checkpoint(str(run_dir), 2, {})
    finally:
        run.close()
    assert Path(path) == latest_checkpoint(run_dir)
    # Two nodes -> one node: the last step on one node equals the uninterrupted one-node run.
    assert_close(one_node(cfg1, str(tmp_path / "resumed"), batches[2:], 2, resume=path), want)
    # One node -> two nodes: a one-node checkpoint of step 2, its last step on two nodes.
    one_dir = tmp_path / "one-ckpt"
    store = ParameterStore(cfg1, str(one_dir), resume_checkpoint=path)
    one_path = store.save_checkpoint(str(one_dir), 2, {})
    store.close()
    run = TwoNodes(cfg2, str(tmp_path / "two-again"), resume=one_path)
    try:
        run.step(2, batches[2])
        assert_close(run.weights(1, STEPS), want)
    finally:
        run.close()


@pytest.mark.slow  # 12 s of Ray drill, run by CI every time (core): the default run stays under 10 minutes
@pytest.mark.core
def test_a_lost_node_stops_the_run_with_the_resume_command(two, tmp_path):
    manifest, batches = two
    cfg2 = config(manifest, tmp_path, **{"data.batch_size": 1, "runtime.nodes": 2})
    run_dir = tmp_path / "lost"
    run = TwoNodes(cfg2, str(run_dir))
    try:
        run.step(0, batches[0])
        path = run.stores.save_checkpoint(str(run_dir), 1, {})
        ray.kill(run.stores.handles[1], no_restart=True)
        with pytest.raises(StoreCallError) as failed:
            run.stores.wait_step(1)
        assert failed.value.node == 1
        with pytest.raises(NodeLostError) as err:  # the driver's recovery: that store cannot come back
            run.stores.recover(1, timeout=30)
        text = str(err.value)
        assert "node 1 of 2" in text and alive_nodes()[1]["NodeID"][:12] in text
        assert f"python -m megaslide_ray.train --run-dir {run_dir} --resume" in text and str(path) in text
    finally:
        run.close()


def test_more_nodes_than_the_cluster_has_are_refused(cluster):
    with pytest.raises(RuntimeError, match="runtime.nodes=3 asks for 3 nodes but the Ray cluster has 2"):
        pick_nodes(3)
    with pytest.raises(NodesUnavailableError, match="needs 2 nodes of 1 GPUs, but 0 of the cluster's alive nodes"):
        pick_nodes(2, gpus=1)  # the GPU compute actors of each node need its GPUs


# -- the Trainer on two nodes -------------------------------------------------------------------------


def trainer_run(cfg, run_dir, resume=False):
    """Train ``cfg`` with the Trainer to the end: (summary, the last checkpoint's master weights)."""
    trainer = Trainer(cfg, run_dir=str(run_dir), progress=False, resume=resume)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    return summary, read_checkpoint_shards(Path(summary.checkpoint))


@pytest.mark.slow
def test_the_trainer_on_two_nodes_equals_one_node_and_resumes_on_one(two, tmp_path):
    manifest, _ = two
    steps = {"training.steps": 3, "training.checkpoint_every": 2}
    _, want = trainer_run(config(manifest, tmp_path, **steps, **{"data.batch_size": 2}), tmp_path / "one")
    cfg2 = config(manifest, tmp_path, **steps, **{"data.batch_size": 1, "runtime.nodes": 2})
    summary, got = trainer_run(cfg2, tmp_path / "two")
    assert summary.last_step == 3
    assert_close(got, want)
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows[-1]["compute_actors"]) == 2  # one per node
    # The two-node run's step-2 checkpoint, its last step on one node.
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "two", again)
    shutil.rmtree(again / "checkpoints" / "step_3")
    (again / "checkpoints" / "latest").write_text("step_2\n")
    resumed, got1 = trainer_run(config(manifest, tmp_path, **steps, **{"data.batch_size": 2}), again, resume=True)
    assert resumed.first_step == 2
    assert_close(got1, want)


@pytest.mark.slow  # 18 s: the run-level twin of the lost-node test above, which stays in the default run
def test_the_trainer_stops_on_a_lost_node_with_the_resume_command(two, tmp_path):
    manifest, _ = two
    cfg2 = config(manifest, tmp_path, **{"training.steps": 4, "training.checkpoint_every": 1, "data.batch_size": 1,
                                         "runtime.nodes": 2})
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg2, run_dir=str(run_dir), progress=False)
    try:
        trainer.train_step(0)
        ckpt = latest_checkpoint(run_dir)
        assert ckpt is not None
        ray.kill(trainer.pipeline.actor_handles().stores[1], no_restart=True)
        with pytest.raises(NodeLostError) as err:
            trainer.train_step(1)
    finally:
        trainer.close()
    text = str(err.value)
    assert "node 1 of 2" in text and "was lost" in text
    assert f"python -m megaslide_ray.train --run-dir {run_dir} --resume" in text and str(ckpt) in text


def test_the_trainer_refuses_more_nodes_than_the_cluster_has(two, tmp_path):
    manifest, _ = two
    with pytest.raises(NodesUnavailableError, match="runtime.nodes=3 asks for 3 nodes but the Ray cluster has 2"):
        Trainer(config(manifest, tmp_path, **{"runtime.nodes": 3}), run_dir=str(tmp_path / "run"), progress=False)
    assert not list(tmp_path.glob("megaslide-*"))  # no store started: no state directory


def test_the_cli_refuses_several_nodes_without_a_ray_cluster(tmp_path):
    proc = run_cli([*CLI_SMALL, "--steps", "1", "--run-dir", str(tmp_path / "run"), "--runtime.nodes", "2"],
                   {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache")}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "runtime.nodes=2 trains on 2 nodes of a Ray cluster" in proc.stderr and "--ray.address" in proc.stderr


def test_init_from_on_two_nodes_fills_every_copy_and_each_owners_state(two, tmp_path):
    """``--init-from`` on several nodes: every node's ``w`` of every shard is the source's weights,
    and each owner's master, m, v are those a one-node store gets from it."""
    manifest, _ = two
    source = ParameterStore(config(manifest, tmp_path, **{"training.seed": 7}), str(tmp_path / "source"))
    try:
        path = source.save_checkpoint(str(tmp_path / "source"), 0, {})
    finally:
        source.close()
    one = ParameterStore(config(manifest, tmp_path), str(tmp_path / "one"), init_from=path)
    fresh = ParameterStore(config(manifest, tmp_path), str(tmp_path / "fresh"))  # seed 0: not the source
    try:
        want = [s["w"].clone() for s in one.seg]
        assert not all(torch.equal(a, s["w"]) for a, s in zip(want, fresh.seg))
        cfg2 = config(manifest, tmp_path, **{"data.batch_size": 1, "runtime.nodes": 2})
        stores = NodeStores(cfg2, str(tmp_path / "two"), pick_nodes(2), {}, init_from=path)
        try:
            for node, h in enumerate(stores.handles):
                for i, w in enumerate(want):
                    got = torch.from_numpy(np.array(ray.get(h.get_weights.remote(i, 0)))).view(torch.float32)
                    assert torch.equal(got, w), f"node {node}, shard {i}"
            for i in range(len(want)):
                state = ray.get(stores.handles[i % 2].shard_state.remote(i, 0))
                assert torch.equal(torch.from_numpy(np.array(state["master"])), one.seg[i]["master"])
                assert not np.asarray(state["m"]).any() and not np.asarray(state["v"]).any()
        finally:
            stores.close()
    finally:
        one.close()
        fresh.close()


def test_bf16_stores_on_two_nodes_equal_one_store_fed_the_fp32_sum(two, tmp_path):
    """The CUDA runs' path (``w`` in bf16; the owner sums in its fp32 update scratch), fed gradients
    directly: each node's gradient written into its own ``w`` segments, as a compute actor does."""
    manifest, _ = two
    cfg = config(manifest, tmp_path, **{"runtime.nodes": 2, "optim.grad_clip": 0.5})
    ref = ParameterStore(config(manifest, tmp_path, **{"optim.grad_clip": 0.5}), str(tmp_path / "ref"),
                         w_dtype="bfloat16")
    stores = NodeStores(cfg, str(tmp_path / "two"), pick_nodes(2), {}, w_dtype="bfloat16")
    try:
        infos = [ray.get(h.shard_infos.remote()) for h in stores.handles]
        w = [[map_segment(info.paths["w"], info.numel, torch.bfloat16) for info in node] for node in infos]
        gen = torch.Generator().manual_seed(0)
        for step in range(3):
            parts = [[torch.randn(info.numel, generator=gen).to(torch.bfloat16) for info in infos[0]] for _ in (0, 1)]
            refs = []
            for node in (0, 1):
                for i, g in enumerate(parts[node]):
                    ray.get(stores.handles[node].wait_version.remote(i, step))  # as a compute actor's fetch does
                    w[node][i].copy_(g)
                    refs.append(stores.handles[node].report_grad.remote(i, step, float(g.float().square().sum())))
            for i in range(len(infos[0])):  # the reference: one store, the fp32 sum rounded once
                total = (parts[0][i].float() + parts[1][i].float()).to(torch.bfloat16)
                ref.seg[i]["w"].copy_(total)
                ref.report_grad(i, step, float(torch.linalg.vector_norm(total, dtype=torch.float32).square()))
            ray.get(refs)
            (update, _), want = stores.wait_step(step), ref.wait_step(step)
            assert update.clip_coef < 1 and math.isclose(update.grad_norm, want.grad_norm, rel_tol=1e-12)
        for i in range(len(infos[0])):
            owner = stores.handles[i % 2]
            master = torch.from_numpy(np.array(ray.get(owner.shard_state.remote(i, 3))["master"]))
            assert_close([master], [ref.seg[i]["master"]])
            ray.get([h.wait_version.remote(i, 3) for h in stores.handles])
            assert torch.equal(w[0][i], w[1][i])  # the owner's new w reached the other node as it is
            assert torch.equal(w[i % 2][i], master.to(torch.bfloat16))
    finally:
        ref.close()
        stores.close()


@pytest.mark.slow  # about 19 s of Ray drill: the default run keeps it under 10 minutes
def test_a_nan_on_one_node_skips_the_update_on_every_node(two, tmp_path):
    """A compute actor on node 1 poisons step 2 (a NaN loss): its node-sum's norm is NaN, the owners
    of every shard skip the update, and the weights sent back are step 1's everywhere."""
    manifest, batches = two
    cfg2 = config(manifest, tmp_path, **{"data.batch_size": 1, "runtime.nodes": 2})
    once = TwoNodes(cfg2, str(tmp_path / "once"))
    try:
        once.step(0, batches[0])
        want = once.weights(1, 1)
    finally:
        once.close()
    run = TwoNodes(cfg2, str(tmp_path / "nan"), fault=("compute.loss@2:nan", str(tmp_path / "faults")))
    try:
        run.step(0, batches[0])
        run.step(1, batches[1])
        assert run.updates[-1][0].skipped and not run.updates[0][0].skipped
        for node in (0, 1):
            for a, b in zip(run.weights(node, 2), want):
                assert torch.equal(a, b)
    finally:
        run.close()
