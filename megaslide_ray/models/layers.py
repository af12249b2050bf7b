"""Pieces the architectures build from: the feed-forward width a config asks for,
``unpatchify``, the inverse of the Conv3d patch embedding, and ``first_frame_timesteps``, the
flow time of diffusers' per-token Wan2.2 TI2V timesteps."""

from __future__ import annotations

import torch

from megaslide_ray.config import Config


def unpatchify(y: torch.Tensor, patch: tuple[int, int, int], channels: int) -> torch.Tensor:
    """(B, T, H, W, pt*ph*pw*C) -> (B, T*pt, H*ph, W*pw, C), the inverse of the Conv3d patching."""
    B, T, H, W, _ = y.shape
    pt, ph, pw = patch
    y = y.view(B, T, H, W, pt, ph, pw, channels).permute(0, 1, 4, 2, 5, 3, 6, 7)
    return y.reshape(B, T * pt, H * ph, W * pw, channels)


def ffn_width(cfg: Config) -> int:
    """The feed-forward hidden width: ``model.ffn_dim``, or ``mlp_ratio * hidden_size`` when it is 0."""
    return cfg.model.ffn_dim or int(cfg.model.hidden_size * cfg.model.mlp_ratio)


def first_frame_timesteps(timestep: torch.Tensor, frames: int) -> torch.Tensor:
    """diffusers' per-token timesteps of Wan2.2 TI2V from an image ``(B, N)`` (0 on the first token
    frame, the sample's ``t`` elsewhere) -> ``(B,)`` ``t``; a ``ValueError`` for any other layout."""
    B, N = timestep.shape
    per_frame = timestep.view(B, frames, N // frames)
    t = per_frame[:, -1, 0]
    if per_frame[:, 0].any() or not torch.equal(per_frame[:, 1:], t.view(B, 1, 1).expand_as(per_frame[:, 1:])):
        raise ValueError("per-token timesteps other than 0 on the first frame and one t elsewhere (Wan2.2 TI2V "
                         "from an image) are not supported")
    return t
