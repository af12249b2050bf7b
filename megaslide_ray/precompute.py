"""Precompute VAE latents and UMT5 text embeddings of a video manifest, for Wan 2.x training.

    python -m megaslide_ray.precompute --model-dir WAN_DIR --data MANIFEST --out CACHE \\
        --frames 81 --height 480 --width 832 [--fps 16] [--device auto] [--dtype bf16] [--num-encoders N]

``WAN_DIR`` is a local diffusers-format Wan 2.1/2.2 folder; three of its parts are read:
``vae/`` (``diffusers.AutoencoderKLWan``), ``text_encoder/`` (``transformers.UMT5EncoderModel``)
and ``tokenizer/`` (``transformers.AutoTokenizer``). Nothing is downloaded.

Per row of the video manifest (``megaslide_ray.manifest``):

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

The output folder (layout and manifest format: ``megaslide_ray.latents``) is resumable: every
file is written to a temporary name and renamed into place, a second run with the same
arguments skips the clips and captions whose files are there and readable (a changed source
video, by size or modification time, is encoded again), and the latent manifest
(``CACHE/manifest.parquet``) is rewritten at the end from everything finished. A run with other
settings (frames, size, fps, dtype, model) into the same folder is refused. Train on it with
``--data CACHE/manifest.parquet``.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import json
import logging
import os
import re
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.decoder import ClipUnreadable, decode_clip
from megaslide_ray.config import DataConfig
from megaslide_ray.latents import (
    DTYPES,
    FORMAT_VERSION,
    LATENT_KEY,
    TEXT_KEY,
    TEXT_LEN,
    read_file_metadata,
    save_tensor_file,
    write_latent_manifest,
)
from megaslide_ray.manifest import MANIFEST_NAME, read_manifest

log = logging.getLogger(__name__)

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "float32": "float32"}
LATENTS_DIR, TEXT_DIR = "latents", "text"
SETTINGS_NAME, SKIPPED_NAME = "precompute.json", "skipped.json"
CLIPS_PER_CALL = 2
"""Clips per actor call. Each actor runs two calls at once: one encodes while the other's clips
decode, and the actor never waits for the driver."""
CAPTIONS_PER_CALL = 16
"""Captions per text-encoder batch."""
_HEADER_KEY = "megaslide_latent"  # safetensors header entry of a latent file: the clip's row (JSON)


# ---------------------------------------------------------------------------------------------
# Arguments and the model folder
# ---------------------------------------------------------------------------------------------


def import_hf():
    """``(diffusers, transformers)``, imported only when precompute runs: training does not need them."""
    try:
        import diffusers
        import transformers
    except ImportError as e:
        raise ImportError(f"precompute needs diffusers and transformers ({e}); install them with "
                          f"`pip install diffusers transformers` (sentencepiece too for Wan's tokenizer)") from None
    return diffusers, transformers


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def check_frames(frames: int, temporal: int = 4) -> None:
    """``frames`` must be ``temporal * k + 1`` (the Wan VAE keeps the first frame, then folds
    each ``temporal`` frames into one latent frame): a ``ValueError`` names the nearest valid ones."""
    if frames >= 1 and (frames - 1) % temporal == 0:
        return
    lo = (max(frames, 1) - 1) // temporal * temporal + 1
    near = [v for v in (lo, lo + temporal) if v >= 1]
    raise ValueError(f"--frames {frames} is not {temporal}k+1 (the VAE compresses time by {temporal} after the first "
                     f"frame); the nearest valid values are {' and '.join(map(str, near))}")


def check_size(height: int, width: int, spatial: int) -> None:
    bad = [f"--{n} {v}" for n, v in (("height", height), ("width", width)) if v < spatial or v % spatial]
    if bad:
        raise ValueError(f"{', '.join(bad)}: height and width must be positive multiples of the VAE's spatial "
                         f"compression {spatial} (e.g. {height // spatial * spatial or spatial} x "
                         f"{width // spatial * spatial or spatial})")


@dataclass(frozen=True)
class ModelInfo:
    """What precompute needs from ``WAN_DIR`` before loading anything (the config files)."""

    name: str
    latent_channels: int
    compression: tuple[int, int, int]
    latents_mean: list[float]
    latents_std: list[float]
    text_dim: int
    configs_sha1: str
    """Hash of vae/config.json and text_encoder/config.json: a different model is a different cache."""


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Read ``WAN_DIR/vae/config.json`` and ``WAN_DIR/text_encoder/config.json`` (checking that
    ``tokenizer/`` is there too); a ``ValueError`` says what is missing."""
    root = Path(model_dir)
    need = [root / "vae" / "config.json", root / "text_encoder" / "config.json", root / "tokenizer"]
    missing = [str(p.relative_to(root)) for p in need if not p.exists()]
    if missing:
        raise ValueError(f"--model-dir {str(root)!r} lacks {', '.join(missing)}; it must be a local diffusers-format "
                         f"Wan folder with vae/, text_encoder/ and tokenizer/")
    vae_text, te_text = need[0].read_text(), need[1].read_text()
    vae, te = json.loads(vae_text), json.loads(te_text)
    z = int(vae.get("z_dim", 16))
    t = 2 ** sum(bool(x) for x in vae.get("temperal_downsample", [False, True, True]))
    s = 2 ** (len(vae.get("dim_mult", [1, 2, 4, 4])) - 1) * int(vae.get("patch_size") or 1)
    mean, std = vae.get("latents_mean"), vae.get("latents_std")
    if not (isinstance(mean, list) and isinstance(std, list) and len(mean) == len(std) == z):
        raise ValueError(f"{need[0]}: latents_mean/latents_std must be lists of z_dim={z} numbers (the per-channel "
                         f"normalisation of the Wan VAE)")
    if not any(k in te for k in ("d_model", "hidden_size")):
        raise ValueError(f"{need[1]} has no d_model: is text_encoder/ a UMT5 encoder?")
    digest = hashlib.sha1(vae_text.encode() + b"\0" + te_text.encode()).hexdigest()
    return ModelInfo(name=root.resolve().name, latent_channels=z, compression=(t, s, s),
                     latents_mean=[float(x) for x in mean], latents_std=[float(x) for x in std],
                     text_dim=int(te.get("d_model", te.get("hidden_size"))), configs_sha1=digest)


