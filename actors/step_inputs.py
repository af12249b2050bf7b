"""A training step's model inputs on the compute device (``FlowInputs``): the noise and ``t``
drawn on the host from (seed, step, sample), the conditioning, an image-to-video model's condition,
and with the dense-attention levers each sample's dense weight twice: on the device for shard 0
while the curriculum lasts (``step_mix``), on the host for the blocks' choice of kind
(``attention_levers.weights_on_host``: no device read per block)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from megaslide_ray.config import Config
from megaslide_ray.models.attention_levers import host_weights, step_mix
from megaslide_ray.training.flow import (
    batch_conditioning,
    batch_flow_inputs,
    expert_t_range,
    keep_first_frame,
    step_expert,
)
from megaslide_ray.training.image_inputs import batch_condition, model_input


class FlowInputs(NamedTuple):
    """One step's model inputs on the compute device (``host_mix``: on the host)."""
    x_t: torch.Tensor       # (B, F, H, W, C) noised clips (pixels or latents)
    t: torch.Tensor         # (B,) flow-matching time
    target: torch.Tensor    # (B, F, H, W, C) velocity to predict
    caption: torch.Tensor   # (B, Lc) uint8 caption bytes, or (B, L, text_dim) text embeddings
    caption_len: torch.Tensor
    condition: torch.Tensor | None = None  # image-to-video: (B, F, H, W, mask + C) mask and image latents
    image: torch.Tensor | None = None      # image-to-video with CLIP: (B n, Li, image_dim) image states
    dense_mix: torch.Tensor | None = None  # (B,) the curriculum's dense weights (attention_levers.step_mix)
    host_mix: torch.Tensor | None = None   # (B,) on the host: the blocks' dense weights (attention_levers.host_weights)

    def split(self, k: int) -> list["FlowInputs"]:
        """The k micro-batches, consecutive clips of the batch (``training.micro_batches``)."""
        if k == 1:
            return [self]
        B = self.x_t.shape[0]
        if B % k:
            raise ValueError(f"a batch of {B} clips does not split into training.micro_batches={k}")
        return [FlowInputs(*(None if a is None else a.chunk(k)[j] for a in self)) for j in range(k)]

    def embed_args(self) -> tuple:
        """Shard 0's arguments: the noised clips (with an image-to-video model's condition
        channels after them), t, the conditioning, and the image states when there are some."""
        x = self.x_t if self.condition is None else model_input(self.x_t, self.condition)
        return (x, self.t, self.caption, self.caption_len) + (() if self.image is None else (self.image,))

    def embed_kwargs(self) -> dict:
        """Shard 0's keyword arguments: the step's dense weights while the curriculum lasts."""
        return {} if self.dense_mix is None else {"dense_mix": self.dense_mix}


def step_inputs(cfg: Config, batch: dict, step: int, first: int, dropout: float,
                device: torch.device) -> FlowInputs:
    """Noise and t drawn from (seed, step, sample) for the samples ``first ..`` of the step's global
    batch (the same step always sees the same noise), moved to ``device``, with the batch's
    conditioning (caption bytes, or text embeddings; ``dropout``: ``training.caption_dropout``)."""
    t = cfg.training
    noise_step = 0 if t.overfit_one_batch else step
    expert = step_expert(cfg, step)  # a two-expert model: t in the step's expert's range
    fx = batch_flow_inputs(batch, t.seed, noise_step, t.t_sampling, t.flow_shift, first,
                           None if expert is None else expert_t_range(t.boundary_ratio, expert))
    if cfg.model.arch == "wan" and cfg.model.clean_first_frame:
        fx = keep_first_frame(fx)
    cond, cond_len = batch_conditioning(batch, t.seed, noise_step, dropout, first)
    condition, image = batch_condition(batch, cfg.model) if cfg.model.arch == "wan" else (None, None)
    mix = step_mix(cfg, fx.t, step).get("dense_mix")  # the curriculum's dense weights
    return FlowInputs(fx.x_t.to(device), fx.t.to(device), fx.target.to(device), cond.to(device),
                      cond_len.to(device), *(None if a is None else a.to(device) for a in (condition, image, mix)),
                      host_weights(cfg, fx.t, step))
