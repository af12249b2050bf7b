"""Memory and step-time planner: will a preset run on a machine, and what bounds its step?

    python -m megaslide_ray.plan --preset dit-105b --frames 256 --height 1080 --width 1920
    python -m megaslide_ray.plan --preset dit-105b --ram-gb 2048 --gpu-gb 141 --json
    python -m megaslide_ray.plan --preset wan2.1-t2v-14b --frames 81 --height 720 --width 1280 --ram-gb 1649

The ``wan`` presets plan on VAE latents (the clip is given in pixels; the token grid is the
latent grid, ``latent_compression`` then ``patch_size``) and add what the Wan blocks have and
the videodit ones do not: parameters applied to each of the ``text_len`` text tokens (the text
projection, the cross-attention's keys and values), the cross-attention FLOPs
``4 * B * N * text_len * D`` per block, and a block working set of ``19 D + 2 F`` per token
(rotated q and k, the cross-attention's query, output and projection, the second
modulation) plus the text's keys and values. The DSA offset heads are reported apart
(``attention.offset_groups`` makes them smaller).

Everything is computed from shards built on the ``meta`` device (no memory is touched), so a
105B plan takes a second. All byte figures are decimal (1 GB = 1e9 B, 1 TB = 1e12 B), the
way the paper quotes them. Symbols used in the formulas below:

    P  parameters              L  blocks (depth)          D  hidden size
    B  batch (clips per step)  N  tokens per sample       nh heads, d = D / nh
    K  DSA window volume kt*kh*kw                        a  activation bytes (= w dtype size)
    F  MLP hidden width mlp_ratio * D                    Smax  parameters of the largest shard

Host memory (the ParameterStore; see ``actors/param_store.py``), per parameter:
    w (compute copy, 2 B bf16 / 4 B fp32) + master 4 + m 4 + v 4  = 14 B/param for bf16:
    the paper's figure (1.47 TB for 105B, of which m + v = 8 B/param = 840 GB).
    The gradient landing buffer g (dtype of w, 2 B/param for bf16) is NOT part of the paper's
    14 B/param; the store allocates it too, so the store's total is 16 B/param, and that
    total (plus ``HOST_MARGIN``) is what the RAM check uses.

Device memory:
    shard buffers = (prefetch_depth + 1) * Smax * (w bytes + grad bytes): the block being
    computed plus ``runtime.prefetch_depth`` staged ahead (none with ``runtime.overlap`` off),
    each with its weights and its gradient.
    activations   = checkpoints + one block's working set during recompute + pixel tensors.
        checkpoints      L * B * N * D * a         (block inputs kept at block boundaries;
                         with ``runtime.offload_activations`` only (prefetch_depth + 1) of them
                         are on the device, the rest in host RAM)
        block linear     B * N * a * (12 D + 2 F + D + max(F, 3 D))
                         saved by autograd: x, norm1, modulated (3D), qkv (3D), attention
                         output (D), proj output (D), residual, norm2, modulated (3D),
                         fc1 and GELU outputs (2F), fc2 output (D) = 12D + 2F; plus the
                         backward's live gradients: residual (D) + the widest (F or qkv 3D).
        pixels           3 * B * frames * height * width * channels * 4   (x_t, target,
                         prediction in fp32)
      plus the attention's own working set, by kind:
        dense, flash/SDPA  (O(N))    B * nh * N * 4             (fp32 log-sum-exp)
        dense, materialised (O(N^2)) 2 * B * nh * N^2 * a       (probabilities + their grad)
        dsa, fused kernel            B*N*nh*K*3*a*2 + 2*B*N*D*a + B*N*nh*4
                                     (offsets and their grad, offset predictor's conv and
                                     GELU outputs, log-sum-exp; samples never leave SRAM)
        dsa, reference (O(N*K*d*nh)) the fused figure + 2*B*N*nh*K*d*a (sampled k_j, v_j)
                                     + B*N*nh*K*4 (fp32 probabilities)
        neighborhood                 the dsa fused figure without the offset predictor
        swin                         2 * B * nh * N * K * a (window scores + their grad)
    The selected figure is flash for ``dense`` and the fused kernel for ``dsa`` /
    ``neighborhood`` (what runs on a GPU).

Traffic per step:
    host -> device   2 * P * w bytes   (weights streamed for the forward and again for the
                                        backward's recompute: 420 GB for 105B in bf16)
    device -> host   P * w bytes       (gradients: 210 GB)
    (the compute actor keeps the head's and the last block's forward weights for their
    backward, so it moves slightly less than 2 P; with ``runtime.offload_activations`` the
    block inputs add L * B * N * D * a in each direction)
    AdamW DRAM       P * ADAMW_BYTES_PER_PARAM: one ideal pass reads g (w bytes) + master +
                     m + v (12) and writes master + m + v (12) + w (w bytes) = 28 B/param in
                     bf16 (2.94 TB for 105B), 32 in fp32. The store's two AdamW kernels
                     (``actors/param_store.py``): ``compiled`` (MEGASLIDE_ADAMW=compiled) is
                     that single pass, 28 / 32 B; ``fused`` (the default: no compile time)
                     makes extra passes, in bf16 the upcast of g into fp32 (+6 B, and the
                     fused kernel reads 4 B of g instead of 2) and w.copy_(master) (+6 B) =
                     40 B; in fp32 w.copy_(master) (+4 B) = 36 B.

FLOPs per step (executed on the device):
    linear     6 * P_tok * B * N + 6 * P_sample * B. P_tok are parameters applied to every
               token (qkv, proj, MLP, offset predictor, patch embedding, head linear);
               P_sample are applied once per sample (adaLN modulations, timestep MLP,
               caption encoder). The usual 6 * P * tokens convention is reported beside it:
               it counts the adaLN weights (a third of each block) per token.
    recompute  + one more forward (2 * P_tok * B * N + attention forward): the blocks are
               recomputed from their checkpoints in the backward.
    attention  per block forward: dense 4 * B * N^2 * D (QK^T and AV); dsa / neighborhood
               36 * B * N * K * D (4 for the dot products and the weighted sum, 32 for the
               trilinear gathers of k and v from 8 corners); swin 4 * B * N * K * D.
               Backward = 2 x forward.

Step-time floor = max(H2D / pcie, D2H / pcie, AdamW bytes / dram, FLOPs / device): PCIe is
full duplex and AdamW overlaps the next step's forward (docs/architecture.md, "One training
step"), so the largest term binds. The floor is a bound, not a prediction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from megaslide_ray.config import Config, ConfigError, build_config, validate
from megaslide_ray.model import build_shard, ffn_width, num_shards

HOST_MARGIN = 0.10
"""Host RAM kept free beyond the store's segments: OS, Ray's object store, decoders, the
compute actor's pinned staging. 10% of the store."""
W_DTYPES = {"bfloat16": 2, "float32": 4}
ATTENTION_VARIANTS = ("dense_flash", "dense_materialised", "dsa_fused", "dsa_reference", "neighborhood", "swin")
SELECTED_VARIANT = {"dense": "dense_flash", "dsa": "dsa_fused", "neighborhood": "neighborhood", "swin": "swin"}
PER_SAMPLE_PREFIXES = ("ada", "t_mlp", "caption", "condition_embedder.time_")
"""Parameter-name prefixes (inside a shard) of modules applied once per sample, not per token."""
PER_TEXT_TOKEN = ("condition_embedder.text_embedder.", "attn2.to_k.", "attn2.to_v.")
"""wan: parameters applied to each of the ``model.text_len`` text tokens of a sample (the text
projection and the cross-attention's keys and values), not to the video tokens."""
NO_MATMUL = ("scale_shift_table",)
"""Parameters added elementwise (Wan's modulation tables): no FLOPs of their own."""


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    # -- what was planned
    preset: str
    attention: str
    w_dtype: str
    batch_size: int
    frames: int
    height: int
    width: int
    token_grid: tuple[int, int, int]
    tokens_per_sample: int
    tokens_per_step: int
    # -- parameters
    params: int
    params_per_token: int          # P_tok: applied to every token
    params_offset_heads: int       # the DSA offset heads' share of params (attention.offset_groups shrinks it)
    num_shards: int
    largest_shard: int             # shard index
    largest_shard_params: int
    # -- host memory
    host_bytes: dict[str, int]     # w, master, m, v, g
    host_state_bytes: int          # w + master + m + v: the paper's figure
    host_state_bytes_per_param: int
    moment_bytes: int              # m + v
    grad_buffer_bytes: int
    grad_buffer_in_state: bool     # always False: g is outside the paper's 14 B/param
    host_total_bytes: int          # what the store allocates: state + g
    # -- device memory
    prefetch_depth: int
    device_shard_bytes: int        # (prefetch_depth + 1) * Smax * (w + grad bytes)
    activation_parts: dict[str, int]   # checkpoints, block_linear, pixels, attention extras
    activation_bytes: dict[str, int]   # total activations per attention variant
    activation_variant: str            # the variant the configured kind runs as
    device_activation_bytes: int
    # -- traffic and FLOPs per step
    h2d_bytes: int
    d2h_bytes: int
    adamw_bytes_per_param: int
    adamw_store_bytes_per_param: int       # the store's default (fused) kernel
    adamw_compiled_bytes_per_param: int    # the store's compiled single pass (= the ideal pass)
    adamw_dram_bytes: int
    flops_6pt: float               # the 6 * P * tokens convention, for reference
    flops_linear: float            # 6 * P_tok * tokens + 6 * P_sample * B
    flops_attention: float         # forward + backward
    flops_recompute: float         # the extra forward of checkpointed blocks
    flops_executed: float
    # -- step-time floor
    pcie_gbps: float
    dram_gbps: float
    device_tflops: float
    time_terms: dict[str, float]   # seconds: h2d, d2h, adamw, compute
    step_floor_s: float
    binding: str
    # -- fit (None where the machine size was not given)
    ram_gb: float | None = None
    gpu_gb: float | None = None
    host_required_bytes: int = 0
    device_required_bytes: int = 0
    fits_host: bool | None = None
    fits_device: bool | None = None
    host_shortfall_bytes: int = 0
    device_shortfall_bytes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool | None:
        checks = [c for c in (self.fits_host, self.fits_device) if c is not None]
        return all(checks) if checks else None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        return d


