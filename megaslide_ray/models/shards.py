"""Flat shard layout: one contiguous buffer per shard, and views that rebuild its tensors.

Why flat: a shard moves host<->device as one copy, AdamW runs over one vector, and a shared-
memory segment per shard per kind is a single file. Tensor views into the buffer give the
module its parameters without copies (``torch.func.functional_call``), and the gradient of
the flat leaf is the flat gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ShardLayout:
    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int

    @classmethod
    def of(cls, module: nn.Module, index: int) -> "ShardLayout":
        names, shapes, offsets = [], [], []
        off = 0
        for name, p in module.named_parameters():
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(off)
            off += math.prod(p.shape)
        return cls(index, tuple(names), tuple(shapes), tuple(offsets), off)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """name -> view of ``flat`` with the parameter's shape (no copy)."""
        if flat.numel() != self.numel:
            raise ValueError(f"shard {self.index}: flat buffer has {flat.numel()} elements, layout needs {self.numel}")
        return {n: flat[o:o + math.prod(s)].view(s) for n, s, o in zip(self.names, self.shapes, self.offsets)}

    def flatten_into(self, module: nn.Module, flat: torch.Tensor) -> None:
        """Copy the module's parameters into ``flat`` (in layout order)."""
        views = self.views(flat)
        with torch.no_grad():
            for name, p in module.named_parameters():
                views[name].copy_(p.detach().reshape(views[name].shape))


def resident_shards(depth: int, numels: list[int], wbytes: int, budget_bytes: float) -> list[int]:
    """The shards kept on the device from their forward to their backward within ``budget_bytes``
    (``runtime.resident_gb``): blocks ``depth - 1, depth - 2, ...``, then shard 0, in that order
    while their weights (``numels[i] x wbytes``) fit. Block ``depth``, the turn's, is kept anyway
    and not counted; the head is not fetched in the backward. The compute actor keeps these and
    the planner counts them."""
    out = []
    for shard in range(depth - 1, -1, -1):
        budget_bytes -= numels[shard] * wbytes
        if budget_bytes < 0:
            break
        out.append(shard)
    return out


def grad_slot_numel(largest: int, slot_mb: float, itemsize: int) -> int:
    """Elements of one gradient slot (``runtime.grad_slot_mb``): ``slot_mb`` MB of ``itemsize``-byte
    elements, at most ``largest`` (the largest shard); ``slot_mb = 0``: ``largest``."""
    if slot_mb <= 0:
        return largest
    return max(1, min(largest, int(slot_mb * 1e6) // itemsize))


def prefetch_window(device: Sequence[bool], pos: int, depth: int) -> list[int]:
    """The positions whose fetches are in flight while position ``pos`` computes: the next
    ``depth`` after it, passing over device shards' positions (``device[p]``: they fetch nothing).
    ``actors.transfer.ShardFeed`` stages by this rule, and the planner's replay
    (``planning/schedule.py``) models it."""
    out, p = [], pos + 1
    while len(out) < depth and p < len(device):
        if not device[p]:
            out.append(p)
        p += 1
    return out
