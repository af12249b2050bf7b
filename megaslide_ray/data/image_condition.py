"""The image condition of the Wan image-to-video models, as diffusers' ``WanImageToVideoPipeline``
builds it, made once per clip by ``precompute`` and read back for training and sampling.

Kinds (the model folder's, ``megaslide_ray.config.wan_folders``):

* ``i2v`` (Wan2.1 I2V-14B): the first frame conditions the clip;
* ``flf2v`` (Wan2.1 FLF2V): the first and the last frame;
* ``i2v-a14b`` (Wan2.2 I2V-A14B): the first frame, without CLIP states (its transformers have
  no image embedder).

Per clip of ``F`` frames (latent grid ``F' x H' x W'``, ``F' = (F - 1) / t + 1``):

``condition`` ``(F', H', W', t + z)`` channels-last: the ``t``-channel mask (``t`` the VAE's
    temporal compression, 4; the model's "4 mask channels") then the ``z`` normalised VAE latents
    of the conditioning video: the first frame (and for ``flf2v`` the last), every other frame
    grey (0 in [-1, 1] pixels, as the pipeline's zeros after its normalisation). The mask is 1
    on the kept pixel frames and 0 elsewhere; the first pixel frame is repeated ``t`` times and
    the sequence of ``t F'`` values folded into ``F'`` latent frames of ``t`` channels, so latent
    frame 0 is all ones and, for ``flf2v``, the last latent frame's last channel is one. The
    model reads ``[noisy latents, condition]`` along the channels (``2 z + t`` = 36 for Wan2.1).
``image`` ``(n, Li, image_dim)``: CLIP's penultimate hidden states (``hidden_states[-2]``) of
    the ``n`` kept frames (1, or 2 for ``flf2v``; none for ``i2v-a14b``), each frame as the
    pixels of the clip (resized and cropped) through the folder's ``image_processor``.

Both are stored in the clip's latent file beside its latents (keys ``condition`` and
``image``), and the latent manifest's metadata says so (``IMAGE_CONDITION_KEY``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from megaslide_ray.config.image_kinds import KINDS, kept_frames, required_kind, uses_clip  # noqa: F401
from megaslide_ray.data.latents import DTYPES, LatentFileError, _load_tensor, resolve

CONDITION_KEY, IMAGE_KEY = "condition", "image"
"""Keys of the condition tensors in a latent file."""
IMAGE_CONDITION_KEY = "image_condition"
"""The latent manifest's metadata entry: ``{"kind", "mask_channels", "frames", "image_tokens",
"image_dim"}`` (``image_tokens``/``image_dim`` 0 without CLIP states)."""


def condition_mask(frames: int, temporal: int, height: int, width: int, last: bool = False) -> torch.Tensor:
    """The mask ``(F', H', W', temporal)`` float32 of a clip of ``frames`` pixel frames (module
    docstring): 1 on the first pixel frame (and the last with ``last``), folded ``temporal``
    pixel frames per latent frame after the first frame is repeated ``temporal`` times."""
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(f"{frames} frames is not {temporal}k+1 (the VAE's temporal compression {temporal})")
    keep = torch.zeros(frames)
    keep[0] = 1.0
    if last:
        keep[-1] = 1.0
    folded = torch.cat([keep[:1].expand(temporal), keep[1:]]).view(-1, temporal)  # (F', temporal)
    return folded[:, None, None, :].expand(-1, height, width, -1).contiguous()


def condition_pixels(frames: np.ndarray | torch.Tensor, last: bool = False) -> torch.Tensor:
    """The conditioning video ``(1, 3, F, H, W)`` float32 in [-1, 1] of a uint8 clip ``(F, H, W,
    3)``: its first frame (and last with ``last``), grey (0) elsewhere."""
    x = torch.as_tensor(np.ascontiguousarray(frames)) if isinstance(frames, np.ndarray) else frames
    if x.ndim != 4 or x.shape[-1] != 3:
        raise ValueError(f"a clip must be (F, H, W, 3) uint8, got shape {tuple(x.shape)}")
    out = torch.zeros((1, 3, *x.shape[:3]), dtype=torch.float32)
    kept = [0, x.shape[0] - 1] if last else [0]
    for f in kept:
        out[0, :, f] = x[f].permute(2, 0, 1).float() / 127.5 - 1.0
    return out


def condition_info(kind: str, mask_channels: int, image_tokens: int = 0, image_dim: int = 0) -> dict[str, Any]:
    """The manifest metadata entry of a cache made for ``kind``."""
    return {"kind": kind, "mask_channels": int(mask_channels), "frames": kept_frames(kind),
            "image_tokens": int(image_tokens), "image_dim": int(image_dim)}


def condition_problems(model: Any, info: Mapping[str, Any] | None, latent_channels: int) -> list[str]:
    """What a manifest's ``image_condition`` entry ``info`` lacks for ``model`` (a config's
    ``model`` section); empty when it fits. An ``i2v`` condition (with CLIP states) serves an
    I2V-A14B model too: the mask and latents are the same."""
    need = required_kind(model)
    if need is None:
        return []
    if not info:
        return [f"the model is image-to-video ({need}) but the manifest holds no image condition"]
    problems = []
    kind = info.get("kind")
    if kind != need and not (need == "i2v-a14b" and kind == "i2v"):
        problems.append(f"its image condition is {kind!r}, the model reads {need!r}")
    channels = int(info.get("mask_channels", 0)) + 2 * latent_channels
    if channels != model.in_channels:
        problems.append(f"noise, mask and image latents make {channels} channels, model.in_channels="
                        f"{model.in_channels}")
    if uses_clip(need) and int(info.get("image_dim", 0)) != model.image_dim:
        problems.append(f"its CLIP states are {info.get('image_dim')} wide, model.image_dim={model.image_dim}")
    if need == "flf2v" and kept_frames(need) * int(info.get("image_tokens", 0)) != model.pos_embed_seq_len:
        problems.append(f"its two frames' {info.get('image_tokens')} CLIP tokens each are not "
                        f"model.pos_embed_seq_len={model.pos_embed_seq_len} together")
    return problems


def load_condition(manifest_path, row: Mapping[str, Any], info: Mapping[str, Any]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(condition, image)`` of one latent manifest row, float32: ``condition`` ``(F', H', W',
    mask_channels + C)``, ``image`` ``(n, Li, image_dim)`` or None (I2V-A14B's). A
    ``LatentFileError`` names the file when a tensor is missing or not the shape ``info`` and the
    row say (``info``: the manifest's ``IMAGE_CONDITION_KEY`` entry)."""
    path = resolve(manifest_path, row["latent_path"])
    F_, H_, W_, C = row["latent_shape"]
    want = {CONDITION_KEY: (F_, H_, W_, int(info["mask_channels"]) + C)}
    if int(info.get("image_dim", 0)):
        want[IMAGE_KEY] = (int(info["frames"]), int(info["image_tokens"]), int(info["image_dim"]))
    got = {}
    for key, shape in want.items():
        t = _load_tensor(path, key, f"latent ({key})")
        if tuple(t.shape) != shape or t.dtype != DTYPES[row["dtype"]]:
            raise LatentFileError(f"latent file {str(path)!r} holds {key} {t.dtype} {tuple(t.shape)}, but its "
                                  f"manifest says {DTYPES[row['dtype']]} {shape}; delete it and run "
                                  f"`python -m megaslide_ray.precompute` again with the image-to-video --model-dir")
        got[key] = t.float()
    return got[CONDITION_KEY], got.get(IMAGE_KEY)


def condition_arrays(info: Mapping[str, Any], batch: int, latent_shape) -> dict[str, np.ndarray]:
    """Empty batch arrays of an image-to-video cache (the decoder fills them): ``condition``
    ``(B, F', H', W', mask + C)`` and, with CLIP states, ``image`` ``(B, n, Li, image_dim)``."""
    F_, H_, W_, C = latent_shape
    out = {"condition": np.zeros((batch, F_, H_, W_, int(info["mask_channels"]) + C), dtype=np.float32)}
    if int(info.get("image_dim", 0)):
        out["image"] = np.zeros((batch, int(info["frames"]), int(info["image_tokens"]), int(info["image_dim"])),
                                dtype=np.float32)
    return out


