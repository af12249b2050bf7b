"""The Wan 2.x transformer's layers below its shards (``megaslide_ray/models/wan.py`` puts them
together): diffusers' timestep features, the 3D RoPE tables, the layout of the condition ``c``
(``split_condition``, the clean first frame's ``CLEAN_PARTS``), the float32 norms and which
parameters stay float32 (``KEEP_FP32``, ``cast_like_diffusers``), and the modules under diffusers'
names: the condition embedder (timestep, text, image), the feed-forward, ``WanAttention``
(``attn1``, self-attention by ``attention.kind`` with RoPE; ``attn2``, dense cross-attention)."""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaslide_ray.config import Config
from megaslide_ray.models.attention import reads_queries, self_attention, self_attention_parts

KEEP_FP32 = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
"""diffusers' ``WanTransformer3DModel._keep_in_fp32_modules`` that hold parameters (``rope`` holds
none here): a parameter whose dotted name has one of these as a component stays float32."""

ROPE_THETA = 10000.0
CONDITION_PARTS = 7
"""``c`` starts with ``temb`` (1 x D) and ``timestep_proj`` (6 x D); the text follows."""
CLEAN_PARTS = 14
"""With ``model.clean_first_frame`` (Wan2.2 TI2V-5B from an image) ``c`` starts with ``temb`` and
``timestep_proj`` at the sample's time, then both again at timestep 0 (the first latent frame's)."""


# ---------------------------------------------------------------------------------------------
# Helpers: timestep features, RoPE, the condition tensor, norms
# ---------------------------------------------------------------------------------------------


