"""Training the Wan image-to-video models (tiny random folders saved by diffusers'
WanImageToVideoPipeline): one streamed step's gradient is diffusers' own on ``[noisy latents,
mask, image latents]`` with the CLIP states, for Wan2.1 I2V, FLF2V and both experts of Wan2.2
I2V-A14B; and through Ray, precompute, train, resume (bit for bit), export and sample on each,
and on Wan2.2 TI2V-5B's layout from an image (``model.clean_first_frame``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from PIL import Image
from wan_models import CLIP_DIM, CLIP_TOKENS, FRAMES, LATENT_SHAPE, SIZE, Z, make_family_dir, make_wan_dir

from actors.compute import ComputeActor, LocalStoreClient
from actors.param_store import ParameterStore
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver import Trainer
from megaslide_ray.evaluation.sampling import sample_video
from megaslide_ray.state.checkpoint import read_checkpoint_shards
from megaslide_ray.state.pretrained_io import config_for_diffusers_dir, export_diffusers, model_names
from megaslide_ray.training.flow import HIGH, batch_flow_inputs, expert_t_range, flow_loss, step_expert
from pipelines.latent_precompute import precompute

CLIP = {"data.num_frames": FRAMES, "data.height": SIZE, "data.width": SIZE, "attention.window": "3,1,1"}
KINDS = ("i2v", "flf2v", "i2v-a14b")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v-train")
    base = make_wan_dir(root / "base")
    return {kind: make_family_dir(base, root / kind, kind) for kind in KINDS}


def _config(folder, tmp_path, **extra):
    two = "training.expert" not in extra and (folder / "transformer_2").is_dir()
    return config_for_diffusers_dir(folder, None, None, {
        **CLIP, "attention.kind": "dense", "data.batch_size": 2, "training.flow_shift": 3.0,
        "training.t_sampling": "uniform", "optim.lr": 1e-3, "optim.grad_clip": 0.05, "runtime.device": "cpu",
        "runtime.state_dir": str(tmp_path / "state"), **({"training.expert": "both"} if two else {}), **extra})


def _batch(cfg, seed: int, frames: int) -> dict:
    """A batch as the latent decoder delivers an image-to-video cache's: latents, padded text, the
    condition (mask and image latents) and the kept frames' CLIP states."""
    g = torch.Generator().manual_seed(seed)
    B, m = cfg.data.batch_size, cfg.model
    text = torch.zeros(B, m.text_len, m.text_dim)
    text[:, :5] = torch.randn(B, 5, m.text_dim, generator=g)
    mask = torch.zeros(B, *LATENT_SHAPE[:3], 4)
    mask[:, 0] = 1.0
    return {"latents": torch.randn(B, *LATENT_SHAPE, generator=g).numpy(), "text": text.numpy(),
            "text_len": np.array([5] * B), "position": seed,
            "condition": torch.cat([mask, torch.randn(B, *LATENT_SHAPE, generator=g)], dim=-1).numpy(),
            "image": torch.randn(B, frames, CLIP_TOKENS, CLIP_DIM, generator=g).numpy()}


def _diffusers_grads(folder, cfg, batch, step, expert):
    """diffusers' own model of ``folder``: the flow loss of ``batch`` at step ``step``'s noise and
    t, with the pipeline's input ``[x_t, condition]`` and its image states; gradients by name."""
    model = WanTransformer3DModel.from_pretrained(str(folder)).float()
    t = cfg.training
    fx = batch_flow_inputs(batch, t.seed, step, t.t_sampling, t.flow_shift, 0,
                           None if expert is None else expert_t_range(t.boundary_ratio, expert))
    x = torch.cat([fx.x_t, torch.from_numpy(batch["condition"])], dim=-1).permute(0, 4, 1, 2, 3)
    image = torch.from_numpy(batch["image"]).flatten(0, 1) if model.config.image_dim else None
    pred = model(hidden_states=x, timestep=1000 * fx.t, encoder_hidden_states=torch.from_numpy(batch["text"]),
                 encoder_hidden_states_image=image, return_dict=False)[0]
    flow_loss(pred.permute(0, 2, 3, 4, 1), fx.target).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_step_is_diffusers_gradient_on_the_image_condition(family, tmp_path, kind):
    """The first moment after each expert's first step is (1 - beta1) x the clipped gradient of
    diffusers' own model on the same noise, t, condition channels and CLIP states."""
    folder = family[kind]
    cfg = _config(folder, tmp_path)
    frames = 2 if kind == "flf2v" else 1
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(folder))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    names = model_names(cfg)
    seen = set()
    try:
        for step in range(4):
            expert = step_expert(cfg, step)
            batch = _batch(cfg, step, frames)
            compute.train_step(batch, step)
            update = store.wait_step(step)
            if expert in seen:
                continue
            seen.add(expert)
            part = "transformer" if expert in (None, HIGH) else "transformer_2"
            grads = _diffusers_grads(folder / part, cfg, batch, step, expert)
            assert any(n.startswith("condition_embedder.image_embedder.") for n in grads) == (kind != "i2v-a14b")
            prefix = "transformer_2." if part == "transformer_2" else ""
            for name, grad in grads.items():
                _, shard, off = names[prefix + name]
                m = store.seg[shard]["m"][off:off + grad.numel()].view(grad.shape)
                torch.testing.assert_close(m, (1 - cfg.optim.betas[0]) * update.clip_coef * grad, rtol=1e-4,
                                           atol=1e-9, msg=lambda s, n=name: f"{n}: {s}")
    finally:
        compute.close()
        store.close()
    assert seen == ({None} if kind != "i2v-a14b" else {HIGH, 1})


