"""A Wan model adapted end to end, as a user with a local diffusers Wan folder does it: precompute
latents and text embeddings from videos, fine-tune every parameter with 3D-DSA swapped into the
self-attention (through the real Ray actors, --init-from the folder), resume bit-identically,
export back to diffusers and sample an mp4 through the VAE. A tiny random Wan (transformer, VAE,
UMT5 encoder, word-level tokenizer) is built on the fly; nothing is downloaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import decord
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from wan_models import FRAMES, SIZE

from megaslide_ray.data.clips import read_frames
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver import Trainer
from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_shards, read_checkpoint_state
from megaslide_ray.state.pretrained_io import config_for_diffusers_dir, export_diffusers
from pipelines.latent_precompute import precompute


@pytest.fixture(scope="module")
def latents(wan_dir, tmp_path_factory):
    videos = ensure_demo_dataset(tmp_path_factory.mktemp("videos"), num_videos=3)
    out = tmp_path_factory.mktemp("latents") / "cache"
    precompute(wan_dir, videos, out, FRAMES, SIZE, SIZE, device="cpu", dtype="fp32", num_encoders=0, progress=False)
    return out / "manifest.parquet"


def _config(wan_dir, manifest, tmp_path, steps: int):
    return config_for_diffusers_dir(wan_dir, None, None, {
        "data.manifest": str(manifest), "data.num_frames": FRAMES, "data.height": SIZE, "data.width": SIZE,
        "data.batch_size": 1, "attention.kind": "dsa", "attention.window": "3,1,1", "training.steps": steps,
        "training.flow_shift": 3.0, "training.log_every": 1, "optim.lr": 1e-3, "runtime.state_dir": str(tmp_path)})


def _train(cfg, run_dir, wan_dir=None, resume=False):
    trainer = Trainer(cfg, run_dir=str(run_dir), resume=resume, progress=False,
                      init_from=str(wan_dir) if wan_dir else None)
    try:
        return trainer.train()
    finally:
        trainer.close()


@pytest.mark.core
@pytest.mark.slow  # 35 s; by default test_wan holds the streamed Wan shards equal to the module
def test_precompute_train_resume_export_sample(ray_session, wan_dir, latents, tmp_path):
    straight = _train(_config(wan_dir, latents, tmp_path, 3), tmp_path / "straight", wan_dir)
    assert straight.last_step == 3 and torch.isfinite(torch.tensor(straight.last_loss))
    first = _train(_config(wan_dir, latents, tmp_path, 2), tmp_path / "resumed", wan_dir)
    assert first.last_step == 2
    resumed = _train(_config(wan_dir, latents, tmp_path, 3), tmp_path / "resumed", resume=True)
    assert (resumed.first_step, resumed.last_step) == (2, 3)
    for a, b in zip(read_checkpoint_shards(straight.checkpoint), read_checkpoint_shards(resumed.checkpoint)):
        assert torch.equal(a, b)  # the latent batches, noise and updates continue exactly
    state = read_checkpoint_state(straight.checkpoint)
    assert state["config"]["model"]["arch"] == "wan" and state["config"]["attention"]["kind"] == "dsa"

    # The trained weights moved away from the pretrained ones, and the offset heads learned.
    out = tmp_path / "export"
    export_diffusers(latest_checkpoint(tmp_path / "straight"), out, drop_offsets=True)
    trained = WanTransformer3DModel.from_pretrained(str(out)).state_dict()
    pretrained = WanTransformer3DModel.from_pretrained(str(wan_dir / "transformer")).state_dict()
    assert set(trained) == set(pretrained)
    assert any(not torch.equal(trained[n], pretrained[n]) for n in trained)

    video = tmp_path / "wan.mp4"
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.sample", "--checkpoint", str(tmp_path / "straight"),
                           "--model-dir", str(wan_dir), "--prompt", "a red circle moving right",
                           "--negative-prompt", "blue", "--cfg-scale", "3", "--steps", "2", "--device", "cpu",
                           "--out", str(video)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reader = decord.VideoReader(str(video))
    frames = read_frames(reader, np.arange(len(reader)))
    assert frames.shape == (FRAMES, SIZE, SIZE, 3) and frames.std() > 0
    assert Path(video.with_suffix(".png")).is_file()


def test_wan_needs_latents_and_a_model_dir_to_sample(wan_dir, latents, tmp_path, cli_run):
    from megaslide_ray.config import ConfigError
    from megaslide_ray.data.checks import check_data

    cfg = _config(wan_dir, latents, tmp_path, 1)
    check_data(cfg)  # fits
    cfg.data.manifest = ""
    with pytest.raises(ConfigError, match="precompute"):
        check_data(cfg)
    run_dir, _, _ = cli_run  # a videodit run's video manifest
    cfg.data.manifest = str(next((run_dir.parent / "cache").rglob("manifest.parquet")))
    with pytest.raises(ConfigError, match="is a video manifest"):
        check_data(cfg)
    cfg = _config(wan_dir, latents, tmp_path, 1)
    cfg.data.num_frames = 13  # latents of 9 frames
    with pytest.raises(ConfigError, match=r"need --data.num_frames 9 --data.height 32 --data.width 32"):
        check_data(cfg)


@pytest.mark.slow  # 18-30 s on the shared 2-core machine; by default the writer's decode is held to diffusers below
def test_samples_during_wan_training_are_decoded_off_the_training_path(ray_session, wan_dir, latents, tmp_path):
    """``training.sample_every`` on a Wan model: each prompt of the file is denoised with the step's
    weights, VAE-decoded by the sample writer actor into an mp4 of the clip's frames and size, and
    shown by TensorBoard (its own reader) at that step, one series per prompt."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle moving right\nblue square on dark background\n")
    cfg = _config(wan_dir, latents, tmp_path, 2)
    for key, value in (("sample_every", 2), ("sample_steps", 2), ("sample_prompts_file", str(prompts)),
                       ("sample_cfg_scale", 3.0), ("sample_negative_prompt", "green"), ("tracker", "tensorboard")):
        setattr(cfg.training, key, value)
    run_dir = tmp_path / "run"
    _train(cfg, run_dir, wan_dir)  # the VAE and text encoder come from the --init-from folder
    slugs = ("a-red-circle-moving-right", "blue-square-on-dark-background")
    videos = [run_dir / "samples" / f"step_000002_{i:02d}_{slug}.mp4" for i, slug in enumerate(slugs)]
    decoded = []
    for video in videos:
        reader = decord.VideoReader(str(video))
        decoded.append(read_frames(reader, np.arange(len(reader))))
        assert decoded[-1].shape == (FRAMES, SIZE, SIZE, 3) and video.with_suffix(".png").is_file()
    assert not np.array_equal(*decoded)  # two prompts, two noises
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    assert sorted(acc.Tags()["images"]) == [f"sample/{i:02d}_{slug}" for i, slug in enumerate(slugs)]
    for i, slug in enumerate(slugs):
        (image,) = acc.Images(f"sample/{i:02d}_{slug}")
        assert image.step == 2 and (image.width, image.height) == (SIZE, SIZE)


