"""Self-attention by ``attention.kind``: the one place the kind is chosen.

Both architectures compute q, k and v their own way (Wan normalises them and rotates q and k
with RoPE; videodit projects them from the modulated input) and hand them, channels-last
``(B, T, H, W, nh, d)``, to the same dispatch:

- ``self_attention(attn, q, k, v, h)``: a whole clip;
- ``chunked_self_attention(attn, x, qkv, chunk, residual, ...)``: a token-chunked block
  (``runtime.token_chunk``): dense attention over query chunks, ``swin`` whole with its residual
  per chunk, ``dsa``/``neighborhood`` over slabs of frames (``chunking.slabbed_attention``).

``attn`` is the block's attention module; the dispatch reads its ``kind`` (``dense``: SDPA over
all tokens; ``swin``: 3D shifted windows, ``shift`` on every other block; ``neighborhood``: DSA
with offsets fixed at zero; ``dsa``: offsets from the module's ``offsets`` head, an
``OffsetPredictor``), ``window``, ``scale`` (None: ``head_dim ** -0.5``), ``num_heads``,
``head_dim`` and ``backend`` (``attention.backend``: the DSA kernel, see ``kernels``), and ``tau``:
the per-head log-temperature (``attention.learn_temperature``; None without it). With ``tau`` the
dispatch multiplies each head's queries by ``exp(tau_h)`` before the operator, so head h's scores
are ``scale * exp(tau_h) * <q, k>`` whatever the kind and the kernel (none of them changes). A
block of ``attention.dense_blocks`` has kind ``dense``; both dispatches also take ``mix (B,)``,
each sample's weight of dense attention (``attention.dense_above_t``, the curriculum:
``attention_levers``), and blend the dense and the block's kind per sample.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import deformable_slide_attention
from kernels.swin import swin_attention_3d
from megaslide_ray.config import Config
from megaslide_ray.models.attention_levers import blend, rows_of
from megaslide_ray.models.chunking import Chunked, bind, slabbed_attention, token_map

KINDS = ("dense", "swin", "neighborhood", "dsa")


class SelfAttention(Protocol):
    """What the dispatch reads of a block's attention module."""

    kind: str
    window: tuple[int, int, int]
    shift: bool
    scale: float | None
    num_heads: int
    head_dim: int
    backend: str
    offsets: "OffsetPredictor | None"
    tau: "nn.Parameter | None"


def temperature(cfg: Config, num_heads: int) -> nn.Parameter | None:
    """A self-attention's per-head log-temperature (``attention.learn_temperature``), zero: the
    softmax starts as without it. None when the lever is off."""
    return nn.Parameter(torch.zeros(num_heads)) if cfg.attention.learn_temperature else None


def self_attention_parts(cfg: Config, num_heads: int,
                         kind: str | None = None) -> tuple["OffsetPredictor | None", nn.Parameter | None]:
    """What a block's self-attention learns beside its projections: the offset head (``dsa``; the
    block's ``kind``, see ``offset_head``) and the per-head log-temperature
    (``attention.learn_temperature``); None where there is none."""
    return offset_head(cfg, kind), temperature(cfg, num_heads)


@torch.no_grad()
def reset_temperatures(module: nn.Module) -> None:
    """Zero every self-attention temperature (``*.tau``) in ``module``: a fresh shard's softmax is
    the one without the lever (``registry.initialize_shard`` calls it for both architectures)."""
    for name, p in module.named_parameters():
        if name == "tau" or name.endswith(".tau"):
            p.zero_()


def query_gain(attn: SelfAttention) -> torch.Tensor | None:
    """``exp(tau)`` in fp32, ``(nh,)``, or None (no temperature). Computed once per block call:
    a token-chunked block hands it to every chunk as a tensor (one use of ``tau``)."""
    tau = getattr(attn, "tau", None)
    return None if tau is None else torch.exp(tau.to(torch.promote_types(tau.dtype, torch.float32)))


