"""The parameter store's moving average of the weights (``training.ema_decay`` > 0).

One more fp32 segment per owned shard, ``ema`` (4 B/param beside the 14 of the state). It starts
as the weights (seeded or pretrained; a checkpoint restores it exactly) and is updated right
after the shard's AdamW, inside the shard's crash marker (so a cut update is as untrusted as the
rest of the shard, and a cut between shards is finished with it), by one vectorised ``lerp_``
over the flat shard: ``ema += (1 - decay) (master - ema)``, or ``ema = master`` until
``training.ema_start_step`` steps are done. A step that is skipped (non-finite gradients) or that
does not train the shard (the idle expert of two, ``actors/store_experts.py``) leaves it as it
is: each expert keeps its own average. Predictions read it through ``w`` while the driver asks
(``use_weights``: evaluation and sampling during training, ``training.ema_eval``)."""

from __future__ import annotations

import torch

from megaslide_ray.state.segments import KINDS


class AverageMethods:
    """Mixed into ``ParameterStore`` (which sets ``cfg``, ``ema_decay``, ``seg``, ``owned``, ``owns``,
    ``versions``, ``_lock``, ``_pending``, ``_applying`` and ``settle``)."""

    def _kinds(self, shard: int) -> tuple[str, ...]:
        """The segments of ``shard`` this store keeps: ``w``, and on its owner ``master``, ``m``,
        ``v`` and, with ``training.ema_decay``, ``ema``."""
        if not self.owns(shard):
            return ("w",)
        return KINDS + (("ema",) if self.ema_decay else ())

    def _start_average(self) -> None:
        """A fresh state's moving average: the weights themselves."""
        for i in self.owned:
            if "ema" in self.seg[i]:
                self.seg[i]["ema"].copy_(self.seg[i]["master"])

    def _update_ema(self, s: dict[str, torch.Tensor], step: int) -> None:
        """The shard's moving average after step ``step``'s update (``training.ema_decay``): ``ema +=
        (1 - decay) (master - ema)``, one vectorised pass over the flat shard; while the first
        ``training.ema_start_step`` steps are done it is ``master`` itself."""
        if "ema" not in s:
            return
        if step + 1 <= self.cfg.training.ema_start_step:
            s["ema"].copy_(s["master"])
        else:
            s["ema"].lerp_(s["master"], 1.0 - self.ema_decay)

    def use_weights(self, kind: str, timeout: float = 120.0) -> tuple[int, ...]:
        """What ``w`` serves the compute actor's predictions (evaluation, sampling during training):
        ``ema``, the moving average (``training.ema_decay``, cast to ``w``'s dtype), or ``master``,
        the trained weights (what training needs: the driver puts them back before the next step).
        Only between steps: the updates queued are applied first and every shard must be at one
        version (a ``w`` holding a gradient is never overwritten). A store restarted meanwhile, or
        a replaced compute actor, restores ``w = master`` by itself. Returns the versions."""
        if kind not in ("ema", "master"):
            raise ValueError(f"use_weights({kind!r}): use 'ema' (the moving average) or 'master' (the trained weights)")
        if kind == "ema" and not self.ema_decay:
            raise ValueError("this parameter store keeps no moving average of the weights (training.ema_decay = 0)")
        versions = self.settle(timeout)
        with self._lock:
            if self._pending or len(set(versions)) != 1 or self._applying:
                raise RuntimeError(f"use_weights({kind!r}) between steps only: shard versions {list(versions)}, "
                                   f"reports of steps {sorted(self._pending)} pending")
            for i in self.owned:
                self.seg[i]["w"].copy_(self.seg[i][kind])
        return versions
