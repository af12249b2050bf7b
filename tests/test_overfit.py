"""The streamed components (store AdamW + block-by-block compute) learn: ``tiny`` on one repeated
batch halves its loss within 50 steps. Runs the actor classes in-process (no Ray) to stay fast;
the Ray wiring is covered by test_pipeline.py."""

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config


def test_tiny_overfits_one_batch(tmp_path):
    cfg = build_config("tiny", None, {"training.steps": 50, "training.overfit_one_batch": "true",
                                      "runtime.state_dir": str(tmp_path / "state")})
    (tmp_path / "state").mkdir()
    from megaslide_ray.trainer import resolve_data

    resolve_data(cfg)
    with VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes) as decoder:
        batch = decoder.next_batch()
    store = ParameterStore(cfg, str(tmp_path / "run"))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    losses = []
    try:
        for step in range(50):
            losses.append(compute.train_step(batch, step).loss)
            store.wait_step(step)
    finally:
        compute.close()
        store.close()
    assert min(losses[-5:]) <= losses[0] / 2, f"loss {losses[0]:.3f} -> {losses[-5:]}"
