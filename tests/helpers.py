"""Set-up the trainer tests share: the demo set's decoded batches, the streamed trainer (the
parameter store and the compute actor) in this process, and its comparison with the in-process
trainer."""

from contextlib import contextmanager

import numpy as np
import torch

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset


def demo_batches(tmp_path_factory, overrides: dict, n: int) -> tuple[str, list[dict]]:
    """``(manifest, batches)``: a demo set of four videos and the first ``n`` batches a decoder
    serves for the tiny preset with ``overrides`` (seed 0)."""
    manifest = str(ensure_demo_dataset(tmp_path_factory.mktemp("cache"), num_videos=4))
    cfg = build_config("tiny", None, {**overrides, "data.manifest": manifest})
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
        return manifest, [dec.next_batch() for _ in range(n)]


@contextmanager
def streamed(cfg, run_dir, transport: str = "shm", **store_kw):
    """``(store, compute)``: a ``ParameterStore`` in ``run_dir`` (``store_kw``: ``resume_checkpoint``,
    ``init_from`` ...) and a ``ComputeActor`` on it, both closed on leaving."""
    store = ParameterStore(cfg, str(run_dir), **store_kw)
    try:
        compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), transport)
    except BaseException:
        store.close()
        raise
    try:
        yield store, compute
    finally:
        compute.close()
        store.close()


def train_steps(store, compute, batches, first: int = 0, after=None) -> list:
    """Steps ``first ..`` on ``batches``, each waited for at the store (``after(step)`` then);
    the compute actor's results."""
    results = []
    for step, b in enumerate(batches, start=first):
        results.append(compute.train_step(b, step))
        store.wait_step(step)
        if after is not None:
            after(step)
    return results


def masters(store) -> list[torch.Tensor]:
    """Copies of the store's fp32 weights, shard by shard."""
    return [s["master"].clone() for s in store.seg]


def flat_shards(model) -> list[torch.Tensor]:
    """A model's parameters, flat shard by shard (the store's layout)."""
    return [torch.cat([p.detach().reshape(-1) for p in s.parameters()]) for s in model.shards()]


def assert_streamed_equals_in_process(results, weights, reference, model, distill: bool = False) -> None:
    """The streamed trainer's step ``results`` and shard ``weights`` against the in-process
    trainer's ``reference`` results and ``model``: the losses (and with ``distill`` the
    distillation terms) to 1e-5 relative, each shard to 1e-5 relative in norm."""
    assert len(results) == len(reference) and len(weights) == len(list(model.shards()))
    assert np.allclose([r.loss for r in results], [r.loss for r in reference], rtol=1e-5), \
        ([r.loss for r in results], [r.loss for r in reference])
    if distill:
        assert np.allclose([r.distill_loss for r in results], [r.distill_loss for r in reference], rtol=1e-5)
    for i, (a, b) in enumerate(zip(weights, flat_shards(model))):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-5, f"shard {i}: relative error {rel:.2e}"
