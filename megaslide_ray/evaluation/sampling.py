"""Sample a video from a checkpoint: Euler integration of the rectified flow, streamed.

The model predicts the velocity ``v = noise - x0`` of ``x_t = (1 - t) x0 + t noise``, so
sampling starts from noise at t = 1 and steps ``x <- x - dt * v`` down to t = 0. Every model
evaluation goes through ``ComputeActor.predict``: the shards run block by block with weights
fetched one shard at a time, exactly as in training, so a model larger than device memory
samples the same way it trains. Weights come from the checkpoint (read by
``megaslide_ray.state.checkpoint``) through ``CheckpointWeights``, a read-only stand-in for the
parameter store (object-ref transport: each shard's bytes on request; AdamW moments are never
read). The prompt is encoded as training captions are (``megaslide_ray.data.captions``). No Ray is
needed.

    python -m megaslide_ray.sample --checkpoint runs/X --prompt "a red circle moving right" \\
        --frames 16 --steps 20 --seed 0 --out video.mp4

Writes the H.264 mp4 and, beside it (same name, ``.png``), a contact sheet of its frames.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from actors.compute import ComputeActor
from actors.param_store import ShardInfo
from megaslide_ray.config import Config, ConfigError, config_from_dict, validate
from megaslide_ray.config.wan_folders import describe_wan_folder, refuse_unsupported
from megaslide_ray.data.captions import caption_batch
from megaslide_ray.data.demo import write_video
from megaslide_ray.data.encoders import Encoder, check_model_dir
from megaslide_ray.data.frames import contact_sheet, decode_latents, to_uint8_frames, write_png  # noqa: F401
from megaslide_ray.data.image_condition import required_kind
from megaslide_ray.data.image_prompts import ImageSpec, image_condition, read_image  # noqa: F401
from megaslide_ray.data.latent_cache import clip_config
from megaslide_ray.data.latents import pad_text
from megaslide_ray.models.registry import build_shard, num_shards
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.state.checkpoint import (
    CheckpointReader,
    read_checkpoint_state,
    resolve_checkpoint,
    safetensors_problem,
)
from megaslide_ray.state.segments import DTYPES
from megaslide_ray.training.flow import shift_time

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------------------------
# Checkpoint: config and a read-only weight source
# ---------------------------------------------------------------------------------------------


def sampling_config(state: dict, frames: int | None = None, height: int | None = None, width: int | None = None,
                    device: str = "auto") -> Config:
    """The checkpoint's config (``state.json``'s ``config``), with the clip shape and device for
    sampling. Raises ``ConfigError`` if a size does not divide by the patch size."""
    cfg = config_from_dict(state["config"])
    cfg.data.manifest = ""            # training data is not needed (and may live on another machine)
    cfg.data.val_manifest = ""
    cfg.training.eval_every = 0
    cfg.runtime.state_dir = ""
    cfg.runtime.device = device
    cfg.data.batch_size = 1
    cfg.training.sample_every = 0     # (a training-time option; sampling is what this is)
    patch = cfg.model.patch_size
    for flag, value, p, attr in (("--frames", frames, patch[0], "num_frames"), ("--height", height, patch[1], "height"),
                                 ("--width", width, patch[2], "width")):
        if value is None:
            continue
        if cfg.latent_space:  # a pixel clip over latents: validate() checks 4k+1 and the VAE x patch
            setattr(cfg.data, attr, int(value))
            continue
        if value <= 0 or value % p:
            raise ConfigError(f"{flag} {value} is not a positive multiple of the model's patch size {p} "
                              f"(model.patch_size={tuple(patch)}); use e.g. {flag} {max(p, value // p * p)}")
        setattr(cfg.data, attr, int(value))
    try:
        return validate(cfg)
    except ConfigError as e:
        raise ConfigError(f"sampling {cfg.data.num_frames} frames of {cfg.data.width}x{cfg.data.height} with this "
                          f"checkpoint's model: {e} (or ask for more --frames/--height/--width)") from None


WEIGHTS = ("auto", "trained", "ema")
"""``--weights`` of ``sample`` and ``evaluate``: the trained weights, their moving average
(``training.ema_decay``), or ``auto``: the average where the run kept one and evaluated with it
(``training.ema_eval``), else the trained weights."""


def use_average(state: dict, weights: str) -> bool:
    """Whether ``--weights`` (``WEIGHTS``) picks the moving average of the checkpoint whose
    ``state.json`` is ``state``; ``ema`` of a run without it is refused later, by the reader."""
    if weights not in WEIGHTS:
        raise ValueError(f"--weights {weights!r}: use one of {list(WEIGHTS)}")
    if weights != "auto":
        return weights == "ema"
    t = state.get("config", {}).get("training", {})
    return bool(t.get("ema_decay", 0.0)) and bool(t.get("ema_eval", True))


class CheckpointWeights:
    """Serves each shard's compute weights from a checkpoint, read-only.

    Implements the ``StoreClient`` calls ``ComputeActor`` makes with the ``object_ref``
    transport: ``get_weights`` returns the shard's raw bytes (uint8). Files are opened once and
    read shard by shard on request, so only one or two shards are in memory at a time.
    ``kind`` is ``w`` (the compute copy) or ``master`` (fp32; for sampling a bf16 run on a CPU).
    ``average``: the moving average of the weights (``ema``, ``training.ema_decay``) instead of the
    trained ones, in the dtype ``kind`` names (``w``: the run's compute dtype; ``master``: fp32).
    """

    def __init__(self, checkpoint: str | Path, cfg: Config, kind: str = "w", average: bool = False):
        n = num_shards(cfg)
        self.reader = CheckpointReader(checkpoint, n)
        self.dir, self.state, self.step = self.reader.path, self.reader.state, self.reader.step
        self.kind, self.average = kind, average
        if average and not self.reader.has(0, "ema"):
            raise ValueError(f"--weights ema: checkpoint {self.dir} holds no moving average of the weights (its run "
                             f"had training.ema_decay = 0); use --weights trained")
        self.w_dtype = self.state.get("w_dtype", "float32") if kind == "w" else "float32"
        self.layouts = [ShardLayout.of(build_shard(cfg, i, "meta"), i) for i in range(n)]
        for i, lay in enumerate(self.layouts):
            names = self.reader.layout(i).names
            if names != lay.names:
                raise RuntimeError(f"checkpoint {self.dir} shard {i} holds tensors {list(names[:3])}..., the model "
                                   f"built from its config expects {list(lay.names[:3])}...: config and weights "
                                   f"disagree")

    def shard_infos(self) -> list[ShardInfo]:
        return [ShardInfo(i, lay.numel, self.w_dtype, {}, lay) for i, lay in enumerate(self.layouts)]

    # -- StoreClient --------------------------------------------------------------------------
    def wait_version(self, shard: int, step: int) -> int:
        if step > self.step:
            raise RuntimeError(f"weights of step {step} requested; checkpoint {self.dir} holds step {self.step}")
        return self.step

    def get_weights(self, shard: int, step: int) -> np.ndarray:
        self.wait_version(shard, step)
        if self.average:  # the fp32 average, cast as ``w`` is cast from master
            t = self.reader.tensor(shard, "ema", self.layouts[shard].numel)
            t = t.to(self.reader.w_dtype) if self.kind == "w" else t
        else:
            t = self.reader.tensor(shard, self.kind, self.layouts[shard].numel)
        return t.contiguous().view(torch.uint8).numpy()

    def report_grad(self, shard: int, step: int, sqnorm: float, grad) -> None:
        raise RuntimeError("CheckpointWeights is read-only: sampling sends no gradients")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.reader.close()


# ---------------------------------------------------------------------------------------------
# Euler sampling
# ---------------------------------------------------------------------------------------------


def initial_noise(cfg: Config, seed: int) -> torch.Tensor:
    """The sampler's starting point: seeded standard noise of one clip, ``(1, F, H, W, C)`` of
    the model's input (pixels for videodit, the latent grid for wan)."""
    g = torch.Generator(device="cpu").manual_seed(int(seed))
    channels = cfg.model.out_channels or cfg.model.in_channels  # an image-to-video model: the latents it predicts
    return torch.randn((1, *cfg.latent_grid, channels), generator=g, dtype=torch.float32)


def integrate(predictor, cfg: Config, x: torch.Tensor, cond, cond_len, steps: int, version: int,
              cfg_scale: float = 1.0, uncond=None, uncond_len=None, extra: dict | None = None,
              grid: torch.Tensor | None = None) -> torch.Tensor:
    """Euler steps from noise (t = 1) to data (t = 0) on the grid ``linspace(1, 0)`` shifted by
    ``training.flow_shift`` (or the ``steps + 1`` times of ``grid``, e.g. a diffusers scheduler's
    sigmas). ``predictor.predict(x, t, cond, cond_len, version)`` is the model's velocity (the
    compute actor, or the pipeline during training). With ``cfg_scale != 1`` each step also
    predicts with ``uncond`` and mixes ``v_u + cfg_scale * (v_c - v_u)`` (one batch of 2).
    ``extra``: an image-to-video model's ``condition`` and ``image`` (``sampling_condition``),
    passed to every prediction (both halves of guidance see the same image); its ``first_frame``
    (``model.clean_first_frame``: the image's latents ``(1, 1, H', W', C)``) is instead kept as
    the first latent frame, before every prediction and at the end, as diffusers' pipeline with
    ``expand_timesteps`` keeps it."""
    guided = cfg_scale != 1.0
    extra = {k: v for k, v in (extra or {}).items() if v is not None}
    first = extra.pop("first_frame", None)
    if guided:
        cond = np.concatenate([np.asarray(cond), np.asarray(uncond)])
        cond_len = np.concatenate([np.asarray(cond_len), np.asarray(uncond_len)])
        extra = {k: torch.cat([v, v]) for k, v in extra.items()}
    ts = shift_time(torch.linspace(1.0, 0.0, steps + 1), cfg.training.flow_shift) if grid is None else grid.float()
    if len(ts) != steps + 1:
        raise ValueError(f"a time grid of {len(ts)} values for {steps} steps (needs {steps + 1})")
    for i in range(steps):
        t, dt = float(ts[i]), float(ts[i] - ts[i + 1])
        if first is not None:
            x = torch.cat([first.to(x.dtype), x[:, 1:]], dim=1)
        xb = torch.cat([x, x]) if guided else x
        v = predictor.predict(xb, torch.full((xb.shape[0],), t), cond, cond_len, version, **extra)
        if guided:
            v = v[1:] + cfg_scale * (v[:1] - v[1:])
        x = x - dt * v
    return x if first is None else torch.cat([first.to(x.dtype), x[:, 1:]], dim=1)


def euler_sample(compute: ComputeActor, cfg: Config, prompt: str, steps: int, seed: int, version: int,
                 cfg_scale: float = 1.0) -> torch.Tensor:
    """videodit: sample ``prompt`` (caption bytes; the unconditional half of guidance is the
    empty caption). Returns ``x0`` as float32 ``(1, F, H, W, C)``."""
    cap, cap_len = caption_batch(prompt, cfg.model.caption_max_bytes, 1)
    return integrate(compute, cfg, initial_noise(cfg, seed), cap, cap_len, steps, version, cfg_scale,
                     np.zeros_like(cap), np.zeros_like(cap_len))


def wan_sample(compute: ComputeActor, cfg: Config, text: torch.Tensor, negative: torch.Tensor, steps: int,
               seed: int, version: int, cfg_scale: float = 5.0, extra: dict | None = None) -> torch.Tensor:
    """wan: sample from prompt embeddings ``text`` and ``negative`` (``(L, text_dim)`` each, valid
    tokens only, as the text encoder gives them), zero-padded to ``model.text_len`` as the Wan
    pipelines do; ``extra``: an image-to-video model's condition (``sampling_condition``).
    Returns normalised latents, float32 ``(1, F', H', W', C)``."""
    n = cfg.model.text_len
    cond = pad_text(text, n)[None].numpy()
    uncond = pad_text(negative, n)[None].numpy()
    lens = (np.array([min(len(text), n)], dtype=np.int32), np.array([min(len(negative), n)], dtype=np.int32))
    return integrate(compute, cfg, initial_noise(cfg, seed), cond, lens[0], steps, version, cfg_scale, uncond,
                     lens[1], extra)


def sampling_condition(encoder: Encoder, cfg: Config, image: str | Path | None,
                       last_image: str | Path | None) -> dict:
    """An image-to-video checkpoint's condition from ``image`` (and FLF2V's ``last_image``), made
    as precompute makes a clip's (``Encoder.encode_condition``: the mask, the VAE latents of the
    image with grey frames after it, CLIP's states): ``{"condition": (1, F', H', W', 4 + C),
    "image": (n, Li, D) or None}``; ``{}`` for a text-to-video checkpoint. A missing or extra
    image is a ``ConfigError``."""
    kind = required_kind(cfg.model)
    if cfg.model.clean_first_frame:  # Wan2.2 TI2V from an image: its latents are the first latent frame
        if image is None or last_image is not None:
            raise ConfigError("this checkpoint is Wan2.2 TI2V from an image (model.clean_first_frame): give --image "
                              "FILE (the first frame) and no --last-image")
        return image_condition(encoder, image_spec(cfg), image)
    if kind is None:
        if image is not None or last_image is not None:
            raise ConfigError("--image/--last-image: this checkpoint is a text-to-video model; leave them out")
        return {}
    if image is None:
        raise ConfigError(f"this checkpoint is an image-to-video model ({kind}): give --image FILE, the first frame")
    if (last_image is not None) != (kind == "flf2v"):
        raise ConfigError("--last-image: only a first-last-frame (FLF2V) checkpoint takes it" if last_image is not None
                          else "this checkpoint is a first-last-frame (FLF2V) model: give --last-image FILE too")
    return image_condition(encoder, image_spec(cfg), image, last_image)


def image_spec(cfg: Config) -> ImageSpec:
    """What ``cfg``'s model needs to make a sample's image condition (``image_condition``)."""
    d = cfg.data
    return ImageSpec(required_kind(cfg.model) or "", bool(cfg.model.clean_first_frame), d.num_frames, d.height, d.width)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleResult:
    video_path: str
    sheet_path: str
    frames: np.ndarray        # uint8 (F, H, W, 3), as written to the mp4 (before H.264; upscaled)
    checkpoint: str
    checkpoint_step: int
    seconds: float


def check_model_files(model_dir: str | Path, parts: tuple[str, ...], flag: str = "--model-dir") -> Path:
    """The local model folder's ``parts`` present (``check_model_dir``) and their safetensors files
    whole, checked before denoising (a VAE found missing or damaged only after the last Euler
    step would cost the whole run), and the folder a text-to-video Wan model's or its encoders'
    alone (``refuse_unsupported``: an image-to-video folder is refused, naming what it is).
    Returns the folder, absolute."""
    try:
        root = check_model_dir(model_dir, parts, flag)
        refuse_unsupported(describe_wan_folder(root, need_transformer=False), flag, image_to_video=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    damaged = [f"{f.relative_to(root)}: {problem.removeprefix(f.name + ' ')}" for part in parts
               for f in sorted((root / part).glob("*.safetensors")) if (problem := safetensors_problem(f))]
    if damaged:
        raise ConfigError(f"{flag} {root}: damaged weights: {'; '.join(damaged)}; copy them again")
    return root


# ---------------------------------------------------------------------------------------------
# Samples during training: the model folder, file names
# ---------------------------------------------------------------------------------------------


def sample_parts(cfg: Config) -> tuple[str, ...]:
    """The model-folder parts sampling ``cfg``'s model needs: the text encoder and VAE for
    ``wan``, the VAE for a latent ``videodit``, none for pixels."""
    if cfg.model.arch == "wan":
        kind = required_kind(cfg.model)
        clip = ("image_encoder", "image_processor") if kind in ("i2v", "flf2v") else ()
        return ("text_encoder", "tokenizer", "vae", *clip)
    return ("vae",) if cfg.latent_space else ()


def sample_model_dir(cfg: Config, init_from: str | Path | None = None) -> Path | None:
    """The local diffusers folder the samples taken during training are encoded and decoded with
    (None for a pixel model): ``training.sample_model_dir``, else the ``init_from`` folder (or
    ``training.init_from``: a diffusers Wan folder, or the one above its ``transformer/``), its
    parts checked whole (``check_model_files``). ``ConfigError`` naming the flag otherwise."""
    parts = sample_parts(cfg)
    if not parts:
        return None
    t = cfg.training
    given = t.sample_model_dir
    if not given:
        source = init_from or t.init_from
        start = Path(source).expanduser() if source else None
        found = next((d for d in ((start, start.parent) if start else ()) if (d / "vae").is_dir()), None)
        if found is None:
            what = "its text_encoder/, tokenizer/ and vae/" if cfg.model.arch == "wan" else "its vae/ (the one the " \
                   "latents were made with)"
            raise ConfigError(f"training.sample_every={t.sample_every} with model.arch={cfg.model.arch!r} on latents: "
                              f"the samples need a local diffusers model folder, {what}; "
                              + (f"the init_from source {source} has no vae/ beside it; " if source else "")
                              + "give --training.sample_model_dir DIR (or set training.sample_every=0)")
        given = str(found)
    return check_model_files(given, parts, "training.sample_model_dir")


def prompt_slug(prompt: str, max_chars: int = 40) -> str:
    """A file-name part for ``prompt``: lower-case letters and digits joined by ``-`` (``empty``
    for a prompt of none), at most ``max_chars`` long."""
    words = "".join(c if c.isascii() and c.isalnum() else " " for c in prompt.lower()).split()
    slug = ""
    for w in words:
        if len(slug) + len(w) + bool(slug) > max_chars:
            break
        slug += ("-" if slug else "") + w
    return slug or (words[0][:max_chars] if words else "empty")


def sample_path(run_dir: str | Path, step: int, index: int, prompt: str) -> Path:
    """Where the sample of prompt ``index`` taken after step ``step`` is written:
    ``RUN_DIR/samples/step_{step:06d}_{index:02d}_{slug}.mp4`` (sorting by name sorts by step)."""
    return Path(run_dir) / "samples" / f"step_{step:06d}_{index:02d}_{prompt_slug(prompt)}.mp4"


def refuse_one_expert(cfg: Config, ckpt: Path) -> None:
    """A checkpoint of one expert of a two-expert model cannot sample alone: ``ConfigError``."""
    if cfg.training.expert in ("high", "low"):
        raise ConfigError(f"{ckpt} holds one expert of a two-expert model (training.expert={cfg.training.expert!r}): "
                          f"sampling runs both (timestep t >= {cfg.training.boundary_ratio} x 1000: transformer/, below: "
                          f"transformer_2/). Export it (--format diffusers) into the model folder in place of its "
                          f"expert and sample with diffusers' WanPipeline, or train both (training.expert=both)")


def sample_video(checkpoint: str | Path, prompt: str, out: str | Path, frames: int | None = None,
                 steps: int = 20, seed: int = 0, height: int | None = None, width: int | None = None,
                 cfg_scale: float = 1.0, fps: int = 8, device: str = "auto", model_dir: str | Path | None = None,
                 negative_prompt: str = "", upscale: int = 1, image: str | Path | None = None,
                 last_image: str | Path | None = None, weights: str = "auto") -> SampleResult:
    """Sample one video from ``checkpoint`` (a checkpoint or run directory) and write
    ``out`` (mp4) and ``out`` with suffix ``.png`` (contact sheet), each pixel repeated
    ``upscale`` x ``upscale`` times (nearest neighbour: a 16x16 model's clip viewed at 64x64, and
    big enough that H.264's half-resolution colour does not smear a shape of a few pixels).

    A ``wan`` checkpoint samples in latent space: ``model_dir`` (a local diffusers Wan folder)
    provides the text encoder for ``prompt`` and ``negative_prompt`` (the unconditional half of
    guidance) and the VAE that decodes the result; ``training.flow_shift`` shifts the time grid.
    A ``videodit`` on latents (``model.inputs = latents``, the ``dit-*`` presets) reads the prompt
    as bytes and needs ``model_dir`` only for its VAE (the one its latents were made with). A
    ``videodit`` on pixels takes no ``model_dir`` (ConfigError: one given was meant for another model). A
    checkpoint of both experts of a two-expert model runs, at each time, the expert diffusers'
    ``WanPipeline`` runs (``ComputeActor.predict``); one of one expert alone is refused. An
    image-to-video checkpoint (Wan2.1 I2V, FLF2V, Wan2.2 I2V-A14B) starts from ``image`` (and
    FLF2V also ends at ``last_image``): ``model_dir`` (its own folder) encodes them as precompute
    encoded the training clips' first frames (``sampling_condition``). ``weights``: the trained
    weights or their moving average (``WEIGHTS``, ``use_average``)."""
    _check_sample_arguments(upscale, steps, fps)
    t0 = time.perf_counter()
    ckpt, state, cfg = _sampling_checkpoint(checkpoint, frames, height, width, device, cfg_scale)
    # A bf16 checkpoint sampled on the CPU: serve the fp32 master copy (CPU kernels want fp32).
    on_cpu = device == "cpu" or not torch.cuda.is_available()
    kind = "master" if on_cpu and DTYPES.get(state.get("w_dtype", "float32")) is torch.bfloat16 else "w"
    if not prompt.strip():
        log.warning("the prompt is empty: the video is sampled unconditionally, as the model learned its captions' "
                    "absence (give --prompt TEXT)")
    encoder, wan_condition = _sampling_encoder(cfg, model_dir, device, prompt, negative_prompt, image, last_image)
    x, step = _denoise(cfg, ckpt, kind, prompt, wan_condition, steps, seed, cfg_scale, use_average(state, weights))
    if encoder is not None:
        video = decode_latents(encoder.load_vae(), x)
        encoder.close()
    else:
        video = to_uint8_frames(x)
    out, sheet, video = _write_sample(out, video, upscale, fps)
    return SampleResult(str(out), str(sheet), video, str(ckpt), step, time.perf_counter() - t0)


def _check_sample_arguments(upscale: int, steps: int, fps: int) -> None:
    """``sample_video``'s refusals of its own arguments (``ValueError``), before any file is read."""
    if upscale < 1:
        raise ValueError(f"upscale={upscale} must be >= 1 (1 writes the model's own size)")
    if steps < 1:
        raise ValueError(f"--steps {steps} must be >= 1")
    if fps < 1:
        raise ValueError(f"--fps {fps} must be >= 1")


def _sampling_checkpoint(checkpoint: str | Path, frames: int | None, height: int | None, width: int | None,
                         device: str, cfg_scale: float) -> tuple[Path, dict, Config]:
    """(checkpoint directory, its state, the config to sample with); refuses a checkpoint of one
    expert and a size H.264 cannot hold, and warns of guidance a checkpoint was not trained for."""
    try:
        ckpt = resolve_checkpoint(checkpoint)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--checkpoint {e}") from None
    state = read_checkpoint_state(ckpt)
    cfg = sampling_config(state, frames, height, width, device)
    refuse_one_expert(cfg, ckpt)
    if cfg.model.arch == "videodit" and cfg_scale != 1.0 and not cfg.training.caption_dropout:
        log.warning("--cfg-scale %s: this checkpoint was trained without caption dropout "
                       "(training.caption_dropout = 0), so its unconditional prediction (the empty caption) "
                       "is untrained and guidance mixes in noise; train with training.caption_dropout > 0 "
                       "(0.1 is usual) or sample with --cfg-scale 1", cfg_scale)
    if cfg.data.height % 2 or cfg.data.width % 2:
        raise ConfigError(f"video size {cfg.data.width}x{cfg.data.height} must be even for H.264 (yuv420p); "
                          f"choose even --height/--width")
    return ckpt, state, cfg


def _sampling_encoder(cfg: Config, model_dir: str | Path | None, device: str, prompt: str, negative_prompt: str,
                      image: str | Path | None, last_image: str | Path | None) -> tuple[Encoder | None, tuple | None]:
    """The encoder whose VAE decodes the sample (None for a model on pixels), and for a ``wan``
    model its condition (text, negative, image condition), encoded with the text encoder closed
    again before the transformer streams; refuses a missing or a needless ``model_dir``."""
    encoder = condition = None
    if cfg.model.arch == "wan":
        if model_dir is None:
            raise ConfigError("this checkpoint is a wan model: give --model-dir WAN_DIR, the local diffusers folder "
                              "whose text_encoder/, tokenizer/ and vae/ encode the prompt and decode the video")
        clip_parts = ("image_encoder", "image_processor") if cfg.model.image_dim else ()
        encoder = _decode_encoder(cfg, check_model_files(model_dir, ("text_encoder", "tokenizer", "vae", *clip_parts)),
                                  device)
        text, negative = encoder.encode_text([prompt, negative_prompt])
        condition = (text, negative, sampling_condition(encoder, cfg, image, last_image))
        encoder.close()  # frees the text encoder before the transformer streams
    elif not cfg.latent_space and model_dir is not None:  # refused, not ignored: the user meant something by it
        raise ConfigError(f"--model-dir {model_dir}: this checkpoint's model draws pixels (model.inputs='pixels'), so "
                          f"no model folder encodes its prompt or decodes its video; leave out --model-dir")
    elif cfg.latent_space:
        if model_dir is None:
            raise ConfigError("this checkpoint's model reads VAE latents (model.inputs='latents'): give --model-dir "
                              "DIR, the local diffusers folder whose vae/ made its latents (e.g. a Wan2.1 folder), "
                              "to decode the video")
        encoder = _decode_encoder(cfg, check_model_files(model_dir, ("vae",)), device)
    return encoder, condition


def _decode_encoder(cfg: Config, model_dir: str | Path, device: str) -> Encoder:
    """``model_dir``'s encoders for clips of ``cfg``'s size, in float32 on the GPU unless the CPU
    is asked for or no GPU is found."""
    d = cfg.data
    return Encoder(str(model_dir), clip_config(d.num_frames, d.height, d.width, 0.0),
                   "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu", "float32")


def _denoise(cfg: Config, ckpt: Path, kind: str, prompt: str, wan_condition: tuple | None, steps: int, seed: int,
             cfg_scale: float, average: bool = False) -> tuple[torch.Tensor, int]:
    """(the sampled clip, in the model's space; the checkpoint's step): the checkpoint's ``kind``
    weights (``average``: their moving average) streamed through a ``ComputeActor``, closed however
    sampling ends."""
    source = CheckpointWeights(ckpt, cfg, kind, average)
    compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    try:
        if cfg.model.arch == "wan":
            text, negative, extra = wan_condition
            x = wan_sample(compute, cfg, text, negative, steps, seed, source.step, cfg_scale, extra)
        else:
            x = euler_sample(compute, cfg, prompt, steps, seed, source.step, cfg_scale)
    finally:
        compute.close()
        source.close()
    return x, source.step


def _write_sample(out: str | Path, video: np.ndarray, upscale: int, fps: int) -> tuple[Path, Path, np.ndarray]:
    """Write ``video``, each pixel repeated ``upscale`` x ``upscale`` times, as the mp4 ``out``
    and its contact sheet beside it: (mp4, sheet, the frames written)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if upscale > 1:
        video = video.repeat(upscale, axis=1).repeat(upscale, axis=2)
    write_video(out, video, fps)
    sheet = out.with_suffix(".png")
    write_png(sheet, contact_sheet(video))
    return out, sheet, video
