"""The encoders ``precompute`` runs (a Wan VAE, a UMT5 text encoder and, for an image-to-video
folder, the CLIP image encoder) as one plain class, ``Encoder``: ``pipelines/encoder_pool.py``
makes it a Ray actor, the sample writer and sampling run it in their own process. Also what
precompute reads of a model folder before loading anything (``read_model_info``,
``check_model_dir``).

Only local files are read (``WAN_DIR/vae``, ``text_encoder``, ``tokenizer``, by absolute path and
with ``local_files_only``: no model hub is ever contacted); the models come from diffusers and
transformers, imported when first needed (they are test extras)."""

from __future__ import annotations

import hashlib
import html
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megaslide_ray.config import DataConfig
from megaslide_ray.config.wan_folders import IMAGE_TO_VIDEO, describe_wan_folder, refuse_unsupported
from megaslide_ray.data.clips import ClipUnreadable, decode_clip
from megaslide_ray.data.image_condition import (
    CONDITION_KEY,
    IMAGE_KEY,
    condition_mask,
    condition_pixels,
    kept_frames,
    uses_clip,
)
from megaslide_ray.data.latents import (
    DTYPES,
    HEADER_KEY,
    LATENT_KEY,
    TEXT_KEY,
    TEXT_LEN,
    save_tensor_file,
)

DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "bfloat16": "bfloat16",
               "float16": "float16", "float32": "float32"}


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
    condition: str = ""
    """The image condition precompute makes (``megaslide_ray.data.image_condition``): ``i2v``,
    ``flf2v``, ``i2v-a14b`` for an image-to-video folder; "" for text-to-video."""
    image_dim: int = 0
    """Width of the CLIP states (``image_encoder/config.json``'s ``hidden_size``); 0: none."""
    image_tokens: int = 0
    """CLIP tokens per frame (patches + the class token); 0: none."""


MODEL_PARTS = {"vae": "config.json", "text_encoder": "config.json", "tokenizer": "tokenizer_config.json",
               "image_encoder": "config.json", "image_processor": "preprocessor_config.json"}
"""The parts of a diffusers Wan folder the encoders read, each with the file that must be in it."""


def check_model_dir(model_dir: str | os.PathLike, parts: tuple[str, ...], flag: str = "--model-dir") -> Path:
    """``model_dir`` made absolute, once every one of ``parts`` (``vae``, ``text_encoder``,
    ``tokenizer``) is there with its config and (``vae``, ``text_encoder``) weights; a ``ValueError``
    names what is missing. Called before any work, so a missing part is not found at its end."""
    root = Path(model_dir).expanduser().resolve()
    if not root.is_dir():
        raise ValueError(f"{flag} {str(model_dir)!r}: no such local folder ({root}); give the local diffusers-format "
                         f"Wan folder (nothing is downloaded)")
    missing = []
    for part in parts:
        d = root / part
        if not (d / MODEL_PARTS[part]).is_file():
            missing.append(f"{part}/{MODEL_PARTS[part]}" if d.is_dir() else f"{part}/")
        elif part not in ("tokenizer", "image_processor") and not any(d.glob("*.safetensors")) and \
                not any(d.glob("*.bin")):
            missing.append(f"{part}/ weights (*.safetensors)")
    if missing:
        raise ValueError(f"{flag} {str(model_dir)!r} ({root}) lacks {', '.join(missing)}: it must be a local "
                         f"diffusers-format Wan folder with {', '.join(p + '/' for p in parts)}")
    return root


def read_model_info(model_dir: str | os.PathLike) -> ModelInfo:
    """Read ``WAN_DIR/vae/config.json`` and ``WAN_DIR/text_encoder/config.json`` (checking that
    ``tokenizer/`` is there too); a ``ValueError`` says what is missing, and a folder of a model
    that is not text-to-video (image-to-video, VACE, ...: ``refuse_unsupported``) is refused,
    naming what it is, so its clips are never stored as text-to-video latents."""
    root = Path(model_dir)
    condition, image_dim, image_tokens = "", 0, 0
    if root.is_dir():
        folder = describe_wan_folder(root, need_transformer=False)
        refuse_unsupported(folder, "--model-dir", image_to_video=True)
        if folder.kind in IMAGE_TO_VIDEO:
            condition = folder.kind
            image_dim, image_tokens = read_clip_info(root) if uses_clip(condition) else (0, 0)
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
                     text_dim=int(te.get("d_model", te.get("hidden_size"))), configs_sha1=digest,
                     condition=condition, image_dim=image_dim, image_tokens=image_tokens)


