"""Precompute VAE latents and UMT5 text embeddings of a video manifest, for Wan 2.x training.

    python -m megaslide_ray.precompute --model-dir WAN_DIR --data MANIFEST --out CACHE \\
        --frames 81 --height 480 --width 832 [--fps 16] [--device auto] [--dtype bf16] [--num-encoders N]

``WAN_DIR`` is a local diffusers-format Wan 2.1/2.2 folder; three of its parts are read:
``vae/`` (``diffusers.AutoencoderKLWan``), ``text_encoder/`` (``transformers.UMT5EncoderModel``)
and ``tokenizer/`` (``transformers.AutoTokenizer``). Nothing is downloaded.

Per row of the video manifest (``megaslide_ray.data.manifest``):

* the clip is decoded with the decoder actors' rules (``actors.decoder.decode_clip``): the
  video's first frames (consecutive, or resampled to ``--fps``), the shorter side resized to
  cover ``--height`` x ``--width`` and center-cropped. A video too short for the clip, or one that
  does not decode, is skipped and listed (the run goes on);
* pixels in [-1, 1] as ``(1, 3, F, H, W)`` go through the VAE encoder; the posterior's mode is
  normalised per channel with the VAE config's ``latents_mean``/``latents_std``,
  ``(z - mean) / std`` (as the Wan pipelines do), and stored channels-last ``(F', H', W', C)``;
* each distinct caption is cleaned as the Wan pipelines clean prompts, tokenized (at most 512
  tokens) and encoded; only the valid tokens (the attention mask's length) are stored, once per
  caption.

An image-to-video folder (Wan2.1 I2V, FLF2V, Wan2.2 I2V-A14B) also makes each clip's image
condition (the mask, the latents of the first frame with grey frames after it, and CLIP's
penultimate hidden states of the first frame; ``megaslide_ray.data.image_condition``), stored
in the clip's latent file and named in the manifest's metadata.

``--frames`` must be ``t*k + 1`` for the VAE's temporal compression ``t`` (4: 5, 9, ..., 81), and
``--height``/``--width`` multiples of its spatial compression (8 for Wan 2.1, 16 for Wan 2.2).
The VAE runs in float32 (as the Wan pipelines load it); ``--dtype`` (bf16, fp16 or fp32) is the
storage dtype of latents and text, and, on CUDA with bf16, the text encoder's compute dtype
(float32 otherwise: UMT5 overflows in fp16).

The work runs on Ray: a pool of ``Encoder`` actors, one per GPU (``--device cuda``, the default
when the cluster has GPUs) or ``--num-encoders`` CPU actors, each with ``CPUs / N`` torch threads
(default ``min(CPUs, 4)``: several actors with a few threads each beat one with all of them,
benchmarks/RESULTS.md); ``--num-encoders 0`` runs one encoder in this process, without Ray. Each
actor decodes its next clips on a thread while it encodes one. The clips come first, then the
captions of the clips that made it; an actor holds one of the two models at a time, and on CPU
the captions go to one actor with every thread (a UMT5-XXL copy is 22 GB in float32).

The output folder (layout and manifest format: ``megaslide_ray.data.latents``) is resumable: every
file is written to a temporary name and renamed into place, a second run with the same
arguments skips the clips and captions whose files are there and readable (a changed source
video, by size or modification time, is encoded again), and the latent manifest
(``CACHE/manifest.parquet``) is rewritten at the end from everything finished. A run with other
settings (frames, size, fps, dtype, model) into the same folder is refused. Train on it with
``--data CACHE/manifest.parquet``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megaslide_ray.config import DataConfig
from megaslide_ray.data.encoders import (
    CAPTIONS_PER_CALL,
    CLIPS_PER_CALL,
    DTYPE_NAMES,
    HANG_TIMEOUT_S,
    _pick_device,
    _Pool,
    check_frames,
    check_size,
    import_hf,
    read_model_info,
)
from megaslide_ray.data.image_condition import IMAGE_CONDITION_KEY, condition_info
from megaslide_ray.data.latents import (
    FORMAT_VERSION,
    HEADER_KEY,
    TEXT_KEY,
    TEXT_LEN,
    read_file_metadata,
    write_latent_manifest,
)
from megaslide_ray.data.manifest import MANIFEST_NAME, read_manifest

log = logging.getLogger(__name__)

LATENTS_DIR, TEXT_DIR = "latents", "text"
SETTINGS_NAME, SKIPPED_NAME = "precompute.json", "skipped.json"


# ---------------------------------------------------------------------------------------------
# Arguments and the model folder
# ---------------------------------------------------------------------------------------------


def clip_config(frames: int, height: int, width: int, fps: float) -> DataConfig:
    """The decoder rules precompute uses: first frames (or resampled to ``fps``), center crop,
    too-short videos skipped."""
    return DataConfig(num_frames=frames, height=height, width=width, fps=float(fps), frame_stride=1,
                      random_crop=False, fixed_start="first", spatial_crop="center", short_clips="skip")


# ---------------------------------------------------------------------------------------------
# The encoder (a plain class; Ray makes it an actor)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------


@dataclass
class PrecomputeReport:
    manifest: Path
    """The latent manifest written."""
    clips: int
    """Rows in it."""
    encoded: int
    """Clips encoded by this run."""
    reused: int
    """Clips whose files a previous run had written."""
    texts_encoded: int
    texts_reused: int
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """Videos that could not be used: (path, reason)."""
    seconds: float = 0.0
    encoders: int = 0
    """Encoder actors (0: in this process, or nothing to encode)."""
    device: str = ""
    """Where the encoders ran ("": nothing was left to encode)."""
    clip_times: list[float] = field(default_factory=list)
    """Seconds from the start of the run at which each clip's result arrived (encoded or skipped)."""

    def steady_clips_per_s(self) -> float:
        """Clips/s over the last three quarters of the clips (start-up excluded); 0 if too few."""
        t = self.clip_times
        k = len(t) // 4
        return (len(t) - 1 - k) / (t[-1] - t[k]) if len(t) >= 2 and t[-1] > t[k] else 0.0


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


