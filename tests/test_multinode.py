"""Two Ray nodes on one machine (``ray.cluster_utils.Cluster``): the store pinned to one, the
compute actor to the other. The compute actor sees a different node id and moves weights and
gradients as object refs; the result equals the single-process shared-memory run."""

import numpy as np
import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset
from pipelines.streaming import RayStoreClient

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
