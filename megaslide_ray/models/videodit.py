"""The video Diffusion Transformer (DiT) and its shard layout.

The model is an ordinary ``nn.Module`` and does not know that its weights are streamed: the
compute actor builds it on the ``meta`` device and calls each shard with
``torch.func.functional_call`` on views into a flat weight buffer (see ``shards.py``).

Shards, in execution order:
  0          ``InputEmbed``   video patches + 3D position + timestep + caption -> (x, c)
  1 .. L     ``DiTBlock``     adaLN-Zero transformer block: x, c -> x
  L + 1      ``FinalLayer``   adaLN head: x, c -> per-patch velocity

``c`` is one tensor per sample, so the compute actor can carry it (and sum its gradient) without
knowing what is in it: the adaLN condition ``(B, D)``, then with ``model.cross_attention`` the
caption's tokens ``(B, Lk * D)`` and their key mask ``(B, Lk)`` (1.0: may be attended to), laid
out by ``pack_condition`` and read back by ``split_condition``.

Tokens are kept channels-last, ``x: (B, T, H, W, D)``, the layout 3D-DSA wants.

``model.arch = wan`` selects the Wan 2.x transformer (``models/wan.py``), with the same shard
structure; ``models/registry.py`` builds and initialises the shards of either.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaslide_ray.config import Config
from megaslide_ray.models.attention import (
    chunked_self_attention,
    init_streams,
    reads_queries,
    self_attention,
    self_attention_parts,
)
from megaslide_ray.models.attention_levers import attach_mix, block_kind, mixes, split_mix, whole_model_weights
from megaslide_ray.models.chunking import bind, token_map
from megaslide_ray.models.layers import ffn_width, unpatchify
from megaslide_ray.models.prediction import as_velocity

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation; ``shift, scale: (B, D)`` broadcast over the token grid of ``x``."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return x * (1 + scale.view(shape)) + shift.view(shape)


def gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return x * g.view((x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],))


def sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """(N,) positions -> (N, dim) sin/cos features; ``dim`` even."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=positions.device) / max(half, 1))
    args = positions.float()[:, None] * freqs[None]
    return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)


