"""The planner's formulas: parameters per shard (counted on the ``meta`` device), the activations
of a block and of attention by kind, FLOPs, and the units they are printed in."""

from __future__ import annotations

import copy
import math

from kernels import slab_kv_frames
from kernels.dsa_lever_cost import share_above
from megaslide_ray.config import Config, ConfigError, validate
from megaslide_ray.models.layers import ffn_width
from megaslide_ray.models.registry import build_shard, expert_shards

HOST_RESERVE_GB = 32.0
"""Host RAM kept free beyond the store, the offloaded block inputs and (generation) the weights:
the OS and the page tables of the store's mappings (8 B per 4 KiB page, about 3 GB per process
that maps 1.5 TB), Ray's daemons, the actor processes with torch and their CUDA context, the
decoders' prefetched batches. On a machine with less than 4 x this much RAM the default is a
quarter of the RAM. ``--host-reserve-gb`` changes it."""


W_DTYPES = {"bfloat16": 2, "float32": 4}


ATTENTION_VARIANTS = ("dense_flash", "dense_materialised", "dsa_fused", "dsa_reference", "neighborhood", "swin")


SELECTED_VARIANT = {"dense": "dense_flash", "dsa": "dsa_fused", "neighborhood": "neighborhood", "swin": "swin"}


PER_SAMPLE_PREFIXES = ("ada", "t_mlp", "caption", "condition_embedder.time_")
"""Parameter-name prefixes (inside a shard) of modules applied once per sample, not per token."""


PER_TEXT_TOKEN = ("condition_embedder.text_embedder.", "attn2.to_k.", "attn2.to_v.", "caption.token_proj.",
                  "cross.kv.", "condition_embedder.image_embedder.", "attn2.add_k_proj.", "attn2.add_v_proj.")
"""Parameters applied to each text (or image) token a block cross-attends to (``text_tokens``),
not to the video tokens: wan's text projection and cross-attention keys and values, an
image-to-video model's image embedder and image keys and values (counted over the text and image
tokens together: a slight overcount, the text tokens outnumber the image ones 2 to 1);
videodit's caption token projection and cross-attention keys and values."""

CLIP_TOKENS = 257
"""Image tokens per frame of the Wan2.1 image-to-video models' CLIP ViT-H/14 (16 x 16 patches of
a 224-pixel image and the class token)."""


NO_MATMUL = ("scale_shift_table",)
"""Parameters added elementwise (Wan's modulation tables): no FLOPs of their own."""


FIXED_TERMS = ("store state", "weights w", "fp32 update scratch", "reserve", "shard buffers", "resident shards",
               "device shards",
               "optimizer state", "weight average",
               "gradient slots", "fp32 sum", "network receive slots")
"""Memory terms that do not grow with the clip (``Plan.binding_memory`` names another when it can)."""


MIN_SUB_SLICE_CHUNK = 512
"""``--token-chunk auto`` tries chunks of whole time slices, then halves of one slice down to this."""


def validate_plan(cfg: Config) -> None:
    """``validate(cfg)``: every rule a run's config meets, but a plan of distillation needs no
    teacher's weights (it counts the teacher, it reads none), so without ``training.init_from`` a
    copy that names one is checked."""
    if cfg.training.distill_weight and not cfg.training.init_from:
        cfg = copy.deepcopy(cfg)
        cfg.training.init_from = "(the dense teacher a plan counts)"
    validate(cfg)


def check_shape(cfg: Config) -> None:
    """Frames, height and width must be multiples of the patch; the message names the value.
    (Latent space: ``validate`` checks the clip against the VAE compression and the patch.)"""
    if cfg.latent_space:
        validate_plan(cfg)
        return
    for flag, size, p in (("frames", cfg.data.num_frames, cfg.model.patch_size[0]),
                          ("height", cfg.data.height, cfg.model.patch_size[1]),
                          ("width", cfg.data.width, cfg.model.patch_size[2])):
        if size <= 0 or size % p:
            below, above = size // p * p, (size // p + 1) * p
            hint = f"{below} or {above}" if below > 0 else f"{above}"
            raise ConfigError(f"{flag}={size} is not divisible by the patch size {p} (preset {cfg.preset!r}, "
                              f"model.patch_size={tuple(cfg.model.patch_size)}); use a multiple of {p}, "
                              f"e.g. {hint}")