@pytest.mark.slow  # precompute, Ray, three runs per kind, export, sample
@pytest.mark.parametrize("kind", [*KINDS, "ti2v"])
def test_precompute_train_resume_sample_export(ray_session, family, tmp_path, kind):
    """Each kind (TI2V-5B's layout with model.clean_first_frame) through precompute, Ray training
    of every parameter, a bit-exact resume, the diffusers export (the trained weights, loaded by
    diffusers) and ``sample --image``."""
    folder = family[kind] if kind != "ti2v" else make_family_dir(family["i2v"].parent / "base", tmp_path / "ti2v",
                                                                  "ti2v")
    image_mode = {"model.clean_first_frame": True} if kind == "ti2v" else {}
    videos = ensure_demo_dataset(tmp_path / "videos", num_videos=3)
    manifest = precompute(folder, videos, tmp_path / "cache", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32",
                          num_encoders=0, progress=False).manifest

    def config(steps):
        return _config(folder, tmp_path, **{"data.manifest": str(manifest), "data.batch_size": 1,
                                            "attention.kind": "dsa", "training.steps": steps,
                                            "training.log_every": 1, "optim.grad_clip": 1.0, **image_mode})

    def train(cfg, run, resume=False):
        trainer = Trainer(cfg, run_dir=str(run), resume=resume, progress=False,
                          init_from=None if resume else str(folder))
        try:
            return trainer.train()
        finally:
            trainer.close()

    straight = train(config(4), tmp_path / "straight")
    train(config(2), tmp_path / "resumed")
    resumed = train(config(4), tmp_path / "resumed", resume=True)
    assert (resumed.first_step, resumed.last_step) == (2, 4)
    shards = list(zip(read_checkpoint_shards(straight.checkpoint), read_checkpoint_shards(resumed.checkpoint)))
    assert shards and all(torch.equal(a, b) for a, b in shards)
    assert Z == LATENT_SHAPE[-1]

    export_diffusers(straight.checkpoint, tmp_path / "export", drop_offsets=True)
    parts = ("transformer", "transformer_2") if kind == "i2v-a14b" else (None,)
    for part in parts:
        out = tmp_path / "export" / part if part else tmp_path / "export"
        trained = WanTransformer3DModel.from_pretrained(str(out)).state_dict()
        pretrained = WanTransformer3DModel.from_pretrained(str(folder / (part or "transformer"))).state_dict()
        assert trained.keys() == pretrained.keys()
        assert any(not torch.equal(trained[n], pretrained[n]) for n in trained), part
    rng = np.random.default_rng(0)
    for name in ("first.png", "last.png"):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(tmp_path / name)
    r = sample_video(tmp_path / "straight", "a red circle moving right", tmp_path / "sample.mp4", steps=2,
                     device="cpu", model_dir=folder, image=tmp_path / "first.png",
                     last_image=tmp_path / "last.png" if kind == "flf2v" else None, cfg_scale=2.0)
    assert r.frames.shape == (FRAMES, SIZE, SIZE, 3) and (tmp_path / "sample.mp4").is_file()


@pytest.mark.parametrize("kind", ["i2v", "flf2v", "ti2v"])
def test_the_held_out_loss_feeds_the_condition_as_diffusers_pipeline_does(family, tmp_path, kind):
    """``validation_loss`` on an image-to-video cache (TI2V-5B's layout from an image: a plain
    cache, its first latent frame kept clean and out of the loss) equals the loss of diffusers'
    own model fed the pipeline's input, clip by clip and bucket by bucket."""
    from megaslide_ray.evaluation.validation import load_val_set, val_inputs, validation_loss

    folder = family[kind] if kind != "ti2v" else make_family_dir(family["i2v"].parent / "base", tmp_path / "ti2v",
                                                                  "ti2v")
    videos = ensure_demo_dataset(tmp_path / "videos", num_videos=2)
    manifest = precompute(folder, videos, tmp_path / "cache", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32",
                          num_encoders=0, progress=False).manifest
    cfg = _config(folder, tmp_path, **{"data.val_manifest": str(manifest), "training.val_clips": 2,
                                       "training.val_t_buckets": 2, "training.eval_every": 1,
                                       **({"model.clean_first_frame": True} if kind == "ti2v" else {})})
    val = load_val_set(cfg)
    assert (val.condition is None) == (kind == "ti2v")
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(folder))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        got = validation_loss(compute, cfg, val, 0)
    finally:
        compute.close()
        store.close()
    ref = WanTransformer3DModel.from_pretrained(str(folder / "transformer")).float().eval()
    losses = []
    for i in range(2):
        for b in range(2):
            x_t, t, target = val_inputs(val.x0[i], cfg.training.seed, i, b, 2)
            timestep = torch.tensor([1000.0 * t])
            if kind == "ti2v":  # the clean first frame at per-token timestep 0
                x_t[:1] = val.x0[i][:1]
                timestep = torch.cat([torch.zeros(4), torch.full((8,), 1000.0 * t)])[None]
            x = x_t if val.condition is None else torch.cat([x_t, val.condition[i]], dim=-1)
            image = val.image[i] if val.image is not None else None
            with torch.no_grad():
                pred = ref(x[None].permute(0, 4, 1, 2, 3), timestep, torch.from_numpy(val.cond[i:i + 1]),
                           encoder_hidden_states_image=image, return_dict=False)[0].permute(0, 2, 3, 4, 1)[0]
            first = int(kind == "ti2v")
            losses.append(float((pred[first:].double() - target[first:].double()).pow(2).mean()))
    want = sum(losses) / len(losses)
    assert abs(got.val_loss - want) < 1e-5 * want


