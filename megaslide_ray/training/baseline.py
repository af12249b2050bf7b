"""The same model trained the ordinary way: one process, whole model, ``torch.optim.AdamW``.

It is the correctness anchor of the streamed trainer (same init, same batches, same noise, same
schedule and clipping: parameters must agree step by step) and the baseline of the pipeline
overhead benchmark.

With ``training.ema_decay`` it keeps the moving average of the weights as the parameter store does
(``ema``: one fp32 tensor per parameter, ``lerp_`` towards the weights after each step, the weights
themselves until ``training.ema_start_step`` steps are done; taken from the weights when the first
step starts, so weights loaded after construction are its start), so the two can be compared.

With ``training.distill_weight`` > 0 it distils as the streamed trainer does: a frozen dense copy
of the model (``teacher_config``), taken when the first step runs (the model the adaptation
starts from: its weights are the caller's, e.g. ``training.init_from``'s loaded by hand) or given
as ``teacher`` (a state dict of the dense model), predicts the velocity on the same input, and
``distill_weight x distill_loss`` is added to the task loss.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from megaslide_ray.config import Config
from megaslide_ray.models.attention_levers import host_weights, step_mix, weights_on_host
from megaslide_ray.models.registry import build_model, distills, num_experts, teacher_config
from megaslide_ray.training.flow import (
    batch_conditioning,
    batch_flow_inputs,
    caption_dropout,
    distill_loss,
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
    distill_loss: float = 0.0  # training.distill_weight > 0: the distillation term before its weight


class InProcessTrainer:
    def __init__(self, cfg: Config, threads: int = 0, teacher: dict | None = None):
        torch.set_num_threads(threads or os.cpu_count() or 1)
        if num_experts(cfg) > 1:
            raise ValueError("the in-process baseline trains one transformer; training.expert='both' holds two")
        self.cfg = cfg
        self.model = build_model(cfg)
        o = cfg.optim
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                                     weight_decay=o.weight_decay)
        self.step = 0
        # the moving average of the weights (training.ema_decay), fp32, in parameter order: taken
        # from the weights when the first step starts (a caller may load weights after __init__)
        self.ema: list[torch.Tensor] | None = None
        self.teacher: torch.nn.Module | None = None
        if teacher is not None:
            self.set_teacher(teacher)

    def set_teacher(self, state: dict) -> None:
        """The dense teacher of ``training.distill_weight``: ``teacher_config``'s model with the
        weights of ``state`` (names of the dense model; a DSA model's offset heads are left out),
        frozen, in eval mode."""
        teacher = build_model(teacher_config(self.cfg))
        names = set(teacher.state_dict())
        teacher.load_state_dict({k: v for k, v in state.items() if k in names})
        self.teacher = teacher.eval().requires_grad_(False)

    def _distill(self, pred: torch.Tensor, inputs: tuple, clean: bool) -> torch.Tensor | None:
        """The distillation term of this step (None when off): the teacher (taken now from the
        model's weights if none was given) predicts on the same ``inputs``."""
        if not distills(self.cfg):
            return None
        if self.teacher is None:
            self.set_teacher({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        with torch.no_grad():
            target = self.teacher(*inputs)
        return distill_loss(pred, target, clean)

    def train_step(self, batch: dict, noise_step: int | None = None) -> BaselineStep:
        t0 = time.perf_counter()
        cfg = self.cfg
        if cfg.training.ema_decay and self.ema is None:
            self.ema = [p.detach().float().clone() for p in self.model.parameters()]
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
        inputs = (x_in, fx.t, cap, cap_len, *extra)
        mix = step_mix(cfg, fx.t, self.step)  # the curriculum's dense weights (attention.dense_warmup_steps)
        with weights_on_host(host_weights(cfg, fx.t, self.step)):  # the blocks choose by the host's t: no read back
            pred = self.model(*inputs, **mix)
        loss = model_loss(pred, fx.target, clean)
        distill = self._distill(pred, inputs, clean)
        total = loss if distill is None else loss + cfg.training.distill_weight * distill
        self.opt.zero_grad(set_to_none=True)
        total.backward()
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
        self._update_ema()
        result = BaselineStep(self.step, float(loss.detach()), norm, time.perf_counter() - t0,
                              0.0 if distill is None else float(distill.detach()))
        self.step += 1
        return result

    @torch.no_grad()
    def _update_ema(self) -> None:
        """The average after this step (``training.ema_decay``; see the module docstring)."""
        if self.ema is None:
            return
        params = [p.detach() for p in self.model.parameters()]
        if self.step + 1 <= self.cfg.training.ema_start_step:
            torch._foreach_copy_(self.ema, params)
        else:
            torch._foreach_lerp_(self.ema, params, 1.0 - self.cfg.training.ema_decay)

    @torch.no_grad()
    def load_average(self) -> None:
        """Put the moving average into the model's parameters (to evaluate or sample with it)."""
        if self.ema is None:
            raise ValueError("this trainer keeps no moving average of the weights: set training.ema_decay")
        torch._foreach_copy_([p.detach() for p in self.model.parameters()], self.ema)
