"""The dense teacher's forward in the compute actor (``training.distill_weight`` > 0).

Each training step, before the student's forward, the compute actor streams the teacher's
frozen shards (``Transfers.fetch_teacher``: the store's ``teacher`` segments, see
``actors/store_teacher.py``) through a ``ShardFeed`` of their own, 0..L+1 with the usual
prefetch, and runs them without gradients on every micro-batch while each shard's weights are
on the device: nothing is kept but the running activation, and at the end one velocity per
micro-batch (the size of the clip), which the head's loss (``ComputeActor._loss``) compares
with the student's. The teacher's modules are the student's built with dense attention
(``models.registry.teacher_config``): no offset heads, and its own shard layouts.

Staged weights (a GPU, or a simulated link): the teacher's shards go through the staging pool
like the student's, and the buffers of sizes only the teacher has (its blocks are smaller: no
offset heads) are dropped once its forward is done, so the device does not keep
``prefetch_depth + 1`` of them beside the student's for the rest of the step (on CUDA the caching
allocator hands the memory to the student's activations).

Cost per step: one dense forward (no backward, no recompute) and one more crossing of the
teacher's weights over the link (``wb x P_teacher`` bytes, counted in the step's ``h2d_bytes``);
the planner adds both (``megaslide_ray/planning/estimate.py``).
"""

from __future__ import annotations

import torch
from torch.func import functional_call

from megaslide_ray.config import Config
from megaslide_ray.models.prediction import as_velocity
from megaslide_ray.models.registry import build_shard, teacher_config
from megaslide_ray.models.shards import ShardLayout


class DenseTeacher:
    """The teacher's modules (on ``meta``) and layouts, one transformer's ``per_expert`` shards;
    ``student_numels``: the student's shard sizes (staging buffers of those sizes are kept)."""

    def __init__(self, cfg: Config, per_expert: int, student_numels: list[int]):
        tcfg = teacher_config(cfg)
        self.weight = cfg.training.distill_weight
        self.prediction = cfg.model.prediction
        self.modules = [build_shard(tcfg, i, "meta") for i in range(per_expert)]
        self.layouts = [ShardLayout.of(m, i) for i, m in enumerate(self.modules)]
        self.own_sizes = {lay.numel for lay in self.layouts} - set(student_numels)

    def store_numels(self, shards: int) -> list[int]:
        """The teacher's shard sizes over the store's ``shards`` (two experts: the same layouts twice)."""
        return [self.layouts[i % len(self.layouts)].numel for i in range(shards)]

    def _run(self, shard: int, flat: torch.Tensor, *args):
        return functional_call(self.modules[shard], self.layouts[shard].views(flat), args)

    @torch.no_grad()
    def forward(self, feed, micro: list, staging=None) -> list[torch.Tensor]:
        """The teacher's velocity on each micro-batch (``FlowInputs``), its shards taken from
        ``feed`` in order 0..L+1; then the buffers of ``staging`` (a ``StagingPool``) of sizes
        only the teacher's shards have are dropped."""
        w = feed.take(0)
        xs, cs = map(list, zip(*(self._run(0, w, *m.embed_args()) for m in micro)))
        feed.done(w)
        for shard in range(1, len(self.modules)):
            w = feed.take(shard)
            xs = [self._run(shard, w, x, c) for x, c in zip(xs, cs)]
            feed.done(w)
        if staging is not None:
            staging.drop_sizes(self.own_sizes)
        return [as_velocity(x, m.x_t, m.t, self.prediction) for x, m in zip(xs, micro)]