def _images(tmp_path):
    rng = np.random.default_rng(1)
    for name in ("first.png", "last.png"):
        Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)).save(tmp_path / name)


def test_sample_prompts_of_an_image_to_video_model_name_their_images(family, tmp_path):
    """``training.sample_prompts_file`` lines ``PROMPT | IMAGE`` (FLF2V: ``| LAST_IMAGE``), paths
    relative to the file: an image-to-video model needs them, a missing file or a missing last
    image is refused naming the prompt, before anything starts."""
    from megaslide_ray.config import ConfigError, sample_prompt_images, sample_prompts

    _images(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\na red circle | first.png\n")
    cfg = _config(family["i2v"], tmp_path, **{"training.sample_every": 1, "training.sample_prompts_file": str(prompts)})
    assert sample_prompts(cfg) == ["a red circle"]
    assert sample_prompt_images(cfg) == [(str(tmp_path / "first.png"), None)]
    for kind, text, why in (("i2v", "a red circle\n", "samples from an image"),
                            ("i2v", "a red circle | nowhere.png\n", "does not exist"),
                            ("flf2v", "a red circle | first.png\n", "LAST_IMAGE"),
                            ("i2v", "a red circle | first.png | last.png\n", "only an FLF2V")):
        prompts.write_text(text)
        with pytest.raises(ConfigError, match=why):
            _config(family[kind], tmp_path, **{"training.sample_every": 1,
                                               "training.sample_prompts_file": str(prompts)})


@pytest.mark.slow  # precompute and a Ray run per kind
@pytest.mark.parametrize("kind", ["i2v", "flf2v"])
def test_samples_during_training_start_from_each_prompts_image(ray_session, family, tmp_path, kind):
    """Samples taken during training by an image-to-video model: each prompt's images encoded once
    by the sample writer (as ``sample --image`` encodes them), the videos written at the sampled
    steps with the clip's frames."""
    import decord

    folder = family[kind]
    _images(tmp_path)
    (tmp_path / "prompts.txt").write_text("a red circle | first.png" + (" | last.png" if kind == "flf2v" else "") + "\n")
    videos = ensure_demo_dataset(tmp_path / "videos", num_videos=2)
    manifest = precompute(folder, videos, tmp_path / "cache", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32",
                          num_encoders=0, progress=False).manifest
    cfg = _config(folder, tmp_path, **{"data.manifest": str(manifest), "data.batch_size": 1, "training.steps": 2,
                                       "training.sample_every": 2, "training.sample_steps": 2,
                                       "training.sample_prompts_file": str(tmp_path / "prompts.txt")})
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"), progress=False, init_from=str(folder))
    try:
        trainer.train()
    finally:
        trainer.close()
    (video,) = (tmp_path / "run" / "samples").glob("step_000002_00_*.mp4")
    reader = decord.VideoReader(str(video))
    assert len(reader) == FRAMES and reader[0].shape[:2] == (SIZE, SIZE)
    # the same sample by `sample --image` from the step's checkpoint (same weights, seed and steps): the
    # same frames (their lossless contact sheets compared); from the other image: other frames
    last = tmp_path / "last.png" if kind == "flf2v" else None
    same = sample_video(tmp_path / "run", "a red circle", tmp_path / "same.mp4", steps=2, seed=0, device="cpu",
                        model_dir=folder, image=tmp_path / "first.png", last_image=last)
    other = sample_video(tmp_path / "run", "a red circle", tmp_path / "other.mp4", steps=2, seed=0, device="cpu",
                         model_dir=folder, image=tmp_path / "last.png", last_image=tmp_path / "first.png" if last else None)
    sheet = np.asarray(Image.open(video.with_suffix(".png")), dtype=np.int16)
    near = np.abs(np.asarray(Image.open(same.sheet_path), dtype=np.int16) - sheet).max()
    far = np.abs(np.asarray(Image.open(other.sheet_path), dtype=np.int16) - sheet).max()
    assert near <= 1 and far > 1, (near, far)  # (the tiny random model reads its condition only a little)