def padded_clip(cfg: Config, frames: int, height: int, width: int) -> tuple[int, int, int]:
    """Latent space: the smallest valid clip at least ``frames x height x width`` (4k+1 frames,
    whose latent frames the temporal patch divides; height and width multiples of compression x
    patch). Pixel space: the clip unchanged (``check_shape`` refuses what the patch does not divide)."""
    for flag, v in (("frames", frames), ("height", height), ("width", width)):
        if v <= 0:
            raise ConfigError(f"{flag}={v} must be > 0")
    if not cfg.latent_space:
        return frames, height, width
    ct, ch, cw = cfg.model.latent_compression
    pt, ph, pw = cfg.model.patch_size
    k = -(-(frames - 1) // ct)
    while (k + 1) % pt:
        k += 1
    return k * ct + 1, -(-height // (ch * ph)) * ch * ph, -(-width // (cw * pw)) * cw * pw


def staged_shards(cfg: Config) -> int:
    """Shards on the device at once: the one computing plus ``runtime.prefetch_depth`` staged
    ahead (with ``runtime.overlap``; without, each shard is fetched when it is needed)."""
    return (cfg.runtime.prefetch_depth if cfg.runtime.overlap else 0) + 1


def offload_keep(cfg: Config) -> int:
    """k: the block inputs kept on the device with ``runtime.offload_activations`` (the last
    ``runtime.offload_keep``, at most the depth); 0 without offload."""
    return min(cfg.runtime.offload_keep, cfg.model.depth) if cfg.runtime.offload_activations else 0


_COUNT_CACHE: dict[str, tuple[list[int], int, int, int, int]] = {}


def _shard_counts(cfg: Config) -> tuple[list[int], int, int, int, int]:
    """Per-shard parameter counts, the totals of parameters applied per video token, per sample
    and per text token (wan; see ``PER_TEXT_TOKEN``), and the DSA offset heads' parameters.

    Every block is the same module but for the dense ones of ``attention.dense_blocks`` (no offset
    head), so four meta builds (embed, a block of each kind, head) suffice; the result depends only
    on the model and attention sections (cached for the searches)."""
    key = repr((cfg.model, cfg.attention))
    if key in _COUNT_CACHE:
        return _COUNT_CACHE[key]
    L = cfg.model.depth
    dense = {i + 1 for i in cfg.attention.dense_blocks}
    local = min(set(range(1, L + 1)) - dense, default=1)  # a block of attention.kind
    block_of = {i: min(dense) if i in dense else local for i in range(1, L + 1)}
    kinds = {i: build_shard(cfg, i, "meta") for i in {0, L + 1, local, *block_of.values()}}
    per_kind = {i: _roles(module) for i, module in kinds.items()}
    _ROLE_CACHE[key] = {0: per_kind[0], 1: per_kind[local], L + 1: per_kind[L + 1]}
    blocks = [per_kind[block_of[i]] for i in range(1, L + 1)]
    counts = [sum(per_kind[0]), *[sum(b) for b in blocks], sum(per_kind[L + 1])]
    p_tok, p_sample, p_text = (per_kind[0][r] + sum(b[r] for b in blocks) + per_kind[L + 1][r] for r in range(3))
    offsets = sum(p.numel() for i in range(1, L + 1) for n, p in kinds[block_of[i]].named_parameters()
                  if ".offsets." in f".{n}")
    assert len(counts) == expert_shards(cfg)  # one transformer (two experts: each has these)
    _COUNT_CACHE[key] = (counts, p_tok, p_sample, p_text, offsets)
    return _COUNT_CACHE[key]


_ROLE_CACHE: dict[str, dict[int, list[int]]] = {}


def _roles(module) -> list[int]:
    """A shard's parameters by how often they are applied: [per video token, per sample, per text
    token, no matmul] (``PER_SAMPLE_PREFIXES``, ``PER_TEXT_TOKEN``, ``NO_MATMUL``)."""
    roles = [0, 0, 0, 0]
    for name, p in module.named_parameters():
        if name.startswith(PER_TEXT_TOKEN):
            roles[2] += p.numel()
        elif name.startswith(PER_SAMPLE_PREFIXES):
            roles[1] += p.numel()
        elif name.startswith(NO_MATMUL):
            roles[3] += p.numel()
        else:
            roles[0] += p.numel()
    return roles


def shard_roles(cfg: Config) -> dict[int, list[int]]:
    """``_roles`` of the embedding (key 0), of one block (1: every block is the same module, but
    for the dense blocks' lack of an offset head) and of the head (depth + 1)."""
    _shard_counts(cfg)
    return _ROLE_CACHE[repr((cfg.model, cfg.attention))]


def _attention_terms(cfg: Config, a: int, Q: int, Qp: int, g: int) -> dict[str, int]:
    """The attention's own working set per variant over ``Q`` query tokens (``Qp``: the offset
    predictor's tokens with its halo); ``g`` = 2 with gradients, 1 without."""
    m = cfg.model
    B, N, D, nh = cfg.data.batch_size, cfg.tokens_per_sample, m.hidden_size, m.num_heads
    d, K = D // nh, math.prod(cfg.attention.window)
    offsets = g * B * Q * nh * K * 3 * a
    predictor = 2 * B * Qp * D * a
    lse = B * Q * nh * 4
    return {
        "dense_flash": lse,
        "dense_materialised": g * B * nh * Q * N * a,
        "dsa_fused": offsets + predictor + lse,
        "dsa_reference": offsets + predictor + lse + 2 * B * Q * nh * K * d * a + B * Q * nh * K * 4,
        "neighborhood": offsets + lse,
        "swin": g * B * nh * Q * K * a,
    }


def _kernel_scratch(cfg: Config, a: int, Q: int, g: int) -> dict[str, int]:
    """The fused kernels' scratch for one attention call over ``Q`` query tokens (whole time
    slices), per variant that runs them: DSA at the configured bound, the neighborhood at zero
    offsets (``kernels.dsa_scratch.scratch_bytes``: the halo forward's scores, the backward's
    records or atomic fp32 dk/dv; chunked, so not proportional to the tokens). None where
    ``runtime.device`` is ``cpu``: the CPU operators (``kernels.dsa_cpu``) allocate no such buffers;
    ``auto`` counts them, as a GPU may take the run."""
    if cfg.runtime.device == "cpu":
        return {}
    from kernels.dsa_scratch import scratch_bytes  # lazy: imports triton (gpu_check --smoke sets it up first)

    m = cfg.model
    T, Ht, Wt = cfg.token_grid
    frames = max(1, Q // (Ht * Wt))
    out = {}
    for variant, bound in (("dsa_fused", cfg.attention.max_offset or None), ("neighborhood", 0.0)):
        lo, hi = slab_kv_frames(0, frames, T, cfg.attention.window[0], bound)
        out[variant] = scratch_bytes(cfg.data.batch_size, m.num_heads, (frames, Ht, Wt), (hi - lo) * Ht * Wt,
                                     cfg.attention.window, m.hidden_size // m.num_heads, bound, a, g == 2)
    return out


def _activations(cfg: Config, a: int, generate: bool) -> tuple[dict[str, int], dict[str, int], dict[str, int], int]:
    """(parts, named block terms, totals per attention variant, Q), in bytes; formulas in the
    module docstring."""
    m = cfg.model
    B, N, D, L = cfg.data.batch_size, cfg.tokens_per_sample, m.hidden_size, m.depth
    F = ffn_width(cfg)
    T, Ht, Wt = cfg.token_grid
    S = Ht * Wt
    BN = B * N
    ND = BN * D * a
    wan = m.arch == "wan"
    text_kv = 2 * B * text_tokens(cfg) * D * a
    cross = text_kv > 0
    chunk = min(cfg.runtime.token_chunk, N)
    if chunk:
        Q = min(T, max(1, chunk // S)) * S
        Qp = min(N, Q + 2 * S)
    else:
        Q = Qp = N
    width = 19 * D if wan else 16 * D if cross else 12 * D
    terms: dict[str, int] = {}
    if not chunk:
        if generate:
            terms["whole block, forward (max(8 D, 2 D + 2 F) per token)"] = \
                BN * a * max((10 if cross else 8) * D, 2 * D + 2 * F) + text_kv
        else:
            terms[f"whole block: saved + grads ({width // D} D + 2 F + D + max(F, 3 D))"] = \
                BN * a * (width + 2 * F + D + max(F, 3 * D)) + 2 * text_kv
    else:
        if generate:
            terms["whole clip: input x, attention residual (2 ND)"] = 2 * ND
            terms["whole clip: q, k, v (3 ND)"] = 3 * ND
        else:
            terms["whole clip: input x, grad x, grad residual (3 ND)"] = 3 * ND
            terms["whole clip: q, k, v (3 ND)"] = 3 * ND
            terms["whole clip: dq, dk, dv (3 ND)"] = 3 * ND
        if wan:
            terms["whole clip: rotated q, k (2 ND)"] = 2 * ND
        if cross:
            terms["text keys and values" + ("" if generate else " + grads")] = text_kv * (1 if generate else 2)
        if generate:
            terms[f"per chunk of {chunk:,} tokens: fwd ({'5' if cross else '3'} D + 2 F)"] = \
                B * chunk * a * ((5 if cross else 3) * D + 2 * F)
        else:
            terms[f"per chunk of {chunk:,} tokens: recompute + bwd"] = \
                B * chunk * a * (width + 2 * F + D + max(F, 3 * D))
    block_linear = sum(terms.values())
    if cfg.latent_space:
        inputs = 3 * B * math.prod(cfg.latent_grid) * m.in_channels * 4  # x_t, target, prediction (latents)
    else:
        inputs = 3 * B * cfg.data.num_frames * cfg.data.height * cfg.data.width * m.in_channels * 4
    # Layer-major micro-batches: B is one micro-batch; a block keeps the inputs of all of them.
    micro = 1 if generate else cfg.training.micro_batches
    if generate:
        kept, offloaded = 0, 0
    elif cfg.runtime.offload_activations:
        k = offload_keep(cfg)
        kept = micro * min(L, staged_shards(cfg) + k)  # in flight + the last k, kept there
        offloaded = micro * (L - k) * ND
    else:
        kept, offloaded = micro * L, 0
    attention = _attention_terms(cfg, a, Q, Qp, 1 if generate else 2)
    scratch = _kernel_scratch(cfg, a, Q, 1 if generate else 2)
    parts = {
        "checkpoints": kept * ND,
        "offloaded_checkpoints": offloaded,
        "block_linear": block_linear,
        "input_side": (2 if wan else 5) * ND,
        "pixels": micro * inputs,
        **attention,
        **{f"{v}_scratch": b for v, b in scratch.items()},
    }
    totals = {v: parts["checkpoints"] + max(block_linear + attention[v] + scratch.get(v, 0), parts["input_side"])
              + parts["pixels"] for v in ATTENTION_VARIANTS}
    return parts, terms, totals, Q


def _attention_flops_fwd(cfg: Config) -> float:
    """Forward FLOPs of all blocks' attention operators (module docstring): ``attention.dense_blocks``
    dense, the rest ``attention.kind``, and a sample at or above ``attention.dense_above_t`` (the
    share of the training draws there, ``dense_share``) dense in every block. A curriculum step
    (``attention.dense_warmup_steps``) runs both kinds; the estimate is of the steps after it."""
    B, N, D, L = cfg.data.batch_size, cfg.tokens_per_sample, cfg.model.hidden_size, cfg.model.depth
    K = math.prod(cfg.attention.window)
    kind = cfg.attention.kind
    dense = 4.0 * B * N * N * D
    if kind == "dense":
        per_block = dense
    elif kind in ("dsa", "neighborhood"):
        per_block = 36.0 * B * N * K * D
    else:  # swin
        per_block = 4.0 * B * N * K * D
    n = 0 if kind == "dense" else len(tuple(cfg.attention.dense_blocks))
    share = 0.0 if kind == "dense" else dense_share(cfg)
    local = n * dense + (L - n) * per_block
    cross = 4.0 * B * N * text_tokens(cfg) * D  # cross-attention of every video token to the text
    return share * L * dense + (1.0 - share) * local + L * cross


def dense_share(cfg: Config) -> float:
    """The share of training samples whose t is at or above ``attention.dense_above_t`` (0: off),
    under ``training.t_sampling`` and ``flow_shift``, within the expert's range when
    ``training.expert`` is ``high`` or ``low``."""
    a, t = cfg.attention, cfg.training
    if a.dense_above_t <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    if t.expert in ("high", "low") and t.boundary_ratio > 0:
        lo, hi = (t.boundary_ratio, 1.0) if t.expert == "high" else (0.0, t.boundary_ratio)
    above = lambda x: share_above(x, t.t_sampling, t.flow_shift)  # noqa: E731
    inside = above(lo) - above(hi)
    return (above(max(a.dense_above_t, lo)) - above(max(a.dense_above_t, hi))) / inside if inside > 0 else 0.0


def text_tokens(cfg: Config) -> int:
    """``Lt``, the text tokens a block cross-attends to per sample (module docstring), with an
    image-to-video model's image tokens (``CLIP_TOKENS``, FLF2V's ``pos_embed_seq_len``)."""
    m = cfg.model
    if m.arch == "wan":
        return m.text_len + (m.pos_embed_seq_len or (CLIP_TOKENS if m.image_dim else 0))
    return cfg.model.caption_max_bytes + 1 if cfg.model.cross_attention else 0


def fmt_bytes(n: float) -> str:
    """Decimal units, as the paper quotes them (1 TB = 1e12 B)."""
    for unit, scale in (("EB", 1e18), ("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if abs(n) / scale < 100 else f"{n / scale:,.0f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.0f}"


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.3g} h"
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms"


VARIANT_LABELS = {
    "dense_flash": "dense, flash/SDPA (O(N))",
    "dense_materialised": "dense, materialised (O(N^2))",
    "dsa_fused": "dsa, fused kernel (O(N*K))",
    "dsa_reference": "dsa, reference (O(N*K*d*nh))",
    "neighborhood": "neighborhood (fused)",
    "swin": "swin (window scores)",
}