def scale_queries(q: torch.Tensor, gain: torch.Tensor | None) -> torch.Tensor:
    """``q (..., nh, d)`` with head h multiplied by ``gain[h]`` (in fp32 at least, back to ``q``'s
    dtype: a bf16 ``q`` is rounded once)."""
    if gain is None:
        return q
    return (q.to(torch.promote_types(q.dtype, gain.dtype)) * gain[:, None]).to(q.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """SDPA of every token against every token: ``(B, T, H, W, nh, d)`` in and out."""
    B, T, H, W, nh, d = q.shape
    qf, kf, vf = (z.reshape(B, T * H * W, nh, d).transpose(1, 2) for z in (q, k, v))
    o = F.scaled_dot_product_attention(qf, kf, vf, scale=scale)  # (B, nh, N, d)
    return o.transpose(1, 2).reshape(B, T, H, W, nh, d)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: torch.Tensor, offsets,
                     window: tuple[int, int, int], scale: float | None, backend: str = "auto",
                     cond: torch.Tensor | None = None) -> torch.Tensor:
    """3D-DSA of channels-last ``q, k, v (B, T, H, W, nh, d)`` over ``window``: offsets from the
    offset head ``offsets`` applied to ``h`` (and the block's condition ``cond (B, D)``, which a
    head with ``attention.offset_condition`` reads), or zero when there is none (``neighborhood``). The
    operator is told the offsets' bound where it is known (``attention.max_offset > 0``: the
    head bounds them, by ``tanh`` or ``clamp``; zero offsets: 0): the Triton kernels run at that bound,
    a constant of the config, and never measure the offsets (a host sync per call)."""
    if offsets is not None:
        off = offsets(h, cond)
        bound = offsets.max_offset if offsets.max_offset > 0 else None
    else:
        B, T, H, W, nh, _ = q.shape
        off = h.new_zeros(B, T, H, W, nh, window[0] * window[1] * window[2], 3)
        bound = 0.0
    return deformable_slide_attention(q, k, v, off, window, scale=scale, backend=backend, max_offset=bound)


def self_attention(attn: SelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   h: torch.Tensor, cond: torch.Tensor | None = None,
                   mix: torch.Tensor | None = None) -> torch.Tensor:
    """The block's self-attention over a whole clip: ``q, k, v (B, T, H, W, nh, d)`` ->
    ``(B, T, H, W, nh, d)``. ``h (B, T, H, W, D)``: what the offset head reads (``dsa``); ``cond
    (B, D)``: the block's condition vector, which it also reads with ``attention.offset_condition``.
    A block with a temperature (``tau``) has its queries scaled per head here. ``mix (B,)``: each
    sample's weight of dense attention (``attention_levers``; None: none)."""
    q = scale_queries(q, query_gain(attn))
    if attn.kind == "dense" or mix is None:
        return _self_attention(attn, attn.kind, q, k, v, h, cond)

    def run(kind, rows):
        sel = rows_of(rows)
        return _self_attention(attn, kind or attn.kind, sel(q), sel(k), sel(v), sel(h), sel(cond))

    return blend(mix, run)


def _self_attention(attn: SelfAttention, kind: str, q, k, v, h, cond) -> torch.Tensor:
    if kind == "dense":
        return dense_attention(q, k, v, attn.scale)
    if kind == "swin":
        return swin_attention_3d(q, k, v, attn.window, attn.shift, scale=attn.scale)
    # dsa, or neighborhood (no offset head: offsets fixed at zero)
    return window_attention(q, k, v, h, attn.offsets, attn.window, attn.scale, attn.backend, cond)


def chunked_self_attention(attn: SelfAttention, x: torch.Tensor, qkv: torch.Tensor, chunk: int,
                           residual: Callable, offset_input: Callable | None,
                           modulation: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
                           cond: torch.Tensor | None = None, mix: torch.Tensor | None = None) -> torch.Tensor:
    """``_chunked_self_attention`` of the block's kind, or with ``mix (B,)`` (each sample's weight
    of dense attention, ``attention_levers``) the blend of the dense and the block's kind's
    residual streams: ``x + g P(o)`` is affine in ``o``, so this is the stream after the blended
    attention (exactly the one kind's for a sample of weight 0 or 1)."""
    if attn.kind == "dense" or mix is None:
        return _chunked_self_attention(attn, attn.kind, x, qkv, chunk, residual, offset_input, modulation, gates,
                                       cond)

    def run(kind, rows):
        sel = rows_of(rows)
        return _chunked_self_attention(attn, kind or attn.kind, sel(x), sel(qkv), chunk, residual, offset_input,
                                       [sel(m) for m in modulation], [sel(g) for g in gates], sel(cond))

    return blend(mix, run)


