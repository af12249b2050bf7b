"""The Wan 2.x video transformer (``model.arch = wan``), in this project's shard layout.

The model of diffusers' ``WanTransformer3DModel`` (Wan2.1 T2V 1.3B and 14B, Wan2.2 TI2V-5B used
as text-to-video), written again for streaming: the same parameters under the same names and the
same arithmetic, so diffusers weights load as they are and give diffusers' outputs
(``tests/test_wan.py`` holds the two side by side). Tokens are channels-last,
``x: (B, T, H, W, D)``, the layout 3D-DSA wants.

Shards, in execution order (the interface of ``megaslide_ray/models/videodit.py``'s shards, so the compute
actor and the parameter store treat both architectures alike):

  0          ``WanEmbed``  ``patch_embedding`` (Conv3d over the latents) and ``condition_embedder``
             (timestep MLP ``time_embedder``, ``time_proj`` to six modulations, text MLP
             ``text_embedder``). ``forward(x_t, t, text, text_len) -> (x, c)``: ``x_t (B, F, H, W, C)``
             channels-last latents, ``t (B,)`` flow time in [0, 1] (diffusers' timestep is
             ``1000 * t``), ``text (B, L, text_dim)`` prompt embeddings, ``text_len (B,)`` their lengths.
  1 .. L     ``WanBlock``  self-attention ``attn1`` (3D RoPE, ``attention.kind``), cross-attention
             ``attn2`` to the text (always dense), feed-forward ``ffn``, modulated by
             ``scale_shift_table + c``: ``forward(x, c) -> x``.
  L + 1      ``WanHead``   ``norm_out`` (no parameters), ``scale_shift_table``, ``proj_out``:
             ``forward(x, c) -> (B, F, H, W, C_out)`` channels-last.

**The condition ``c``** is one tensor ``(B, 7 D + Lt D)``, concatenated in this order:
``temb`` (D, the timestep embedding; the head's modulation), ``timestep_proj`` (6 D, the blocks'
modulation), the projected text ``(Lt, D)`` flattened (the blocks' cross-attention keys and
values come from it). ``Lt`` is ``model.text_len``: ``WanEmbed.forward`` zeroes each prompt past
``text_len`` and pads it with zeros to ``model.text_len`` tokens, as the Wan pipeline does; no mask
is applied. Blocks and head read what they need back out of ``c`` (``split_condition``), so its
gradient, summed over the shards by the compute actor, flows back to shard 0.

**Names.** Shard 0's parameters are ``patch_embedding.*`` and ``condition_embedder.*``; a block's
are named as inside diffusers' ``blocks.{i}`` (``scale_shift_table``, ``attn1.to_q.weight``,
``norm2.weight``, ``ffn.net.0.proj.weight``, ...); the head's are ``scale_shift_table`` and
``proj_out.*``. With ``attention.kind = dsa`` each block adds the offset head
``attn1.offsets.{dwconv,out}.*`` (``model.OffsetPredictor``), which diffusers does not have.
``WanTransformer``, the whole model, has exactly diffusers' names.

**Image-to-video** (Wan2.1 I2V / FLF2V: ``model.image_dim``, ``added_kv_proj_dim``,
``pos_embed_seq_len``). ``x_t`` has ``in_channels = 2 z + 4`` channels, the noisy latents, the
4-channel mask and the image latents concatenated (the caller does it, as diffusers' pipeline
does). Shard 0 also takes the CLIP image states ``image (B, Li, image_dim)``; its
``condition_embedder.image_embedder`` embeds them and ``c`` carries the ``Li`` image tokens
between ``timestep_proj`` and the text: ``(B, 7 D + (Li + Lt) D)``. Each block reads the last
``model.text_len`` tokens as the text and those before as the image (diffusers splits at 512
the same way) and its cross-attention adds the attention to the image keys/values
(``attn2.add_k_proj``, ``norm_added_k``, ``add_v_proj``). Wan2.2 I2V-A14B has no image embedder:
only the wider input.

**RoPE and local attention.** diffusers' 3D rotary embedding (float64 angles, float32 tables,
recomputed per block from the grid) rotates q and k at their integer positions after the q/k RMS
norms; ``dsa``, ``neighborhood`` and ``swin`` take the rotated q and k, so 3D-DSA samples
*rotated* keys (a fractional sample blends its neighbours' rotated keys). With zero offsets this
is exactly Wan's attention restricted to the window (the window the grid: Wan's dense attention).

**Precision.** diffusers keeps ``rope``, ``time_embedder``, ``scale_shift_table`` and
``norm1/2/3`` in float32 (``KEEP_FP32``); this module computes the layer norms, the modulation
(``scale_shift_table + c``), the residual sums and the RoPE tables in float32 whatever the
weights' dtype, so a bf16 model (``cast_like_diffusers``) gives diffusers' bf16 results. The
parameter store holds one dtype per shard, so in a streamed bf16 run those few parameters are
bf16 too (the arithmetic is still float32).

The helpers and modules under the shards (RoPE, the condition's layout, the float32 norms,
``KEEP_FP32`` and ``cast_like_diffusers``, the embedders, ``WanAttention``):
``megaslide_ray/models/wan_layers.py``. A diffusers folder in and out (``from_diffusers``,
``wan_config_from_diffusers``, ``diffusers_config``): ``megaslide_ray/models/wan_diffusers.py``.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaslide_ray.config import Config
from megaslide_ray.models.attention import chunked_self_attention, init_streams, reads_queries
from megaslide_ray.models.attention_levers import attach_mix, block_kind, mixes, split_mix, whole_model_weights
from megaslide_ray.models.chunking import Chunked, bind, token_map
from megaslide_ray.models.layers import ffn_width, first_frame_timesteps, unpatchify
from megaslide_ray.models.wan_layers import (
    CLEAN_PARTS,
    CONDITION_PARTS,
    ConditionEmbedder,
    FeedForward,
    FP32LayerNorm,
    WanAttention,
    _broadcast,
    apply_rope,
    clean_condition,
    frame_modulation,
    layer_norm32,
    pad_text,
    rope_tables,
    split_condition,
    timestep_features,
)


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


def embed_inputs(patch_embedding: nn.Conv3d, condition_embedder: ConditionEmbedder, freq_dim: int,
                 x_t: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                 image: torch.Tensor | None = None, clean_first_frame: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard 0's computation on diffusers' timestep scale and unpadded text: ``(x, c)``. ``image``
    (an image-to-video model's CLIP states) is embedded and its tokens go before the text's in
    ``c``, as diffusers concatenates them. ``clean_first_frame``: ``temb`` and ``timestep_proj``
    at timestep 0 follow those of ``timestep`` (``CLEAN_PARTS``)."""
    x = patch_embedding(x_t.to(patch_embedding.weight.dtype).permute(0, 4, 1, 2, 3))
    x = x.permute(0, 2, 3, 4, 1).contiguous()  # (B, T, H, W, D)
    ce = condition_embedder
    if (image is None) != (ce.image_embedder is None):
        raise ValueError("an image-to-video Wan model (model.image_dim > 0) needs the CLIP image states of its "
                         "first frame (encoder_hidden_states_image)" if image is None else
                         "CLIP image states given to a Wan model without an image embedder (model.image_dim = 0)")
    text = text.to(ce.text_embedder.linear_1.weight.dtype)
    features = timestep_features(timestep, freq_dim).to(ce.time_embedder.linear_1.weight.dtype)
    temb = ce.time_embedder(features).to(text.dtype)
    proj = ce.time_proj(F.silu(temb))
    ctx = ce.text_embedder(text)
    parts = [temb, proj.to(temb.dtype)]
    if clean_first_frame:  # timestep 0, the clean first latent frame's
        features0 = timestep_features(torch.zeros_like(timestep), freq_dim).to(features.dtype)
        temb0 = ce.time_embedder(features0).to(text.dtype)
        parts += [temb0, ce.time_proj(F.silu(temb0)).to(temb0.dtype)]
    if image is not None:
        parts.append(ce.image_embedder(image.to(ce.image_embedder.ff.net[0].proj.weight.dtype)).flatten(1)
                     .to(temb.dtype))
    return x, torch.cat(parts + [ctx.flatten(1).to(temb.dtype)], dim=1)


