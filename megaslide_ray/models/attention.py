"""Self-attention by ``attention.kind``: the one place the kind is chosen."""

from __future__ import annotations
import torch
import torch.nn as nn
import torch.nn.functional as F
from kernels import deformable_slide_attention


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor, offsets,
                     window: tuple[int, int, int], scale: float | None) -> torch.Tensor:
    """3D-DSA of channels-last ``q, k, v (B, T, H, W, nh, d)`` over ``window``: offsets from the
    offset head ``offsets`` applied to ``h``, or zero when there is none (``neighborhood``). The
    operator is told the offsets' bound where it is known (``attention.max_offset > 0``: the
    head's ``max_offset * tanh``; zero offsets: 0), so the tiled Triton kernel sizes its halo
    without measuring them (a host sync)."""
    if offsets is not None:
        off = offsets(h)
        bound = offsets.max_offset if offsets.max_offset > 0 else None
    else:
        B, T, H, W, nh, _ = q.shape
        off = h.new_zeros(B, T, H, W, nh, window[0] * window[1] * window[2], 3)
        bound = 0.0
    return deformable_slide_attention(q, k, v, off, window, scale=scale, max_offset=bound)


class OffsetPredictor(nn.Module):
    """Depthwise Conv3d (``kernel``, default 3x3x3) -> GELU -> Linear(D -> groups*K*3), last layer zero-initialised so a
    fresh model starts as 3D neighborhood attention. ``groups`` (``attention.offset_groups``; 0:
    one per head) sets of offsets, each shared by ``num_heads / groups`` consecutive heads."""

    def __init__(self, hidden: int, num_heads: int, window: tuple[int, int, int], max_offset: float,
                 groups: int = 0, kernel: tuple[int, int, int] = (3, 3, 3), scale: float = 1.0):
        super().__init__()
        self.num_heads = num_heads
        self.groups = groups or num_heads
        if num_heads % self.groups:
            raise ValueError(f"offset groups {self.groups} do not divide {num_heads} heads")
        self.K = window[0] * window[1] * window[2]
        self.max_offset = max_offset
        self.scale = float(scale)
        kernel = tuple(int(k) for k in kernel)
        self.halo = kernel[0] // 2  # frames the conv reads on either side of a token's own
        self.dwconv = nn.Conv3d(hidden, hidden, kernel_size=kernel, padding=tuple(k // 2 for k in kernel),
                                groups=hidden)
        self.out = nn.Linear(hidden, self.groups * self.K * 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # h: (B, T, H, W, D) -> offsets (B, T, H, W, nh, K, 3)
        y = self.dwconv(h.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)
        y = self.out(F.gelu(y))
        if self.scale != 1.0:
            y = y * self.scale
        if self.max_offset > 0:
            y = self.max_offset * torch.tanh(y)
        y = y.view(*h.shape[:4], self.groups, self.K, 3)
        if self.groups != self.num_heads:
            y = y.repeat_interleave(self.num_heads // self.groups, dim=4)
        return y


def init_streams(module: nn.Module, seed: int, index: int):
    """The generators a shard's init draws from: ``main``, and ``stream_of(submodule)``, which is
    a stream of the offset heads' own inside an ``OffsetPredictor`` and ``main`` elsewhere. So
    every other weight is the same with or without offset heads: dsa and the fixed-window kinds
    start from the same weights per seed (``videodit`` and ``wan`` alike)."""
    main = torch.Generator(device="cpu").manual_seed(_mix(seed, index))
    heads = torch.Generator(device="cpu").manual_seed(_mix(seed, index) ^ 0x0FF5E7)
    in_head = {id(m) for head in module.modules() if isinstance(head, OffsetPredictor) for m in head.modules()}
    return main, (lambda mod: heads if id(mod) in in_head else main)


def _mix(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index * 7919 + 0x5EED) % (2**63 - 1)
