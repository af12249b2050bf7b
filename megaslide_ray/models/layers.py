"""Pieces both architectures build from: the feed-forward width a config asks for, and
``unpatchify``, the inverse of the Conv3d patch embedding."""

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
