"""Shards kept and updated on the compute device across steps (``runtime.device_shards``).

The forward's first shards (the input side, then blocks 1, 2, ...) are the step boundary: the
next step's forward needs them first, and their gradients are the backward's last, so in the
store's schedule each one's fetch waits for its update, which waits for the step's last
gradient (exact global-norm clipping). Kept here with their fp32 weights and moments, they are
updated right after the backward, with the global norm summed from every shard's squared norm
(the same exactly rounded sum the store takes, ``training.schedule.global_norm``, of the same
fp32 values it is sent), the store's clipping and learning-rate rule
(``training.schedule.step_constants``) and its fused AdamW (``training.adamw.adamw_fused``).
The store still counts their norms (a report without a gradient) and moves their versions on
with every step; their segments there hold the state of the last ``ParameterStore.put_device_state``
(the driver's, before a checkpoint)."""

from __future__ import annotations

import numpy as np
import torch

from megaslide_ray.config import Config
from megaslide_ray.training.adamw import adamw_fused
from megaslide_ray.training.schedule import global_norm, step_constants


class DeviceShards:
    """The device shards of one compute actor: their state, this step's gradients and every
    shard's squared norm of this step."""

    def __init__(self, cfg: Config, device: torch.device, w_dtype: torch.dtype):
        self.cfg, self.device, self.w_dtype = cfg, device, w_dtype
        self.ids = list(range(cfg.runtime.device_shards))
        self.state: dict[int, dict[str, torch.Tensor]] | None = None  # master, m, v (fp32), w (compute dtype)
        self.version = -1                       # the step whose weights ``w`` holds
        self._grads: dict[int, torch.Tensor] = {}
        self._sqnorms: list[torch.Tensor] = []

    def __contains__(self, shard: int) -> bool:
        return shard in self.ids

    def __bool__(self) -> bool:
        return bool(self.ids)

    def load(self, store, step: int) -> None:
        """Take the shards' state at version ``step`` from the store (once, at the first step;
        afterwards the state here is newer than the store's and is kept)."""
        if self.state is not None:
            if self.version != step:
                raise RuntimeError(f"the device shards {self.ids} hold the weights of step {self.version}, but step "
                                   f"{step + 1} asks for those of step {step}: a step was skipped or repeated")
            return
        states = store.device_state(step)
        self.state = {}
        for i in self.ids:
            # np.array copies: arrays from Ray are read-only views of the object store.
            st = {k: torch.from_numpy(np.array(states[i][k], copy=True)).to(self.device) for k in ("master", "m", "v")}
            st["w"] = st["master"].to(self.w_dtype, copy=True)
            self.state[i] = st
        self.version = step

    def weights(self) -> dict[int, torch.Tensor]:
        """The compute copies by shard (empty before ``load``)."""
        return {} if self.state is None else {i: st["w"] for i, st in self.state.items()}

    def begin_step(self) -> None:
        self._grads.clear()
        self._sqnorms = []

    def add_norm(self, sqnorm: torch.Tensor) -> None:
        """A shard's squared gradient norm of this step (a 0-d float32 tensor, NaN when poisoned)."""
        self._sqnorms.append(sqnorm)

    def keep_grad(self, shard: int, grad: torch.Tensor) -> None:
        """Shard ``shard``'s gradient of this step, in the weights' dtype, as the store would get it."""
        self._grads[shard] = grad

    @torch.no_grad()
    def update(self, step: int) -> float:
        """AdamW of ``step`` on the device shards, once every shard's norm is in; returns the
        global norm. A norm that is not finite skips the update here, as the store does."""
        if sorted(self._grads) != self.ids:
            raise RuntimeError(f"the device shards' update of step {step + 1} has gradients of shards "
                               f"{sorted(self._grads)}, not of {self.ids}")
        total = global_norm(torch.stack(self._sqnorms).tolist())  # the step's one host sync
        o = self.cfg.optim
        coef, lr, finite = step_constants(o, self.cfg.training.steps, step, total)
        if finite:
            for i in self.ids:
                st, g = self.state[i], self._grads[i]
                g = g if g.dtype == torch.float32 else g.float()
                adamw_fused(st["master"], g, st["m"], st["v"], o, step, coef, lr)
                st["w"].copy_(st["master"])
        self._grads.clear()
        self.version = step + 1
        return total

    def export(self) -> tuple[int, dict[int, dict[str, np.ndarray]]]:
        """(version, the shards' master, m and v as host arrays), for ``ParameterStore.put_device_state``;
        no arrays before the first step took them from the store."""
        if self.state is None:
            return self.version, {}
        return self.version, {i: {k: st[k].cpu().numpy().copy() for k in ("master", "m", "v")}
                              for i, st in self.state.items()}