def _check_settings(out: Path, settings: dict) -> None:
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


def condition_settings(model) -> dict:
    """The settings entry of an image-to-video cache (none for text-to-video, so a text-to-video
    cache made before image-to-video existed keeps its settings)."""
    return {"condition": model.condition} if model.condition else {}


def condition_metadata(model) -> dict:
    """The latent manifest's image-condition entry (``megaslide_ray.data.image_condition``)."""
    if not model.condition:
        return {}
    return {IMAGE_CONDITION_KEY: condition_info(model.condition, model.compression[0], model.image_tokens,
                                                model.image_dim)}


def precompute(model_dir: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, frames: int,
               height: int, width: int, fps: float = 0.0, device: str = "auto", dtype: str = "bf16",
               num_encoders: int | None = None, progress: bool = True,
               hang_timeout_s: float = HANG_TIMEOUT_S) -> PrecomputeReport:
    """Encode the video manifest ``data`` into the cache folder ``out`` (module docstring) and
    write its latent manifest. ``num_encoders``: actors (None: one per GPU, or ``min(CPUs, 4)`` on CPU);
    0 encodes in this process. With actors, Ray must be running or is started locally; an actor
    that finishes no call for ``hang_timeout_s`` is killed as hung and replaced (0: never)."""
    t0 = time.perf_counter()
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype {dtype!r}: choose bf16, fp16 or fp32")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {device!r}: choose auto, cpu or cuda")
    if num_encoders is not None and num_encoders < 0:
        raise ValueError(f"--num-encoders {num_encoders} must be >= 0")
    if fps < 0:
        raise ValueError(f"--fps {fps} must be >= 0 (0: the video's own rate)")
    if hang_timeout_s < 0:
        raise ValueError(f"--hang-timeout {hang_timeout_s} must be >= 0 (0: no watchdog)")
    model = read_model_info(model_dir)
    t, s, _ = model.compression
    check_frames(frames, t)
    check_size(height, width, s)
    import_hf()
    source = Path(data)
    entries = read_manifest(source)
    out = Path(out)
    dtype_name = DTYPE_NAMES[dtype]
    settings = {"format_version": FORMAT_VERSION, "model_dir": model.name, "model_configs_sha1": model.configs_sha1,
                "frames": frames, "height": height, "width": width, "fps": float(fps), "dtype": dtype_name,
                **condition_settings(model)}
    _check_settings(out, settings)
    shape = [1 + (frames - 1) // t, height // s, width // s, model.latent_channels]

    # -- which clips are done -------------------------------------------------------------------
    base = source.resolve().parent
    keys: list[str] = []
    tasks: dict[str, dict] = {}
    infos: dict[str, dict] = {}
    for e in entries:
        rel = Path(os.path.relpath(e.path, base)).as_posix()
        key = f"{Path(e.path).stem[:40]}-{hashlib.sha1(rel.encode()).hexdigest()[:12]}"
        keys.append(key)
        if key in tasks or key in infos:
            continue
        latent_file = out / LATENTS_DIR / f"{key}.safetensors"
        stamp = _file_stamp(e.path)
        header = _latent_header(latent_file) if latent_file.is_file() else None
        if header and header.get("latent_shape") == shape and header.get("dtype") == dtype_name and all(
                header.get(k) == v for k, v in stamp.items()) and header.get("condition", "") == model.condition:
            infos[key] = header
            continue
        tasks[key] = {"key": key, "source": e.path, "out": str(latent_file), "stamp": stamp,
                      "source_rel": Path(os.path.relpath(e.path, out.resolve())).as_posix()}
    reused = len(infos)

    # -- encode ------------------------------------------------------------------------------------
    skipped: dict[str, str] = {}
    clip_times: list[float] = []
    texts_encoded = texts_reused = 0
    pool = None
    started_ray = False
    dev = device

    def get_pool() -> _Pool:  # started on first use: a run with nothing left to do starts no Ray and no actor
        nonlocal pool, started_ray, dev, num_encoders
        if pool is None:
            if num_encoders != 0:
                import ray

                if not ray.is_initialized():
                    ray.init(address="local", include_dashboard=False, namespace="megaslide", logging_level="ERROR")
                    started_ray = True
            dev = _pick_device(device, num_encoders != 0)
            if num_encoders is None:
                res = __import__("ray").cluster_resources()
                num_encoders = (max(1, int(res.get("GPU", 0))) if dev == "cuda"
                                else max(1, min(int(res.get("CPU", 1)), 4)))
            pool = _Pool(num_encoders, (str(model_dir), clip_config(frames, height, width, fps), dev, dtype_name), dev,
                         hang_timeout_s, {"condition": model.condition} if model.condition else None)
        return pool

    try:
        if tasks:
            from tqdm import tqdm

            bar = tqdm(total=len(tasks), unit="clip", desc="latents", disable=not progress, file=sys.stderr)
            by_key = {t["key"]: t for t in tasks.values()}

            def got_clips(results: list[dict]) -> None:
                for r in results:
                    if r["ok"]:
                        if r["info"]["latent_shape"] != shape:
                            raise RuntimeError(f"the VAE made latents of shape {r['info']['latent_shape']} for "
                                               f"{frames}x{height}x{width}, expected {shape}: is vae/config.json "
                                               f"(dim_mult, temperal_downsample, patch_size) the model's?")
                        infos[r["key"]] = r["info"]
                    else:
                        skipped[by_key[r["key"]]["source"]] = r["reason"]
                        bar.write(f"skipped {by_key[r['key']]['source']}: {r['reason']}")
                    clip_times.append(time.perf_counter() - t0)
                bar.update(len(results))

            todo = list(tasks.values())
            get_pool().run("encode_clips", [todo[i: i + CLIPS_PER_CALL] for i in range(0, len(todo), CLIPS_PER_CALL)],
                     got_clips)
            bar.close()

        # -- captions of the clips that made it ------------------------------------------------------
        text_keys: dict[str, str] = {}
        text_lens: dict[str, int] = {}
        text_tasks = []
        for e, key in zip(entries, keys):
            if key not in infos or e.caption in text_keys:
                continue
            tkey = hashlib.sha1(e.caption.encode()).hexdigest()[:20]
            text_keys[e.caption] = tkey  # one key per distinct caption: each is looked at once
            path = out / TEXT_DIR / f"{tkey}.safetensors"
            n = _text_len(path, e.caption, model.text_dim)
            if n is None:
                text_tasks.append({"key": tkey, "caption": e.caption, "out": str(path)})
            else:
                text_lens[tkey] = n
        texts_reused = len(text_lens)
        if text_tasks:
            def got_texts(results: list[dict]) -> None:
                for r in results:
                    text_lens[r["key"]] = r["text_len"]

            if get_pool().device == "cpu":
                pool.shrink_to_one()
            pool.run("encode_captions", [text_tasks[i: i + CAPTIONS_PER_CALL]
                                         for i in range(0, len(text_tasks), CAPTIONS_PER_CALL)], got_texts)
            texts_encoded = len(text_tasks)
    finally:
        if pool is not None:
            pool.close()
        if started_ray:
            __import__("ray").shutdown()

    # -- the manifest ------------------------------------------------------------------------------
    rows = []
    for e, key in zip(entries, keys):
        if key not in infos:
            continue
        info = infos[key]
        tkey = text_keys[e.caption]
        rows.append({**{k: info[k] for k in ("source_path", "frame_start", "frame_end", "num_frames", "fps",
                                             "height", "width", "latent_shape", "dtype")},
                     "latent_path": f"{LATENTS_DIR}/{key}.safetensors", "text_path": f"{TEXT_DIR}/{tkey}.safetensors",
                     "caption": e.caption, "text_len": text_lens[tkey]})
    metadata = {"latents_mean": model.latents_mean, "latents_std": model.latents_std,
                "compression": list(model.compression), "latent_channels": model.latent_channels,
                "text_dim": model.text_dim, "text_len": TEXT_LEN, "model_dir": model.name, "layout": "FHWC",
                "storage": "safetensors", "dtype": dtype_name,
                "clip": {"frames": frames, "height": height, "width": width, "fps": float(fps), "frame_stride": 1},
                **condition_metadata(model)}
    manifest = write_latent_manifest(rows, metadata, out / MANIFEST_NAME)
    _write_json(out / SKIPPED_NAME, [{"path": p, "reason": r} for p, r in sorted(skipped.items())])
    return PrecomputeReport(manifest=manifest, clips=len(rows), encoded=len(tasks) - len(skipped), reused=reused,
                            texts_encoded=texts_encoded, texts_reused=texts_reused, skipped=sorted(skipped.items()),
                            seconds=time.perf_counter() - t0, encoders=pool.size if pool is not None else 0,
                            device=dev if pool is not None else "",
                            clip_times=clip_times)