def read_clip_info(root: Path) -> tuple[int, int]:
    """``(image_dim, image_tokens)`` of an image-to-video folder's CLIP vision encoder, from
    ``image_encoder/config.json``; a ``ValueError`` names a missing ``image_encoder/`` or
    ``image_processor/`` (Wan2.1 I2V and FLF2V read CLIP states of the first frame)."""
    need = [root / "image_encoder" / "config.json", root / "image_processor" / "preprocessor_config.json"]
    missing = [str(p.relative_to(root)) for p in need if not p.is_file()]
    if missing:
        raise ValueError(f"--model-dir {str(root)!r} is an image-to-video folder whose transformer reads CLIP states "
                         f"of the first frame, but it lacks {', '.join(missing)} (the pipeline's image_encoder, a "
                         f"CLIPVisionModel, and its image_processor)")
    cfg = json.loads(need[0].read_text())
    cfg = cfg.get("vision_config", cfg)
    patches = (int(cfg["image_size"]) // int(cfg["patch_size"])) ** 2
    return int(cfg["hidden_size"]), patches + 1


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


class Encoder:
    """Decodes clips and encodes them with the Wan VAE; encodes captions with UMT5. Writes the
    files itself (atomically) and returns small result dicts. Holds one model at a time."""

    def __init__(self, model_dir: str, data: DataConfig, device: str = "cpu", dtype: str = "bfloat16",
                 threads: int = 0, condition: str = "") -> None:
        import_hf()
        self.threads = threads if threads > 0 else torch.get_num_threads()
        torch.set_num_threads(self.threads)
        # Absolute: a relative folder that is not found must never be taken for a Hub repository id
        # (``local_files_only`` below: nothing is ever downloaded).
        self.model_dir = Path(model_dir).expanduser().resolve()
        self.data = data
        self.device = torch.device(device)
        self.dtype_name = DTYPE_NAMES[dtype]
        self.store_dtype = DTYPES[self.dtype_name]
        bf16_text = self.device.type == "cuda" and self.dtype_name == "bfloat16"
        self.text_dtype = torch.bfloat16 if bf16_text else torch.float32
        self.vae = None
        self.text_encoder = None
        self.tokenizer = None
        self.condition = condition  # "" or an image-to-video kind: the clip's image condition is made too
        self.image_encoder = self.image_processor = None
        self._decode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="precompute-decode")
        # An actor runs two calls at once (``max_concurrency=2``): the second one's clips decode
        # while the first one encodes; the models run one call at a time (the Wan VAE keeps its
        # causal cache on the module).
        self._model_lock = threading.Lock()

    # -- models ----------------------------------------------------------------------------------

    def _free(self) -> None:
        self.vae = self.text_encoder = self.image_encoder = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def load_vae(self):
        if self.vae is None:
            diffusers, _ = import_hf()
            self._free()
            vae = diffusers.AutoencoderKLWan.from_pretrained(str(self.model_dir / "vae"), torch_dtype=torch.float32,
                                                             low_cpu_mem_usage=_has_accelerate(), local_files_only=True)
            self.vae = vae.to(self.device).eval()
            shape = (1, self.vae.config.z_dim, 1, 1, 1)
            self._mean = torch.tensor(self.vae.config.latents_mean, dtype=torch.float32, device=self.device).view(shape)
            self._std = torch.tensor(self.vae.config.latents_std, dtype=torch.float32, device=self.device).view(shape)
        return self.vae

    def load_text_encoder(self):
        if self.text_encoder is None:
            _, transformers = import_hf()
            self._free()
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(self.model_dir / "tokenizer"),
                                                                        local_files_only=True)
            self.tokenizer.padding_side = "right"  # valid tokens first: the mask's length cuts them
            te = transformers.UMT5EncoderModel.from_pretrained(str(self.model_dir / "text_encoder"),
                                                               local_files_only=True)
            self.text_encoder = te.to(device=self.device, dtype=self.text_dtype).eval()
        return self.text_encoder

    def load_image_encoder(self):
        """The folder's CLIP vision encoder (float32) and its image processor (image-to-video)."""
        if self.image_encoder is None:
            _, transformers = import_hf()
            self.image_processor = transformers.CLIPImageProcessor.from_pretrained(
                str(self.model_dir / "image_processor"), local_files_only=True)
            enc = transformers.CLIPVisionModel.from_pretrained(str(self.model_dir / "image_encoder"),
                                                               torch_dtype=torch.float32, local_files_only=True)
            self.image_encoder = enc.to(self.device).eval()
        return self.image_encoder

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
    def encode_condition(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """The image condition of a uint8 clip ``(F, H, W, 3)`` (``megaslide_ray.data.image_condition``):
        ``condition`` ``(F', H', W', t + z)`` (mask, then the normalised latents of the first
        frame, and the last for FLF2V, with grey frames between) and, for the kinds that read
        CLIP, ``image`` ``(n, Li, image_dim)`` (the kept frames' ``hidden_states[-2]``)."""
        last = kept_frames(self.condition) == 2
        vae = self.load_vae()
        z = vae.encode(condition_pixels(frames, last).to(self.device)).latent_dist.mode().float()
        z = ((z - self._mean) / self._std)[0].permute(1, 2, 3, 0).cpu()  # (F', H', W', z)
        t = int(vae.config.scale_factor_temporal)
        mask = condition_mask(frames.shape[0], t, z.shape[1], z.shape[2], last)
        out = {CONDITION_KEY: torch.cat([mask, z], dim=-1)}
        if uses_clip(self.condition):
            from PIL import Image

            enc = self.load_image_encoder()
            kept = [frames[0], frames[-1]] if last else [frames[0]]
            pixels = self.image_processor(images=[Image.fromarray(np.ascontiguousarray(f)) for f in kept],
                                          return_tensors="pt")["pixel_values"].to(self.device)
            out[IMAGE_KEY] = enc(pixel_values=pixels, output_hidden_states=True).hidden_states[-2].float().cpu()
        return out

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
                extra = self.encode_condition(clip.frames) if self.condition else {}
            d = self.data
            clip_fps = d.fps if d.fps > 0 else clip.source_fps
            info = {"source_path": task["source_rel"], "frame_start": int(clip.indices[0]),
                    "frame_end": int(clip.indices[-1]), "num_frames": d.num_frames, "fps": float(clip_fps),
                    "height": d.height, "width": d.width, "latent_shape": list(latents.shape),
                    "dtype": self.dtype_name, **task["stamp"], **({"condition": self.condition} if extra else {})}
            save_tensor_file(task["out"], LATENT_KEY, latents.to(self.store_dtype),
                             {HEADER_KEY: json.dumps(info)}, {k: v.to(self.store_dtype) for k, v in extra.items()})
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
