"""Precompute VAE latents and UMT5 text embeddings of a video manifest, for Wan 2.x training.

    python -m megaslide_ray.precompute --model-dir WAN_DIR --data MANIFEST --out CACHE \\
        --frames 81 --height 480 --width 832 [--fps 16] [--device auto] [--dtype bf16] [--num-encoders N]

``WAN_DIR`` is a local diffusers-format Wan 2.1/2.2 folder; three of its parts are read:
``vae/`` (``diffusers.AutoencoderKLWan``), ``text_encoder/`` (``transformers.UMT5EncoderModel``)
and ``tokenizer/`` (``transformers.AutoTokenizer``), and for an image-to-video folder its CLIP
``image_encoder/`` and ``image_processor/``. Nothing is downloaded. What the cache folder holds,
and how a second run resumes it, is ``megaslide_ray.data.latent_cache``'s.

``precompute`` runs in steps: check the arguments and the model folder (``_check_arguments``,
``_cache_spec``), plan what the folder lacks (``plan_clips``), encode those clips
(``_encode_clips``), then the captions of the clips that made it (``plan_captions``,
``_encode_captions``), and write the latent manifest (``write_cache_manifest``). The encoders run
in an ``EncoderPool`` (``pipelines/encoder_pool.py``: actors, or one encoder in this process with
``--num-encoders 0``), opened when the first step has work for it: a run with nothing left to
encode starts no Ray and no actor.

``--frames`` must be ``t*k + 1`` for the VAE's temporal compression ``t`` (4: 5, 9, ..., 81), and
``--height``/``--width`` multiples of its spatial compression (8 for Wan 2.1, 16 for Wan 2.2).
The VAE runs in float32 (as the Wan pipelines load it); ``--dtype`` (bf16, fp16 or fp32) is the
storage dtype of latents and text, and, on CUDA with bf16, the text encoder's compute dtype
(float32 otherwise: UMT5 overflows in fp16).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from megaslide_ray.data.encoders import DTYPE_NAMES, check_frames, check_size, import_hf, read_model_info
from megaslide_ray.data.latent_cache import (
    CacheSpec,
    CaptionPlan,
    ClipPlan,
    check_settings,
    manifest_rows,
    plan_captions,
    plan_clips,
    write_cache_manifest,
)
from megaslide_ray.data.manifest import read_manifest
from pipelines.encoder_pool import CAPTIONS_PER_CALL, CLIPS_PER_CALL, HANG_TIMEOUT_S, EncoderPool


@dataclass
class PrecomputeReport:
    """What one ``precompute`` run did."""

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


def precompute(model_dir: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, frames: int,
               height: int, width: int, fps: float = 0.0, device: str = "auto", dtype: str = "bf16",
               num_encoders: int | None = None, progress: bool = True,
               hang_timeout_s: float = HANG_TIMEOUT_S) -> PrecomputeReport:
    """Encode the video manifest ``data`` into the cache folder ``out`` (module docstring) and
    write its latent manifest. ``num_encoders``: actors (None: one per GPU, or ``min(CPUs, 4)`` on CPU);
    0 encodes in this process. With actors, Ray must be running or is started locally; an actor
    that finishes no call for ``hang_timeout_s`` is killed as hung and replaced (0: never)."""
    t0 = time.perf_counter()
    _check_arguments(dtype, device, num_encoders, fps, hang_timeout_s)
    spec = _cache_spec(model_dir, frames, height, width, fps, DTYPE_NAMES[dtype])
    entries = read_manifest(data)
    out = Path(out)
    check_settings(out, spec.settings())
    clips = plan_clips(entries, Path(data).resolve().parent, out, spec)
    reused = len(clips.done)
    encoders = _PoolOnDemand(str(model_dir), spec, num_encoders, device, hang_timeout_s)
    skipped: dict[str, str] = {}
    clip_times: list[float] = []
    try:
        if clips.tasks:
            _encode_clips(encoders, clips, spec, skipped, clip_times, t0, progress)
        captions = plan_captions(entries, clips, out, spec.model.text_dim)
        texts_reused = len(captions.lengths)
        if captions.tasks:
            _encode_captions(encoders, captions)
    finally:
        encoders.close()
    rows = manifest_rows(entries, clips, captions)
    manifest = write_cache_manifest(out, rows, spec, skipped)
    pool = encoders.pool
    return PrecomputeReport(manifest=manifest, clips=len(rows), encoded=len(clips.tasks) - len(skipped),
                            reused=reused, texts_encoded=len(captions.tasks), texts_reused=texts_reused,
                            skipped=sorted(skipped.items()), seconds=time.perf_counter() - t0,
                            encoders=pool.size if pool is not None else 0,
                            device=pool.device if pool is not None else "", clip_times=clip_times)


def _check_arguments(dtype: str, device: str, num_encoders: int | None, fps: float, hang_timeout_s: float) -> None:
    """The checks of the arguments alone, before anything is read (a ``ValueError`` names the flag)."""
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


def _cache_spec(model_dir: str | os.PathLike, frames: int, height: int, width: int, fps: float,
                dtype: str) -> CacheSpec:
    """What the cache will hold (``dtype``: a torch dtype name), once the model folder's configs
    and the clip's shape against the VAE's compression are checked (a ``ValueError`` says what is
    wrong) and diffusers and transformers are found (an ``ImportError`` says how to install them)."""
    model = read_model_info(model_dir)
    t, s, _ = model.compression
    check_frames(frames, t)
    check_size(height, width, s)
    import_hf()
    return CacheSpec(model=model, frames=frames, height=height, width=width, fps=float(fps), dtype=dtype)


class _PoolOnDemand:
    """The run's ``EncoderPool``, opened by the first step that has work for it."""

    def __init__(self, model_dir: str, spec: CacheSpec, num_encoders: int | None, device: str,
                 hang_timeout_s: float) -> None:
        self.model_dir, self.spec = model_dir, spec
        self.num_encoders, self.device, self.hang_timeout_s = num_encoders, device, hang_timeout_s
        self.pool: EncoderPool | None = None

    def __call__(self) -> EncoderPool:
        if self.pool is None:
            self.pool = EncoderPool.open(self.model_dir, self.spec.clip_config(), self.spec.dtype,
                                         self.spec.model.condition, num_encoders=self.num_encoders,
                                         device=self.device, hang_timeout_s=self.hang_timeout_s)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _encode_clips(encoders: _PoolOnDemand, clips: ClipPlan, spec: CacheSpec, skipped: dict[str, str],
                  clip_times: list[float], t0: float, progress: bool) -> None:
    """Encode ``clips.tasks``: each clip encoded goes into ``clips.done``, each video that cannot
    be used into ``skipped`` (path -> reason); ``clip_times`` gets when each result arrived
    (seconds since ``t0``)."""
    bar = tqdm(total=len(clips.tasks), unit="clip", desc="latents", disable=not progress, file=sys.stderr)

    def got(results: list[dict]) -> None:
        for r in results:
            if r["ok"]:
                if r["info"]["latent_shape"] != spec.latent_shape:
                    raise RuntimeError(f"the VAE made latents of shape {r['info']['latent_shape']} for {spec.frames}x"
                                       f"{spec.height}x{spec.width}, expected {spec.latent_shape}: is "
                                       f"vae/config.json (dim_mult, temperal_downsample, patch_size) the model's?")
                clips.done[r["key"]] = r["info"]
            else:
                source = clips.tasks[r["key"]]["source"]
                skipped[source] = r["reason"]
                bar.write(f"skipped {source}: {r['reason']}")
            clip_times.append(time.perf_counter() - t0)
        bar.update(len(results))

    todo = list(clips.tasks.values())
    encoders().run("encode_clips", [todo[i: i + CLIPS_PER_CALL] for i in range(0, len(todo), CLIPS_PER_CALL)], got)
    bar.close()


def _encode_captions(encoders: _PoolOnDemand, captions: CaptionPlan) -> None:
    """Encode ``captions.tasks``, each one's valid tokens into ``captions.lengths``; on CPU one
    actor with every thread does it (``EncoderPool.shrink_to_one``)."""
    def got(results: list[dict]) -> None:
        for r in results:
            captions.lengths[r["key"]] = r["text_len"]

    pool = encoders()
    if pool.device == "cpu":
        pool.shrink_to_one()
    tasks = captions.tasks
    pool.run("encode_captions", [tasks[i: i + CAPTIONS_PER_CALL] for i in range(0, len(tasks), CAPTIONS_PER_CALL)],
             got)
