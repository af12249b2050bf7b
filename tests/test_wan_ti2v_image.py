"""Wan2.2 TI2V-5B from an image (``model.clean_first_frame``; diffusers' ``expand_timesteps``):
the transformer with diffusers' per-token timesteps (0 on the first latent frame, t elsewhere)
against WanTransformer3DModel, forward and every gradient, on a tiny random config."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import WanTransformer3DModel

from megaslide_ray.config import Config, apply_overrides
from megaslide_ray.models.wan_diffusers import DiffusersWanTransformer, wan_config_from_diffusers

KW = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=6, out_channels=6,
          text_dim=12, freq_dim=16, ffn_dim=24, num_layers=2)
SHAPE = (6, 3, 4, 6)  # (C, F', H', W'): a token grid of 3 x 2 x 3


def _models(seed: int = 0):
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**KW)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cfg = Config()
    apply_overrides(cfg, {**wan_config_from_diffusers(dict(ref.config)), "attention.kind": "dense",
                          "model.clean_first_frame": True})
    ours = DiffusersWanTransformer(cfg)
    ours.load_state_dict(ref.state_dict(), strict=False)
    return ref.eval(), ours


def _per_token(t: torch.Tensor) -> torch.Tensor:
    """diffusers' TI2V timesteps: the first-frame mask (0 on latent frame 0) at token positions, times t."""
    mask = torch.ones(SHAPE[1], SHAPE[2], SHAPE[3])
    mask[0] = 0
    return (mask[:, ::2, ::2].flatten()[None] * t[:, None])


def test_per_token_timesteps_match_diffusers_forward_and_gradients():
    ref, ours = _models()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, *SHAPE, generator=g)
    text = torch.randn(2, 7, KW["text_dim"], generator=g)
    ts = _per_token(torch.tensor([370.0, 905.0]))
    want = ref(x, ts, text, return_dict=False)[0]
    got = ours(x, ts, text)
    assert float((got - want).norm() / want.norm()) < 1e-5
    w = torch.randn_like(want)
    (want * w).sum().backward()
    (got * w).sum().backward()
    theirs = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert float((p.grad - theirs[n].grad).norm() / theirs[n].grad.norm()) < 1e-4, n
    # the first frame is modulated at timestep 0: not the model at one timestep for every token
    with torch.no_grad():
        flat = ref(x, torch.tensor([370.0, 905.0]), text, return_dict=False)[0]
    assert float((flat - want).norm() / want.norm()) > 1e-3


def test_other_per_token_timesteps_are_refused():
    _, ours = _models()
    ts = _per_token(torch.tensor([370.0, 905.0]))
    ts[0, -1] = 1.0
    with pytest.raises(ValueError, match="per-token timesteps other than 0 on the first frame"):
        ours(torch.randn(2, *SHAPE), ts, torch.randn(2, 7, KW["text_dim"]))


@pytest.fixture(scope="module")
def ti2v(tmp_path_factory):
    """A tiny Wan2.2 TI2V-like folder (WanPipeline with expand_timesteps) and a checkpoint of one
    streamed step of its image mode; the step's batch; the first moment and clip coefficient."""
    import diffusers
    import numpy as np
    from wan_models import LATENT_SHAPE, TRANSFORMER, _pipeline_parts, make_wan_dir

    from actors.compute import ComputeActor, LocalStoreClient
    from actors.param_store import ParameterStore
    from megaslide_ray.state.checkpoint import latest_checkpoint
    from megaslide_ray.state.pretrained_io import config_for_diffusers_dir, model_names

    root = tmp_path_factory.mktemp("ti2v")
    base = make_wan_dir(root / "base")
    torch.manual_seed(0)
    diffusers.WanPipeline(transformer=diffusers.WanTransformer3DModel(**TRANSFORMER), expand_timesteps=True,
                          **_pipeline_parts(base)).save_pretrained(root / "ti2v")
    folder = root / "ti2v"
    cfg = config_for_diffusers_dir(folder, None, None, {
        "data.num_frames": 9, "data.height": 32, "data.width": 32, "attention.kind": "dense", "data.batch_size": 2,
        "model.clean_first_frame": True, "runtime.device": "cpu", "optim.lr": 1e-2, "optim.grad_clip": 0.05,
        "training.t_sampling": "uniform", "runtime.state_dir": str(root / "state")})
    g = torch.Generator().manual_seed(3)
    text = torch.zeros(2, 512, 16)
    text[:, :5] = torch.randn(2, 5, 16, generator=g)
    batch = {"latents": torch.randn(2, *LATENT_SHAPE, generator=g).numpy(), "text": text.numpy(),
             "text_len": np.array([5, 5]), "position": 0}
    store = ParameterStore(cfg, str(root / "run"), init_from=str(folder))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        compute.train_step(batch, 0)
        update = store.wait_step(0)
        names = model_names(cfg)
        moments = {n: store.seg[shard]["m"][off:off + math.prod(shape)].clone().view(shape)
                   for n, (shape, shard, off) in names.items()}
        store.save_checkpoint(str(root / "run"), 1, {"data_position": 1})
    finally:
        compute.close()
        store.close()
    return folder, cfg, batch, moments, update.clip_coef, latest_checkpoint(root / "run")