def test_the_model_folder_of_the_samples_is_found_or_refused_before_training(wan_dir, latents, tmp_path):
    from megaslide_ray.config import ConfigError
    from megaslide_ray.evaluation.sampling import sample_model_dir

    cfg = _config(wan_dir, latents, tmp_path, 1)
    cfg.training.sample_every = 1
    root = wan_dir.resolve()
    assert sample_model_dir(cfg, wan_dir) == root
    assert sample_model_dir(cfg, wan_dir / "transformer") == root  # --init-from ROOT/transformer
    cfg.training.init_from = str(wan_dir)  # a resumed run: the folder its config.toml recorded
    assert sample_model_dir(cfg) == root
    cfg.training.init_from = ""
    with pytest.raises(ConfigError, match=r"text_encoder/, tokenizer/ and vae/; give --training.sample_model_dir"):
        sample_model_dir(cfg)
    cfg.training.sample_model_dir = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="training.sample_model_dir '.*nowhere': no such local folder"):
        sample_model_dir(cfg, wan_dir)  # given, it wins over the init_from folder
    cfg.training.sample_model_dir = str(wan_dir / "transformer")
    with pytest.raises(ConfigError, match="lacks text_encoder/, tokenizer/, vae/"):
        sample_model_dir(cfg)


def test_the_sample_writer_decodes_as_diffusers_vae_does(wan_dir, tmp_path):
    """The writer (in process, no Ray) undoes the latents' per-channel normalisation and decodes
    them with the folder's AutoencoderKLWan: its lossless contact sheet holds exactly the frames
    diffusers' VAE gives; samples.jsonl lists the video."""
    import json

    from diffusers import AutoencoderKLWan
    from PIL import Image
    from wan_models import LATENT_SHAPE

    from actors.sample_writer import SampleWriter
    from megaslide_ray.evaluation.sampling import contact_sheet

    writer = SampleWriter(str(tmp_path), str(wan_dir), "cpu")
    texts = writer.encode_prompts(["a red circle", "blue"])
    assert [t.shape for t in texts] == [(4, 16), (2, 16)]  # the valid tokens and </s>
    latents = torch.randn((1, *LATENT_SHAPE), generator=torch.Generator().manual_seed(4))
    done = writer.write(latents.numpy(), 6, 1, "blue", 8, str(tmp_path / "samples" / "s.mp4"))
    writer.close()
    vae = AutoencoderKLWan.from_pretrained(str(wan_dir / "vae")).eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        video = vae.decode(latents.permute(0, 4, 1, 2, 3) * std + mean).sample  # (1, 3, F, H, W)
    frames = ((video[0].permute(1, 2, 3, 0).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    assert frames.shape == (FRAMES, SIZE, SIZE, 3)
    assert np.array_equal(np.asarray(Image.open(done.sheet).convert("RGB")), contact_sheet(frames))
    assert (done.step, done.index, done.prompt, done.seed, done.frames, done.height, done.width) == (
        6, 1, "blue", 8, FRAMES, SIZE, SIZE)
    (line,) = (tmp_path / "samples" / "samples.jsonl").read_text().splitlines()
    assert json.loads(line)["video"] == done.video == str(tmp_path / "samples" / "s.mp4")
    reader = decord.VideoReader(done.video)
    assert len(reader) == FRAMES