def timestep_features(timestep: torch.Tensor, dim: int) -> torch.Tensor:
    """diffusers' timestep features on the 0..1000 scale, cos first: ``(B,) -> (B, dim)`` float32."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=timestep.device)
    freqs = torch.exp(exponent / half)
    args = timestep[:, None].float() * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Head channels of the (frames, height, width) rotations; height and width get
    ``2 * (head_dim // 6)`` each, frames the rest."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_tables(grid: Sequence[int], head_dim: int, max_seq_len: int,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 3D rotary angles, each ``(T, H, W, 1, head_dim // 2)`` float32 (one entry
    per channel pair), at the integer positions of the token grid."""
    device = torch.device(device)
    if any(n > max_seq_len for n in grid):
        raise ValueError(f"token grid {tuple(grid)} exceeds the {max_seq_len} rotary positions per axis "
                         f"(model.rope_max_seq_len)")
    dtype = torch.float32 if device.type == "mps" else torch.float64  # as diffusers: float64 but on MPS
    cos, sin = [], []
    for axis, (n, dim) in enumerate(zip(grid, rope_axis_dims(head_dim))):
        freqs = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim))
        angles = torch.outer(torch.arange(n, dtype=dtype, device=device), freqs)  # (n, dim / 2)
        shape = [1, 1, 1, dim // 2]
        shape[axis] = n
        cos.append(angles.cos().float().view(shape).expand(*grid, dim // 2))
        sin.append(angles.sin().float().view(shape).expand(*grid, dim // 2))
    return torch.cat(cos, dim=-1).unsqueeze(3), torch.cat(sin, dim=-1).unsqueeze(3)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs ``(2i, 2i+1)`` of ``x (B, T, H, W, nh, d)``; computed in float32,
    returned in ``x``'s dtype."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def split_condition(c: torch.Tensor, dim: int, parts: int = CONDITION_PARTS
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``c (B, parts D + Lt D)`` -> ``temb (B, D)``, ``timestep_proj (B, 6 D)``, ``text (B, Lt, D)``
    (with ``CLEAN_PARTS``, those of the sample's time; ``clean_condition`` gives timestep 0's)."""
    start = parts * dim
    if c.dim() != 2 or c.shape[1] <= start or (c.shape[1] - start) % dim:
        raise ValueError(f"condition of shape {tuple(c.shape)} is not (B, 7 * {dim} + text tokens * {dim})")
    return c[:, :dim], c[:, dim:CONDITION_PARTS * dim], c[:, start:].unflatten(1, (-1, dim))


def clean_condition(c: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``temb (B, D)`` and ``timestep_proj (B, 6 D)`` at timestep 0 from a ``CLEAN_PARTS`` condition."""
    return c[:, 7 * dim:8 * dim], c[:, 8 * dim:CLEAN_PARTS * dim]


def frame_modulation(table: torch.Tensor, proj: torch.Tensor, proj0: torch.Tensor, frames: int
                     ) -> tuple[torch.Tensor, ...]:
    """``table (1, k, D) + proj`` per token frame, float32, each of the ``k`` parts ``(B, T, 1, 1, D)``:
    frame 0 from ``proj0`` (timestep 0: the clean first frame), the others from ``proj`` (diffusers'
    per-token timesteps of Wan2.2 TI2V with an image, whose mask is 0 on the first latent frame)."""
    B, k, D = proj.shape[0], table.shape[1], table.shape[2]
    m, m0 = table.float() + proj.float().view(B, -1, D), table.float() + proj0.float().view(B, -1, D)  # head: one
    per_frame = torch.cat([m0[:, :, None], m[:, :, None].expand(-1, -1, frames - 1, -1)], dim=2)  # (B, k, T, D)
    return tuple(per_frame[:, i, :, None, None, :] for i in range(k))


def pad_text(text: torch.Tensor, text_len: torch.Tensor, tokens: int) -> torch.Tensor:
    """Zero each prompt past its length and pad to ``tokens`` tokens, as the Wan pipeline does."""
    B, L, _ = text.shape
    if L > tokens:
        raise ValueError(f"text has {L} tokens, more than model.text_len={tokens}")
    keep = torch.arange(L, device=text.device)[None, :] < text_len.to(text.device).view(B, 1)
    text = torch.where(keep[..., None], text, torch.zeros((), dtype=text.dtype, device=text.device))
    return F.pad(text, (0, 0, 0, tokens - L)) if L < tokens else text


def layer_norm32(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Parameter-free LayerNorm computed in float32 (diffusers' ``FP32LayerNorm``, no affine)."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


def _broadcast(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, D) -> (B, 1, ..., 1, D) against channels-last ``x``."""
    return v.view((v.shape[0],) + (1,) * (x.dim() - 2) + (v.shape[-1],))


def keeps_fp32(name: str) -> bool:
    return any(part in KEEP_FP32 for part in name.split("."))


def cast_like_diffusers(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast parameters to ``dtype``, except those diffusers keeps in float32 (``KEEP_FP32``)."""
    for name, p in module.named_parameters():
        p.data = p.data.to(torch.float32 if keeps_fp32(name) else dtype)
    return module


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class FP32LayerNorm(nn.LayerNorm):
    """Affine LayerNorm computed in float32, returned in float32 (the cross-attention ``norm2``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)


class MLP(nn.Module):
    """``linear_1 -> act -> linear_2`` (diffusers' ``TimestepEmbedding`` and ``PixArtAlphaTextProjection``)."""

    def __init__(self, dim_in: int, dim: int, act: nn.Module):
        super().__init__()
        self.linear_1 = nn.Linear(dim_in, dim)
        self.act = act
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEmbedder(nn.Module):
    """diffusers' ``WanImageEmbedding``: the CLIP image states ``(B, Li, image_dim)`` through an
    affine float32 LayerNorm, an exact-GELU MLP (``image_dim -> image_dim -> D``) and another
    float32 LayerNorm (both norms return the input's dtype). FLF2V (``pos_embed_seq_len``): the
    first and last frames' states, stacked along the batch as ``(2 B, Li, image_dim)``, are
    joined per sample into ``(B, 2 Li, image_dim)`` and a learned position added."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int = 0):
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim)  # diffusers' FP32LayerNorm: eps 1e-5, affine
        self.ff = FeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = nn.LayerNorm(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim)) if pos_embed_seq_len else None

    @staticmethod
    def _norm32(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(),
                            norm.eps).to(x.dtype)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if self.pos_embed is not None:
            image = image.reshape(-1, 2 * image.shape[1], image.shape[2]) + self.pos_embed
        return self._norm32(self.norm2, self.ff(self._norm32(self.norm1, image)))


class ConditionEmbedder(nn.Module):
    """Timestep MLP, its projection to the six block modulations, the text MLP, and for an
    image-to-video model (``model.image_dim``) the image embedder."""

    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.time_embedder = MLP(m.timestep_freq_dim, m.hidden_size, nn.SiLU())
        self.time_proj = nn.Linear(m.hidden_size, 6 * m.hidden_size)
        self.text_embedder = MLP(m.text_dim, m.hidden_size, nn.GELU(approximate="tanh"))
        self.image_embedder = (ImageEmbedder(m.image_dim, m.hidden_size, m.pos_embed_seq_len)
                               if m.image_dim else None)


class GELUProjection(nn.Module):
    """``proj`` then GELU (diffusers' ``GELU`` activation module, ``ffn.net.0``): tanh for the
    blocks' feed-forward, exact for the image embedder's."""

    def __init__(self, dim_in: int, dim_out: int, approximate: str = "tanh"):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate=self.approximate)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, dim_out: int | None = None, approximate: str = "tanh"):
        super().__init__()
        self.net = nn.ModuleList([GELUProjection(dim, hidden, approximate), nn.Identity(),
                                  nn.Linear(hidden, dim_out or dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class WanAttention(nn.Module):
    """``attn1`` (``cross=False``: self-attention over the token grid with 3D RoPE, by
    ``attention.kind`` through ``attention.self_attention``) or ``attn2`` (``cross=True``: dense
    cross-attention to the text; with ``model.added_kv_proj_dim``, also to the image tokens,
    through keys and values of their own, ``add_k_proj``/``norm_added_k``/``add_v_proj``, the
    two attentions' outputs summed before ``to_out``)."""

    def __init__(self, cfg: Config, cross: bool, shift: bool = False, kind: str | None = None):
        super().__init__()
        m, a = cfg.model, cfg.attention
        D = m.hidden_size
        self.cross = cross
        self.kind = "dense" if cross else kind or a.kind  # kind: the block's (attention.dense_blocks)
        self.backend = a.backend
        self.shift = shift  # swin only: even-numbered blocks use shifted windows
        self.num_heads = m.num_heads
        self.head_dim = D // m.num_heads
        self.window = tuple(a.window)
        self.scale = a.scale if (a.scale > 0 and not cross) else None  # None: head_dim ** -0.5
        self.rope_max_seq_len = m.rope_max_seq_len
        self.to_q = nn.Linear(D, D)
        self.to_k = nn.Linear(D, D)
        self.to_v = nn.Linear(D, D)
        self.to_out = nn.ModuleList([nn.Linear(D, D), nn.Identity()])  # [1]: diffusers' dropout
        self.norm_q = nn.RMSNorm(D, eps=m.eps)
        self.norm_k = nn.RMSNorm(D, eps=m.eps)
        self.offsets, self.tau = (None, None) if cross else self_attention_parts(cfg, m.num_heads, self.kind)
        if cross and m.added_kv_proj_dim:
            self.add_k_proj = nn.Linear(m.added_kv_proj_dim, D)
            self.add_v_proj = nn.Linear(m.added_kv_proj_dim, D)
            self.norm_added_k = nn.RMSNorm(D, eps=m.eps)
        else:
            self.add_k_proj = self.add_v_proj = self.norm_added_k = None

    def image_kv(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The image tokens' keys and values, ``(B, Li, nh, d)`` each."""
        return (self._heads(self.norm_added_k(self.add_k_proj(image))), self._heads(self.add_v_proj(image)))

    def _heads(self, z: torch.Tensor) -> torch.Tensor:
        return z.unflatten(-1, (self.num_heads, self.head_dim))

    def forward(self, h: torch.Tensor, text: torch.Tensor | None = None,
                temb: torch.Tensor | None = None, image: torch.Tensor | None = None,
                mix: torch.Tensor | None = None) -> torch.Tensor:
        # temb (B, D): the timestep embedding, read by an offset head with attention.offset_condition
        # mix (B,): each sample's weight of dense self-attention (attention_levers), None: none
        # image (B, Li, D): the embedded image tokens (cross-attention of an image-to-video model)
        B, T, H, W, D = h.shape
        src = text if self.cross else h
        q = self._heads(self.norm_q(self.to_q(h)))  # (B, T, H, W, nh, d)
        k = self._heads(self.norm_k(self.to_k(src)))
        v = self._heads(self.to_v(src))
        if self.cross:  # keys and values: (B, Lt, nh, d)
            q = q.reshape(B, T * H * W, self.num_heads, self.head_dim)
            o = self._sdpa(q, k, v)
            if image is not None:
                o = o + self._sdpa(q, *self.image_kv(image))
        else:
            cos, sin = rope_tables((T, H, W), self.head_dim, self.rope_max_seq_len, h.device)
            off_in = q.flatten(-2) if reads_queries(self) else h  # what the offset head reads (queries before RoPE)
            o = self_attention(self, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, off_in, temb, mix)
        return self.to_out[0](o.reshape(B, T, H, W, D))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, N, nh, d) queries against (B, M, nh, d) keys and values -> (B, N, nh, d)."""
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=self.scale)
        return o.transpose(1, 2)
