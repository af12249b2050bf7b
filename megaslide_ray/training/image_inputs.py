"""An image-to-video model's inputs in a training or sampling step: the decoder batch's condition
and CLIP states as tensors (``batch_condition``), and ``[x_t, condition]`` as the pipeline feeds
the transformer (``model_input``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from megaslide_ray.config.image_kinds import required_kind, uses_clip


def model_input(x_t: torch.Tensor, condition: torch.Tensor) -> torch.Tensor:
    """``[x_t, condition]`` along the channels (channels-last), as the pipeline feeds the model."""
    return torch.cat([x_t, condition.to(x_t.dtype)], dim=-1)


def stack_image_states(image: torch.Tensor) -> torch.Tensor:
    """``(B, n, Li, D)`` per-clip CLIP states -> ``(B n, Li, D)``, the frames of each clip
    consecutive, as the pipeline passes them (FLF2V's embedder joins each pair)."""
    return image.reshape(-1, *image.shape[2:])


def batch_condition(batch: Mapping[str, Any], model: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(condition, image)`` of a decoder batch as the ``model`` config reads them (None, None
    for a text-to-video model; ``image`` None for I2V-A14B): float32 tensors, ``image`` as
    ``(B n, Li, D)`` (``stack_image_states``). A model that needs them and a batch without them
    is a ``ValueError``."""
    kind = required_kind(model)
    if kind is None:
        return None, None
    if "condition" not in batch or (uses_clip(kind) and "image" not in batch):
        raise ValueError(f"the image-to-video model ({kind}) needs the batch's image condition; its latent manifest "
                         f"has none: precompute it with the model's folder")
    # np.array copies: batches from Ray are read-only views of the object store.
    condition = torch.from_numpy(np.array(batch["condition"], dtype=np.float32))
    image = stack_image_states(torch.from_numpy(np.array(batch["image"], dtype=np.float32))) if uses_clip(kind) else None
    return condition, image