def check_shape(cfg: Config) -> None:
    """Frames, height and width must be multiples of the patch; the message names the value.
    (wan: ``validate`` has checked the clip against the VAE compression and the patch.)"""
    if cfg.model.arch == "wan":
        validate(cfg)
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


def staged_shards(cfg: Config) -> int:
    """Shards on the device at once: the one computing plus ``runtime.prefetch_depth`` staged
    ahead (with ``runtime.overlap``; without, each shard is fetched when it is needed)."""
    return (cfg.runtime.prefetch_depth if cfg.runtime.overlap else 0) + 1


def _shard_counts(cfg: Config) -> tuple[list[int], int, int, int]:
    """Per-shard parameter counts, and the totals of parameters applied per video token, per
    sample and per text token (wan; see ``PER_TEXT_TOKEN``).

    Every block is the same module, so three meta builds (embed, one block, head) suffice."""
    L = cfg.model.depth
    kinds = {0: build_shard(cfg, 0, "meta"), 1: build_shard(cfg, 1, "meta"), L + 1: build_shard(cfg, L + 1, "meta")}
    per_kind: dict[int, list[int]] = {}
    for i, module in kinds.items():
        roles = [0, 0, 0, 0]  # per token, per sample, per text token, no matmul
        for name, p in module.named_parameters():
            if name.startswith(PER_SAMPLE_PREFIXES):
                roles[1] += p.numel()
            elif name.startswith(PER_TEXT_TOKEN):
                roles[2] += p.numel()
            elif name.startswith(NO_MATMUL):
                roles[3] += p.numel()
            else:
                roles[0] += p.numel()
        per_kind[i] = roles
    counts = [sum(per_kind[0]), *[sum(per_kind[1])] * L, sum(per_kind[L + 1])]
    p_tok, p_sample, p_text = (per_kind[0][r] + L * per_kind[1][r] + per_kind[L + 1][r] for r in range(3))
    assert len(counts) == num_shards(cfg)
    return counts, p_tok, p_sample, p_text


