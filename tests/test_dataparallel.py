"""Data parallelism on one node and layer-major micro-batches, in one process (no Ray): N compute
actors with batch b equal one actor with batch N x b, k micro-batches of b equal one batch of
k x b (fp32, to 1e-6 relative on the weights after several steps), and the store's fixed-order
fp32 sum is bit-identical run to run. The same through Ray (decoder pool, pipeline, faults,
resume) is in test_dataparallel_pipeline.py."""

import threading

import numpy as np
import pytest
import torch
from conftest import EXACT
from safetensors.torch import save_file

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.grad_reduce import GradientReducer, slot_value
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.models.registry import build_model
from megaslide_ray.training.flow import batch_conditioning, batch_flow_inputs

STEPS = 3


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return str(ensure_demo_dataset(tmp_path_factory.mktemp("cache"), num_videos=6))


def global_batches(manifest: str, size: int) -> list[dict]:
    """``STEPS`` batches of ``size`` clips, as one decoder with that batch size draws them."""
    cfg = build_config("tiny", None, {**EXACT, "data.manifest": manifest, "data.batch_size": size})
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
        return [dec.next_batch() for _ in range(STEPS)]


def split(batch: dict, n: int) -> list[dict]:
    """The n consecutive parts of a batch: what n compute actors' decoder slots hold."""
    size = len(batch["index"])
    per = size // n
    return [{k: v[r * per:(r + 1) * per] if np.ndim(v) and len(v) == size else v for k, v in batch.items()}
            for r in range(n)]


def train(tmp_path, manifest, batches, actors=1, tag="run", transport="shm", **overrides):
    """Train ``batches`` with ``actors`` compute actors (threads, each its part of every batch);
    returns the weights after the last update and each step's mean loss (with distillation,
    ``train.distill`` holds each step's mean term). ``transport``: ``shm`` or
    ``object_ref`` (gradients as bytes, copied into the slots by the store)."""
    cfg = build_config("tiny", None, {**EXACT, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                      "runtime.compute_actors": actors, **overrides})
    store = ParameterStore(cfg, str(tmp_path / tag), compute_actors=actors, init_from=cfg.training.init_from or None)
    computes = [ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store, r), transport, rank=r,
                             grad_slots=store.grad_slots()) for r in range(actors)]
    losses, train.distill = [], []
    try:
        for step, batch in enumerate(batches):
            results = [None] * actors
            errors = []

            def run(r, part):
                try:
                    results[r] = computes[r].train_step(part, step)
                except BaseException as e:  # noqa: BLE001 - re-raised below
                    errors.append(e)
            threads = [threading.Thread(target=run, args=(r, part)) for r, part in enumerate(split(batch, actors))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]
            update = store.wait_step(step)
            assert update.reduce_seconds > 0 or actors == 1
            losses.append(sum(r.loss for r in results) / actors)
            train.distill.append(sum(r.distill_loss for r in results) / actors)
        return [s["w"].clone() for s in store.seg], losses
    finally:
        for c in computes:
            c.close()
        store.close()


