"""Failures of a run on two nodes (``runtime.nodes = 2``), on a local two-node Ray cluster.

Each drill injects its faults through ``MEGASLIDE_FAULT`` (``/1``: in node 1's actors only) into a
Trainer run of 4 steps with a checkpoint every 2, and compares the final weights with the
uninterrupted two-node run of the same config: bit for bit. A compute actor's death leaves every
shard's update undone (the step is redone on both nodes); a store killed between two shards of its
update is restarted by Ray on its shared memory and the update is finished (the step is not
redone); a store cut inside a shard rolls back to the checkpoint; a lost node (its node manager
killed) stops the run with the ``--resume`` command. The cluster notices a lost node within
seconds (``benchmarks.faults.HEALTH_CHECK``); that drill runs last: the cluster has one node after it.
"""

import os
from pathlib import Path

import pytest
import ray
import torch
from conftest import EXACT

from benchmarks.faults import start_cluster
from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver import Trainer
from megaslide_ray.runtime import faults
from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_shards
from pipelines.multinode import NodeLostError

STEPS = {"training.steps": 4, "training.checkpoint_every": 2, "data.batch_size": 1, "runtime.nodes": 2}


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(2)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def base(cluster, tmp_path_factory):
    """The demo manifest, the state root and the uninterrupted two-node run's final weights."""
    root = tmp_path_factory.mktemp("nodes")
    manifest = str(ensure_demo_dataset(root / "cache", num_videos=6))
    summary, weights = run(manifest, root, "base")
    assert summary.last_step == 4 and summary.restarts == 0
    return manifest, root, weights


def run(manifest, root, name, spec=""):
    """A 4-step two-node Trainer run with the faults ``spec``: (summary, last checkpoint's weights)."""
    cfg = build_config("tiny", None, {**EXACT, **STEPS, "data.manifest": manifest, "runtime.state_dir": str(root)})
    env = {faults.ENV_SPEC: spec, faults.ENV_DIR: str(root / f"{name}-faults")} if spec else {}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        trainer = Trainer(cfg, run_dir=str(root / name), progress=False)
        try:
            summary = trainer.train()
        finally:
            trainer.close()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return summary, read_checkpoint_shards(Path(summary.checkpoint))


def assert_fired(root, name, spec):
    for one in spec.split(","):
        assert faults.fired(one, directory=root / f"{name}-faults"), f"{one} did not fire"


def assert_recovered(base, name, spec, restarts, rollbacks):
    """A run with the faults ``spec`` fires them all, ends, and equals the uninterrupted run bit for bit."""
    manifest, root, want = base
    summary, got = run(manifest, root, name, spec)
    assert_fired(root, name, spec)
    assert summary.last_step == 4
    assert (summary.restarts, summary.rollbacks) == (restarts, rollbacks)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"shard {i}: max difference {float((a - b).abs().max()):.3e}"


@pytest.mark.slow  # with the module's cluster about 45 s: the default run keeps it under 10 minutes
def test_a_compute_actor_and_a_store_dying_on_node_1_are_recovered_bit_identically(base):
    assert_recovered(base, "compute-store", "compute.mid_backward@2/1:exit,store.mid_update@3/1:exit", 2, 0)


@pytest.mark.slow
def test_store_deaths_before_the_sum_in_a_checkpoint_and_inside_a_shard_are_recovered(base):
    """Node 1's store dies once its gradients are sent (step 2: redone), node 0's while writing
    the step-2 checkpoint (written again), node 1's inside a shard's update (step 3: rolled back
    to that checkpoint)."""
    spec = "store.after_last_report@2/1:exit,store.mid_checkpoint@2:exit,store.mid_shard_update@3/1:exit"
    assert_recovered(base, "stores", spec, 3, 1)


@pytest.mark.slow
def test_a_lost_node_stops_the_run_with_the_resume_command(base):
    """Last in this module: node 1's node manager is killed, so the cluster keeps one node."""
    manifest, root, _ = base
    spec = "compute.mid_backward@3/1:lose_node"
    with pytest.raises(NodeLostError) as err:
        run(manifest, root, "lost", spec)
    assert_fired(root, "lost", spec)
    text = str(err.value)
    ckpt = latest_checkpoint(root / "lost")
    assert ckpt is not None and ckpt.name == "step_2"
    assert "node 1 of 2" in text and "was lost" in text
    assert f"python -m megaslide_ray.train --run-dir {root / 'lost'} --resume" in text and str(ckpt) in text
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1