def head_output(scale_shift_table: torch.Tensor, proj_out: nn.Linear, patch: tuple[int, int, int], eps: float,
                x: torch.Tensor, c: torch.Tensor, parts: int = CONDITION_PARTS) -> torch.Tensor:
    """The head's computation: ``(B, T, H, W, D) -> (B, F, H, W, C_out)``."""
    D = x.shape[-1]
    temb, _, _ = split_condition(c, D, parts)
    if parts == CLEAN_PARTS:
        shift, scale = frame_modulation(scale_shift_table, temb, clean_condition(c, D)[0], x.shape[1])
    else:
        shift, scale = (_broadcast(z, x) for z in (scale_shift_table.float() + temb.float()[:, None, :]).unbind(1))
    y = (layer_norm32(x, eps) * (1 + scale) + shift).to(x.dtype)
    y = proj_out(y)
    return unpatchify(y, patch, y.shape[-1] // math.prod(patch))


class WanEmbed(nn.Module):
    """Shard 0. ``patch_embedding`` / ``condition_embedder`` may be given (``WanTransformer.shards``
    passes its own, so the shard shares the whole model's parameters)."""

    arch = "wan"

    def __init__(self, cfg: Config, patch_embedding: nn.Conv3d | None = None,
                 condition_embedder: ConditionEmbedder | None = None):
        super().__init__()
        m = cfg.model
        self.freq_dim = m.timestep_freq_dim
        self.text_len = m.text_len
        self.clean_first_frame = m.clean_first_frame
        self.patch_embedding = (patch_embedding if patch_embedding is not None else
                                nn.Conv3d(m.in_channels, m.hidden_size, kernel_size=m.patch_size, stride=m.patch_size))
        self.condition_embedder = condition_embedder if condition_embedder is not None else ConditionEmbedder(cfg)
        self.cfg = cfg  # for the dense weight column of c (attention_levers.attach_mix)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, text_len: torch.Tensor,
                image: torch.Tensor | None = None, dense_mix: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, c = embed_inputs(self.patch_embedding, self.condition_embedder, self.freq_dim, x_t, t * 1000.0,
                            pad_text(text, text_len, self.text_len), image, self.clean_first_frame)
        return x, attach_mix(self.cfg, c, t, dense_mix)  # dense_mix: the trainer's (attention_levers)


class WanBlock(nn.Module):
    """Shards 1..L: diffusers' ``WanTransformerBlock`` on channels-last tokens."""

    arch = "wan"

    def __init__(self, cfg: Config, index: int = 1):
        super().__init__()
        m = cfg.model
        D = m.hidden_size
        self.eps = m.eps
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, D) / D ** 0.5)
        self.attn1 = WanAttention(cfg, cross=False, shift=index % 2 == 0, kind=block_kind(cfg, index))
        self.attn2 = WanAttention(cfg, cross=True)
        self.norm2 = FP32LayerNorm(D, eps=m.eps) if m.cross_attn_norm else None
        self.ffn = FeedForward(D, ffn_width(cfg))
        self.token_chunk = cfg.runtime.token_chunk  # 0: whole clip; else chunked (see chunking.py)
        self.text_len = m.text_len
        self.parts = CLEAN_PARTS if m.clean_first_frame else CONDITION_PARTS
        self.mixes = mixes(cfg)  # c's last column: each sample's weight of dense attention

    def context(self, ctx: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The cross-attention's ``(image, text)`` tokens: with image keys/values, ``ctx``'s last
        ``model.text_len`` tokens are the text and those before them the image (diffusers splits
        the same way, at 512 text tokens); else all of it is text and the image None."""
        if self.attn2.add_k_proj is None:
            return None, ctx
        if ctx.shape[1] <= self.text_len:
            raise ValueError(f"the condition holds {ctx.shape[1]} tokens, no image tokens before the "
                             f"model.text_len={self.text_len} text tokens (an image-to-video model)")
        return ctx[:, :-self.text_len], ctx[:, -self.text_len:]

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c, mix = split_mix(c, self.mixes)
        if self.token_chunk:
            return self._forward_chunked(x, c, mix)
        B, D = x.shape[0], x.shape[-1]
        temb, proj, ctx = split_condition(c, D, self.parts)
        image, text = self.context(ctx)
        if self.parts == CLEAN_PARTS:  # the first token frame at timestep 0
            mods = frame_modulation(self.scale_shift_table, proj, clean_condition(c, D)[1], x.shape[1])
        else:
            mods = (_broadcast(z, x) for z in (self.scale_shift_table.float() + proj.float().view(B, 6, D)).unbind(1))
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mods
        h = (layer_norm32(x, self.eps) * (1 + scale_a) + shift_a).to(x.dtype)
        x = (x.float() + self.attn1(h, temb=temb, mix=mix) * gate_a).to(x.dtype)
        h = self.norm2(x).to(x.dtype) if self.norm2 is not None else x
        x = x + self.attn2(h, text, image=image)
        h = (layer_norm32(x, self.eps) * (1 + scale_f) + shift_f).to(x.dtype)
        return (x.float() + self.ffn(h).float() * gate_f).to(x.dtype)

    def _forward_chunked(self, x: torch.Tensor, c: torch.Tensor, mix: torch.Tensor | None) -> torch.Tensor:
        """``forward`` with ``runtime.token_chunk``: self-attention's projections, norms and RoPE
        over chunks of tokens, its attention over query chunks (dense) or slabs of frames (dsa,
        neighborhood; swin stays whole), cross-attention and feed-forward together over chunks
        of tokens, each chunk checkpointed (``megaslide_ray/models/chunking.py``). The rotated q, k and
        v stay whole, and so do the text's keys and values (computed once per block)."""
        B, T, H, W, D = x.shape
        N, eps, dtype = self.token_chunk, self.eps, x.dtype
        a1, a2 = self.attn1, self.attn2
        nh, hd = a1.num_heads, a1.head_dim
        temb, proj, ctx = split_condition(c, D)
        image, text = self.context(ctx)
        mod = self.scale_shift_table.float() + proj.float().view(B, 6, D)
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = mod.unbind(1)  # (B, D) each
        q1, k1, v1, qn1, kn1 = (bind(m) for m in (a1.to_q, a1.to_k, a1.to_v, a1.norm_q, a1.norm_k))
        out1, out2, q2, qn2, ffn = (bind(m) for m in (a1.to_out[0], a2.to_out[0], a2.to_q, a2.norm_q, self.ffn))
        norm2 = bind(self.norm2) if self.norm2 is not None else None

        def modulated(xc, sh, sc):  # (B, D) modulations against (B, ..., D) tokens
            return (layer_norm32(xc, eps) * (1 + _broadcast(sc, xc)) + _broadcast(sh, xc)).to(dtype)

        def qkv_chunk(xc, cos, sin, sh, sc):
            h = modulated(xc, sh, sc)
            q = apply_rope(qn1(q1(h)).unflatten(-1, (nh, hd)), cos, sin)
            k = apply_rope(kn1(k1(h)).unflatten(-1, (nh, hd)), cos, sin)
            return torch.cat([q.flatten(-2), k.flatten(-2), v1(h)], dim=-1)

        cos, sin = rope_tables((T, H, W), hd, a1.rope_max_seq_len, x.device)
        qkv = token_map(qkv_chunk, x, N, Chunked(cos, batched=False), Chunked(sin, batched=False),
                        shift_a, scale_a)  # (B, T, H, W, 3D), q and k rotated

        def residual(xc, o, g):
            return (xc.float() + out1(o) * _broadcast(g, xc)).to(dtype)

        if reads_queries(a1):  # the offset head reads the (unrotated) queries of the slab's frames and halo
            def offset_input(xe, sh, sc):
                return qn1(q1(modulated(xe, sh, sc)))
        else:
            offset_input = modulated
        x = chunked_self_attention(a1, x, qkv, N, residual, offset_input, (shift_a, scale_a), (gate_a,), temb, mix)
        del qkv
        k_text = a2.norm_k(a2.to_k(text)).unflatten(-1, (nh, hd))  # (B, Lt, nh, d): once per block
        v_text = a2.to_v(text).unflatten(-1, (nh, hd))
        kv_image = a2.image_kv(image) if image is not None else ()  # (B, Li, nh, d) each, once per block

        def cross_ffn_chunk(xc, kt, vt, sh, sc, g, *kvi):
            h = norm2(xc).to(dtype) if norm2 is not None else xc
            q = qn2(q2(h)).unflatten(-1, (nh, hd))
            o = a2._sdpa(q, kt, vt)
            if kvi:
                o = o + a2._sdpa(q, *kvi)
            xc = xc + out2(o.flatten(-2))
            return (xc.float() + ffn(modulated(xc, sh, sc)).float() * _broadcast(g, xc)).to(dtype)

        return token_map(cross_ffn_chunk, x, N, k_text, v_text, shift_f, scale_f, gate_f, *kv_image)


class WanHead(nn.Module):
    """Shard L+1: output norm, modulation, projection and unpatchify. ``scale_shift_table`` /
    ``proj_out`` may be given (see ``WanEmbed``)."""

    arch = "wan"

    def __init__(self, cfg: Config, scale_shift_table: torch.Tensor | None = None, proj_out: nn.Linear | None = None):
        super().__init__()
        m = cfg.model
        D = m.hidden_size
        self.patch_size = tuple(m.patch_size)
        self.eps = m.eps
        self.parts = CLEAN_PARTS if m.clean_first_frame else CONDITION_PARTS
        self.scale_shift_table = (scale_shift_table if scale_shift_table is not None
                                  else nn.Parameter(torch.randn(1, 2, D) / D ** 0.5))
        out = (m.out_channels or m.in_channels) * math.prod(m.patch_size)
        self.proj_out = proj_out if proj_out is not None else nn.Linear(D, out)
        self.mixes = mixes(cfg)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        c = split_mix(c, self.mixes)[0]
        return head_output(self.scale_shift_table, self.proj_out, self.patch_size, self.eps, x, c, self.parts)


class WanTransformer(nn.Module):
    """The whole model, with exactly diffusers' parameter names (``scale_shift_table``,
    ``patch_embedding``, ``condition_embedder``, ``blocks``, ``proj_out``); ``shards()`` gives
    the streamed shards as modules sharing these parameters.

    ``forward(x_t, t, text, text_len)`` is the shards' interface (channels-last latents, flow time
    in [0, 1]); ``forward_diffusers`` is diffusers' (``from_diffusers`` returns a module whose
    ``forward`` it is)."""

    def __init__(self, cfg: Config):
        super().__init__()
        if cfg.model.arch != "wan":
            raise ValueError(f"model.arch={cfg.model.arch!r}: WanTransformer needs model.arch='wan'")
        self.cfg = cfg
        embed, head = WanEmbed(cfg), WanHead(cfg)
        self.scale_shift_table = head.scale_shift_table
        self.patch_embedding = embed.patch_embedding
        self.condition_embedder = embed.condition_embedder
        self.blocks = nn.ModuleList(WanBlock(cfg, i) for i in range(1, cfg.model.depth + 1))
        self.proj_out = head.proj_out

    def shards(self) -> list[nn.Module]:
        """Modules in streaming order (input side, each block, head), on this model's parameters."""
        return [WanEmbed(self.cfg, self.patch_embedding, self.condition_embedder), *self.blocks,
                WanHead(self.cfg, self.scale_shift_table, self.proj_out)]

    def _run(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        with whole_model_weights(c, mixes(self.cfg)):  # c's dense weights read back once, not once per block
            for block in self.blocks:
                x = block(x, c)
        m = self.cfg.model
        return head_output(self.scale_shift_table, self.proj_out, tuple(m.patch_size), m.eps, x,
                           split_mix(c, mixes(self.cfg))[0], CLEAN_PARTS if m.clean_first_frame else CONDITION_PARTS)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, text_len: torch.Tensor,
                image: torch.Tensor | None = None, dense_mix: torch.Tensor | None = None) -> torch.Tensor:
        m = self.cfg.model
        x, c = embed_inputs(self.patch_embedding, self.condition_embedder, m.timestep_freq_dim, x_t, t * 1000.0,
                            pad_text(text, text_len, m.text_len), image, m.clean_first_frame)
        return self._run(x, attach_mix(self.cfg, c, t, dense_mix))

    def forward_diffusers(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                          encoder_hidden_states: torch.Tensor,
                          encoder_hidden_states_image: torch.Tensor | None = None) -> torch.Tensor:
        """``WanTransformer3DModel(...)(hidden_states, timestep, encoder_hidden_states,
        encoder_hidden_states_image, return_dict=False)[0]``: ``(B, C, F, H, W)`` latents (an
        image-to-video model's: noise, mask and image latents), ``(B,)`` timesteps on the 0..1000
        scale, ``(B, L, text_dim)`` text (used as given: not padded; an image-to-video model needs
        ``L = model.text_len``, as diffusers' needs 512), the CLIP image states ``(B, Li,
        image_dim)`` -> ``(B, C_out, F, H, W)``."""
        m = self.cfg.model
        if timestep.dim() == 2 and m.clean_first_frame:
            timestep = first_frame_timesteps(timestep, hidden_states.shape[2] // m.patch_size[0])
        if timestep.dim() != 1:
            raise ValueError(f"timestep of shape {tuple(timestep.shape)}: per-token timesteps are read only with "
                             f"model.clean_first_frame (Wan2.2 TI2V from an image); one per sample (B,) otherwise")
        if m.added_kv_proj_dim and encoder_hidden_states.shape[1] != m.text_len:
            raise ValueError(f"the text has {encoder_hidden_states.shape[1]} tokens: an image-to-video model reads "
                             f"model.text_len={m.text_len} (the image tokens are those before them); pad it")
        x, c = embed_inputs(self.patch_embedding, self.condition_embedder, m.timestep_freq_dim,
                            hidden_states.permute(0, 2, 3, 4, 1), timestep, encoder_hidden_states,
                            encoder_hidden_states_image, m.clean_first_frame)
        return self._run(x, attach_mix(self.cfg, c, timestep / 1000.0)).permute(0, 4, 1, 2, 3).contiguous()

    def initialize_weights(self, seed: int) -> None:
        for index, shard in enumerate(self.shards()):
            initialize_shard(shard, seed, index)


# ---------------------------------------------------------------------------------------------
# Shard initialisation (``registry.initialize_shard`` dispatches here)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def initialize_shard(module: nn.Module, seed: int, index: int) -> None:
    """Deterministic init of one Wan shard from ``(seed, index)`` alone (every parameter is set),
    after Wan's own recipe: xavier-uniform linears with zero biases, the patch embedding xavier
    over its flattened kernel, normal(0, 0.02) timestep and text MLPs, ``scale_shift_table``
    normal / sqrt(D), unit norms, a zero output projection; the DSA offset head as in
    ``megaslide_ray.models.videodit`` (its last layer zero: a fresh model starts as neighborhood attention;
    drawn from a stream of its own, so every other weight is the same with or without it)."""
    main, stream_of = init_streams(module, seed, index)
    g = main

    def fill_(p: torch.Tensor, fn) -> None:
        tmp = torch.empty(p.shape, dtype=torch.float32)
        fn(tmp)
        p.copy_(tmp)

    def xavier_(p: torch.Tensor, fan_in: int, fan_out: int) -> None:
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        fill_(p, lambda t: t.uniform_(-bound, bound, generator=g))

    def normal_(p: torch.Tensor, std: float) -> None:
        fill_(p, lambda t: t.normal_(0.0, std, generator=g))

    for name, mod in module.named_modules():
        g = stream_of(mod)
        if isinstance(mod, nn.Linear):
            if ".time_embedder." in f".{name}." or ".text_embedder." in f".{name}.":
                normal_(mod.weight, 0.02)
            else:
                xavier_(mod.weight, mod.in_features, mod.out_features)
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Conv3d):
            fan_in = mod.weight[0].numel()
            fan_out = mod.weight.shape[0] * (1 if mod.groups == 1 else mod.weight[0, 0].numel())
            xavier_(mod.weight, fan_in, fan_out)
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, (nn.RMSNorm, nn.LayerNorm)):
            if mod.weight is not None:
                nn.init.ones_(mod.weight)
            if getattr(mod, "bias", None) is not None:
                nn.init.zeros_(mod.bias)
    g = main
    if isinstance(module, (WanBlock, WanHead)):
        normal_(module.scale_shift_table, module.scale_shift_table.shape[-1] ** -0.5)
    if isinstance(module, WanHead):
        nn.init.zeros_(module.proj_out.weight)
    for name, p in module.named_parameters():
        if name.endswith("image_embedder.pos_embed"):  # FLF2V's positions start at zero (as diffusers')
            nn.init.zeros_(p)
    if isinstance(module, WanBlock) and module.attn1.offsets is not None:
        module.attn1.offsets.reset_output()

