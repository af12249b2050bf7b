"""Rectified-flow (flow-matching) objective.

x_t = (1 - t) * x0 + t * noise, and the model predicts the velocity v = noise - x0. Sampling
integrates dx/dt = v from t = 1 (noise) to t = 0 (data). Noise and t for a step come from a
generator seeded by (seed, step), so a streamed run, an in-process run and a resumed run all
see the same draws without carrying RNG state around.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class FlowInputs:
    x0: torch.Tensor        # (B, F, H, W, C) clean video in [-1, 1]
    noise: torch.Tensor     # same shape
    t: torch.Tensor         # (B,) in (0, 1)
    x_t: torch.Tensor       # noised input
    target: torch.Tensor    # velocity noise - x0


def video_to_unit(video: torch.Tensor | np.ndarray) -> torch.Tensor:
    """uint8 (B, F, H, W, C) -> float32 in [-1, 1]."""
    # np.array copies: batches from Ray are read-only views of the object store.
    v = video if isinstance(video, torch.Tensor) else torch.from_numpy(np.array(video))
    return v.to(torch.float32) / 127.5 - 1.0


def step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed((seed * 0x9E3779B1 + step * 0x85EBCA77 + 1) % (2**63 - 1))


def sample_flow_inputs(video, seed: int, step: int, t_sampling: str = "logit_normal") -> FlowInputs:
    x0 = video_to_unit(video)
    g = step_generator(seed, step)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float32)
    B = x0.shape[0]
    if t_sampling == "uniform":
        t = torch.rand(B, generator=g, dtype=torch.float32)
    elif t_sampling == "logit_normal":  # SD3-style: more weight on the middle of the path
        t = torch.sigmoid(torch.randn(B, generator=g, dtype=torch.float32))
    else:
        raise ValueError(f"t_sampling={t_sampling!r} is not 'uniform' or 'logit_normal'")
    t = t.clamp(1e-4, 1 - 1e-4)
    tb = t.view(B, *([1] * (x0.dim() - 1)))
    x_t = (1 - tb) * x0 + tb * noise
    return FlowInputs(x0=x0, noise=noise, t=t, x_t=x_t, target=noise - x0)


def flow_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float())