def test_a_streamed_step_keeps_the_first_frame_clean_and_out_of_the_loss(ti2v):
    """The first moment is (1 - beta1) x the clipped gradient of diffusers' own model fed the
    clip's clean first latent frame at per-token timestep 0, the loss over the other frames."""
    from megaslide_ray.training.flow import batch_flow_inputs, flow_loss

    folder, cfg, batch, moments, coef, _ = ti2v
    ref = WanTransformer3DModel.from_pretrained(str(folder / "transformer")).float()
    t = cfg.training
    fx = batch_flow_inputs(batch, t.seed, 0, t.t_sampling, t.flow_shift)
    x = fx.x_t.clone()
    x[:, 0] = fx.x0[:, 0]
    F_, H_, W_ = x.shape[1:4]
    mask = torch.ones(F_, H_, W_)
    mask[0] = 0
    ts = mask[:, ::2, ::2].flatten()[None] * (1000 * fx.t)[:, None]
    pred = ref(x.permute(0, 4, 1, 2, 3), ts, torch.from_numpy(batch["text"]), return_dict=False)[0]
    flow_loss(pred.permute(0, 2, 3, 4, 1)[:, 1:], fx.target[:, 1:]).backward()
    for n, p in ref.named_parameters():
        m = moments[n]
        torch.testing.assert_close(m, (1 - cfg.optim.betas[0]) * coef * p.grad, rtol=1e-4, atol=1e-9,
                                   msg=lambda s, n=n: f"{n}: {s}")


def test_sampling_from_an_image_lands_on_the_expand_timesteps_pipelines_latents(ti2v, tmp_path):
    import numpy as np
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    from actors.compute import ComputeActor
    from megaslide_ray.data.encoders import Encoder
    from megaslide_ray.data.latent_cache import clip_config
    from megaslide_ray.data.latents import pad_text
    from megaslide_ray.evaluation.sampling import (
        CheckpointWeights,
        initial_noise,
        integrate,
        sampling_condition,
        sampling_config,
    )
    from megaslide_ray.state.checkpoint import read_checkpoint_state
    from megaslide_ray.state.pretrained_io import export_diffusers

    folder, _, _, _, _, ckpt = ti2v
    cfg = sampling_config(read_checkpoint_state(ckpt), device="cpu")
    first = Image.fromarray(np.random.default_rng(5).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    first.save(tmp_path / "first.png")
    export_diffusers(ckpt, tmp_path / "export")
    pipe = WanImageToVideoPipeline.from_pretrained(
        str(folder), transformer=WanTransformer3DModel.from_pretrained(str(tmp_path / "export")))
    assert pipe.config.expand_timesteps
    encoder = Encoder(str(folder), clip_config(9, 32, 32, 0.0), "cpu", "float32")
    text, neg = encoder.encode_text(["a red circle moving right", "blue square"])
    extra = sampling_condition(encoder, cfg, tmp_path / "first.png", None)
    encoder.close()
    noise, steps = initial_noise(cfg, seed=7), 3
    want = pipe(image=first, prompt_embeds=pad_text(text, 512)[None], negative_prompt_embeds=pad_text(neg, 512)[None],
                height=32, width=32, num_frames=9, num_inference_steps=steps, guidance_scale=2.0,
                output_type="latent", latents=noise.permute(0, 4, 1, 2, 3).clone(), return_dict=False)[0]
    source = CheckpointWeights(ckpt, cfg, "master")
    compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    try:
        got = integrate(compute, cfg, noise, pad_text(text, 512)[None].numpy(), np.array([len(text)]), steps,
                        source.step, 2.0, pad_text(neg, 512)[None].numpy(), np.array([len(neg)]), extra,
                        pipe.scheduler.sigmas)
    finally:
        compute.close()
        source.close()
    got = got.permute(0, 4, 1, 2, 3)
    assert float((got - want).norm() / want.norm()) < 1e-4
    assert float((got[:, :, 0] - want[:, :, 0]).abs().max()) < 1e-5  # the image's latents, kept
