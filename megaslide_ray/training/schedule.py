"""Learning-rate schedule: linear warm-up, then constant, cosine or linear decay."""

from __future__ import annotations

import math

from megaslide_ray.config import OptimizerConfig


def lr_at(optim: OptimizerConfig, total_steps: int, step: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of a ``total_steps`` run."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    if optim.schedule == "cosine":
        factor = optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    else:  # linear
        factor = 1 - (1 - optim.min_lr_ratio) * progress
    return optim.lr * factor


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor ``torch.nn.utils.clip_grad_norm_`` applies: min(1, max_norm / (norm + 1e-6))."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def step_constants(optim: OptimizerConfig, total_steps: int, step: int, total_norm: float,
                   lr_factor: float = 1.0) -> tuple[float, float, bool]:
    """The clipping coefficient and learning rate of 0-based ``step`` for the global gradient norm
    ``total_norm``, and whether that norm is finite (if not, the step's update is skipped
    everywhere): the one rule the parameter store and a device-side update share."""
    finite = math.isfinite(total_norm)
    lr = lr_at(optim, total_steps, step) * lr_factor
    return (clip_coefficient(total_norm, optim.grad_clip) if finite else 0.0), lr, finite


def global_norm(sqnorms) -> float:
    """The global gradient norm from the shards' squared norms: an exactly rounded sum, so it is
    the same whatever order the reports arrived in (the store and the compute actor agree)."""
    return math.sqrt(math.fsum(sqnorms))