def assert_close(got, want, rtol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        rel = float((a - b).norm() / b.norm())
        assert rel < rtol, f"shard {i}: relative difference {rel:.2e}"


@pytest.mark.parametrize("actors", [2, 3])
def test_n_compute_actors_equal_one_with_n_times_the_batch(tmp_path, manifest, actors):
    batches = global_batches(manifest, actors)
    one, one_loss = train(tmp_path, manifest, batches, 1, "one", **{"data.batch_size": actors})
    many, many_loss = train(tmp_path, manifest, batches, actors, "many", **{"data.batch_size": 1})
    assert_close(many, one)
    np.testing.assert_allclose(many_loss, one_loss, rtol=1e-6)
    initial = train(tmp_path, manifest, [], 1, "init")[0]
    assert min(float((a - b).norm() / b.norm()) for a, b in zip(one, initial)) > 1e-3  # they really trained


def test_the_fixed_order_sum_is_bit_identical_run_to_run(tmp_path, manifest):
    batches = global_batches(manifest, 2)
    a, _ = train(tmp_path, manifest, batches, 2, "a", **{"data.batch_size": 1})
    b, _ = train(tmp_path, manifest, batches, 2, "b", **{"data.batch_size": 1})
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("k,overrides", [
    (2, {}),
    (3, {"runtime.recompute_blocks": "false"}),                      # kept graphs, one per micro-batch
    (2, {"runtime.offload_activations": "true", "runtime.link_gbps": "50", "runtime.offload_keep": "1"}),
], ids=["recompute", "kept-graphs", "offload"])
def test_micro_batches_equal_one_batch_of_k_times_b(tmp_path, manifest, k, overrides):
    batches = global_batches(manifest, k)
    whole, whole_loss = train(tmp_path, manifest, batches, 1, "whole", **{"data.batch_size": k, **overrides})
    micro, micro_loss = train(tmp_path, manifest, batches, 1, "micro",
                              **{"data.batch_size": 1, "training.micro_batches": k, **overrides})
    assert_close(micro, whole)
    np.testing.assert_allclose(micro_loss, whole_loss, rtol=1e-6)


def test_actors_and_micro_batches_together(tmp_path, manifest):
    batches = global_batches(manifest, 4)
    one, _ = train(tmp_path, manifest, batches, 1, "one", **{"data.batch_size": 4})
    both, _ = train(tmp_path, manifest, batches, 2, "both", **{"data.batch_size": 1, "training.micro_batches": 2})
    assert_close(both, one)


def test_distillation_with_actors_and_micro_batches_equals_one_batch(tmp_path, manifest):
    """Distillation from the dense teacher (``training.distill_weight``): 2 actors of 2 micro-batches
    equal one actor with their 4 clips, task loss, term and weights: each actor's and micro-batch's
    term is scaled like its loss."""
    dense = build_model(build_config("tiny", None, EXACT))
    g = torch.Generator().manual_seed(1)
    path = tmp_path / "dense.safetensors"
    save_file({k: torch.randn(v.shape, generator=g) * 0.1 for k, v in dense.state_dict().items()}, str(path))
    over = {"attention.kind": "dsa", "attention.window": "1,3,3", "training.init_from": str(path),
            "training.distill_weight": 1.0}
    batches = global_batches(manifest, 4)
    one, one_loss = train(tmp_path, manifest, batches, 1, "one", **{"data.batch_size": 4, **over})
    one_distill = train.distill
    both, both_loss = train(tmp_path, manifest, batches, 2, "both",
                            **{"data.batch_size": 1, "training.micro_batches": 2, **over})
    assert_close(both, one)
    np.testing.assert_allclose(both_loss, one_loss, rtol=1e-6)
    np.testing.assert_allclose(train.distill, one_distill, rtol=1e-6)
    assert min(one_distill) > 1e-5  # the term is there (the teacher and the student differ)


def test_noise_and_caption_drops_follow_the_global_sample():
    rng = np.random.default_rng(0)
    batch = {"latents": rng.standard_normal((6, 2, 4, 4, 3)).astype(np.float32),
             "caption": rng.integers(1, 255, (6, 8)).astype(np.uint8), "caption_len": np.full(6, 8, np.int32)}
    whole = batch_flow_inputs(batch, 5, 7)
    whole_cap, _ = batch_conditioning(batch, 5, 7, 0.5)
    for first in (0, 2, 4):
        part = {k: v[first:first + 2] for k, v in batch.items()}
        got = batch_flow_inputs(part, 5, 7, first_sample=first)
        assert torch.equal(got.noise, whole.noise[first:first + 2]) and torch.equal(got.t, whole.t[first:first + 2])
        cap, _ = batch_conditioning(part, 5, 7, 0.5, first_sample=first)
        assert torch.equal(cap, whole_cap[first:first + 2])
    assert not torch.equal(batch_flow_inputs(batch, 5, 8).noise, whole.noise)  # another step draws anew


def test_a_nan_loss_on_one_actor_skips_the_update_of_all(tmp_path, manifest, monkeypatch):
    from megaslide_ray.runtime import faults

    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path / "faults"))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.loss@2:nan")  # fires in whichever actor gets there first
    batches = global_batches(manifest, 2)
    got, losses = train(tmp_path, manifest, batches[:2], 2, "nan", **{"data.batch_size": 1})
    monkeypatch.delenv(faults.ENV_SPEC)
    once, _ = train(tmp_path, manifest, batches[:1], 2, "once", **{"data.batch_size": 1})
    assert losses[1] != losses[1]  # NaN: the mean over the actors
    for a, b in zip(got, once):  # step 2 changed nothing
        assert torch.equal(a, b)


def test_object_ref_transport_with_two_actors(tmp_path, manifest):
    batches = global_batches(manifest, 2)
    shm, _ = train(tmp_path, manifest, batches, 2, "shm", **{"data.batch_size": 1})
    refs, _ = train(tmp_path, manifest, batches, 2, "refs", transport="object_ref", **{"data.batch_size": 1})
    for a, b in zip(refs, shm):
        assert torch.equal(a, b)


def test_a_stale_slot_mark_of_a_replaced_actor_does_not_block_the_new_one(tmp_path):
    """A killed compute actor's process can mark its gradient slot full a moment after the store
    freed every slot for the new generation: the new actor's wait frees it instead of waiting for
    a report that never comes."""
    targets = [torch.zeros(8), torch.zeros(4)]
    reducer = GradientReducer(tmp_path, 2, 2, targets, "float32", True, 1, lambda *a: None)
    try:
        reducer.reset(1)
        i = reducer.info.index(0, 1)
        reducer.state[i] = slot_value(0, 5)  # generation 0's late write
        reducer.wait_slot(0, 1, 1, timeout=5.0)
        assert int(reducer.state[i]) == -1
        reducer.state[i] = slot_value(1, 5)  # the current generation's: really full
        with pytest.raises(TimeoutError, match="holds the gradient of step 6"):
            reducer.wait_slot(0, 1, 1, timeout=1.0)
    finally:
        reducer.close()


@pytest.mark.parametrize("transport", ["shm", "object_ref"])
def test_gradients_in_pieces_smaller_than_a_shard_equal_one_actor(tmp_path, manifest, transport):
    """Slots of 4 kB (1,000 fp32 values) against shards of thousands: every shard's gradient goes
    in pieces, each summed on its own; the run equals one actor with twice the batch."""
    cfg = build_config("tiny", None, {**EXACT, "data.manifest": manifest, "runtime.compute_actors": 2,
                                      "runtime.grad_slot_mb": 0.004, "runtime.state_dir": str(tmp_path)})
    store = ParameterStore(cfg, str(tmp_path / "probe"), compute_actors=2)
    try:
        assert store.grad_slots().numel == 1000 and store.slot_bytes() == 2 * 2 * 1000 * 4
        assert max(store.reducer.pieces(i) for i in range(store.n)) > 3  # the test means something
    finally:
        store.close()
    batches = global_batches(manifest, 2)
    one, _ = train(tmp_path, manifest, batches, 1, "one", **{"data.batch_size": 2})
    pieces, _ = train(tmp_path, manifest, batches, 2, "pieces", transport=transport,
                      **{"data.batch_size": 1, "runtime.grad_slot_mb": 0.004})
    assert_close(pieces, one)
