"""An image-to-video model's condition for a sample: the image (and FLF2V's last image) read as a
training clip's frames are (resized to cover, center-cropped), then encoded as precompute encodes a
clip's condition (``Encoder.encode_condition``). Used by ``python -m megaslide_ray.sample --image``
and by the sample writer for the samples taken during training (a prompt line's images)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megaslide_ray.data.clips import resize_crop
from megaslide_ray.data.image_condition import CONDITION_KEY, IMAGE_KEY


@dataclass(frozen=True)
class ImageSpec:
    """What a model's image condition needs: its kind (``required_kind``: ``i2v``, ``flf2v``,
    ``i2v-a14b``; empty for TI2V from an image), whether it is TI2V from an image
    (``model.clean_first_frame``), and the clip's frames, height and width."""

    kind: str
    clean_first_frame: bool
    frames: int
    height: int
    width: int


def read_image(path: str | Path, height: int, width: int) -> np.ndarray:
    """An image file as uint8 ``(height, width, 3)``: the shorter side resized to cover the clip,
    then center-cropped, as training clips are (``resize_crop``). ``ValueError`` naming the file
    when it is not a readable image."""
    from PIL import Image  # lazy: only image prompts need Pillow

    try:
        with Image.open(path) as im:
            pixels = np.asarray(im.convert("RGB"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{str(path)!r}: not a readable image ({e})") from None
    return resize_crop(pixels[None], height, width)[0]


def image_condition(encoder, spec: ImageSpec, image: str | Path, last_image: str | Path | None = None
                    ) -> dict[str, torch.Tensor | None]:
    """The condition of one sample from ``image`` (and ``last_image`` for FLF2V), batch of one:
    ``{"first_frame": (1, 1, H', W', C)}`` for TI2V from an image (the image's latents, the clip's
    clean first latent frame), else ``{"condition": (1, F', H', W', 4 + C), "image": (n, Li, D) or
    None}`` (the mask, the latents of the image with grey frames after it, CLIP's states)."""
    if spec.clean_first_frame:
        return {"first_frame": encoder.encode_video(read_image(image, spec.height, spec.width)[None])[None]}
    frames = np.zeros((spec.frames, spec.height, spec.width, 3), dtype=np.uint8)  # only the kept frames are read
    frames[0] = read_image(image, spec.height, spec.width)
    if last_image is not None:
        frames[-1] = read_image(last_image, spec.height, spec.width)
    encoder.condition = spec.kind
    out = encoder.encode_condition(frames)
    return {"condition": out[CONDITION_KEY][None], "image": out.get(IMAGE_KEY)}
