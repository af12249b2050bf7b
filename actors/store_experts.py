"""The parameter store's side of a two-expert model (``training.expert = both``, Wan2.2 A14B).

The store holds both transformers, expert e's shard i at ``e x (L + 2) + i``. Each step trains one
expert (``training.flow.step_expert``, a function of the seed and the step, which the compute
actor computes too): only its shards report gradients, so the step's update is queued once they
have; its norm alone clips it, and its AdamW counts its own steps (``adam_step``: the bias
correction of an expert's k-th update is that of step k). The other expert's shards only move to
the next version (``_pass_shard``): their weights and moments are untouched, no weight decay and
no moment decay on a step they did not take. The learning-rate schedule follows the run's step;
the low-noise expert's peak rate is ``training.low_expert_lr`` where set (``expert_lr_factor``).
"""

from __future__ import annotations

from megaslide_ray.models.registry import expert_shards
from megaslide_ray.training.flow import LOW, expert_steps_before, step_expert


class ExpertMethods:
    """Mixed into ``ParameterStore`` (which sets ``cfg``, ``n``, ``_experts``, ``versions``, ``_lock``)."""

    def step_shards(self, step: int) -> range:
        """The shards step ``step`` trains: all of them, or with two experts
        (``training.expert = both``) those of the step's expert (``step_expert``)."""
        if self._experts == 1:
            return range(self.n)
        per = expert_shards(self.cfg)
        first = step_expert(self.cfg, step) * per
        return range(first, first + per)

    def adam_step(self, step: int) -> int:
        """The 0-based AdamW step count of ``step``'s update: ``step``, or with two experts the
        steps the step's expert took before it (its bias correction counts its own updates)."""
        if self._experts == 1:
            return step
        return expert_steps_before(self.cfg, step, step_expert(self.cfg, step))

    def expert_lr_factor(self, step: int) -> float:
        """The step's learning rate over ``optim.lr``'s schedule: ``training.low_expert_lr / optim.lr``
        on a step of the low-noise expert when it is set, else 1."""
        t = self.cfg.training
        if self._experts == 1 or not t.low_expert_lr or step_expert(self.cfg, step) != LOW:
            return 1.0
        return t.low_expert_lr / self.cfg.optim.lr

    def _pass_shard(self, i: int, step: int) -> None:
        """Step ``step`` did not train shard ``i`` (the other expert's): no gradient reached its
        ``w``, nothing is updated, only its version moves on."""
        with self._lock:
            self.versions[i] = step + 1
            self._lock.notify_all()

