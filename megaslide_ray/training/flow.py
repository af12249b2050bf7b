"""Rectified-flow (flow-matching) objective.

x_t = (1 - t) * x0 + t * noise, and the model predicts the velocity v = noise - x0. Sampling
integrates dx/dt = v from t = 1 (noise) to t = 0 (data). The noise and t of sample j of step k
(j counted over the step's whole batch: every compute actor's, every micro-batch's) come from a
generator seeded by (seed, k, j) alone, so a streamed run, an in-process run, a resumed run, and
runs that split the same global batch over another number of compute actors or micro-batches
all see the same draws without carrying RNG state around.

``x0`` is either a decoded video batch (uint8 pixels, scaled to [-1, 1]) or precomputed VAE
latents (already normalised). ``training.flow_shift`` s moves the sampled times towards the
noise end, ``t' = s t / (1 + (s - 1) t)``, as Wan 2.x and SD3 train and sample at high
resolution (s = 1: no shift). Wan's ``timestep`` is ``1000 t'``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class FlowInputs:
    x0: torch.Tensor        # (B, F, H, W, C) clean video in [-1, 1]
    noise: torch.Tensor     # same shape
    t: torch.Tensor         # (B,) in (0, 1)
    x_t: torch.Tensor       # noised input
    target: torch.Tensor    # velocity noise - x0


def video_to_unit(video: torch.Tensor | np.ndarray) -> torch.Tensor:
    """uint8 (B, F, H, W, C) -> float32 in [-1, 1]."""
    # np.array copies: batches from Ray are read-only views of the object store.
    v = video if isinstance(video, torch.Tensor) else torch.from_numpy(np.array(video))
    return v.to(torch.float32) / 127.5 - 1.0


def step_generator(seed: int, step: int, stream: int = 1) -> torch.Generator:
    """The generator of step ``step``'s draws in ``stream`` (caption dropout has its own)."""
    return torch.Generator(device="cpu").manual_seed((seed * 0x9E3779B1 + step * 0x85EBCA77 + stream) % (2**63 - 1))


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a 64-bit hash, so nearby (seed, step, sample) seed far-apart generators."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def sample_generator(seed: int, step: int, sample: int) -> torch.Generator:
    """The generator of the noise and t of sample ``sample`` (counted over the step's global
    batch) of step ``step``: a function of the three alone, so however a global batch is split
    over compute actors and micro-batches, each sample sees the same draws."""
    key = _mix64(_mix64(_mix64(seed) ^ step) ^ sample)
    return torch.Generator(device="cpu").manual_seed(key % (2**63 - 1))


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """``s t / (1 + (s - 1) t)``: the time shift of flow matching (identity for ``shift == 1``)."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


_DROP_STREAM = 0x5DEECE66D  # caption dropout draws from its own stream of (seed, step)


def batch_conditioning(batch: dict, seed: int = 0, step: int = 0, caption_dropout: float = 0.0,
                       first_sample: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's conditioning as the input shard takes it: caption bytes and their lengths
    (video batches, and latent batches for a ``videodit``), or text embeddings and their valid
    lengths (latent batches for ``wan``). With ``caption_dropout`` > 0, each caption is replaced
    by the empty caption (zero bytes, length 0) with that probability, drawn from (seed, step)
    alone (``caption_drops``; the batch's clips are samples ``first_sample`` on of the step's
    global batch); text embeddings are never dropped."""
    keys = ("text", "text_len") if "text" in batch else ("caption", "caption_len")
    # np.array copies: batches from Ray are read-only views of the object store.
    cond, cond_len = (torch.from_numpy(np.array(batch[k])) for k in keys)
    if caption_dropout > 0 and keys[0] == "caption":
        drop = caption_drops(seed, step, cond.shape[0], caption_dropout, first_sample)
        cond[drop] = 0
        cond_len[drop] = 0
    return cond, cond_len


def caption_dropout(cfg) -> float:
    """The caption dropout a config trains with: ``training.caption_dropout`` for ``videodit``, 0
    for ``wan`` (its conditioning is text embeddings)."""
    return cfg.training.caption_dropout if cfg.model.arch == "videodit" else 0.0


def caption_drops(seed: int, step: int, batch: int, p: float, first_sample: int = 0) -> torch.Tensor:
    """``(batch,)`` bool: which captions of samples ``first_sample .. first_sample + batch - 1`` of
    step ``step``'s global batch are dropped (probability ``p``): one draw per sample of the
    global batch, in order, so a split of the batch changes none."""
    u = torch.rand(first_sample + batch, generator=step_generator(seed, step, _DROP_STREAM), dtype=torch.float64)
    return u[first_sample:] < p


