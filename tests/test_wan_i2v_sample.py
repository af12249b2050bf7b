"""``sample --image`` (and ``--last-image``) of a Wan image-to-video checkpoint against diffusers'
WanImageToVideoPipeline: the checkpoint (one trained step, from a tiny random folder) exported
and loaded into the pipeline, the same first (and last) frame, prompt, noise and time grid (the
folder's FlowMatchEulerDiscreteScheduler), with and without guidance: the project's Euler
steps (its own condition, CLIP states and streamed predictions) land on the pipeline's latents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from PIL import Image
from wan_models import FRAMES, SIZE, make_family_dir, make_wan_dir

from actors.compute import ComputeActor, LocalStoreClient
from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError
from megaslide_ray.data.encoders import Encoder
from megaslide_ray.data.latent_cache import clip_config
from megaslide_ray.data.latents import pad_text
from megaslide_ray.evaluation.sampling import (
    CheckpointWeights,
    initial_noise,
    integrate,
    sample_video,
    sampling_condition,
    sampling_config,
)
from megaslide_ray.models.diffusers_dsa import enable_dsa
from megaslide_ray.models.wan_diffusers import from_diffusers
from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_state
from megaslide_ray.state.pretrained_io import config_for_diffusers_dir, export_diffusers

CLIP = {"data.num_frames": FRAMES, "data.height": SIZE, "data.width": SIZE, "attention.kind": "dense",
        "data.batch_size": 1, "runtime.device": "cpu", "optim.lr": 1e-2}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """kind -> (folder, checkpoint): one streamed step on a random condition batch."""
    root = tmp_path_factory.mktemp("i2v-sample")
    base = make_wan_dir(root / "base")
    out = {}
    for kind in ("i2v", "flf2v", "i2v-a14b", "i2v-dsa"):
        folder = make_family_dir(base, root / kind, kind.removesuffix("-dsa"))
        both = {"training.expert": "both"} if kind == "i2v-a14b" else {}
        dsa = {"attention.kind": "dsa", "attention.window": "3,1,1"} if kind == "i2v-dsa" else {}
        cfg = config_for_diffusers_dir(folder, None, None, {**CLIP, **both, **dsa,
                                                            "runtime.state_dir": str(root / "state" / kind)})
        store = ParameterStore(cfg, str(root / kind / "run"), init_from=str(folder))
        compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
        g = torch.Generator().manual_seed(1)
        grid = cfg.latent_grid
        batch = {"latents": torch.randn(1, *grid, 4, generator=g).numpy(),
                 "text": torch.randn(1, 512, 16, generator=g).numpy(), "text_len": np.array([512]), "position": 0,
                 "condition": torch.randn(1, *grid, 8, generator=g).numpy(),
                 "image": torch.randn(1, 2 if kind == "flf2v" else 1, 5, 8, generator=g).numpy()}
        steps = 4 if both else 1  # both experts train within 4 steps (seed 0)
        try:
            for step in range(steps):
                compute.train_step(batch, step)
                store.wait_step(step)
            store.save_checkpoint(str(root / kind / "run"), steps, {"data_position": steps})
        finally:
            compute.close()
            store.close()
        out[kind] = (folder, latest_checkpoint(root / kind / "run"))
    return out


def _frame(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8))


@pytest.mark.parametrize("kind,guidance", [("i2v", 1.0), ("i2v", 3.0), ("flf2v", 2.0), ("i2v-a14b", 2.0),
                                           ("i2v-dsa", 2.0)])
def test_sampling_from_an_image_lands_on_the_pipelines_latents(trained, tmp_path, kind, guidance):
    """I2V-A14B: both experts exported (transformer/, transformer_2/, model_index.json with the
    boundary) and loaded by the pipeline, which runs each step on the expert its rule picks;
    the project's predictions route the same way. 3D-DSA: the export (offset heads kept) in the
    pipeline with ``enable_dsa``."""
    folder, ckpt = trained[kind]
    cfg = sampling_config(read_checkpoint_state(ckpt), device="cpu")
    first, last = _frame(3), _frame(4) if kind == "flf2v" else None
    first.save(tmp_path / "first.png")
    if last is not None:
        last.save(tmp_path / "last.png")
    export_diffusers(ckpt, tmp_path / "export")
    if kind == "i2v-a14b":
        parts = WanImageToVideoPipeline.from_pretrained(str(folder))
        pipe = WanImageToVideoPipeline.from_pretrained(str(tmp_path / "export"), vae=parts.vae,
                                                       text_encoder=parts.text_encoder, tokenizer=parts.tokenizer,
                                                       scheduler=parts.scheduler)
        assert pipe.config.boundary_ratio == 0.9 and pipe.transformer_2 is not None
        calls = []
        for name in ("transformer", "transformer_2"):
            getattr(pipe, name).register_forward_hook(lambda *a, n=name: calls.append(n))
    else:
        pipe = WanImageToVideoPipeline.from_pretrained(
            str(folder), transformer=WanTransformer3DModel.from_pretrained(str(tmp_path / "export")))
        if kind == "i2v-dsa":
            enable_dsa(pipe.transformer, tmp_path / "export")
    noise = initial_noise(cfg, seed=7)
    steps = 4
    encoder = Encoder(str(folder), clip_config(FRAMES, SIZE, SIZE, 0.0), "cpu", "float32")
    text, neg = encoder.encode_text(["a red circle moving right", "blue square"])
    # the prompts as embeddings, padded to 512 as the pipeline pads them (its own prompt cleaning needs ftfy)
    want = pipe(image=first, last_image=last, prompt_embeds=pad_text(text, 512)[None],
                negative_prompt_embeds=pad_text(neg, 512)[None], height=SIZE, width=SIZE,
                num_frames=FRAMES, num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                latents=noise.permute(0, 4, 1, 2, 3).clone(), return_dict=False)[0]
    grid = pipe.scheduler.sigmas  # the pipeline's time grid (steps + 1 values, ending at 0)
    extra = sampling_condition(encoder, cfg, tmp_path / "first.png", tmp_path / "last.png" if last else None)
    encoder.close()
    source = CheckpointWeights(ckpt, cfg, "master")
    compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    try:
        got = integrate(compute, cfg, noise, pad_text(text, 512)[None].numpy(), np.array([len(text)]), steps,
                        source.step, guidance, pad_text(neg, 512)[None].numpy(), np.array([len(neg)]), extra, grid)
    finally:
        compute.close()
        source.close()
    got = got.permute(0, 4, 1, 2, 3)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-4
    assert float((got - noise.permute(0, 4, 1, 2, 3)).norm()) > 1e-2  # the steps moved it
    if kind == "i2v-a14b":
        assert set(calls) == {"transformer", "transformer_2"}  # both experts ran


def test_sample_cli_needs_the_images_its_checkpoint_reads(trained, tmp_path):
    folder, ckpt = trained["flf2v"]
    _frame(3).save(tmp_path / "first.png")
    with pytest.raises(ConfigError, match="give --last-image FILE too"):
        sample_video(ckpt, "a red circle", tmp_path / "x.mp4", steps=1, device="cpu", model_dir=folder,
                     image=tmp_path / "first.png")
    with pytest.raises(ConfigError, match="give --image FILE"):
        sample_video(ckpt, "a red circle", tmp_path / "x.mp4", steps=1, device="cpu", model_dir=folder)
    folder, ckpt = trained["i2v"]
    r = sample_video(ckpt, "a red circle", tmp_path / "i2v.mp4", steps=2, device="cpu", model_dir=folder,
                     image=tmp_path / "first.png")
    assert r.frames.shape == (FRAMES, SIZE, SIZE, 3) and (tmp_path / "i2v.mp4").is_file()


def test_from_diffusers_keeps_an_exports_recorded_attention(trained, tmp_path):
    """An export of a 3D-DSA model loads as that model (kind, window, its trained offset heads)
    unless the caller names another attention, and gives the checkpoint's own prediction."""
    folder, ckpt = trained["i2v-dsa"]
    cfg = sampling_config(read_checkpoint_state(ckpt), device="cpu")
    export_diffusers(ckpt, tmp_path / "export")
    model = from_diffusers(tmp_path / "export")
    a = model.cfg.attention
    assert (a.kind, tuple(a.window), a.max_offset) == ("dsa", (3, 1, 1), cfg.attention.max_offset)
    assert model.blocks[0].attn1.offsets.out.weight.abs().sum() > 0  # trained, not fresh
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, *cfg.latent_grid, 12, generator=g)
    text, image = torch.randn(1, 512, 16, generator=g), torch.randn(1, 5, 8, generator=g)
    source = CheckpointWeights(ckpt, cfg, "master")
    compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    try:
        want = compute.predict(x[..., :4], torch.tensor([0.6]), text.numpy(), np.array([512]), source.step,
                               condition=x[..., 4:], image=image)
    finally:
        compute.close()
        source.close()
    with torch.no_grad():
        got = model(x.permute(0, 4, 1, 2, 3), torch.tensor([600.0]), text, image).permute(0, 2, 3, 4, 1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert from_diffusers(tmp_path / "export", attention_kind="neighborhood").cfg.attention.kind == "neighborhood"
