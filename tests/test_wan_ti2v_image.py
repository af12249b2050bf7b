"""Wan2.2 TI2V-5B from an image (``model.clean_first_frame``; diffusers' ``expand_timesteps``):
the transformer with diffusers' per-token timesteps (0 on the first latent frame, t elsewhere)
against WanTransformer3DModel, forward and every gradient, on a tiny random config."""

from __future__ import annotations

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
