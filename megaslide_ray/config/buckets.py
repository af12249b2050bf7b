"""``data.buckets``: the clip shapes a run trains on when its manifest mixes sizes and lengths.

A bucket is ``HEIGHTxWIDTHxFRAMES`` in pixels (frames of the pixel clip; for a latent model the
clip the VAE encodes). ``config_buckets(cfg)`` reads the field: an explicit list, ``auto``, or
empty (no buckets: the single shape ``data.num_frames x height x width``). ``with_clip`` gives
the config of one bucket (what validation, the decoders and the planner look at), and
``largest_bucket`` the one of the most tokens, which the planner and the memory checks answer for.
Assigning rows to buckets and the batch order are the data's concern (``megaslide_ray.data.buckets``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from megaslide_ray.config.sections import Config, ConfigError

AUTO_ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16)
"""Width / height of the ``auto`` buckets, all at the area ``data.height x data.width``."""


class Bucket(NamedTuple):
    height: int
    width: int
    frames: int

    def __str__(self) -> str:
        return f"{self.height}x{self.width}x{self.frames}"


def parse_buckets(text: str) -> list[Bucket]:
    """``"480x832x81,512x512x1"`` -> buckets, in the order given (duplicates refused)."""
    out: list[Bucket] = []
    for item in (t.strip() for t in text.split(",")):
        parts = item.lower().split("x")
        try:
            h, w, f = (int(p) for p in parts)
            if len(parts) != 3 or min(h, w, f) < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"data.buckets={text!r}: {item!r} is not HEIGHTxWIDTHxFRAMES with three positive "
                              f"integers (e.g. 480x832x81,512x512x1), nor 'auto'") from None
        if Bucket(h, w, f) in out:
            raise ConfigError(f"data.buckets={text!r} names {item} twice; list each shape once")
        out.append(Bucket(h, w, f))
    return out


def spatial_unit(cfg: Config) -> tuple[int, int]:
    """The pixel multiple each bucket's (height, width) must be: the patch, times the VAE's
    compression for a latent model."""
    _, ph, pw = cfg.model.patch_size
    if cfg.latent_space:
        _, ch, cw = cfg.model.latent_compression
        return ch * ph, cw * pw
    return ph, pw


def with_clip(cfg: Config, bucket: Bucket) -> Config:
    """``cfg`` with ``data.num_frames/height/width`` set to ``bucket`` (a shallow copy)."""
    data = dataclasses.replace(cfg.data, num_frames=bucket.frames, height=bucket.height, width=bucket.width)
    return dataclasses.replace(cfg, data=data)


def _fits_window(cfg: Config) -> bool:
    a = cfg.attention
    if a.kind == "dense":
        return True
    return all(k <= n for k, n in zip(a.window, cfg.token_grid))


def auto_buckets(cfg: Config) -> list[Bucket]:
    """``data.buckets = auto``: ``AUTO_ASPECTS`` at the area ``data.height x data.width`` (each side
    rounded to ``spatial_unit``) with ``data.num_frames`` frames, and the same sizes with one frame
    (images) when the model can read one frame (patch of one frame, attention window of one frame
    or dense). Shapes whose token grid the attention window does not fit are left out."""
    d = cfg.data
    uh, uw = spatial_unit(cfg)
    area = d.height * d.width
    sizes: list[tuple[int, int]] = []
    for r in AUTO_ASPECTS:
        h = max(uh, round(math.sqrt(area / r) / uh) * uh)
        w = max(uw, round(math.sqrt(area * r) / uw) * uw)
        if (h, w) not in sizes:
            sizes.append((h, w))
    out = [Bucket(h, w, d.num_frames) for h, w in sizes]
    out += [Bucket(h, w, 1) for h, w in sizes]
    return [b for b in out if _fits_window(with_clip(cfg, b)) and _patches_frames(cfg, b.frames)]


def _patches_frames(cfg: Config, frames: int) -> bool:
    pt = cfg.model.patch_size[0]
    if cfg.latent_space:
        ct = cfg.model.latent_compression[0]
        return (frames - 1) % ct == 0 and ((frames - 1) // ct + 1) % pt == 0
    return frames % pt == 0


def config_buckets(cfg: Config) -> list[Bucket]:
    """The run's buckets (module docstring); [] when ``data.buckets`` is empty."""
    text = cfg.data.buckets.strip()
    if not text:
        return []
    if text.lower() == "auto":
        found = auto_buckets(cfg)
        if not found:
            raise ConfigError(f"data.buckets='auto' finds no shape at the area {cfg.data.height}x{cfg.data.width} "
                              f"that the attention window {tuple(cfg.attention.window)} fits; list the buckets")
        return found
    return parse_buckets(text)


def bucket_tokens(cfg: Config, bucket: Bucket) -> int:
    return with_clip(cfg, bucket).tokens_per_sample


def largest_bucket(cfg: Config) -> Config:
    """``cfg`` at its bucket of the most tokens (ties: the first listed); ``cfg`` itself without
    buckets. What the planner and the memory checks answer for."""
    buckets = config_buckets(cfg)
    if not buckets:
        return cfg
    return with_clip(cfg, max(buckets, key=lambda b: bucket_tokens(cfg, b)))