def prompt_clean(text: str) -> str:
    """The Wan pipelines' prompt cleaning: ftfy (when installed), HTML unescaping twice,
    whitespace runs collapsed, ends stripped."""
    try:
        import ftfy
    except ImportError:
        pass
    else:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def clip_config(frames: int, height: int, width: int, fps: float) -> DataConfig:
    """The decoder rules precompute uses: first frames (or resampled to ``fps``), center crop,
    too-short videos skipped."""
    return DataConfig(num_frames=frames, height=height, width=width, fps=float(fps), frame_stride=1,
                      random_crop=False, fixed_start="first", spatial_crop="center", short_clips="skip")


# ---------------------------------------------------------------------------------------------
# The encoder (a plain class; Ray makes it an actor)
# ---------------------------------------------------------------------------------------------


class Encoder:
    """Decodes clips and encodes them with the Wan VAE; encodes captions with UMT5. Writes the
    files itself (atomically) and returns small result dicts. Holds one model at a time."""

    def __init__(self, model_dir: str, data: DataConfig, device: str = "cpu", dtype: str = "bfloat16",
                 threads: int = 0) -> None:
        import_hf()
        self.threads = threads if threads > 0 else torch.get_num_threads()
        torch.set_num_threads(self.threads)
        self.model_dir = Path(model_dir)
        self.data = data
        self.device = torch.device(device)
        self.dtype_name = DTYPE_NAMES[dtype]
        self.store_dtype = DTYPES[self.dtype_name]
        bf16_text = self.device.type == "cuda" and self.dtype_name == "bfloat16"
        self.text_dtype = torch.bfloat16 if bf16_text else torch.float32
        self.vae = None
        self.text_encoder = None
        self.tokenizer = None
        self._decode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="precompute-decode")
        # An actor runs two calls at once (``max_concurrency=2``): the second one's clips decode
        # while the first one encodes; the models run one call at a time (the Wan VAE keeps its
        # causal cache on the module).
        self._model_lock = threading.Lock()

    # -- models ----------------------------------------------------------------------------------

    def _free(self) -> None:
        self.vae = self.text_encoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def load_vae(self):
        if self.vae is None:
            diffusers, _ = import_hf()
            self._free()
            vae = diffusers.AutoencoderKLWan.from_pretrained(str(self.model_dir / "vae"), torch_dtype=torch.float32,
                                                             low_cpu_mem_usage=_has_accelerate())
            self.vae = vae.to(self.device).eval()
            shape = (1, self.vae.config.z_dim, 1, 1, 1)
            self._mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32, device=self.device).view(shape)
            self._std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32, device=self.device).view(shape)
        return self.vae

    def load_text_encoder(self):
        if self.text_encoder is None:
            _, transformers = import_hf()
            self._free()
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.model_dir / "tokenizer"))
            self.tokenizer.padding_side = "right"  # valid tokens first: the mask's length cuts them
            te = transformers.UMT5EncoderModel.from_pretrained(str(self.model_dir / "text_encoder"))
            self.text_encoder = te.to(device=self.device, dtype=self.text_dtype).eval()
        return self.text_encoder

    # -- encoding --------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 ``(F, H, W, 3)`` -> normalised latents float32 ``(F', H', W', C)`` on the CPU."""
        vae = self.load_vae()
        x = torch.from_numpy(np.ascontiguousarray(frames)).to(self.device)
        x = x.permute(3, 0, 1, 2).unsqueeze(0).float().div_(127.5).sub_(1.0)  # (1, 3, F, H, W) in [-1, 1]
        z = vae.encode(x).latent_dist.mode().float()
        z = (z - self._mean) / self._std
        return z[0].permute(1, 2, 3, 0).contiguous().cpu()

    @torch.inference_mode()
    def encode_text(self, captions: list[str]) -> list[torch.Tensor]:
        """Captions -> float32 ``(L_valid, text_dim)`` each, on the CPU. Padded to the batch's
        longest (the padding is masked, so the valid tokens equal a 512-padded run's)."""
        te = self.load_text_encoder()
        batch = self.tokenizer([prompt_clean(c) for c in captions], padding="longest", max_length=TEXT_LEN,
                               truncation=True, add_special_tokens=True, return_attention_mask=True,
                               return_tensors="pt")
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        hidden = te(input_ids=ids, attention_mask=mask).last_hidden_state.float().cpu()
        lengths = mask.gt(0).sum(dim=1).tolist()
        return [hidden[i, :n].clone() for i, n in enumerate(lengths)]

    # -- the jobs the driver hands out -----------------------------------------------------------

    def _decode(self, task: dict):
        try:
            return decode_clip(task["source"], self.data, 0, 0)
        except ClipUnreadable as e:
            return e

    def encode_clips(self, tasks: list[dict]) -> list[dict]:
        """Encode and write each task's clip: ``{"key", "ok": True, "info": row}`` or ``{"key",
        "ok": False, "reason"}`` for a video that cannot be used."""
        futures = [self._decode_pool.submit(self._decode, t) for t in tasks]  # decoded ahead on a thread
        results = []
        for task, future in zip(tasks, futures):
            clip = future.result()
            if isinstance(clip, ClipUnreadable):
                results.append({"key": task["key"], "ok": False, "reason": str(clip)})
                continue
            with self._model_lock:
                torch.set_num_threads(self.threads)  # this call's thread: see set_threads
                latents = self.encode_video(clip.frames)
            d = self.data
            clip_fps = d.fps if d.fps > 0 else clip.source_fps
            info = {"source_path": task["source_rel"], "frame_start": int(clip.indices[0]),
                    "frame_end": int(clip.indices[-1]), "num_frames": d.num_frames, "fps": float(clip_fps),
                    "height": d.height, "width": d.width, "latent_shape": list(latents.shape),
                    "dtype": self.dtype_name, **task["stamp"]}
            save_tensor_file(task["out"], LATENT_KEY, latents.to(self.store_dtype),
                             {_HEADER_KEY: json.dumps(info)})
            results.append({"key": task["key"], "ok": True, "info": info})
        return results

    def encode_captions(self, tasks: list[dict]) -> list[dict]:
        """Encode and write each ``{"key", "caption", "out"}``: ``{"key", "ok", "text_len"}``."""
        with self._model_lock:
            torch.set_num_threads(self.threads)  # this call's thread: see set_threads
            texts = self.encode_text([t["caption"] for t in tasks])
        out = []
        for task, text in zip(tasks, texts):
            save_tensor_file(task["out"], TEXT_KEY, text.to(self.store_dtype), {"caption": task["caption"]})
            out.append({"key": task["key"], "ok": True, "text_len": int(text.shape[0])})
        return out

    def set_threads(self, threads: int) -> None:
        """Torch threads for the encoding calls from now on. OpenMP keeps the count per thread and
        an actor with ``max_concurrency=2`` runs calls on threads of a pool, which start from
        OMP_NUM_THREADS (Ray sets 1): each encoding call sets the count for its own thread."""
        self.threads = max(1, threads)
        torch.set_num_threads(self.threads)

    def close(self) -> None:
        self._decode_pool.shutdown(wait=False)
        self._free()


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
    if not meta or _HEADER_KEY not in meta:
        return None
    try:
        return json.loads(meta[_HEADER_KEY])
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