def _offset_head_params(cfg: Config) -> int:
    """Parameters of the DSA offset heads (``*.offsets.*``), 0 unless ``attention.kind`` is dsa."""
    block = build_shard(cfg, 1, "meta")
    return cfg.model.depth * sum(p.numel() for n, p in block.named_parameters() if ".offsets." in f".{n}")


def _activations(cfg: Config, a: int) -> tuple[dict[str, int], dict[str, int]]:
    """(parts, totals per attention variant), in bytes; formulas in the module docstring."""
    m = cfg.model
    B, N, D, L, nh = cfg.data.batch_size, cfg.tokens_per_sample, m.hidden_size, m.depth, m.num_heads
    d = D // nh
    F = ffn_width(cfg)
    K = math.prod(cfg.attention.window)
    BN = B * N
    offsets = BN * nh * K * 3 * a
    offset_predictor = 2 * BN * D * a
    lse = BN * nh * 4
    kept = min(L, staged_shards(cfg)) if cfg.runtime.offload_activations else L
    if m.arch == "wan":
        # + rotated q, k (2D), the cross-attention's norm, query, output and projection (4D),
        # the second modulation (D); the text's keys and values (2 x text_len x D per sample)
        block_linear = BN * a * (19 * D + 2 * F + D + max(F, 3 * D)) + 2 * B * m.text_len * D * a + lse
        inputs = 3 * B * math.prod(cfg.latent_grid) * m.in_channels * 4  # x_t, target, prediction (latents)
    else:
        block_linear = BN * a * (12 * D + 2 * F + D + max(F, 3 * D))
        inputs = 3 * B * cfg.data.num_frames * cfg.data.height * cfg.data.width * m.in_channels * 4
    parts = {
        "checkpoints": kept * BN * D * a,
        "offloaded_checkpoints": (L - kept) * BN * D * a,
        "block_linear": block_linear,
        "pixels": inputs,
        "dense_flash": lse,
        "dense_materialised": 2 * B * nh * N * N * a,
        "dsa_fused": 2 * offsets + offset_predictor + lse,
        "dsa_reference": 2 * offsets + offset_predictor + lse + 2 * BN * nh * K * d * a + BN * nh * K * 4,
        "neighborhood": 2 * offsets + lse,
        "swin": 2 * BN * nh * K * a,
    }
    base = parts["checkpoints"] + parts["block_linear"] + parts["pixels"]
    return parts, {v: base + parts[v] for v in ATTENTION_VARIANTS}


