"""Frames out: a model's output in [-1, 1] as uint8 video frames, Wan latents decoded by the VAE,
and a contact sheet of a video's frames written as PNG (a dependency-free writer: zlib and the PNG
chunk format). Used by ``megaslide_ray.sample`` and by the sample writer actor during training."""

from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

SHEET_MAX_FRAMES = 16   # the contact sheet shows at most this many frames, evenly spaced
SHEET_COLUMNS = 8


def to_uint8_frames(x: torch.Tensor) -> np.ndarray:
    """(1, F, H, W, C) in [-1, 1] -> uint8 (F, H, W, 3); one channel is repeated to RGB."""
    frames = ((x[0].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy()
    if frames.shape[-1] == 1:
        frames = np.repeat(frames, 3, axis=-1)
    if frames.shape[-1] != 3:
        raise ValueError(f"the model makes {frames.shape[-1]} channels; a video needs 1 or 3 (model.in_channels)")
    return frames


def contact_sheet(frames: np.ndarray, max_frames: int = SHEET_MAX_FRAMES, columns: int = SHEET_COLUMNS,
                  gap: int = 2) -> np.ndarray:
    """Up to ``max_frames`` evenly spaced frames of uint8 ``(F, H, W, 3)`` in a grid, row-major."""
    f, h, w, _ = frames.shape
    picks = np.unique(np.linspace(0, f - 1, min(f, max_frames)).round().astype(int))
    cols = min(columns, len(picks))
    rows = math.ceil(len(picks) / cols)
    sheet = np.full((rows * h + (rows - 1) * gap, cols * w + (cols - 1) * gap, 3), 255, dtype=np.uint8)
    for k, i in enumerate(picks):
        r, c = divmod(k, cols)
        sheet[r * (h + gap): r * (h + gap) + h, c * (w + gap): c * (w + gap) + w] = frames[i]
    return sheet


def write_png(path: str | Path, image: np.ndarray) -> None:
    """uint8 (H, W, 3) RGB -> 8-bit PNG."""
    h, w, _ = image.shape
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(h))  # filter type 0 per row

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    Path(path).write_bytes(png)



def decode_latents(vae, latents: torch.Tensor) -> np.ndarray:
    """Normalised latents ``(1, F', H', W', C)`` -> uint8 video ``(F, H, W, 3)`` with a diffusers
    ``AutoencoderKLWan``: undo the per-channel normalisation (``latents_mean``/``latents_std``
    of its config, as precompute applied it), decode, map [-1, 1] to bytes."""
    c = vae.config
    shape = (1, len(c.latents_mean), 1, 1, 1)
    mean = torch.tensor(c.latents_mean, dtype=torch.float32).view(shape)
    std = torch.tensor(c.latents_std, dtype=torch.float32).view(shape)
    z = latents.permute(0, 4, 1, 2, 3).float() * std + mean  # (1, C, F', H', W')
    param = next(vae.parameters())
    with torch.inference_mode():
        video = vae.decode(z.to(param.device, param.dtype)).sample  # (1, 3, F, H, W) in [-1, 1]
    return to_uint8_frames(video.permute(0, 2, 3, 4, 1).float().cpu())