def _pick_device(device: str, use_ray: bool) -> str:
    if device != "auto":
        return device
    if use_ray:
        import ray

        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


class _Pool:
    """The encoder actors, or one ``Encoder`` in this process (``n == 0``), and the dispatch of
    chunks of tasks to them, two calls in flight per actor. An actor that dies (a codec crash, an
    out-of-memory kill) is replaced and the tasks of its calls are retried one at a time, each
    alone on an actor; a task whose actor dies again while it runs alone is reported as failed
    ("died on it twice") and the run goes on."""

    encoder_cls = Encoder

    def __init__(self, n: int, make_args: tuple, device: str):
        self.n, self.args, self.device = n, make_args, device
        self.size = n  # actors started (``n`` drops to 1 for the text phase on CPU)
        self.replacements = 0
        self.threads = self.cpus = 0
        if n == 0:
            self.local = self.encoder_cls(*make_args)
            self.actors = []
            return
        import ray

        self.cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        self.threads = 0 if device == "cuda" else max(1, self.cpus // n)
        self.actors = [self._start(i) for i in range(n)]

    def _start(self, i: int):
        import ray

        opts = {"num_gpus": 1} if self.device == "cuda" else {}
        actor = ray.remote(self.encoder_cls).options(num_cpus=0, max_concurrency=2, **opts)
        return actor.remote(*self.args, self.threads)

    def run(self, method: str, chunks: list[list[dict]], on_result) -> None:
        if self.n == 0:
            for chunk in chunks:
                on_result(getattr(self.local, method)(chunk))
            return
        import ray
        from ray.exceptions import RayActorError

        queue = deque((c, 0) for c in chunks)  # (chunk, attempt); attempt 1: a retry, run alone
        running: dict = {}  # ref -> (actor index, actor, chunk, attempt)
        busy = [0] * self.n  # calls in flight on the current actor i
        alone = [False] * self.n  # a retry runs on it: nothing else goes there meanwhile

        def fill(i: int) -> None:
            while queue and busy[i] < 2 and not alone[i]:
                chunk, attempt = queue[0]
                if attempt and busy[i]:  # a retry waits for an idle actor: only it can be blamed
                    return
                queue.popleft()
                running[getattr(self.actors[i], method).remote(chunk)] = (i, self.actors[i], chunk, attempt)
                busy[i] += 1
                alone[i] = attempt > 0

        for i in range(self.n):
            fill(i)
        while running:
            done, _ = ray.wait(list(running), num_returns=1)
            i, actor, chunk, attempt = running.pop(done[0])
            current = self.actors[i] is actor
            if current:
                busy[i] -= 1
                alone[i] = False
            try:
                results = ray.get(done[0])
            except RayActorError as e:
                if "creation task" in str(e):
                    raise RuntimeError(f"an encoder actor could not start: {e}") from e
                if current:  # not replaced yet (its other call fails too, and lands here as not current)
                    self._died(i, e)
                    busy[i], alone[i] = 0, False
                if attempt == 0:  # maybe innocent (another call ran beside it): each task again, alone
                    queue.extendleft(([t], 1) for t in reversed(chunk))
                else:
                    on_result([{"key": chunk[0]["key"], "ok": False,
                                "reason": f"the encoder process died on it twice ({type(e).__name__})"}])
            else:
                on_result(results)
            for j in range(self.n):
                fill(j)

    def _died(self, i: int, error: BaseException) -> None:
        import ray

        self.replacements += 1
        if self.replacements > 2 * self.n + 4:
            raise RuntimeError(f"encoder actors died {self.replacements} times (last: {error}); check memory and the "
                               f"worker logs") from error
        log.warning("encoder %d died (%s); replacing it and retrying its clips one at a time", i, type(error).__name__)
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._start(i)

    def shrink_to_one(self) -> None:
        """Keep one actor, with every CPU (on CPU, before the text phase: each UMT5-XXL copy
        takes 22 GB in float32, and the captions are few)."""
        if self.n <= 1:
            return
        import ray

        for a in self.actors[1:]:
            ray.kill(a)
        self.actors, self.n = self.actors[:1], 1
        ray.get(self.actors[0].set_threads.remote(self.cpus))

    def close(self) -> None:
        if self.n == 0:
            self.local.close()
            return
        import ray

        for a in self.actors:
            ray.kill(a)


def precompute(model_dir: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike, frames: int,
               height: int, width: int, fps: float = 0.0, device: str = "auto", dtype: str = "bf16",
               num_encoders: int | None = None, progress: bool = True) -> PrecomputeReport:
    """Encode the video manifest ``data`` into the cache folder ``out`` (module docstring) and
    write its latent manifest. ``num_encoders``: actors (None: one per GPU, or ``min(CPUs, 4)`` on CPU);
    0 encodes in this process. With actors, Ray must be running or is started locally."""
    t0 = time.perf_counter()
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype {dtype!r}: choose bf16, fp16 or fp32")
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"--device {device!r}: choose auto, cpu or cuda")
    if num_encoders is not None and num_encoders < 0:
        raise ValueError(f"--num-encoders {num_encoders} must be >= 0")
    if fps < 0:
        raise ValueError(f"--fps {fps} must be >= 0 (0: the video's own rate)")
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
                "frames": frames, "height": height, "width": width, "fps": float(fps), "dtype": dtype_name}
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
                header.get(k) == v for k, v in stamp.items()):
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
            pool = _Pool(num_encoders, (str(model_dir), clip_config(frames, height, width, fps), dev, dtype_name), dev)
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
                "clip": {"frames": frames, "height": height, "width": width, "fps": float(fps), "frame_stride": 1}}
    manifest = write_latent_manifest(rows, metadata, out / MANIFEST_NAME)
    _write_json(out / SKIPPED_NAME, [{"path": p, "reason": r} for p, r in sorted(skipped.items())])
    return PrecomputeReport(manifest=manifest, clips=len(rows), encoded=len(tasks) - len(skipped), reused=reused,
                            texts_encoded=texts_encoded, texts_reused=texts_reused, skipped=sorted(skipped.items()),
                            seconds=time.perf_counter() - t0, encoders=pool.size if pool is not None else 0,
                            device=dev if pool is not None else "",
                            clip_times=clip_times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaslide_ray.precompute",
                                     description="Precompute Wan VAE latents and UMT5 text embeddings of a video "
                                                 "manifest (a latent manifest for training).")
    parser.add_argument("--model-dir", required=True,
                        help="local diffusers Wan folder (vae/, text_encoder/, tokenizer/)")
    parser.add_argument("--data", required=True, help="video manifest (Parquet; make one with megaslide_ray.index)")
    parser.add_argument("--out", required=True, help="cache folder: latents/, text/, manifest.parquet")
    parser.add_argument("--frames", type=int, required=True, help="pixel frames per clip, 4k+1 (e.g. 81)")
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--fps", type=float, default=0.0, help="resample clips to this rate (0: consecutive frames)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="storage dtype")
    parser.add_argument("--num-encoders", type=int, default=None,
                        help="encoder actors (default: one per GPU, or min(CPUs, 4) on CPU); "
                             "0: in this process, no Ray")
    parser.add_argument("--ray-address", default=None, help="join a running Ray cluster")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.ray_address and args.num_encoders != 0:
        import ray

        ray.init(address=args.ray_address, namespace="megaslide")
    from megaslide_ray import precompute as module  # not __main__'s copy: Ray pickles the Encoder by name

    try:
        rep = module.precompute(args.model_dir, args.data, args.out, args.frames, args.height, args.width, fps=args.fps,
                         device=args.device, dtype=args.dtype, num_encoders=args.num_encoders,
                         progress=not args.no_progress)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    how = (f"{rep.encoders} encoder actors on {rep.device}" if rep.encoders else f"in this process on {rep.device}"
           ) if rep.device else "nothing left to encode"
    print(f"{rep.clips} clips in {rep.manifest}: {rep.encoded} encoded, {rep.reused} already done, "
          f"{len(rep.skipped)} skipped; captions: {rep.texts_encoded} encoded, {rep.texts_reused} already done "
          f"({rep.seconds:.1f} s, {how})")
    for path, reason in rep.skipped:
        print(f"  skipped: {path}: {reason}")
    if rep.skipped:
        print(f"  (listed in {Path(args.out) / SKIPPED_NAME})")
    return 0 if rep.clips else 1


if __name__ == "__main__":
    raise SystemExit(main())
