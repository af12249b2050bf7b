"""The cache folder ``python -m megaslide_ray.precompute`` fills: what it holds, which of its clips
and captions a previous run finished, its settings file and its latent manifest. Nothing here
loads a model or starts Ray: ``pipelines/latent_precompute.py`` plans a run with these functions
and runs the encoders (``megaslide_ray.data.encoders``) on what is left.

The folder's layout and the latent manifest's format are ``megaslide_ray.data.latents``'s. What
each file holds, per row of the video manifest (``megaslide_ray.data.manifest``):

* the clip is decoded with the decoder actors' rules (``clip_config``, ``decode_clip``): the
  video's first frames (consecutive, or resampled to ``--fps``), the shorter side resized to
  cover ``--height`` x ``--width`` and center-cropped. A video too short for the clip, or one that
  does not decode, is skipped and listed in ``skipped.json``;
* pixels in [-1, 1] as ``(1, 3, F, H, W)`` go through the VAE encoder; the posterior's mode is
  normalised per channel with the VAE config's ``latents_mean``/``latents_std``,
  ``(z - mean) / std`` (as the Wan pipelines do), and stored channels-last ``(F', H', W', C)``
  in ``latents/KEY.safetensors``, whose header is the clip's row of the latent manifest;
* each distinct caption is cleaned as the Wan pipelines clean prompts, tokenized (at most 512
  tokens) and encoded; only the valid tokens (the attention mask's length) are stored, once per
  caption, in ``text/TKEY.safetensors``.

A cache of an image-to-video folder (Wan2.1 I2V, FLF2V, Wan2.2 I2V-A14B) also holds each clip's
image condition (the mask, the latents of the first frame with grey frames after it, and CLIP's
penultimate hidden states of the first frame; ``megaslide_ray.data.image_condition``) in the
clip's latent file, and names it in the manifest's metadata and in ``precompute.json``.

A cache resumes: every file is written to a temporary name and renamed into place, a clip whose
latent file is there with this cache's shape, dtype and condition and its source video's size and
modification time is not encoded again (``plan_clips``), nor a caption whose text file is there
and readable (``plan_captions``), and the latent manifest is rewritten at the end from
everything finished. ``precompute.json`` holds the settings (frames, size, fps, dtype, model) the
cache was made with; a run with other settings into the same folder is refused
(``check_settings``).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaslide_ray.config import DataConfig
from megaslide_ray.data.encoders import ModelInfo
from megaslide_ray.data.image_condition import IMAGE_CONDITION_KEY, condition_info
from megaslide_ray.data.latents import (
    FORMAT_VERSION,
    HEADER_KEY,
    TEXT_KEY,
    TEXT_LEN,
    read_file_metadata,
    write_latent_manifest,
)
from megaslide_ray.data.manifest import MANIFEST_NAME, ManifestEntry

LATENTS_DIR, TEXT_DIR = "latents", "text"
SETTINGS_NAME, SKIPPED_NAME = "precompute.json", "skipped.json"

MANIFEST_COLUMNS = ("source_path", "frame_start", "frame_end", "num_frames", "fps", "height", "width",
                    "latent_shape", "dtype")
"""The columns of a latent-manifest row that come from the clip's latent file header."""


def clip_config(frames: int, height: int, width: int, fps: float) -> DataConfig:
    """The decoder rules precompute uses: first frames (or resampled to ``fps``), center crop,
    too-short videos skipped."""
    return DataConfig(num_frames=frames, height=height, width=width, fps=float(fps), frame_stride=1,
                      random_crop=False, fixed_start="first", spatial_crop="center", short_clips="skip")


