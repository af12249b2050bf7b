"""What a model output means: the velocity of the rectified flow, or (``model.prediction =
sample``) a clean-clip estimate turned into that velocity. The model's forward and the compute
actor both call ``as_velocity``, so the loss and the sampler are the velocity ones either way."""

from __future__ import annotations

import torch

SAMPLE_T_MIN = 0.05
"""``model.prediction = sample``: the velocity is ``(x_t - x0_hat) / max(t, SAMPLE_T_MIN)``."""


def as_velocity(out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
    """The velocity a model output means: ``out`` itself (``velocity``), or, for a clean-clip
    estimate (``sample``: x-prediction), ``(x_t - out) / max(t, 0.05)``. With x_t = (1 - t) x0 +
    t noise the exact clean clip gives the exact velocity noise - x0 (for t >= 0.05), so the loss
    and the sampler are the velocity ones either way. The difference and the division are in fp32
    (at least) whatever ``out``'s dtype: a bf16 division would round the velocity up to 20x its
    own rounding (t down to 0.05), so the velocity of ``sample`` comes back fp32 from a bf16 model."""
    if prediction == "velocity":
        return out
    if prediction != "sample":
        raise ValueError(f"prediction={prediction!r} is not 'velocity' or 'sample'")
    dtype = torch.promote_types(out.dtype, torch.float32)
    tb = t.to(dtype).clamp(min=SAMPLE_T_MIN).view(-1, *([1] * (out.dim() - 1)))
    return (x_t.to(dtype) - out.to(dtype)) / tb