def batch_flow_inputs(batch: dict, seed: int, step: int, t_sampling: str = "logit_normal",
                      flow_shift: float = 1.0, first_sample: int = 0,
                      t_range: tuple[float, float] | None = None) -> FlowInputs:
    """Flow-matching inputs of a decoder batch: its ``latents`` (float, normalised) if it has
    them, else its ``video`` (uint8 pixels). Its clips are samples ``first_sample`` on of the
    step's global batch (``flow_inputs``)."""
    if "latents" in batch:
        x0 = torch.from_numpy(np.array(batch["latents"], dtype=np.float32))
    else:
        x0 = video_to_unit(batch["video"])
    return flow_inputs(x0, seed, step, t_sampling, flow_shift, first_sample, t_range)


def sample_flow_inputs(video, seed: int, step: int, t_sampling: str = "logit_normal",
                       flow_shift: float = 1.0) -> FlowInputs:
    """Flow-matching inputs of a uint8 video batch (B, F, H, W, C)."""
    return flow_inputs(video_to_unit(video), seed, step, t_sampling, flow_shift)


def flow_inputs(x0: torch.Tensor, seed: int, step: int, t_sampling: str = "logit_normal",
                flow_shift: float = 1.0, first_sample: int = 0,
                t_range: tuple[float, float] | None = None) -> FlowInputs:
    """Noise and t for ``x0``, whose clips are samples ``first_sample, first_sample + 1, ...`` of
    step ``step``'s global batch: each clip's noise, then its t, from ``sample_generator(seed,
    step, sample)``; t shifted by ``flow_shift``. ``t_range`` (lo, hi): t drawn from the same
    distribution conditioned on ``lo <= t < hi`` (an expert's range, ``expert_t_range``), by
    mapping the draw's own quantile into the range's (one draw, no rejection)."""
    if t_sampling not in ("uniform", "logit_normal"):
        raise ValueError(f"t_sampling={t_sampling!r} is not 'uniform' or 'logit_normal'")
    B = x0.shape[0]
    noise = torch.empty(x0.shape, dtype=torch.float32)
    t = torch.empty(B, dtype=torch.float32)
    for i in range(B):
        g = sample_generator(seed, step, first_sample + i)
        noise[i] = torch.randn(x0.shape[1:], generator=g, dtype=torch.float32)
        if t_sampling == "uniform":
            t[i] = torch.rand((), generator=g, dtype=torch.float32)
        else:  # logit-normal, SD3-style: more weight on the middle of the path
            t[i] = torch.sigmoid(torch.randn((), generator=g, dtype=torch.float32))
    if t_range is not None:
        return _flow_inputs_in_range(x0, noise, t, t_sampling, flow_shift, t_range)
    t = shift_time(t, flow_shift).clamp(1e-4, 1 - 1e-4)
    tb = t.view(B, *([1] * (x0.dim() - 1)))
    x_t = (1 - tb) * x0 + tb * noise
    return FlowInputs(x0=x0, noise=noise, t=t, x_t=x_t, target=noise - x0)


def _flow_inputs_in_range(x0, noise, t, t_sampling, shift, t_range) -> FlowInputs:
    """``flow_inputs``' last part for t conditioned on ``t_range``: each draw's quantile ``u`` under
    the unshifted distribution goes to ``F(lo) + (F(hi) - F(lo)) u``, back through the inverse
    distribution and the shift; every t is then inside the range in float32 too."""
    lo, hi = t_range
    t64 = t.double()
    u = t64 if t_sampling == "uniform" else torch.special.ndtr(torch.logit(t64))
    f_lo, f_hi = base_cdf(lo, t_sampling, shift), base_cdf(hi, t_sampling, shift)
    q = (f_lo + (f_hi - f_lo) * u).clamp(1e-12, 1 - 1e-12)
    raw = q if t_sampling == "uniform" else torch.sigmoid(torch.special.ndtri(q))
    t = shift_time(raw, shift).clamp(max(lo, 1e-4), min(hi, 1 - 1e-4)).float()
    below, above = torch.tensor(lo, dtype=torch.float32), torch.tensor(hi, dtype=torch.float32)
    t = torch.where(t.double() < lo, torch.nextafter(below, above).expand_as(t), t)  # lo <= t (float32)
    t = torch.where(t.double() >= hi, torch.nextafter(above, below).expand_as(t), t)  # t < hi
    tb = t.view(-1, *([1] * (x0.dim() - 1)))
    return FlowInputs(x0=x0, noise=noise, t=t, x_t=(1 - tb) * x0 + tb * noise, target=noise - x0)