@dataclass(frozen=True)
class CacheSpec:
    """What one cache folder holds: ``model``'s encodings of clips of ``frames`` x ``height`` x
    ``width`` at ``fps`` (0: the video's own rate), stored as ``dtype`` (a torch dtype name:
    ``bfloat16``, ``float16``, ``float32``)."""

    model: ModelInfo
    frames: int
    height: int
    width: int
    fps: float
    dtype: str

    @property
    def latent_shape(self) -> list[int]:
        """``[F', H', W', C]`` of every clip's latents."""
        t, s, _ = self.model.compression
        return [1 + (self.frames - 1) // t, self.height // s, self.width // s, self.model.latent_channels]

    def clip_config(self) -> DataConfig:
        return clip_config(self.frames, self.height, self.width, self.fps)

    def settings(self) -> dict:
        """``precompute.json``: a run with other settings into the same folder is refused. An
        image-to-video cache names its condition (a text-to-video one names none, so a cache made
        before image-to-video existed keeps its settings)."""
        m = self.model
        return {"format_version": FORMAT_VERSION, "model_dir": m.name, "model_configs_sha1": m.configs_sha1,
                "frames": self.frames, "height": self.height, "width": self.width, "fps": float(self.fps),
                "dtype": self.dtype, **({"condition": m.condition} if m.condition else {})}

    def manifest_metadata(self) -> dict:
        """The latent manifest's metadata (``megaslide_ray.data.latents``), with the image
        condition's entry for an image-to-video cache (``megaslide_ray.data.image_condition``)."""
        m = self.model
        condition = ({IMAGE_CONDITION_KEY: condition_info(m.condition, m.compression[0], m.image_tokens, m.image_dim)}
                     if m.condition else {})
        return {"latents_mean": m.latents_mean, "latents_std": m.latents_std, "compression": list(m.compression),
                "latent_channels": m.latent_channels, "text_dim": m.text_dim, "text_len": TEXT_LEN,
                "model_dir": m.name, "layout": "FHWC", "storage": "safetensors", "dtype": self.dtype,
                "clip": {"frames": self.frames, "height": self.height, "width": self.width, "fps": float(self.fps),
                         "frame_stride": 1},
                **condition}


def check_settings(out: Path, settings: dict) -> None:
    """Refuse a folder made with other settings (naming each difference); else create the folder
    and write ``settings`` into its ``precompute.json``."""
    path = out / SETTINGS_NAME
    if path.is_file():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = None
        if old is not None and old != settings:
            diff = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
            shown = "; ".join(f"{k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in diff if k != "model_configs_sha1")
            raise ValueError(f"{str(out)!r} was precomputed with other settings ({shown or 'another model'}); "
                             f"use another --out, or delete {str(out)!r} to start over")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(path, settings)


# ---------------------------------------------------------------------------------------------
# What is left to encode
# ---------------------------------------------------------------------------------------------


@dataclass
class ClipPlan:
    """The clips of a video manifest in a cache folder: ``keys[i]`` is row ``i``'s clip (rows of
    the same video share one); ``done`` maps the key of each clip whose latent file is finished to
    its header (the clip's row), ``tasks`` the key of each clip to encode to its task (what
    ``Encoder.encode_clips`` takes: ``key``, ``source``, ``out``, ``stamp``, ``source_rel``)."""

    keys: list[str] = field(default_factory=list)
    done: dict[str, dict] = field(default_factory=dict)
    tasks: dict[str, dict] = field(default_factory=dict)


def clip_key(path: str, base: Path) -> str:
    """A clip's file name in ``latents/``: the video's stem and a hash of its path relative to
    the video manifest's folder ``base``."""
    rel = Path(os.path.relpath(path, base)).as_posix()
    return f"{Path(path).stem[:40]}-{hashlib.sha1(rel.encode()).hexdigest()[:12]}"


def plan_clips(entries: list[ManifestEntry], base: Path, out: Path, spec: CacheSpec) -> ClipPlan:
    """Which clips of ``entries`` (a video manifest in the folder ``base``) the cache ``out``
    holds already and which must be encoded: a latent file counts when its header has ``spec``'s
    shape, dtype and condition and the source video's current size and modification time."""
    plan = ClipPlan()
    for e in entries:
        key = clip_key(e.path, base)
        plan.keys.append(key)
        if key in plan.tasks or key in plan.done:
            continue
        latent_file = out / LATENTS_DIR / f"{key}.safetensors"
        stamp = _file_stamp(e.path)
        header = _latent_header(latent_file) if latent_file.is_file() else None
        if header and header.get("latent_shape") == spec.latent_shape and header.get("dtype") == spec.dtype and all(
                header.get(k) == v for k, v in stamp.items()) and header.get("condition", "") == spec.model.condition:
            plan.done[key] = header
            continue
        plan.tasks[key] = {"key": key, "source": e.path, "out": str(latent_file), "stamp": stamp,
                           "source_rel": Path(os.path.relpath(e.path, out.resolve())).as_posix()}
    return plan


@dataclass
class CaptionPlan:
    """The captions of the clips that made it: ``keys`` maps each caption to its text file's key,
    ``lengths`` each finished text file's key to its valid tokens, ``tasks`` the captions to encode
    (what ``Encoder.encode_captions`` takes: ``key``, ``caption``, ``out``)."""

    keys: dict[str, str] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    tasks: list[dict] = field(default_factory=list)


def plan_captions(entries: list[ManifestEntry], clips: ClipPlan, out: Path, text_dim: int) -> CaptionPlan:
    """The captions of the rows whose clip is in ``clips.done``, each distinct caption once: the
    ones whose text file in ``out`` is finished (the caption and width ``text_dim`` checked) and the
    ones to encode."""
    plan = CaptionPlan()
    for e, key in zip(entries, clips.keys):
        if key not in clips.done or e.caption in plan.keys:
            continue
        tkey = hashlib.sha1(e.caption.encode()).hexdigest()[:20]
        plan.keys[e.caption] = tkey
        path = out / TEXT_DIR / f"{tkey}.safetensors"
        n = _text_len(path, e.caption, text_dim)
        if n is None:
            plan.tasks.append({"key": tkey, "caption": e.caption, "out": str(path)})
        else:
            plan.lengths[tkey] = n
    return plan


# ---------------------------------------------------------------------------------------------
# The latent manifest
# ---------------------------------------------------------------------------------------------


def manifest_rows(entries: list[ManifestEntry], clips: ClipPlan, captions: CaptionPlan) -> list[dict]:
    """The latent manifest's rows: one per row of ``entries`` whose clip is done, in their order."""
    rows = []
    for e, key in zip(entries, clips.keys):
        if key not in clips.done:
            continue
        info = clips.done[key]
        tkey = captions.keys[e.caption]
        rows.append({**{k: info[k] for k in MANIFEST_COLUMNS},
                     "latent_path": f"{LATENTS_DIR}/{key}.safetensors", "text_path": f"{TEXT_DIR}/{tkey}.safetensors",
                     "caption": e.caption, "text_len": captions.lengths[tkey]})
    return rows


def write_cache_manifest(out: Path, rows: list[dict], spec: CacheSpec, skipped: dict[str, str]) -> Path:
    """Write ``out``'s latent manifest and ``skipped.json`` (``skipped``: source path -> reason);
    returns the manifest's path."""
    manifest = write_latent_manifest(rows, spec.manifest_metadata(), out / MANIFEST_NAME)
    _write_json(out / SKIPPED_NAME, [{"path": p, "reason": r} for p, r in sorted(skipped.items())])
    return manifest


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def _file_stamp(path: str) -> dict:
    try:
        st = os.stat(path)
    except OSError:
        return {"source_size": -1, "source_mtime": -1}
    return {"source_size": int(st.st_size), "source_mtime": int(st.st_mtime)}


def _latent_header(path: Path) -> dict | None:
    meta = read_file_metadata(path)
    if not meta or HEADER_KEY not in meta:
        return None
    try:
        return json.loads(meta[HEADER_KEY])
    except ValueError:
        return None


def _text_len(path: Path, caption: str, text_dim: int) -> int | None:
    """Rows of a finished text file for ``caption``; None when it must be (re)made."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("caption") != caption:
                return None
            shape = f.get_slice(TEXT_KEY).get_shape()
    except Exception:  # noqa: BLE001 - unreadable: made again
        return None
    return int(shape[0]) if len(shape) == 2 and shape[1] == text_dim else None


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