def _attention_flops_fwd(cfg: Config) -> float:
    """Forward FLOPs of all blocks' attention operators (module docstring)."""
    B, N, D, L = cfg.data.batch_size, cfg.tokens_per_sample, cfg.model.hidden_size, cfg.model.depth
    K = math.prod(cfg.attention.window)
    kind = cfg.attention.kind
    if kind == "dense":
        per_block = 4.0 * B * N * N * D
    elif kind in ("dsa", "neighborhood"):
        per_block = 36.0 * B * N * K * D
    else:  # swin
        per_block = 4.0 * B * N * K * D
    if cfg.model.arch == "wan":  # cross-attention of every video token to the text tokens
        per_block += 4.0 * B * N * cfg.model.text_len * D
    return L * per_block


def plan(cfg: Config, w_dtype: str = "bfloat16", pcie_gbps: float = 55.0, dram_gbps: float = 300.0,
         device_tflops: float = 990.0, ram_gb: float | None = None, gpu_gb: float | None = None) -> Plan:
    """Memory, traffic and step-time floor of one training step of ``cfg`` (module docstring)."""
    if w_dtype not in W_DTYPES:
        raise ConfigError(f"w_dtype={w_dtype!r}; use one of {list(W_DTYPES)}")
    for name, value in (("pcie_gbps", pcie_gbps), ("dram_gbps", dram_gbps), ("device_tflops", device_tflops)):
        if not value > 0:
            raise ConfigError(f"{name}={value!r} must be > 0")
    for name, value in (("ram_gb", ram_gb), ("gpu_gb", gpu_gb)):
        if value is not None and not value > 0:
            raise ConfigError(f"{name}={value!r} must be > 0 (GB, 1e9 bytes)")
    check_shape(cfg)
    wb = W_DTYPES[w_dtype]
    counts, p_tok, p_sample, p_text = _shard_counts(cfg)
    P = sum(counts)
    B, N = cfg.data.batch_size, cfg.tokens_per_sample
    tokens = B * N
    largest = max(range(len(counts)), key=lambda i: counts[i])

    # -- host memory
    host = {"w": wb * P, "master": 4 * P, "m": 4 * P, "v": 4 * P, "g": wb * P}
    state = host["w"] + host["master"] + host["m"] + host["v"]
    total = state + host["g"]

    # -- device memory
    shard_bytes = staged_shards(cfg) * counts[largest] * (wb + wb)
    parts, act_totals = _activations(cfg, wb)
    variant = SELECTED_VARIANT[cfg.attention.kind]

    # -- traffic
    # offloaded block inputs all go out and come back, the ones a step holds on the device included
    offloaded = parts["checkpoints"] + parts["offloaded_checkpoints"] if cfg.runtime.offload_activations else 0
    h2d = 2 * P * wb + offloaded
    d2h = P * wb + offloaded
    adamw_pp = wb + 12 + 12 + wb
    adamw_store_pp = adamw_pp + (12 if wb == 2 else 4)  # fused; bf16: g upcast and w cast; fp32: w.copy_
    adamw_bytes = P * adamw_pp

    # -- FLOPs
    attn_fwd = _attention_flops_fwd(cfg)
    text_tokens = B * cfg.model.text_len if cfg.model.arch == "wan" else 0
    flops_linear = 6.0 * p_tok * tokens + 6.0 * p_sample * B + 6.0 * p_text * text_tokens
    flops_attention = 3.0 * attn_fwd
    flops_recompute = 2.0 * p_tok * tokens + 2.0 * p_text * text_tokens + attn_fwd
    flops_executed = flops_linear + flops_attention + flops_recompute

    terms = {
        "h2d": h2d / (pcie_gbps * 1e9),
        "d2h": d2h / (pcie_gbps * 1e9),
        "adamw": adamw_bytes / (dram_gbps * 1e9),
        "compute": flops_executed / (device_tflops * 1e12),
    }
    binding = max(terms, key=terms.__getitem__)

    # -- fit
    host_required = int(math.ceil((total + parts["offloaded_checkpoints"]) * (1 + HOST_MARGIN)))
    device_required = shard_bytes + act_totals[variant]
    fits_host = None if ram_gb is None else host_required <= ram_gb * 1e9
    fits_device = None if gpu_gb is None else device_required <= gpu_gb * 1e9
    host_short = 0 if ram_gb is None else max(0, host_required - int(ram_gb * 1e9))
    device_short = 0 if gpu_gb is None else max(0, device_required - int(gpu_gb * 1e9))

    notes = []
    if fits_device is False and parts["checkpoints"] > 0.25 * device_required:
        notes.append(f"block-boundary checkpoints alone take {fmt_bytes(parts['checkpoints'])} on the device; "
                     f"runtime.offload_activations (--offload-activations here) keeps them in host RAM for "
                     f"{fmt_bytes(parts['checkpoints'])} more in each PCIe direction per step")
    if fits_device is False and parts["block_linear"] > 0.25 * device_required:
        notes.append(f"one block's linear working set is {fmt_bytes(parts['block_linear'])}: the MLP and projections "
                     f"act per token, so running a block's recompute and backward in token chunks would divide it "
                     f"(not implemented)")
    if fits_host is False:
        notes.append("runtime.state_dir on a fast disk lets the store exceed RAM, at disk speed for AdamW")
    if cfg.attention.kind == "dense":
        notes.append("dense assumes flash/SDPA on the device; a materialised N^2 score matrix would need "
                     f"{fmt_bytes(act_totals['dense_materialised'])} of activations")

    return Plan(
        preset=cfg.preset, attention=cfg.attention.kind, w_dtype=w_dtype, batch_size=B,
        frames=cfg.data.num_frames, height=cfg.data.height, width=cfg.data.width,
        token_grid=tuple(cfg.token_grid), tokens_per_sample=N, tokens_per_step=tokens,
        params=P, params_per_token=p_tok, params_offset_heads=_offset_head_params(cfg), num_shards=len(counts), largest_shard=largest,
        largest_shard_params=counts[largest],
        host_bytes=host, host_state_bytes=state, host_state_bytes_per_param=wb + 12,
        moment_bytes=host["m"] + host["v"], grad_buffer_bytes=host["g"], grad_buffer_in_state=False,
        host_total_bytes=total,
        prefetch_depth=staged_shards(cfg) - 1, device_shard_bytes=shard_bytes, activation_parts=parts,
        activation_bytes=act_totals, activation_variant=variant, device_activation_bytes=act_totals[variant],
        h2d_bytes=h2d, d2h_bytes=d2h, adamw_bytes_per_param=adamw_pp, adamw_store_bytes_per_param=adamw_store_pp,
        adamw_compiled_bytes_per_param=adamw_pp,
        adamw_dram_bytes=adamw_bytes, flops_6pt=6.0 * P * tokens, flops_linear=flops_linear,
        flops_attention=flops_attention, flops_recompute=flops_recompute, flops_executed=flops_executed,
        pcie_gbps=pcie_gbps, dram_gbps=dram_gbps, device_tflops=device_tflops, time_terms=terms,
        step_floor_s=terms[binding], binding=binding,
        ram_gb=ram_gb, gpu_gb=gpu_gb, host_required_bytes=host_required, device_required_bytes=device_required,
        fits_host=fits_host, fits_device=fits_device, host_shortfall_bytes=host_short,
        device_shortfall_bytes=device_short, notes=tuple(notes),
    )


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


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