def _chunked_self_attention(attn: SelfAttention, kind: str, x: torch.Tensor, qkv: torch.Tensor, chunk: int,
                            residual: Callable, offset_input: Callable | None,
                            modulation: Sequence[torch.Tensor], gates: Sequence[torch.Tensor],
                            cond: torch.Tensor | None = None) -> torch.Tensor:
    """The block's self-attention and the residual stream after it, token-chunked: returns
    ``residual(x_chunk, o_chunk, *gates)`` over the whole grid ``(B, T, H, W, D)``.

    ``x (B, T, H, W, D)``: the block input; ``qkv (B, T, H, W, 3 D)``: q, k, v of every token
    (heads ``(3, nh, d)`` in the last axis), whole. ``residual(xc, o, *gates)``: the stream after
    attention from ``xc`` (tokens of ``x``) and ``o`` (the attention output of those tokens, heads
    merged, before the output projection). ``offset_input(xe, *modulation)``: what the offset
    head reads on frames ``xe`` of ``x`` (``dsa``; with ``attention.offset_condition`` also ``cond (B,
    D)``, the block's condition vector). Dense: query chunks against every key.
    ``swin``: the windows whole, the residual per chunk. ``dsa``/``neighborhood``: slabs of whole
    frames, keys from the slab plus its halo (``chunking.slabbed_attention``)."""
    B, T, H, W, D = x.shape
    nh, hd = attn.num_heads, attn.head_dim
    gain = query_gain(attn)  # a temperature's query scale, applied per chunk (dense) or slab (dsa)
    if kind == "swin":
        q, k, v = qkv.view(B, T, H, W, 3, nh, hd).unbind(4)
        o = swin_attention_3d(scale_queries(q, gain), k, v, attn.window, attn.shift,
                              scale=attn.scale).reshape(B, T, H, W, D)
        return token_map(residual, x, chunk, Chunked(o), *gates)
    if kind == "dense":
        kv = qkv.view(B, T * H * W, 3, nh, hd)[:, :, 1:].transpose(1, 3)  # (B, nh, 2, N, d)

        def dense_chunk(xc, qkvc, kvw, *g):
            qc = qkvc.view(B, -1, 3, nh, hd)[:, :, 0]
            if gain is not None:  # the last extra: the temperature's query scale
                qc, g = scale_queries(qc, g[-1]), g[:-1]
            o = F.scaled_dot_product_attention(qc.transpose(1, 2), kvw[:, :, 0], kvw[:, :, 1], scale=attn.scale)
            return residual(xc, o.transpose(1, 2).reshape(B, -1, D), *g)

        return token_map(dense_chunk, x, chunk, Chunked(qkv), kv, *gates, *(() if gain is None else (gain,)))
    head = attn.offsets  # dsa: the offset head reads the modulated input of the slab's frames
    offsets = None
    if head is not None:
        head_f = bind(head)
        if head.condition != "none":  # the condition goes through each slab's checkpoint with the modulations
            modulation = (*modulation, cond)

            def offsets(xe, *mod):
                return head_f(offset_input(xe, *mod[:-1]), mod[-1])
        else:
            def offsets(xe, *mod):
                return head_f(offset_input(xe, *mod))

    return slabbed_attention(x, qkv, chunk, nh, hd, attn.window, attn.scale,
                             head.max_offset if head is not None else 0.0, offsets, residual,
                             tuple(modulation), tuple(gates), head.halo if head is not None else 0,
                             backend=attn.backend, q_gain=gain)


