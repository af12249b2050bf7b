"""A videodit on VAE latents (the dit-* presets, ``model.inputs = latents``): check_data, the
decoder's latent batches with byte captions from the manifest's caption column, and streamed
training steps through the store and the compute actor (no Ray, no VAE: synthetic latents)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.data import latents as L
from megaslide_ray.data.captions import encode_caption
from megaslide_ray.data.checks import check_data

SHAPE = (3, 10, 12, 16)  # 9 frames of 80 x 96 pixels through a 4x8x8 VAE with 16 channels
CAPTIONS = ["a red circle moving right", "two squares", "ein grüner Kreis"]


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    root = tmp_path_factory.mktemp("latent-cache")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, caption in enumerate(CAPTIONS):
        L.save_tensor_file(root / "latents" / f"clip{i}.safetensors", L.LATENT_KEY, torch.randn(SHAPE, generator=g))
        L.save_tensor_file(root / "text" / f"t{i}.safetensors", L.TEXT_KEY, torch.randn(2, 8, generator=g))
        rows.append({"latent_path": f"latents/clip{i}.safetensors", "text_path": f"text/t{i}.safetensors",
                     "caption": caption, "source_path": f"clip{i}.mp4", "frame_start": 0, "frame_end": 8,
                     "num_frames": 9, "fps": 16.0, "height": 80, "width": 96, "latent_shape": list(SHAPE),
                     "text_len": 2, "dtype": "float32"})
    meta = {"latents_mean": [0.0] * 16, "latents_std": [1.0] * 16, "compression": [4, 8, 8], "latent_channels": 16,
            "text_dim": 8, "text_len": 512, "dtype": "float32"}
    return L.write_latent_manifest(rows, meta, root / "manifest.parquet")


def _config(manifest, tmp_path, **extra):
    return build_config("dit-28b", None, {
        "model.hidden_size": 32, "model.depth": 2, "model.num_heads": 2, "model.caption_dim": 16,
        "data.manifest": str(manifest), "data.num_frames": 9, "data.height": 80, "data.width": 96,
        "data.batch_size": 2, "data.prefetch": 1, "runtime.state_dir": str(tmp_path), "runtime.device": "cpu",
        "optim.lr": 1e-3, "optim.warmup_steps": 0, **extra})


def test_check_data_accepts_matching_latents_and_names_a_mismatch(manifest, tmp_path):
    check_data(_config(manifest, tmp_path))  # the text width is the wan's business, not the videodit's
    with pytest.raises(ConfigError, match="does not fit the model"):
        check_data(_config(manifest, tmp_path, **{"data.height": 96}))
    pixel = build_config("tiny", None, {"data.manifest": str(manifest)})
    with pytest.raises(ConfigError, match="holds precomputed latents"):
        check_data(pixel)


def test_decoder_gives_latents_with_byte_captions(manifest, tmp_path):
    cfg = _config(manifest, tmp_path)
    rows, _ = L.read_latent_manifest(manifest)
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes, latent_captions="bytes") as dec:
        batch = dec.next_batch()
    assert set(batch) == {"latents", "caption", "caption_len", "index", "position", "skipped"}
    assert batch["latents"].shape == (2, *SHAPE) and batch["caption"].dtype == np.uint8
    for i, row in enumerate(batch["index"]):
        want = encode_caption(rows[row]["caption"], cfg.model.caption_max_bytes)
        assert bytes(batch["caption"][i, : batch["caption_len"][i]]) == want
        np.testing.assert_array_equal(batch["latents"][i], L.load_latents(manifest, rows[row]).numpy())


def test_streamed_training_steps_on_latents(manifest, tmp_path):
    cfg = _config(manifest, tmp_path)
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes, latent_captions="bytes") as dec:
        batches = [dec.next_batch() for _ in range(2)]
    store = ParameterStore(cfg, str(tmp_path / "run"))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        before = [s["master"].clone() for s in store.seg]
        losses = []
        for step, b in enumerate(batches):
            losses.append(compute.train_step(b, step).loss)
            store.wait_step(step)
        after = [s["master"] for s in store.seg]
    finally:
        compute.close()
        store.close()
    assert all(np.isfinite(losses))
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_sample_decodes_a_latent_videodit_with_the_vae(tmp_path, wan_dir):
    from wan_models import Z

    from megaslide_ray.evaluation.sampling import sample_video

    cfg = build_config("dit-28b", None, {
        "model.hidden_size": 32, "model.depth": 2, "model.num_heads": 2, "model.caption_dim": 16,
        "model.in_channels": Z, "attention.window": "3,3,3", "data.num_frames": 9, "data.height": 64,
        "data.width": 64, "runtime.state_dir": str(tmp_path), "runtime.device": "cpu"})
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        store.save_checkpoint(str(tmp_path / "run"), 0, {"data_position": 0})
    finally:
        store.close()
    with pytest.raises(ConfigError, match="--model-dir"):
        sample_video(tmp_path / "run", "a red circle", tmp_path / "no.mp4", steps=1, device="cpu")
    result = sample_video(tmp_path / "run", "a red circle", tmp_path / "out.mp4", steps=2, device="cpu",
                          model_dir=wan_dir)
    assert result.frames.shape == (9, 64, 64, 3) and result.frames.dtype == np.uint8


def test_samples_during_training_of_a_latent_videodit_are_vae_decoded(tmp_path, wan_dir, monkeypatch):
    """The Sampler on a latent videodit (no Ray: the compute actor and the sample writer in this
    process): the prompt read as bytes, the latents denoised by the compute actor, decoded by the
    writer with ``training.sample_model_dir``'s VAE into a video of the pixel clip."""
    import types

    import decord
    from wan_models import Z

    from actors.sample_writer import SampleWriter
    from megaslide_ray.driver import components
    from megaslide_ray.evaluation.sampling import sample_model_dir

    cfg = build_config("dit-28b", None, {
        "model.hidden_size": 32, "model.depth": 2, "model.num_heads": 2, "model.caption_dim": 16,
        "model.in_channels": Z, "attention.window": "3,3,3", "data.num_frames": 9, "data.height": 64,
        "data.width": 64, "runtime.state_dir": str(tmp_path), "runtime.device": "cpu",
        "training.sample_every": 1, "training.sample_steps": 2, "training.sample_model_dir": str(wan_dir)})
    folder = sample_model_dir(cfg)
    assert folder == wan_dir.resolve()
    run_dir = tmp_path / "run"
    writer = SampleWriter(str(run_dir), str(folder), "cpu")
    here = types.SimpleNamespace(write=types.SimpleNamespace(remote=writer.write))  # the actor's call, in process
    monkeypatch.setattr(components, "start_sample_writer", lambda *args: here)
    store = ParameterStore(cfg, str(run_dir))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        sampler = components.Sampler(cfg, compute, run_dir, folder)
        assert sampler.texts is None  # a videodit reads its prompt as bytes: no text encoder
        row = sampler.run(0)
    finally:
        compute.close()
        store.close()
        writer.close()
    (video,) = row["sample"]
    assert row["sample_failures"] == 0 and video.endswith("step_000000_00_a-red-circle-moving-right-on-a-dark-blue.mp4")
    assert len(decord.VideoReader(video)) == 9 and decord.VideoReader(video)[0].shape == (64, 64, 3)