def render(p: Plan) -> str:
    wb = W_DTYPES[p.w_dtype]
    lines: list[str] = []

    def row(label: str, value: str, extra: str = "") -> None:
        lines.append(f"  {label:<46}{value:>11}{'   ' + extra if extra else ''}")

    t, h, w = p.token_grid
    lines.append(f"megaslide-ray plan: preset {p.preset}, attention {p.attention}, w {p.w_dtype}, "
                 f"batch {p.batch_size}")
    lines.append(f"  clip {p.frames} x {p.height} x {p.width} pixels -> token grid {t} x {h} x {w} = "
                 f"{p.tokens_per_sample:,} tokens/sample, {p.tokens_per_step:,} tokens/step")
    lines.append(f"  parameters {p.params:,} ({fmt_count(p.params)}) in {p.num_shards} shards; largest: "
                 f"shard {p.largest_shard}, {p.largest_shard_params:,}")
    if p.params_offset_heads:
        lines.append(f"  of which DSA offset heads {p.params_offset_heads:,} ({fmt_count(p.params_offset_heads)}, "
                     f"{100 * p.params_offset_heads / (p.params - p.params_offset_heads):.0f}% on top of the rest; "
                     f"attention.offset_groups shares them between heads)")

    lines.append("\nhost memory (ParameterStore, B/param)")
    for kind, bpp, label in (("w", wb, f"w, compute copy ({p.w_dtype})"), ("master", 4, "master (fp32)"),
                             ("m", 4, "m (fp32)"), ("v", 4, "v (fp32)")):
        row(f"{label:<40}{bpp:>3}", fmt_bytes(p.host_bytes[kind]))
    state_label = "= state (the paper's 14 B/param)" if wb == 2 else "= state"
    row(f"{state_label:<40}{p.host_state_bytes_per_param:>3}", fmt_bytes(p.host_state_bytes))
    row(f"{'    of which moments m + v':<40}{8:>3}", fmt_bytes(p.moment_bytes))
    row(f"{'g, gradient landing buffer':<40}{wb:>3}", fmt_bytes(p.grad_buffer_bytes),
        "NOT included in the state figure above")
    row(f"{'= store total (state + g)':<40}{p.host_state_bytes_per_param + wb:>3}", fmt_bytes(p.host_total_bytes))

    lines.append("\ndevice memory")
    parts = p.activation_parts
    row(f"shard buffers: {p.prefetch_depth + 1} x (w + grad) of shard {p.largest_shard}",
        fmt_bytes(p.device_shard_bytes))
    if parts["offloaded_checkpoints"]:
        row(f"checkpoints: {p.prefetch_depth + 1} x B x N x D x {wb} B (offloaded)",
            fmt_bytes(parts["checkpoints"]), f"(host: {fmt_bytes(parts['offloaded_checkpoints'])})")
    else:
        row(f"checkpoints: L x B x N x D x {wb} B", fmt_bytes(parts["checkpoints"]))
    row("one block's working set (linear part)", fmt_bytes(parts["block_linear"]))
    row("input tensors (x_t, target, prediction; fp32)", fmt_bytes(parts["pixels"]))
    lines.append("  activations in total, by attention:")
    shown = ["dense_flash", "dense_materialised", "dsa_fused", "dsa_reference"]
    if p.activation_variant not in shown:
        shown.append(p.activation_variant)
    for v in shown:
        mark = "  <- selected" if v == p.activation_variant else ""
        row(f"  {VARIANT_LABELS[v]}", fmt_bytes(p.activation_bytes[v]), f"(attention part {fmt_bytes(parts[v])}){mark}")

    lines.append("\nper step")
    inputs = " + block inputs" if parts["offloaded_checkpoints"] else ""
    row("host -> device: weights twice" + (inputs or " (fwd + bwd)"), fmt_bytes(p.h2d_bytes))
    row("device -> host: gradients" + inputs, fmt_bytes(p.d2h_bytes))
    row(f"AdamW DRAM traffic, {p.adamw_bytes_per_param} B/param", fmt_bytes(p.adamw_dram_bytes),
        f"(the store: fused {p.adamw_store_bytes_per_param} B/param, "
        f"compiled {p.adamw_compiled_bytes_per_param})")
    row("FLOPs executed", f"{p.flops_executed:.3e}")
    row("  linear: 6 x P_tok x tokens", f"{p.flops_linear:.3e}", f"(6 x P x tokens: {p.flops_6pt:.3e})")
    row("  attention: forward + backward", f"{p.flops_attention:.3e}")
    row("  recompute: one more forward", f"{p.flops_recompute:.3e}")

    lines.append(f"\nstep-time floor (PCIe {p.pcie_gbps:g} GB/s, DRAM {p.dram_gbps:g} GB/s, "
                 f"device {p.device_tflops:g} TFLOP/s)")
    labels = {"h2d": "host -> device / PCIe", "d2h": "device -> host / PCIe", "adamw": "AdamW bytes / DRAM",
              "compute": "FLOPs executed / device"}
    for k, s in p.time_terms.items():
        row(labels[k], fmt_seconds(s), "<- binds" if k == p.binding else "")
    row("= floor", fmt_seconds(p.step_floor_s), f"({p.binding}-bound)")

    if p.ram_gb is not None or p.gpu_gb is not None:
        lines.append("\nfit")
        if p.ram_gb is not None:
            verdict = "fits" if p.fits_host else f"DOES NOT FIT, short by {fmt_bytes(p.host_shortfall_bytes)}"
            row(f"host: store total + {HOST_MARGIN:.0%} margin", fmt_bytes(p.host_required_bytes),
                f"vs {p.ram_gb:g} GB RAM: {verdict}")
        if p.gpu_gb is not None:
            verdict = "fits" if p.fits_device else f"DOES NOT FIT, short by {fmt_bytes(p.device_shortfall_bytes)}"
            row("device: shard buffers + selected activations", fmt_bytes(p.device_required_bytes),
                f"vs {p.gpu_gb:g} GB: {verdict}")
        lines.append(f"  => {'this machine can run it' if p.fits else 'this machine cannot run it as planned'}")
    for note in p.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def config_for(preset: str = "tiny", frames: int | None = None, height: int | None = None,
               width: int | None = None, batch_size: int | None = None, attention: str | None = None,
               config_file: str | None = None) -> Config:
    """The preset (or config file) with the shape / attention overrides of the CLI."""
    overrides: dict[str, Any] = {}
    for key, value in (("data.num_frames", frames), ("data.height", height), ("data.width", width),
                       ("data.batch_size", batch_size), ("attention.kind", attention)):
        if value is not None:
            overrides[key] = value
    # check the shape first so the message names the CLI flag rather than the config key
    probe = build_config(preset, config_file)
    for key in ("data.num_frames", "data.height", "data.width"):
        if key in overrides:
            setattr(probe.data, key.split(".", 1)[1], overrides[key])
    check_shape(probe)
    return build_config(preset, config_file, overrides)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaslide_ray.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny", help="config preset (tiny, dit-105b, dit-33b, dit-28b, "
                                                     "wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-ti2v-5b)")
    ap.add_argument("--config", default=None, help="TOML config file (as for training)")
    ap.add_argument("--frames", type=int, default=None, help="frames per clip (default: the preset's)")
    ap.add_argument("--height", type=int, default=None, help="clip height in pixels (default: the preset's)")
    ap.add_argument("--width", type=int, default=None, help="clip width in pixels (default: the preset's)")
    ap.add_argument("--batch-size", type=int, default=None, help="clips per step (default: the preset's)")
    ap.add_argument("--attention", default=None, choices=["dense", "swin", "neighborhood", "dsa"],
                    help="attention kind (default: the preset's)")
    ap.add_argument("--w-dtype", default="bfloat16", choices=list(W_DTYPES), help="compute-copy dtype")
    ap.add_argument("--pcie-gbps", type=float, default=55.0, help="host<->device GB/s each way")
    ap.add_argument("--dram-gbps", type=float, default=300.0, help="host DRAM GB/s AdamW reaches")
    ap.add_argument("--device-tflops", type=float, default=990.0, help="device TFLOP/s (bf16 dense)")
    ap.add_argument("--ram-gb", type=float, default=None, help="host RAM in GB (1e9 B): check the fit")
    ap.add_argument("--gpu-gb", type=float, default=None, help="device memory in GB (1e9 B): check the fit")
    ap.add_argument("--prefetch-depth", type=int, default=None,
                    help="shards staged ahead of the one computing (runtime.prefetch_depth; default: the config's)")
    ap.add_argument("--offload-activations", action="store_true",
                    help="plan with runtime.offload_activations (block inputs in host RAM)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        cfg = config_for(args.preset, args.frames, args.height, args.width, args.batch_size, args.attention,
                         args.config)
        if args.offload_activations:
            cfg.runtime.offload_activations = True
        if args.prefetch_depth is not None:
            if args.prefetch_depth < 0:
                raise ConfigError(f"--prefetch-depth {args.prefetch_depth} must be >= 0")
            cfg.runtime.prefetch_depth = args.prefetch_depth
        result = plan(cfg, args.w_dtype, args.pcie_gbps, args.dram_gbps, args.device_tflops, args.ram_gb,
                      args.gpu_gb)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
