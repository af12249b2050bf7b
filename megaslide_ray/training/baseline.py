"""The same model trained the ordinary way: one process, whole model, ``torch.optim.AdamW``.

It is the correctness anchor of the streamed trainer (same init, same batches, same noise, same
schedule and clipping: parameters must agree step by step) and the baseline of the pipeline
overhead benchmark.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from megaslide_ray.config import Config
from megaslide_ray.models.attention_levers import step_mix
from megaslide_ray.models.registry import build_model, num_experts
from megaslide_ray.training.flow import (
    batch_conditioning,
    batch_flow_inputs,
    caption_dropout,
    keep_first_frame,
    model_loss,
    step_t_range,
)
from megaslide_ray.training.image_inputs import batch_condition, model_input
from megaslide_ray.training.schedule import lr_at


@dataclass(frozen=True)
class BaselineStep:
    step: int
    loss: float
    grad_norm: float
    seconds: float


class InProcessTrainer:
    def __init__(self, cfg: Config, threads: int = 0):
        torch.set_num_threads(threads or os.cpu_count() or 1)
        if num_experts(cfg) > 1:
            raise ValueError("the in-process baseline trains one transformer; training.expert='both' holds two")
        self.cfg = cfg
        self.model = build_model(cfg)
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay)
        self.step = 0

    def train_step(self, batch: dict, noise_step: int | None = None) -> BaselineStep:
        t0 = time.perf_counter()
        cfg = self.cfg
        step = self.step if noise_step is None else noise_step
        fx = batch_flow_inputs(batch, cfg.training.seed, step, cfg.training.t_sampling, cfg.training.flow_shift,
                               t_range=step_t_range(cfg, step))
        clean = cfg.model.arch == "wan" and cfg.model.clean_first_frame
        fx = keep_first_frame(fx) if clean else fx
        cap, cap_len = batch_conditioning(batch, cfg.training.seed, step, caption_dropout(cfg))
        x_in, extra = fx.x_t, ()
        if cfg.model.arch == "wan":  # an image-to-video model: its condition channels and image states
            condition, image = batch_condition(batch, cfg.model)
            x_in = fx.x_t if condition is None else model_input(fx.x_t, condition)
            extra = () if image is None else (image,)
        mix = step_mix(cfg, fx.t, self.step)  # the curriculum's dense weights (attention.dense_warmup_steps)
        loss = model_loss(self.model(x_in, fx.t, cap, cap_len, *extra, **mix), fx.target, clean)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in self.model.parameters():  # a weight this step did not use (an offset head while every sample's
            if p.grad is None:  # attention is dense) still takes its AdamW step, as in the streamed trainer
                p.grad = torch.zeros_like(p)
        if cfg.optim.grad_clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.model.parameters()])))
        for group in self.opt.param_groups:
            group["lr"] = lr_at(cfg.optim, cfg.training.steps, self.step)
        self.opt.step()
        result = BaselineStep(self.step, float(loss.detach()), norm, time.perf_counter() - t0)
        self.step += 1
        return result
