"""The parameter store's side of distillation (``training.distill_weight`` > 0): the dense teacher.

Beside the state, one more flat segment per shard, ``shard_XXXX.teacher``: the frozen weights of
the dense teacher (``models.registry.teacher_config``: the shard without its DSA offset heads) in
the compute dtype (``w_dtype``), ``wb x P_teacher`` bytes (the planner's ``dense teacher`` host
term). The compute actor streams them for one forward without gradients per step, as it streams
``w``: on the same node it maps the segment files (``ShardInfo.paths["teacher"]``), across nodes
it asks ``get_teacher_weights``. Nothing ever writes them after the fill, so they need no version:
any step reads the same bytes.

Crash consistency: the segments are filled with the rest of a fresh state, before
``layout.json`` marks it complete (a store cut while reading the teacher leaves a state nobody
re-attaches to); a re-attached store maps them as they are. Checkpoints do not hold the teacher:
a resumed run's fresh store reads it again from ``training.init_from``
(``megaslide_ray/state/teacher_io.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from megaslide_ray.models.registry import build_shard, distills, teacher_config
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.state.segments import DTYPES, map_segment
from megaslide_ray.state.teacher_io import load_teacher_into


class TeacherMethods:
    """Mixed into ``ParameterStore`` (which sets ``cfg``, ``n``, ``w_dtype``, ``dir``)."""

    def _teacher_layouts(self) -> list[ShardLayout]:
        """The dense teacher's shard layouts (none when the run does not distil)."""
        if not distills(self.cfg):
            return []
        tcfg = teacher_config(self.cfg)
        return [ShardLayout.of(build_shard(tcfg, i, "meta"), i) for i in range(self.n)]

    def _map_teacher(self, attached: bool) -> None:
        """Map (create, or with ``attached`` find again) the teacher's segments."""
        self.teacher_seg = [map_segment(self._path(i, "teacher"), lay.numel, DTYPES[self.w_dtype],
                                        create=not attached) for i, lay in enumerate(self.teacher_layouts)]

    def _fill_teacher(self, source: str | None) -> None:
        """A fresh state's teacher, read from ``source`` (``training.init_from``)."""
        if self.teacher_layouts:
            if not source:
                raise ValueError("training.distill_weight > 0 needs training.init_from, the dense teacher's weights")
            load_teacher_into(self, source)

    def teacher_bytes(self) -> int:
        """Host bytes of the teacher's segments (0 without distillation)."""
        return sum(lay.numel for lay in self.teacher_layouts) * DTYPES[self.w_dtype].itemsize

    def get_teacher_weights(self, shard: int) -> np.ndarray:
        """Object-ref transport: the teacher's bytes of shard ``shard`` (frozen: valid at any step)."""
        return self.teacher_seg[shard].view(torch.uint8).numpy().copy()