def unshift_time(t, shift: float):
    """The inverse of ``shift_time``: ``t / (s - (s - 1) t)``."""
    return t if shift == 1.0 else t / (shift - (shift - 1) * t)


def base_cdf(t: float, t_sampling: str, shift: float) -> float:
    """P(shifted t < ``t``) under ``t_sampling`` and ``flow_shift`` (before the clamp)."""
    if t <= 0.0:
        return 0.0
    if t >= 1.0:
        return 1.0
    x = unshift_time(float(t), shift)
    if t_sampling == "uniform":
        return x
    return float(torch.special.ndtr(torch.logit(torch.tensor(x, dtype=torch.float64))))


HIGH, LOW = 0, 1
"""The experts of a two-expert model: 0 ``transformer`` (high noise), 1 ``transformer_2`` (low noise)."""
EXPERT_NAMES = ("high", "low")
_EXPERT_STREAM = 0x2545F4914F6CDD1D  # the expert of a step is drawn from its own stream of (seed, step)


def expert_t_range(boundary: float, expert: int) -> tuple[float, float]:
    """The flow times an expert denoises, as diffusers' ``WanPipeline`` routes them (timestep
    ``1000 t >= boundary_ratio x 1000`` runs ``transformer``): high ``[b, 1)``, low ``[0, b)``."""
    return (boundary, 1.0) if expert == HIGH else (0.0, boundary)


def route_expert(t: float, boundary: float) -> int:
    """The expert diffusers' pipeline runs at flow time ``t`` (timestep ``1000 t``)."""
    return HIGH if 1000.0 * t >= boundary * 1000.0 else LOW


def step_expert(cfg, step: int) -> int | None:
    """The expert step ``step`` trains (None: a one-transformer model): ``training.expert`` high or
    low, or with ``both`` one drawn from (seed, step) alone, high with the probability
    ``1 - base_cdf(boundary)`` of its range. Under ``overfit_one_batch`` every step is step 0's."""
    t = cfg.training
    if not t.expert:
        return None
    if t.expert != "both":
        return HIGH if t.expert == "high" else LOW
    step = 0 if t.overfit_one_batch else step
    u = _mix64(_mix64(_mix64(t.seed) ^ _EXPERT_STREAM) ^ step) / 2.0 ** 64
    return HIGH if u < 1.0 - base_cdf(t.boundary_ratio, t.t_sampling, t.flow_shift) else LOW


def step_t_range(cfg, step: int) -> tuple[float, float] | None:
    """The range step ``step``'s t is drawn in (``step_expert``'s), or None (no expert)."""
    expert = step_expert(cfg, step)
    return None if expert is None else expert_t_range(cfg.training.boundary_ratio, expert)


def expert_steps_before(cfg, step: int, expert: int) -> int:
    """How many of steps ``0 .. step - 1`` trained ``expert`` (its own AdamW step count)."""
    return sum(step_expert(cfg, k) == expert for k in range(step))


def flow_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(pred.float(), target.float())


def keep_first_frame(fx: FlowInputs) -> FlowInputs:
    """``model.clean_first_frame`` (Wan2.2 TI2V from an image): the first latent frame of ``x_t``
    is the clip's clean one, as the pipeline feeds the image's latents there (the Wan VAE encodes
    the first frame alone, so the clip's first latent frame is the image's)."""
    x_t = fx.x_t.clone()
    x_t[:, :1] = fx.x0[:, :1]
    return FlowInputs(x0=fx.x0, noise=fx.noise, t=fx.t, x_t=x_t, target=fx.target)


def model_loss(pred: torch.Tensor, target: torch.Tensor, clean_first_frame: bool = False) -> torch.Tensor:
    """``flow_loss``, without the first latent frame when it is the clean condition
    (``model.clean_first_frame``: the model is not asked to denoise it)."""
    if clean_first_frame:
        return flow_loss(pred[:, 1:], target[:, 1:])
    return flow_loss(pred, target)


def distill_loss(pred: torch.Tensor, teacher: torch.Tensor, clean_first_frame: bool = False) -> torch.Tensor:
    """``training.distill_weight``'s term before the weight: the mean squared difference between
    the model's velocity ``pred`` and the dense teacher's ``teacher`` on the same input (no
    gradient reaches the teacher), over the frames ``model_loss`` counts."""
    return model_loss(pred, teacher.detach(), clean_first_frame)