def reads_queries(attn: SelfAttention) -> bool:
    """Whether the block hands its offset head the queries (``attention.offset_source = query``)
    instead of the attention's input."""
    return attn.offsets is not None and attn.offsets.source == "query"


def offset_head(cfg: Config, kind: str | None = None) -> "OffsetPredictor | None":
    """The offset head a ``dsa`` block's self-attention gets (None for the other kinds; ``kind``:
    the block's, default ``attention.kind``: a block of ``attention.dense_blocks`` has none)."""
    m, a = cfg.model, cfg.attention
    if (kind or a.kind) != "dsa":
        return None
    return OffsetPredictor(m.hidden_size, m.num_heads, tuple(a.window), a.max_offset, a.offset_groups,
                           a.offset_kernel, a.offset_scale, a.offset_condition, a.offset_source, a.offset_bound)


class OffsetPredictor(nn.Module):
    """Depthwise Conv3d (``kernel``, default 3x3x3) -> GELU -> Linear(D -> groups*K*3), last layer zero-initialised so a
    fresh model starts as 3D neighborhood attention. ``groups`` (``attention.offset_groups``; 0:
    one per head) sets of offsets, each shared by ``num_heads / groups`` consecutive heads.
    ``condition`` (``attention.offset_condition``): ``add``, a ``Linear(D -> D)`` of the block's
    condition vector added before the GELU (``cond``); ``gate``, the offsets times ``1 + Linear(D ->
    groups)`` of it (``gate``, zero-initialised: ``reset_output``). ``source``
    (``attention.offset_source``) tells the block what to hand it as ``h``: its attention's input
    (``block``) or its queries (``query``)."""

    def __init__(self, hidden: int, num_heads: int, window: tuple[int, int, int], max_offset: float,
                 groups: int = 0, kernel: tuple[int, int, int] = (3, 3, 3), scale: float = 1.0,
                 condition: str = "none", source: str = "block", bound: str = "tanh"):
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
        if condition not in ("none", "add", "gate"):
            raise ValueError(f"offset condition {condition!r} is not 'none', 'add' or 'gate'")
        self.condition = condition
        if source not in ("block", "query"):
            raise ValueError(f"offset source {source!r} is not 'block' or 'query'")
        self.source = source
        if bound not in ("tanh", "clamp"):
            raise ValueError(f"offset bound {bound!r} is not 'tanh' or 'clamp'")
        self.bound = bound
        # registered after ``out``: the weights drawn before them are those of a head without them
        self.cond = nn.Linear(hidden, hidden) if condition == "add" else None
        self.gate = nn.Linear(hidden, self.groups) if condition == "gate" else None

    @torch.no_grad()
    def reset_output(self) -> None:
        """Zero the layers that make a fresh head predict zero offsets (and a gate of 1)."""
        for lin in (self.out, self.gate):
            if lin is not None:
                nn.init.zeros_(lin.weight)
                nn.init.zeros_(lin.bias)

    def forward(self, h: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        # h: (B, T, H, W, D), cond: (B, D) -> offsets (B, T, H, W, nh, K, 3)
        if self.condition != "none" and cond is None:
            raise ValueError(f"this offset head reads the block's condition (attention.offset_condition="
                             f"{self.condition!r}), but none was given")
        y = self.dwconv(h.permute(0, 4, 1, 2, 3)).permute(0, 2, 3, 4, 1)
        if self.cond is not None:
            y = y + self.cond(cond.to(y.dtype)).view(cond.shape[0], 1, 1, 1, -1)
        y = self.out(F.gelu(y))
        if self.scale != 1.0:
            y = y * self.scale
        y = y.view(*h.shape[:4], self.groups, self.K * 3)
        if self.gate is not None:  # before the bound, so max_offset still holds
            y = y * (1 + self.gate(cond.to(y.dtype))).view(cond.shape[0], 1, 1, 1, self.groups, 1)
        if self.max_offset > 0:
            y = (self.max_offset * torch.tanh(y) if self.bound == "tanh"
                 else torch.clamp(y, -self.max_offset, self.max_offset))
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