def pos_embed_3d(grid: tuple[int, int, int], dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 3D sin/cos position encoding, (T, H, W, dim). Channels are split between the
    axes (even counts each); leftover channels stay zero. Not a parameter: nothing to stream."""
    t, h, w = grid
    d_axis = (dim // 3) // 2 * 2
    out = torch.zeros(t, h, w, dim, device=device)
    if d_axis == 0:
        return out
    et = sincos_1d(torch.arange(t, device=device), d_axis)
    eh = sincos_1d(torch.arange(h, device=device), d_axis)
    ew = sincos_1d(torch.arange(w, device=device), d_axis)
    out[..., :d_axis] = et[:, None, None, :]
    out[..., d_axis:2 * d_axis] = eh[None, :, None, :]
    out[..., 2 * d_axis:3 * d_axis] = ew[None, None, :, :]
    return out


def timestep_features(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Flow time t in [0, 1] -> sinusoidal features (B, dim), on the DiT scale of 0..1000."""
    return sincos_1d(t * 1000.0, dim)


# ---------------------------------------------------------------------------------------------
# Shard 0: input side
# ---------------------------------------------------------------------------------------------


class CaptionLayer(nn.Module):
    """One pre-norm transformer layer over a caption's bytes: self-attention among the caption's
    own bytes (padding is never attended to), then an MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.heads = dim // 32 if dim % 32 == 0 and dim >= 64 else 1
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        # x: (B, Lc, D); keys: (B, 1, 1, Lc) bool, the positions each query may attend to
        B, L, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keys)
        x = x + self.out(a.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.norm2(x))


class CaptionEncoder(nn.Module):
    """Bytes -> embedding (+ position) -> ``layers`` self-attention layers -> MLP -> masked mean
    pool -> (B, hidden). Small and built in, so the system needs no text model downloaded from a
    hub. Its input, zero-padded UTF-8 bytes and their lengths, is built by
    ``megaslide_ray.data.captions``.

    The self-attention layers are what let the pooled vector depend on word order: "a red circle
    on a dark blue background" and "a blue circle on a dark red background" hold the same bytes,
    so with ``layers = 0`` (a bag of bytes, this model's first encoder) they are the same
    condition and the model cannot tell the object's colour from the background's. An empty
    caption (length 0) pools to zeros either way: the unconditional input is ``proj``'s bias.

    With ``tokens`` (``model.cross_attention``) it also returns the caption's tokens for the
    blocks' cross-attention: every byte's feature projected to ``hidden``, after a learned null
    token that every caption has (so an empty caption, or a dropped one, still has a key to attend
    to), and their key mask. Returns ``pooled`` or ``(pooled, tokens (B, 1 + Lc, hidden), keys
    (B, 1 + Lc) bool)``."""

    def __init__(self, caption_dim: int, hidden: int, layers: int = 0, max_bytes: int = 128,
                 tokens: bool = False):
        super().__init__()
        self.embed = nn.Embedding(257, caption_dim)  # 0 = padding, byte b -> b + 1
        self.position = nn.Embedding(max_bytes, caption_dim) if layers > 0 else None
        self.layers = nn.ModuleList(CaptionLayer(caption_dim) for _ in range(layers))
        self.mlp = nn.Sequential(nn.Linear(caption_dim, caption_dim), nn.GELU(approximate="tanh"))
        self.proj = nn.Linear(caption_dim, hidden)
        self.token_proj = nn.Linear(caption_dim, hidden) if tokens else None
        self.null_token = nn.Embedding(1, hidden) if tokens else None

    def forward(self, caption: torch.Tensor, caption_len: torch.Tensor):
        # caption: (B, Lc) uint8 bytes; caption_len: (B,)
        B, Lc = caption.shape
        mask = torch.arange(Lc, device=caption.device)[None, :] < caption_len[:, None]  # (B, Lc)
        ids = torch.where(mask, caption.long() + 1, torch.zeros_like(caption, dtype=torch.long))
        e = self.embed(ids)  # (B, Lc, Cd)
        if self.position is not None:
            if Lc > self.position.num_embeddings:
                raise ValueError(f"captions of {Lc} bytes, but the encoder has positions for "
                                 f"{self.position.num_embeddings} (model.caption_max_bytes)")
            pos = self.position.weight
            if Lc != pos.shape[0]:  # batches come padded to caption_max_bytes: this is rare (a slice's
                pos = pos[:Lc]  # backward fills a zero table of the whole size, one more per step)
            e = e + pos.to(e.dtype)
            # an empty caption's queries attend to everything (they are pooled away), never to nothing
            keys = (mask | (caption_len[:, None] <= 0))[:, None, None, :]
            for layer in self.layers:
                e = layer(e, keys)
        e = self.mlp(e)
        m = mask.to(e.dtype)[..., None]
        pooled = self.proj((e * m).sum(1) / m.sum(1).clamp(min=1.0))  # empty caption -> proj's bias
        if self.token_proj is None:
            return pooled
        null = self.null_token.weight.to(e.dtype).expand(B, 1, -1)
        tokens = torch.cat([null, self.token_proj(e)], dim=1)  # (B, 1 + Lc, hidden)
        keys = torch.cat([mask.new_ones(B, 1), mask], dim=1)
        return pooled, tokens, keys


def pack_condition(cond: torch.Tensor, tokens: torch.Tensor | None = None,
                   keys: torch.Tensor | None = None) -> torch.Tensor:
    """``c`` from the adaLN condition ``(B, D)`` and, with cross-attention, the caption's tokens
    ``(B, Lk, D)`` and key mask ``(B, Lk)`` (module docstring)."""
    if tokens is None:
        return cond
    return torch.cat([cond, tokens.flatten(1).to(cond.dtype), keys.to(cond.dtype)], dim=1)


def split_condition(c: torch.Tensor, hidden: int, tokens: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(cond (B, D), tokens (B, Lk, D) or None, keys (B, Lk) bool or None)`` from ``c``;
    ``tokens``: the caller cross-attends, so ``c`` must carry them."""
    if c.shape[1] == hidden:
        if tokens:
            raise ValueError(f"this block cross-attends to caption tokens (model.cross_attention) but its "
                             f"condition of width {hidden} carries none: the input shard was built without "
                             f"model.cross_attention")
        return c, None, None
    lk = (c.shape[1] - hidden) // (hidden + 1)
    if hidden + lk * (hidden + 1) != c.shape[1]:
        raise ValueError(f"condition of width {c.shape[1]} is not D + Lk * (D + 1) for D = {hidden}")
    # split, not slices: its backward concatenates, where each slice's would zero-fill all of c
    cond, tokens, keys = c.split([hidden, lk * hidden, lk], dim=1)
    return cond, tokens.unflatten(1, (lk, hidden)), keys > 0.5


class InputEmbed(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.patch_size = tuple(m.patch_size)
        self.freq_dim = m.timestep_freq_dim
        self.patch = nn.Conv3d(m.in_channels, m.hidden_size, kernel_size=m.patch_size, stride=m.patch_size)
        self.t_mlp = nn.Sequential(nn.Linear(m.timestep_freq_dim, m.hidden_size), nn.SiLU(),
                                   nn.Linear(m.hidden_size, m.hidden_size))
        self.caption = CaptionEncoder(m.caption_dim, m.hidden_size, m.caption_layers, m.caption_max_bytes,
                                      tokens=m.cross_attention)
        self.cfg = cfg  # for the dense weight column of c (attention_levers.attach_mix)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, caption: torch.Tensor,
                caption_len: torch.Tensor, dense_mix: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # x_t: (B, F, Hp, Wp, C) pixels in [-1, 1] (noised); t: (B,); dense_mix (B,): the trainer's
        # dense weights (attention.dense_warmup_steps), None: from t (attention_levers)
        dtype = self.patch.weight.dtype
        x = self.patch(x_t.to(dtype).permute(0, 4, 1, 2, 3))  # (B, D, T, H, W)
        x = x.permute(0, 2, 3, 4, 1)  # (B, T, H, W, D)
        x = x + pos_embed_3d(tuple(x.shape[1:4]), x.shape[-1], x.device).to(dtype)
        cap = self.caption(caption, caption_len)
        pooled, tokens, keys = cap if isinstance(cap, tuple) else (cap, None, None)
        c = self.t_mlp(timestep_features(t, self.freq_dim).to(dtype)) + pooled
        return x, attach_mix(self.cfg, pack_condition(c, tokens, keys), t, dense_mix)


# ---------------------------------------------------------------------------------------------
# Shards 1..L: adaLN-Zero blocks
# ---------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Self-attention over the token grid by ``attention.kind`` (``attention.self_attention``)."""

    def __init__(self, cfg: Config, shift: bool = False, kind: str | None = None):
        super().__init__()
        self.shift = shift  # swin only: odd-numbered blocks use shifted windows
        m, a = cfg.model, cfg.attention
        self.kind = kind or a.kind  # a block of attention.dense_blocks: dense
        self.backend = a.backend
        self.num_heads = m.num_heads
        self.head_dim = m.hidden_size // m.num_heads
        self.window = tuple(a.window)
        self.scale = a.scale if a.scale > 0 else self.head_dim ** -0.5
        self.qkv = nn.Linear(m.hidden_size, 3 * m.hidden_size)
        self.proj = nn.Linear(m.hidden_size, m.hidden_size)
        self.offsets, self.tau = self_attention_parts(cfg, m.num_heads, self.kind)  # dsa offset head, temperature

    def forward(self, h: torch.Tensor, cond: torch.Tensor | None = None, mix: torch.Tensor | None = None
                ) -> torch.Tensor:
        # cond (B, D): the block's adaLN condition, read by an offset head with attention.offset_condition;
        # mix (B,): each sample's weight of dense attention (attention_levers), None: none
        B, T, H, W, D = h.shape
        q, k, v = self.qkv(h).view(B, T, H, W, 3, self.num_heads, self.head_dim).unbind(4)  # (B,T,H,W,nh,d)
        off_in = q.reshape(B, T, H, W, D) if reads_queries(self) else h  # what the offset head reads
        return self.proj(self_attention(self, q, k, v, off_in, cond, mix).reshape(B, T, H, W, D))


class CrossAttention(nn.Module):
    """Video tokens (queries) attend to the caption's tokens (keys, values); padding is masked out
    and every caption has its null token, so no query is left with nothing to attend to. Pre-norm
    (an affine LayerNorm) and residual, without adaLN gating, as in PixArt and Wan; the output
    projection starts at zero, so a fresh block is still the identity plus its gated branches."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.norm = nn.LayerNorm(hidden, eps=1e-6)
        self.q = nn.Linear(hidden, hidden)
        self.kv = nn.Linear(hidden, 2 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def keys_values(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, Lk, D) caption tokens -> keys and values (B, nh, Lk, d)."""
        B, L, _ = tokens.shape
        k, v = self.kv(tokens).view(B, L, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return cross_attend(self.norm, self.q, self.proj, self.num_heads, x, *self.keys_values(tokens), keys)


def cross_attend(norm, q_proj, out_proj, num_heads: int, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 keys: torch.Tensor) -> torch.Tensor:
    """Cross-attention's residual branch for tokens ``x (B, ..., D)`` against the caption's keys
    and values ``(B, nh, Lk, d)`` and key mask ``(B, Lk)``; ``norm, q_proj, out_proj`` are the
    modules or their ``chunking.bind`` forms."""
    B, D = x.shape[0], x.shape[-1]
    q = q_proj(norm(x)).reshape(B, -1, num_heads, D // num_heads).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=keys[:, None, None, :])
    return out_proj(o.transpose(1, 2).reshape(x.shape))


class DiTBlock(nn.Module):
    def __init__(self, cfg: Config, index: int = 1):
        super().__init__()
        D = cfg.model.hidden_size
        hidden = ffn_width(cfg)
        self.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(cfg, shift=index % 2 == 0, kind=block_kind(cfg, index))
        self.cross = CrossAttention(D, cfg.model.num_heads) if cfg.model.cross_attention else None
        self.norm2 = nn.LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(D, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, D))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))
        self.token_chunk = cfg.runtime.token_chunk  # 0: whole clip; else chunked (see chunking.py)
        self.mixes = mixes(cfg)  # c's last column: each sample's weight of dense attention

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c, mix = split_mix(c, self.mixes)
        if self.token_chunk:
            return self._forward_chunked(x, c, mix)
        c, tokens, keys = split_condition(c, x.shape[-1], self.cross is not None)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(c).chunk(6, dim=-1)
        x = x + gate(self.attn(modulate(self.norm1(x), shift_a, scale_a), c, mix), gate_a)
        if self.cross is not None:
            x = x + self.cross(x, tokens, keys)
        x = x + gate(self.mlp(modulate(self.norm2(x), shift_m, scale_m)), gate_m)
        return x

    def _forward_chunked(self, x: torch.Tensor, c: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:
        """``forward`` with ``runtime.token_chunk``: the same function, computed a chunk of
        tokens (per-token parts) or a slab of frames (attention) at a time, each chunk
        checkpointed (``megaslide_ray/models/chunking.py``). q, k, v stay whole."""
        B, T, H, W, D = x.shape
        attn, N = self.attn, self.token_chunk
        c, tokens, keys = split_condition(c, D, self.cross is not None)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.ada(c).chunk(6, dim=-1)
        norm1, norm2 = self.norm1, self.norm2  # no parameters
        qkv_f, proj_f, mlp_f = bind(attn.qkv), bind(attn.proj), bind(self.mlp)

        def qkv_chunk(xc, sh, sc):
            return qkv_f(modulate(norm1(xc), sh, sc))

        qkv = token_map(qkv_chunk, x, N, shift_a, scale_a)  # (B, T, H, W, 3D)
        if reads_queries(attn):  # the queries of the slab's frames and their halo: the first D of q, k, v
            def offset_input(xe, sh, sc):
                return qkv_chunk(xe, sh, sc)[..., :D]
        else:
            def offset_input(xe, sh, sc):
                return modulate(norm1(xe), sh, sc)
        x = chunked_self_attention(attn, x, qkv, N, lambda xc, oc, g: xc + gate(proj_f(oc), g),
                                   offset_input, (shift_a, scale_a), (gate_a,), c, mix)
        del qkv

        if self.cross is None:
            def mlp_chunk(xc, sh, sc, g):
                return xc + gate(mlp_f(modulate(norm2(xc), sh, sc)), g)

            return token_map(mlp_chunk, x, N, shift_m, scale_m, gate_m)
        cr = self.cross  # the caption's keys and values once per block, queries per chunk
        c_norm, c_q, c_out = bind(cr.norm), bind(cr.q), bind(cr.proj)
        k_cap, v_cap = cr.keys_values(tokens)

        def cross_mlp_chunk(xc, kc, vc, km, sh, sc, g):
            xc = xc + cross_attend(c_norm, c_q, c_out, cr.num_heads, xc, kc, vc, km)
            return xc + gate(mlp_f(modulate(norm2(xc), sh, sc)), g)

        return token_map(cross_mlp_chunk, x, N, k_cap, v_cap, keys, shift_m, scale_m, gate_m)


# ---------------------------------------------------------------------------------------------
# Shard L+1: head
# ---------------------------------------------------------------------------------------------


class FinalLayer(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        m = cfg.model
        self.patch_size = tuple(m.patch_size)
        self.channels = m.in_channels
        self.norm = nn.LayerNorm(m.hidden_size, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(m.hidden_size, 2 * m.hidden_size))
        self.linear = nn.Linear(m.hidden_size, math.prod(m.patch_size) * m.in_channels)
        self.mixes = mixes(cfg)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c, _ = split_mix(c, self.mixes)
        shift, scale = self.ada(split_condition(c, x.shape[-1])[0]).chunk(2, dim=-1)
        y = self.linear(modulate(self.norm(x), shift, scale))  # (B, T, H, W, pt*ph*pw*C)
        return unpatchify(y, self.patch_size, self.channels)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class VideoDiT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = InputEmbed(cfg)
        self.blocks = nn.ModuleList(DiTBlock(cfg, i) for i in range(1, cfg.model.depth + 1))
        self.head = FinalLayer(cfg)
        self.prediction = cfg.model.prediction
        self.mixes = mixes(cfg)  # c's last column: each sample's weight of dense attention

    def shards(self) -> list[nn.Module]:
        """Modules in streaming order: input side, each block, head."""
        return [self.embed, *self.blocks, self.head]

    def forward(self, x_t, t, caption, caption_len, dense_mix=None):
        x, c = self.embed(x_t, t, caption, caption_len, dense_mix)
        with whole_model_weights(c, self.mixes):  # c's dense weights read back once, not once per block
            for block in self.blocks:
                x = block(x, c)
        return as_velocity(self.head(x, c), x_t, t, self.prediction)  # always a velocity

    def initialize_weights(self, seed: int) -> None:
        for index, shard in enumerate(self.shards()):
            initialize_shard(shard, seed, index)


CAPTION_EMBED_STD = 1.0
"""Init std of the caption encoder's byte and position embeddings (every other embedding: 0.02).
The encoder's MLP has no norm before it; at GPT's 0.02 its inputs are so small that its GELU is
nearly linear, so a fresh encoder is a bag of bytes plus a near-constant: "a red circle ... dark
blue background" and "a blue circle ... dark red background" differ by 1.7% of the caption
vector, against 9.7% at 1 (tests/test_model.py), and the caption is 170x smaller."""
CAPTION_INPUTS = ("caption.embed", "caption.position")


@torch.no_grad()
def initialize_shard(module: nn.Module, seed: int, index: int) -> None:
    """Deterministic init of one shard from (seed, index), independent of every other shard,
    so a shard-by-shard init equals a whole-model init. DiT recipe: xavier linears, zeroed
    adaLN modulations and output layer (adaLN-Zero), zeroed residual branches of the caption
    encoder's layers and zeroed cross-attention output projections, zeroed offset head (drawn from a stream of
    its own, so the rest of a dsa model equals a neighborhood or swin model of the same seed). Wan shards follow
    Wan's recipe (``wan.initialize_shard``); ``registry.initialize_shard`` picks by architecture."""
    main, stream_of = init_streams(module, seed, index)

    def fill_(p: torch.Tensor, fn) -> None:
        tmp = torch.empty(p.shape, dtype=torch.float32)
        fn(tmp, g)
        p.copy_(tmp)

    for name, mod in module.named_modules():
        g = stream_of(mod)
        if isinstance(mod, nn.Linear):
            bound = math.sqrt(6.0 / (mod.in_features + mod.out_features))
            fill_(mod.weight, lambda t, g, b=bound: t.uniform_(-b, b, generator=g))
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Conv3d):
            fan_in = mod.weight[0].numel()
            fan_out = mod.weight.shape[0] * mod.weight[0, 0].numel()
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            fill_(mod.weight, lambda t, g, b=bound: t.uniform_(-b, b, generator=g))
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            std = CAPTION_EMBED_STD if isinstance(module, InputEmbed) and name in CAPTION_INPUTS else 0.02
            fill_(mod.weight, lambda t, g, s=std: t.normal_(0.0, s, generator=g))
    g = main
    if isinstance(module, InputEmbed):
        for lin in (module.t_mlp[0], module.t_mlp[2]):
            fill_(lin.weight, lambda t, g: t.normal_(0.0, 0.02, generator=g))
    for layer in module.modules():
        if isinstance(layer, CaptionLayer):  # residual branches start at zero: at init the caption
            for lin in (layer.out, layer.mlp[-1]):  # encoder is the bag of bytes plus positions, and
                nn.init.zeros_(lin.weight)  # its output stays as small as the timestep's in ``c``
                nn.init.zeros_(lin.bias)
    if isinstance(module, DiTBlock):
        nn.init.zeros_(module.ada[-1].weight)
        nn.init.zeros_(module.ada[-1].bias)
        if module.cross is not None:
            nn.init.zeros_(module.cross.proj.weight)
            nn.init.zeros_(module.cross.proj.bias)
        if module.attn.offsets is not None:
            module.attn.offsets.reset_output()
    if isinstance(module, FinalLayer):
        for lin in (module.ada[-1], module.linear):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
