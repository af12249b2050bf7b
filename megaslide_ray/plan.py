"""Memory and step-time planner: will a preset run on a machine, and what bounds its step?

    python -m megaslide_ray.plan --preset dit-105b --generate --frames 256 --height 1080 --width 1920 --gpu-gb 141
    python -m megaslide_ray.plan --preset dit-105b --frames 81 --height 1080 --width 1920 \\
        --gpu-gb 141 --ram-gb 1649 --offload-activations --token-chunk auto --offload-keep auto
    python -m megaslide_ray.plan --preset dit-105b --height 1080 --width 1920 --gpu-gb 141 --ram-gb 1649 \\
        --offload-activations --token-chunk auto --offload-keep auto --max-frames
    python -m megaslide_ray.plan --preset wan2.1-t2v-14b --frames 81 --height 720 --width 1280 --ram-gb 1649

Two kinds of run are planned: a training step (the default) and, with ``--generate``, one
denoising step of sampling (forward only: no gradients, no optimizer state, no block inputs
kept; the weights stream once per denoising step).

Latent space. The paper's presets (``dit-105b``, ``dit-33b``, ``dit-28b``, ``model.inputs =
latents``) and the ``wan`` presets read VAE latents: the clip is given in pixels, the latent grid
is ``((F - 1) / ct + 1, H / ch, W / cw)`` with ``model.latent_compression`` (4, 8, 8), the token
grid that divided by ``model.patch_size`` (1, 2, 2). The VAE encodes 4k+1 frames and the
height and width must be multiples of compression x patch (16): the planner **pads** a clip
that is not up to the next valid size (256 frames -> 257, 1080 rows -> 1088; padding only adds
memory, so a plan of the padded clip bounds the requested one) and prints both. Training data
must have the exact size (``validate`` refuses others). ``tiny`` stays in pixel space, where a
clip that the patch does not divide is refused.

The ``wan`` presets add what the Wan blocks have and the videodit ones do not: parameters
applied to each of the ``text_len`` text tokens (the text projection, the cross-attention's keys
and values), the cross-attention FLOPs ``4 * B * N * text_len * D`` per block, rotated q and k,
the cross-attention's query, output and projection, the second modulation, and the text's keys
and values. A ``videodit`` with ``model.cross_attention`` (off by default and in the ``dit-*``
presets) has cross-attention too, over ``Lt = caption_max_bytes + 1`` caption tokens: the same FLOPs and
keys and values, and parameters per caption token (the token projection, the keys and values). The DSA offset heads are reported apart (``attention.offset_groups`` makes them
smaller).

Everything is computed from shards built on the ``meta`` device (no memory is touched), so a
105B plan takes a second. All byte figures are decimal (1 GB = 1e9 B, 1 TB = 1e12 B), the
way the paper quotes them; ``--ram-gb`` and ``--gpu-gb`` are in the same GB (a "1.5 TB" server
of 24 x 64 GiB DIMMs has 1649 GB; an H200 141 GB). Symbols used in the formulas below:

    P  parameters              L  blocks (depth)          D  hidden size
    B  batch (clips per step)  N  tokens per sample       nh heads, d = D / nh
    K  DSA window volume kt*kh*kw                        a  activation bytes (= w dtype size)
    F  MLP hidden width mlp_ratio * D                    Smax  parameters of the largest shard
    ND = B * N * D * a: one whole-clip tensor of the block width
    Lt text tokens a block cross-attends to: wan ``text_len``, videodit ``caption_max_bytes + 1``
       (0 without ``model.cross_attention``)
    c  token chunk (runtime.token_chunk)  S  tokens of one time slice of the token grid
    Q  attention query chunk: c rounded down to whole time slices, at least one (Q = N unchunked)

Host memory, training (the ParameterStore; see ``actors/param_store.py``), per parameter:
    w (compute copy, 2 B bf16 / 4 B fp32) + master 4 + m 4 + v 4  = 14 B/param for bf16:
    the paper's figure (1.47 TB for 105B, of which m + v = 8 B/param = 840 GB). A shard's
    gradient lands in its own ``w`` segment (the weights are not needed again until AdamW
    rewrites them), so there is no gradient buffer. A bf16 run has one fp32 **update scratch**
    of the largest shard's size (4 * Smax: the gradient is upcast into it for AdamW).
    + offloaded block inputs   (L - k) * ND   (``runtime.offload_activations``: the host segment
                                         has one slot per block not kept on the device;
                                         k = ``runtime.offload_keep``, at most L)
    + reserve                  ``--host-reserve-gb`` (default 32 GB, at most a quarter of
                               ``--ram-gb``): the OS and page tables,
                               Ray's daemons, the actor processes with their CUDA context, the
                               decoders' prefetched batches. A fixed amount, not a share of the
                               store: none of these grows with the model.
Host memory, generation: the bf16 weights w (2 B/param, what ``sample`` maps) + the reserve.

Device memory:
    shard buffers = (prefetch_depth + 1) * Smax * (w bytes + grad bytes): the block being
    computed plus ``runtime.prefetch_depth`` staged ahead (none with ``runtime.overlap`` off),
    each with its weights and (training) its gradient.
    activations = checkpoints + max(one block's working set + its attention, the input side)
                  + the input tensors
        checkpoints      L * ND, the block inputs kept at block boundaries (training; with
                         ``runtime.offload_activations`` only (prefetch_depth + 1 + k) on the
                         device, at most L: those in flight plus the last k kept there,
                         ``runtime.offload_keep``); none in generation.
        block working set, unchunked (``runtime.token_chunk = 0``):
          training       B * N * a * (12 D + 2 F + D + max(F, 3 D))
                         saved by autograd: x, norm1, modulated (3D), qkv (3D), attention
                         output (D), proj output (D), residual, norm2, modulated (3D),
                         fc1 and GELU outputs (2F), fc2 output (D) = 12D + 2F; plus the
                         backward's live gradients: residual (D) + the widest (F or qkv 3D).
                         wan: 19 D instead of 12 D, + the text's keys and values;
                         videodit with cross-attention: 16 D (its norm, query, output,
                         residual), + the caption's keys and values.
          generation     B * N * a * max(8 D, 2 D + 2 F): x, modulated, q, k, v, attention
                         output, projection, residual; then x, modulated, fc1, GELU.
        block working set, chunked (token_chunk = c > 0): the per-token parts (modulation,
        norms, projections, MLP) run over chunks of c tokens (nested checkpoint per chunk) and
        the attention over query chunks of whole time slices, so
          whole-clip     training:   9 ND: block input, q, k, v, dq, dk, dv, the gradients of
                                     the post-attention residual and of the block input
                         generation: 5 ND: block input, q, k, v, post-attention residual
                         (wan: + rotated q and k, 2 ND; + the text's keys and values)
          per chunk      training:   B * c * a * (12 D + 2 F + D + max(F, 3 D))   (the
                                     unchunked formula on one chunk)
                         generation: B * c * a * (3 D + 2 F)
        input side       videodit: 5 ND (patch embedding, the fp32 3D position table (2 ND),
                         its cast, the sum); wan: 2 ND. Counted when larger than a block.
        inputs           3 * B * (pixels or latent positions) * channels * 4 (x_t, target,
                         prediction in fp32)
      plus the attention's own working set, over Q query tokens (g = 2 in training: the
      tensor and its gradient; 1 in generation):
        dense, flash/SDPA  (O(N))    B * nh * Q * 4             (fp32 log-sum-exp)
        dense, materialised (O(N^2)) g * B * nh * Q * N * a     (probabilities + their grad)
        dsa, fused kernel            g*B*Q*nh*K*3*a + 2*B*Q'*D*a + B*Q*nh*4
                                     (offsets and their grad, offset predictor's conv and
                                     GELU outputs over Q' = Q + 2 S tokens (its 3x3x3 conv's
                                     halo), log-sum-exp; samples never leave SRAM)
        dsa, reference (O(N*K*d*nh)) the fused figure + 2*B*Q*nh*K*d*a (sampled k_j, v_j)
                                     + B*Q*nh*K*4 (fp32 probabilities)
        neighborhood                 the dsa fused figure without the offset predictor
        swin                         g * B * nh * Q * K * a (window scores + their grad)
    The selected figure is flash for ``dense`` and the fused kernel for ``dsa`` /
    ``neighborhood`` (what runs on a GPU).

Traffic per training step:
    host -> device   2 * P * w bytes   (weights streamed for the forward and again for the
                                        backward's recompute: 420 GB for 105B in bf16)
    device -> host   P * w bytes       (gradients: 210 GB)
    (the compute actor keeps the head's and the last block's forward weights for their
    backward, so it moves slightly less than 2 P; with ``runtime.offload_activations`` the
    offloaded block inputs add (L - k) * ND in each direction: the k kept on the device do not move)
    AdamW DRAM       P * ADAMW_BYTES_PER_PARAM: one ideal pass reads g (w bytes) + master +
                     m + v (12) and writes master + m + v (12) + w (w bytes) = 28 B/param in
                     bf16 (2.94 TB for 105B), 32 in fp32. The store's two AdamW kernels
                     (``actors/param_store.py``): ``compiled`` (MEGASLIDE_ADAMW=compiled) is
                     that single pass, 28 / 32 B; ``fused`` (the default: no compile time)
                     makes extra passes, in bf16 the upcast of g into fp32 (+6 B, and the
                     fused kernel reads 4 B of g instead of 2) and w.copy_(master) (+6 B) =
                     40 B; in fp32 w.copy_(master) (+4 B) = 36 B.
Traffic per denoising step (generation): host -> device P * w bytes; nothing comes back.

FLOPs per training step (executed on the device):
    linear     6 * P_tok * B * N + 6 * P_sample * B. P_tok are parameters applied to every
               token (qkv, proj, MLP, offset predictor, patch embedding, head linear);
               P_sample are applied once per sample (adaLN modulations, timestep MLP,
               caption encoder). The usual 6 * P * tokens convention is reported beside it:
               it counts the adaLN weights (a third of each block) per token.
    attention  3 * forward, forward per block:
                 dense                 4 * B * N^2 * D
                 dsa / neighborhood    36 * B * N * K * D   (the kernel's per-sample work:
                                       trilinear weights, 8-corner gathers of k and v, q.k, the
                                       weighted sum; the backward's scatter is in the 3x)
                 swin                  4 * B * N * K * D
    recompute  one more forward of every block: 2 * P_tok * B * N + the attention's forward;
               chunked (token_chunk > 0), the nested per-chunk checkpoint recomputes once more.
FLOPs per denoising step: one forward, 2 * P_tok * B * N + 2 * P_sample * B + the attention's
forward.

Step-time floor = max(h2d / pcie, d2h / pcie, AdamW bytes / dram, FLOPs / device): PCIe is
full duplex and AdamW overlaps the next step's forward (docs/architecture.md, "One training
step"), so the largest term binds. The floor is a bound, not a prediction.

Searches. ``--token-chunk auto`` picks the largest token chunk (whole time slices, or a
fraction of one) whose plan fits the device. ``--offload-keep auto`` (with
``--offload-activations``, ``--gpu-gb`` and ``--ram-gb``) picks k = ``runtime.offload_keep``: the
host terms do not depend on the token chunk and fall by ND per kept input, so the smallest k
whose host fits is found first (the host shortfall with every input offloaded, divided by ND,
rounded up; checked by planning it); then the token chunk is chosen with that k (``auto``: the
largest that fits the device; a given chunk is kept). Device memory only grows with k, so no
other pair fits with a larger chunk or a smaller k: when the device does not fit with that k, no
k does, and the plan at that k shows by how much. ``--max-frames`` finds the longest clip at the
given height and width that fits the machine (every valid frame count is tried in order of a
binary search; memory grows with the clip), for training or, with ``--generate``, generation,
and prints the plan at that length and what binds one step further (with ``--offload-keep auto``
k is re-picked at each length, like the chunk). Without ``--token-chunk``
a config that does not chunk is planned whole-clip, and with ``auto`` when that does not fit
``--gpu-gb`` (the plan's first note says so).
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
                  "cross.kv.")
"""Parameters applied to each text token a block cross-attends to (``text_tokens``), not to the
video tokens: wan's text projection and cross-attention keys and values; videodit's caption
token projection and cross-attention keys and values."""
NO_MATMUL = ("scale_shift_table",)
"""Parameters added elementwise (Wan's modulation tables): no FLOPs of their own."""
FIXED_TERMS = ("store state", "weights w", "fp32 update scratch", "reserve", "shard buffers")
"""Memory terms that do not grow with the clip (``Plan.binding_memory`` names another when it can)."""
MIN_SUB_SLICE_CHUNK = 512
"""``--token-chunk auto`` tries chunks of whole time slices, then halves of one slice down to this."""


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    # -- what was planned
    mode: str                      # "train" (one optimizer step) or "generate" (one denoising step)
    preset: str
    attention: str
    w_dtype: str
    batch_size: int                # clips per step (generation with guidance: 2 x the prompts)
    frames: int                    # the clip planned, in pixels (padded where needed)
    height: int
    width: int
    requested_clip: tuple[int, int, int]   # the clip asked for (differs when padded)
    latent_space: bool
    latent_grid: tuple[int, int, int]      # = (frames, height, width) in pixel space
    in_channels: int
    token_grid: tuple[int, int, int]
    tokens_per_sample: int
    tokens_per_step: int
    token_chunk: int               # runtime.token_chunk (0: whole clip)
    attention_chunk_tokens: int    # Q: query tokens per attention chunk (N when unchunked)
    # -- parameters
    params: int
    params_per_token: int          # P_tok: applied to every token
    params_offset_heads: int       # the DSA offset heads' share of params (attention.offset_groups shrinks it)
    num_shards: int
    largest_shard: int             # shard index
    largest_shard_params: int
    # -- host memory
    host_bytes: dict[str, int]     # w, master, m, v, scratch (training); w (generation)
    host_state_bytes: int          # w + master + m + v: the paper's figure (generation: w)
    host_state_bytes_per_param: int
    moment_bytes: int              # m + v
    scratch_bytes: int             # fp32 update scratch of the largest shard (bf16 training)
    host_store_bytes: int          # what the store allocates: state + scratch
    host_offloaded_bytes: int      # offloaded block inputs ((L - k) * ND), 0 without offload
    host_reserve_bytes: int
    # -- device memory
    prefetch_depth: int
    offload_keep: int              # k: block inputs kept on the device with offload (0 without offload)
    device_shard_bytes: int        # (prefetch_depth + 1) * Smax * (w [+ grad] bytes)
    activation_parts: dict[str, int]   # checkpoints, block_linear, pixels, attention extras, ...
    block_terms: dict[str, int]        # the named terms of one block's working set
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
    flops_6pt: float               # the 6 * P * tokens convention (2 * P * tokens in generation)
    flops_linear: float            # 6 * P_tok * tokens + 6 * P_sample * B (generation: 2x)
    flops_attention: float         # forward + backward (generation: forward)
    flops_recompute: float         # the extra forwards of checkpointed blocks and chunks
    flops_executed: float
    # -- step-time floor
    pcie_gbps: float
    dram_gbps: float
    device_tflops: float
    time_terms: dict[str, float]   # seconds: h2d, d2h, adamw, compute (generation: h2d, compute)
    step_floor_s: float
    binding: str
    sample_steps: int = 0          # generation: denoising steps of one sample
    # -- fit (None where the machine size was not given)
    ram_gb: float | None = None
    gpu_gb: float | None = None
    host_required_bytes: int = 0
    device_required_bytes: int = 0
    host_terms: dict[str, int] = field(default_factory=dict)     # what host_required adds up
    device_terms: dict[str, int] = field(default_factory=dict)   # what device_required adds up
    fits_host: bool | None = None
    fits_device: bool | None = None
    host_shortfall_bytes: int = 0
    device_shortfall_bytes: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fits(self) -> bool | None:
        checks = [c for c in (self.fits_host, self.fits_device) if c is not None]
        return all(checks) if checks else None

    @property
    def binding_memory(self) -> tuple[str, str, int] | None:
        """(side, term, shortfall) of the first side that does not fit: the term is the largest one
        that grows with the clip (``FIXED_TERMS`` do not), or the largest when none does."""
        for side, ok, terms, short in (("host", self.fits_host, self.host_terms, self.host_shortfall_bytes),
                                       ("device", self.fits_device, self.device_terms, self.device_shortfall_bytes)):
            if ok is False:
                growing = {k: v for k, v in terms.items() if not k.startswith(FIXED_TERMS) and v}
                pool = growing or terms
                return side, max(pool, key=pool.__getitem__), short
        return None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fits"] = self.fits
        d["binding_memory"] = self.binding_memory
        return d


def check_shape(cfg: Config) -> None:
    """Frames, height and width must be multiples of the patch; the message names the value.
    (Latent space: ``validate`` checks the clip against the VAE compression and the patch.)"""
    if cfg.latent_space:
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

    Every block is the same module, so three meta builds (embed, one block, head) suffice; the
    result depends only on the model and attention sections (cached for the searches)."""
    key = repr((cfg.model, cfg.attention))
    if key in _COUNT_CACHE:
        return _COUNT_CACHE[key]
    L = cfg.model.depth
    kinds = {0: build_shard(cfg, 0, "meta"), 1: build_shard(cfg, 1, "meta"), L + 1: build_shard(cfg, L + 1, "meta")}
    per_kind: dict[int, list[int]] = {}
    for i, module in kinds.items():
        roles = [0, 0, 0, 0]  # per token, per sample, per text token, no matmul
        for name, p in module.named_parameters():
            if name.startswith(PER_TEXT_TOKEN):
                roles[2] += p.numel()
            elif name.startswith(PER_SAMPLE_PREFIXES):
                roles[1] += p.numel()
            elif name.startswith(NO_MATMUL):
                roles[3] += p.numel()
            else:
                roles[0] += p.numel()
        per_kind[i] = roles
    counts = [sum(per_kind[0]), *[sum(per_kind[1])] * L, sum(per_kind[L + 1])]
    p_tok, p_sample, p_text = (per_kind[0][r] + L * per_kind[1][r] + per_kind[L + 1][r] for r in range(3))
    offsets = L * sum(p.numel() for n, p in kinds[1].named_parameters() if ".offsets." in f".{n}")
    assert len(counts) == num_shards(cfg)
    _COUNT_CACHE[key] = (counts, p_tok, p_sample, p_text, offsets)
    return _COUNT_CACHE[key]


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
    if generate:
        kept, offloaded = 0, 0
    elif cfg.runtime.offload_activations:
        k = offload_keep(cfg)
        kept = min(L, staged_shards(cfg) + k)  # in flight + the last k, kept there
        offloaded = (L - k) * ND
    else:
        kept, offloaded = L, 0
    attention = _attention_terms(cfg, a, Q, Qp, 1 if generate else 2)
    parts = {
        "checkpoints": kept * ND,
        "offloaded_checkpoints": offloaded,
        "block_linear": block_linear,
        "input_side": (2 if wan else 5) * ND,
        "pixels": inputs,
        **attention,
    }
    totals = {v: parts["checkpoints"] + max(block_linear + attention[v], parts["input_side"]) + inputs
              for v in ATTENTION_VARIANTS}
    return parts, terms, totals, Q


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
    per_block += 4.0 * B * N * text_tokens(cfg) * D  # cross-attention of every video token to the text
    return L * per_block


def text_tokens(cfg: Config) -> int:
    """``Lt``, the text tokens a block cross-attends to per sample (module docstring)."""
    if cfg.model.arch == "wan":
        return cfg.model.text_len
    return cfg.model.caption_max_bytes + 1 if cfg.model.cross_attention else 0


def plan(cfg: Config, w_dtype: str = "bfloat16", pcie_gbps: float = 55.0, dram_gbps: float = 300.0,
         device_tflops: float = 990.0, ram_gb: float | None = None, gpu_gb: float | None = None, *,
         generate: bool = False, sample_steps: int = 50, host_reserve_gb: float | None = None,
         requested_clip: tuple[int, int, int] | None = None) -> Plan:
    """Memory, traffic and step-time floor of one training step of ``cfg``, or with ``generate``
    of one denoising step (module docstring)."""
    if w_dtype not in W_DTYPES:
        raise ConfigError(f"w_dtype={w_dtype!r}; use one of {list(W_DTYPES)}")
    for name, value in (("pcie_gbps", pcie_gbps), ("dram_gbps", dram_gbps), ("device_tflops", device_tflops)):
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name}={value!r} must be a finite number > 0")
    for name, value in (("ram_gb", ram_gb), ("gpu_gb", gpu_gb)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{name}={value!r} must be a finite number > 0 (GB, 1e9 bytes)")
    if host_reserve_gb is None:
        host_reserve_gb = HOST_RESERVE_GB if ram_gb is None else min(HOST_RESERVE_GB, ram_gb / 4)
    if not (host_reserve_gb >= 0 and math.isfinite(host_reserve_gb)):
        raise ConfigError(f"host_reserve_gb={host_reserve_gb!r} must be a finite number >= 0")
    if sample_steps < 1:
        raise ConfigError(f"sample_steps={sample_steps} must be >= 1")
    check_shape(cfg)
    wb = W_DTYPES[w_dtype]
    counts, p_tok, p_sample, p_text, p_offsets = _shard_counts(cfg)
    P = sum(counts)
    B, N = cfg.data.batch_size, cfg.tokens_per_sample
    tokens = B * N
    largest = max(range(len(counts)), key=lambda i: counts[i])
    Smax = counts[largest]
    chunk = min(cfg.runtime.token_chunk, N)

    # -- host memory
    if generate:
        host = {"w": wb * P}
        state, scratch = host["w"], 0
    else:
        scratch = 4 * Smax if wb == 2 else 0  # the bf16 gradient is upcast into it for AdamW
        host = {"w": wb * P, "master": 4 * P, "m": 4 * P, "v": 4 * P, "scratch": scratch}
        state = host["w"] + host["master"] + host["m"] + host["v"]
    store = state + scratch

    # -- device memory
    shard_bytes = staged_shards(cfg) * Smax * (wb if generate else wb + wb)
    parts, block_terms, act_totals, Q = _activations(cfg, wb, generate)
    variant = SELECTED_VARIANT[cfg.attention.kind]

    # -- traffic
    attn_fwd = _attention_flops_fwd(cfg)
    n_text = B * text_tokens(cfg)
    if generate:
        h2d, d2h, adamw_pp, adamw_store_pp, adamw_bytes = P * wb, 0, 0, 0, 0
        flops_linear = 2.0 * p_tok * tokens + 2.0 * p_sample * B + 2.0 * p_text * n_text
        flops_attention = attn_fwd
        flops_recompute = 0.0
        flops_6pt = 2.0 * P * tokens
    else:
        # offloaded block inputs all go out and come back, the ones a step holds on the device included
        offloaded = parts["offloaded_checkpoints"]
        h2d = 2 * P * wb + offloaded
        d2h = P * wb + offloaded
        adamw_pp = wb + 12 + 12 + wb
        adamw_store_pp = adamw_pp + (12 if wb == 2 else 4)  # fused; bf16: g upcast and w cast; fp32: w.copy_
        adamw_bytes = P * adamw_pp
        flops_linear = 6.0 * p_tok * tokens + 6.0 * p_sample * B + 6.0 * p_text * n_text
        flops_attention = 3.0 * attn_fwd
        flops_recompute = 2.0 * p_tok * tokens + 2.0 * p_text * n_text + attn_fwd
        if chunk:  # the nested per-chunk checkpoint: one more forward of the blocks
            flops_recompute += 2.0 * p_tok * tokens + attn_fwd
        flops_6pt = 6.0 * P * tokens
    flops_executed = flops_linear + flops_attention + flops_recompute

    terms = {"h2d": h2d / (pcie_gbps * 1e9)}
    if not generate:
        terms["d2h"] = d2h / (pcie_gbps * 1e9)
        terms["adamw"] = adamw_bytes / (dram_gbps * 1e9)
    terms["compute"] = flops_executed / (device_tflops * 1e12)
    binding = max(terms, key=terms.__getitem__)

    # -- fit
    reserve = int(round(host_reserve_gb * 1e9))
    host_terms = {"weights w" if generate else "store state (w + master + m + v)": state}
    if scratch:
        host_terms["fp32 update scratch (largest shard)"] = scratch
    if parts["offloaded_checkpoints"]:
        label = "offloaded block inputs ((L - k) x ND)" if offload_keep(cfg) else "offloaded block inputs (L x ND)"
        host_terms[label] = parts["offloaded_checkpoints"]
    host_terms["reserve (OS, Ray, processes)"] = reserve
    host_required = sum(host_terms.values())
    block_total = parts["block_linear"] + parts[variant]
    device_terms = {"shard buffers": shard_bytes}
    if parts["checkpoints"]:
        device_terms["block-input checkpoints"] = parts["checkpoints"]
    if parts["input_side"] > block_total:
        device_terms["input side (patch embedding, position table)"] = parts["input_side"]
    else:
        device_terms.update(block_terms)
        device_terms[f"attention ({VARIANT_LABELS[variant]})"] = parts[variant]
    device_terms["input tensors (fp32)"] = parts["pixels"]
    device_required = shard_bytes + act_totals[variant]
    assert device_required == sum(device_terms.values())
    fits_host = None if ram_gb is None else host_required <= ram_gb * 1e9
    fits_device = None if gpu_gb is None else device_required <= gpu_gb * 1e9
    host_short = 0 if ram_gb is None else max(0, host_required - int(ram_gb * 1e9))
    device_short = 0 if gpu_gb is None else max(0, device_required - int(gpu_gb * 1e9))

    notes = _notes(cfg, generate, wb, P, parts, block_terms, act_totals, variant, fits_host, fits_device,
                   host_short, device_short, device_required, gpu_gb, terms)
    clip = (cfg.data.num_frames, cfg.data.height, cfg.data.width)
    return Plan(
        mode="generate" if generate else "train", preset=cfg.preset, attention=cfg.attention.kind,
        w_dtype=w_dtype, batch_size=B, frames=clip[0], height=clip[1], width=clip[2],
        requested_clip=tuple(requested_clip or clip), latent_space=cfg.latent_space,
        latent_grid=tuple(cfg.latent_grid), in_channels=cfg.model.in_channels,
        token_grid=tuple(cfg.token_grid), tokens_per_sample=N, tokens_per_step=tokens, token_chunk=chunk,
        attention_chunk_tokens=Q,
        params=P, params_per_token=p_tok, params_offset_heads=p_offsets, num_shards=len(counts),
        largest_shard=largest, largest_shard_params=Smax,
        host_bytes=host, host_state_bytes=state, host_state_bytes_per_param=wb if generate else wb + 12,
        moment_bytes=host.get("m", 0) + host.get("v", 0), scratch_bytes=scratch, host_store_bytes=store,
        host_offloaded_bytes=parts["offloaded_checkpoints"], host_reserve_bytes=reserve,
        prefetch_depth=staged_shards(cfg) - 1, offload_keep=0 if generate else offload_keep(cfg),
        device_shard_bytes=shard_bytes, activation_parts=parts,
        block_terms=block_terms, activation_bytes=act_totals, activation_variant=variant,
        device_activation_bytes=act_totals[variant],
        h2d_bytes=h2d, d2h_bytes=d2h, adamw_bytes_per_param=adamw_pp, adamw_store_bytes_per_param=adamw_store_pp,
        adamw_compiled_bytes_per_param=adamw_pp,
        adamw_dram_bytes=adamw_bytes, flops_6pt=flops_6pt, flops_linear=flops_linear,
        flops_attention=flops_attention, flops_recompute=flops_recompute, flops_executed=flops_executed,
        pcie_gbps=pcie_gbps, dram_gbps=dram_gbps, device_tflops=device_tflops, time_terms=terms,
        step_floor_s=terms[binding], binding=binding, sample_steps=sample_steps if generate else 0,
        ram_gb=ram_gb, gpu_gb=gpu_gb, host_required_bytes=host_required, device_required_bytes=device_required,
        host_terms=host_terms, device_terms=device_terms,
        fits_host=fits_host, fits_device=fits_device, host_shortfall_bytes=host_short,
        device_shortfall_bytes=device_short, notes=tuple(notes),
    )


def _notes(cfg: Config, generate: bool, wb: int, P: int, parts: dict[str, int], block_terms: dict[str, int],
           act_totals: dict[str, int], variant: str, fits_host, fits_device, host_short: int, device_short: int,
           device_required: int, gpu_gb: float | None, time_terms: dict[str, float]) -> list[str]:
    """What would change a plan that does not fit (or what it assumes)."""
    notes = []
    m = cfg.model
    ND = cfg.data.batch_size * cfg.tokens_per_sample * m.hidden_size * wb
    whole = sum(v for k, v in block_terms.items() if k.startswith("whole clip"))
    keep = offload_keep(cfg)
    if fits_device is False and keep and not generate:
        notes.append(f"runtime.offload_keep = {cfg.runtime.offload_keep} keeps {keep} block inputs on the device "
                     f"({fmt_bytes(keep * ND)}); a smaller offload_keep frees that much there for as much host RAM")
    if fits_device is False and not cfg.runtime.offload_activations and parts["checkpoints"] > 0.25 * device_required:
        notes.append(f"block-boundary checkpoints alone take {fmt_bytes(parts['checkpoints'])} on the device; "
                     f"runtime.offload_activations (--offload-activations here) keeps them in host RAM for "
                     f"{fmt_bytes(parts['checkpoints'])} more in each PCIe direction per step")
    if fits_device is False and not cfg.runtime.token_chunk and parts["block_linear"] > 0.25 * device_required:
        notes.append(f"one block's working set is {fmt_bytes(parts['block_linear'])} over the whole clip: "
                     f"runtime.token_chunk (--token-chunk N, or auto) runs its per-token parts in chunks")
    if fits_device is False and cfg.runtime.token_chunk and whole > 0.5 * device_required:
        notes.append(f"the whole-clip tensors of one block alone take {fmt_bytes(whole)} "
                     f"({whole // ND} x {fmt_bytes(ND)}): a smaller token chunk cannot help; computing k and v "
                     f"per time slab with its halo instead of for the whole clip (and dq per query chunk) "
                     f"would (not implemented)")
    if fits_host is False:
        if parts["offloaded_checkpoints"]:
            ssd = parts["offloaded_checkpoints"] / 7e9
            notes.append(f"the offloaded block inputs take {fmt_bytes(parts['offloaded_checkpoints'])} of host RAM: "
                         f"a disk tier for them (a separate directory on NVMe; not implemented: they share "
                         f"runtime.state_dir with the store) would free it, at about {ssd:.0f} s each way per step "
                         f"at 7 GB/s, against a compute floor of {time_terms['compute']:.0f} s")
            if gpu_gb is not None and fits_device:
                spare = int(gpu_gb * 1e9) - device_required
                room = min(m.depth - keep, spare // ND) if ND else 0
                if room:
                    notes.append(f"the device has {fmt_bytes(spare)} spare: runtime.offload_keep = {keep + room} "
                                 f"(--offload-keep {keep + room}, or auto) would keep {keep + room} of the {m.depth} "
                                 f"block inputs there, {fmt_bytes(room * ND)} off the host")
        if not generate:
            notes.append(f"bf16 AdamW moments (an option the store does not have) would save 4 B/param, "
                         f"{fmt_bytes(4 * P)}; runtime.state_dir on a fast disk lets the store exceed RAM, at "
                         f"disk speed for AdamW")
    if cfg.attention.kind == "dense":
        notes.append("dense assumes flash/SDPA on the device; a materialised N^2 score matrix would need "
                     f"{fmt_bytes(act_totals['dense_materialised'])} of activations")
    if not generate and not cfg.runtime.recompute_blocks:
        kept = cfg.model.depth * (parts["block_linear"] + parts[variant])
        notes.append(f"runtime.recompute_blocks = false (a CPU compute only) keeps every block's autograd graph: "
                     f"about depth x one block's working set, {fmt_bytes(kept)}, in place of the "
                     f"{fmt_bytes(parts['checkpoints'])} of block inputs counted here, and one forward per block "
                     f"less; this plan counts the recomputing step")
    if generate:
        notes.append("generation holds no gradients, optimizer state or block inputs; classifier-free guidance "
                     "in one batch (sample --cfg-scale) doubles the batch: --guidance")
    return notes


# ---------------------------------------------------------------------------------------------
# Searches: the largest token chunk that fits, the longest clip that fits
# ---------------------------------------------------------------------------------------------


def chunk_candidates(cfg: Config) -> list[int]:
    """Token chunks ``--token-chunk auto`` tries, ascending: halves of one time slice (down to
    ``MIN_SUB_SLICE_CHUNK``), then 1, 2, ... whole time slices up to the whole clip."""
    T, H, W = cfg.token_grid
    S = H * W
    subs = []
    c = S // 2
    while c >= MIN_SUB_SLICE_CHUNK:
        subs.append(c)
        c //= 2
    return sorted(set(subs)) + [k * S for k in range(1, T + 1)]


def _with(cfg: Config, **runtime: Any) -> Config:
    out = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, **runtime))
    return out


def auto_token_chunk(cfg: Config, gpu_gb: float, **kw: Any) -> tuple[int, Plan] | None:
    """The largest candidate token chunk whose plan fits ``gpu_gb`` of device memory, with that
    plan; None when even the smallest does not fit. Device memory grows with the chunk."""
    cands = chunk_candidates(cfg)
    lo, hi, best = 0, len(cands) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        p = plan(_with(cfg, token_chunk=cands[mid]), gpu_gb=gpu_gb, **kw)
        if p.fits_device:
            best, lo = (cands[mid], p), mid + 1
        else:
            hi = mid - 1
    return best


def plan_with_chunk(cfg: Config, token_chunk: int | str | None, **kw: Any) -> Plan:
    """``plan`` with ``token_chunk`` = an int (set on the config), ``auto`` (``auto_token_chunk``;
    the smallest chunk's plan when none fits, to show by how much), or None: the config's
    ``runtime.token_chunk``, except that a config without chunking whose whole-clip plan does not
    fit ``gpu_gb`` gets ``auto`` (and a note saying so)."""
    if token_chunk is None:
        p = plan(cfg, **kw)
        if cfg.runtime.token_chunk or p.fits_device is not False:
            return p
        chosen = plan_with_chunk(cfg, "auto", **kw)
        why = (f"runtime.token_chunk = 0 (the whole clip at once) needs {fmt_bytes(p.device_required_bytes)} "
               f"on the device; ")
        why += (f"the planner chose token_chunk {chosen.token_chunk:,} (--token-chunk auto: the largest that fits; "
                f"--token-chunk 0 shows the unchunked plan)" if chosen.fits_device else
                f"no token chunk fits either; shown with the smallest, {chosen.token_chunk:,}")
        return dataclasses.replace(chosen, notes=(why,) + chosen.notes)
    if token_chunk == "auto":
        if kw.get("gpu_gb") is None:
            raise ConfigError("--token-chunk auto needs --gpu-gb (the device it must fit)")
        found = auto_token_chunk(cfg, **kw)
        if found is not None:
            return _with_partial_offload_note(cfg, found[1], kw)
        return plan(_with(cfg, token_chunk=chunk_candidates(cfg)[0]), **kw)
    if int(token_chunk) < 0:
        raise ConfigError(f"--token-chunk {token_chunk} must be >= 0 (0: whole clip) or auto")
    return plan(_with(cfg, token_chunk=int(token_chunk)), **kw)


def _with_partial_offload_note(cfg: Config, p: Plan, kw: dict) -> Plan:
    """A plan short of host RAM with offloaded block inputs, whose device fits: would keeping
    (more of) them on the device (``runtime.offload_keep``, with a smaller token chunk to make
    room) close the gap? Adds a note naming the count and the chunk when it would."""
    if not (p.fits_host is False and p.fits_device and cfg.runtime.offload_activations and p.token_chunk
            and p.host_offloaded_bytes):
        return p
    L, k0 = cfg.model.depth, p.offload_keep
    ND = p.host_offloaded_bytes // (L - k0)
    need = k0 + -(-p.host_shortfall_bytes // ND)
    if need > L:
        return p
    for c in reversed(chunk_candidates(cfg)):
        if c > p.token_chunk:
            continue
        q = plan(_with(cfg, token_chunk=c, offload_keep=need), **kw)
        if q.fits:
            note = (f"runtime.offload_keep = {need} (--offload-keep {need}, or auto) keeps the last {need} of the "
                    f"{L} block inputs on the device instead of offloading them, {fmt_bytes((need - k0) * ND)} off "
                    f"the host, which closes the gap; with token_chunk {c:,} the device then needs "
                    f"{fmt_bytes(q.device_required_bytes)}")
            return dataclasses.replace(p, notes=p.notes + (note,))
    return p


def plan_with_keep(cfg: Config, token_chunk: int | str | None, keep: int | str | None, **kw: Any) -> Plan:
    """``plan_with_chunk`` with ``runtime.offload_keep`` = ``keep``: an int (set on the config),
    None (the config's), or ``auto``: the smallest k whose host fits ``ram_gb``, then the token
    chunk for that k as ``plan_with_chunk`` picks it (module docstring, "Searches"). A note says
    what was chosen."""
    if keep is None:
        return plan_with_chunk(cfg, token_chunk, **kw)
    if not cfg.runtime.offload_activations or kw.get("generate"):
        raise ConfigError("--offload-keep plans block inputs kept on the device instead of offloaded: it needs "
                          "--offload-activations (and a training plan, not --generate)")
    if keep != "auto":
        if int(keep) < 0:
            raise ConfigError(f"--offload-keep {keep} must be >= 0 or auto")
        return plan_with_chunk(_with(cfg, offload_keep=int(keep)), token_chunk, **kw)
    if kw.get("gpu_gb") is None or kw.get("ram_gb") is None:
        raise ConfigError("--offload-keep auto needs --gpu-gb and --ram-gb (the machine it must fit)")
    L = cfg.model.depth
    # The host terms do not depend on the chunk: plan one (the smallest: cheapest to fit) unkept.
    probe = _with(cfg, offload_keep=0, token_chunk=chunk_candidates(cfg)[0] if token_chunk == "auto"
                  else cfg.runtime.token_chunk if token_chunk is None else int(token_chunk))
    full = plan(probe, **kw)
    ND = full.host_offloaded_bytes // L
    k = min(L, -(-full.host_shortfall_bytes // ND)) if ND else 0
    while k < L and plan(_with(probe, offload_keep=k), **kw).fits_host is False:
        k += 1  # (the division above is exact; this guards the rounding of --ram-gb)
    p = plan_with_chunk(_with(cfg, offload_keep=k), token_chunk, **kw)
    if p.fits_host is False:
        why = (f"--offload-keep auto: even keeping all {L} block inputs on the device leaves the host short by "
               f"{fmt_bytes(p.host_shortfall_bytes)}")
    elif not k:
        why = "--offload-keep auto: the host fits with every block input offloaded (k = 0)"
    else:
        why = (f"--offload-keep auto: k = {k}, the fewest block inputs kept on the device that make the host fit "
               f"(short by {fmt_bytes(full.host_shortfall_bytes)} with all {L} offloaded, {fmt_bytes(ND)} each)")
        if not p.fits_device:
            why += f"; the device does not fit with k = {k}, and a larger k only needs more there"
        elif token_chunk == "auto":
            why += f"; token chunk {p.token_chunk:,}, the largest that then fits the device"
    return dataclasses.replace(p, notes=(why,) + p.notes)


def frame_candidates(cfg: Config, limit: int) -> list[int]:
    """Valid clip lengths in pixel frames, ascending, up to ``limit``: 4k+1 (whose latent frames the
    temporal patch divides) in latent space, multiples of the temporal patch in pixel space; only
    those whose token grid holds the attention window."""
    m = cfg.model
    if cfg.latent_space:
        ct, pt = m.latent_compression[0], m.patch_size[0]
        frames = [k * ct + 1 for k in range(0, (limit - 1) // ct + 1) if (k + 1) % pt == 0]
    else:
        frames = list(range(m.patch_size[0], limit + 1, m.patch_size[0]))
    out = []
    for f in frames:
        probe = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_frames=f))
        if probe.token_grid[0] >= (cfg.attention.window[0] if cfg.attention.kind != "dense" else 1):
            out.append(f)
    return out


@dataclass(frozen=True)
class FrameSearch:
    best_frames: int | None        # the longest clip that fits (None: not even the shortest)
    best: Plan | None              # its plan
    next_frames: int | None        # the next valid length (None: the search limit was reached)
    next: Plan | None              # its plan: what binds, by how much
    tried: int                     # plans evaluated


def max_frames(cfg: Config, token_chunk: int | str | None = None, limit: int = 4097,
               keep: int | str | None = None, **kw: Any) -> FrameSearch:
    """The longest clip (pixel frames, at ``cfg``'s height and width) whose plan fits the machine in
    ``kw`` (``ram_gb`` and/or ``gpu_gb``), by binary search over ``frame_candidates``: memory grows
    with the clip. ``token_chunk`` as in ``plan_with_chunk``, ``keep`` (``runtime.offload_keep``) as
    in ``plan_with_keep`` (``auto`` re-picks them at each length)."""
    if kw.get("gpu_gb") is None and kw.get("ram_gb") is None:
        raise ConfigError("--max-frames needs the machine: --gpu-gb and/or --ram-gb")
    if not kw.get("generate") and (kw.get("gpu_gb") is None or kw.get("ram_gb") is None):
        raise ConfigError("--max-frames for training needs both --gpu-gb and --ram-gb")
    cands = frame_candidates(cfg, limit)
    if not cands:
        raise ConfigError(f"no clip of at most {limit} frames holds the attention window {cfg.attention.window}")
    tried = 0
    cache: dict[int, Plan] = {}

    def at(i: int) -> Plan:
        nonlocal tried
        if i not in cache:
            tried += 1
            f = cands[i]
            c = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_frames=f))
            cache[i] = plan_with_keep(c, token_chunk, keep, **kw)
        return cache[i]

    if not at(0).fits:
        return FrameSearch(None, None, cands[0], at(0), tried)
    lo, hi = 0, len(cands) - 1
    while lo < hi:  # invariant: cands[lo] fits
        mid = (lo + hi + 1) // 2
        if at(mid).fits:
            lo = mid
        else:
            hi = mid - 1
    nxt = lo + 1 if lo + 1 < len(cands) else None
    return FrameSearch(cands[lo], at(lo), None if nxt is None else cands[nxt], None if nxt is None else at(nxt),
                       tried)


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


def clip_lines(p: Plan) -> list[str]:
    """The clip, its latent grid and its token grid (and the padding, if any)."""
    t, h, w = p.token_grid
    lines = []
    if p.requested_clip != (p.frames, p.height, p.width):
        f0, h0, w0 = p.requested_clip
        lines.append(f"  clip {f0} x {h0} x {w0} pixels padded to {p.frames} x {p.height} x {p.width} (the VAE "
                     f"encodes 4k+1 frames; height and width are multiples of compression x patch)")
    if p.latent_space:
        lf, lh, lw = p.latent_grid
        lines.append(f"  clip {p.frames} x {p.height} x {p.width} pixels -> latent grid {lf} x {lh} x {lw} x "
                     f"{p.in_channels} -> token grid {t} x {h} x {w} = {p.tokens_per_sample:,} tokens/sample, "
                     f"{p.tokens_per_step:,} tokens/step")
    else:
        lines.append(f"  clip {p.frames} x {p.height} x {p.width} pixels -> token grid {t} x {h} x {w} = "
                     f"{p.tokens_per_sample:,} tokens/sample, {p.tokens_per_step:,} tokens/step")
    return lines


def render(p: Plan) -> str:
    wb = W_DTYPES[p.w_dtype]
    gen = p.mode == "generate"
    lines: list[str] = []

    def row(label: str, value: str, extra: str = "") -> None:
        lines.append(f"  {label:<58}{value:>11}{'   ' + extra if extra else ''}")

    what = "generation, one denoising step (forward only)" if gen else "training, one optimizer step"
    lines.append(f"megaslide-ray plan: preset {p.preset}, {what}, attention {p.attention}, w {p.w_dtype}, "
                 f"batch {p.batch_size}")
    lines += clip_lines(p)
    lines.append(f"  token chunk {p.token_chunk:,} tokens, attention query chunks of {p.attention_chunk_tokens:,}"
                 if p.token_chunk else "  token chunk: none (whole clip at once; runtime.token_chunk = 0)")
    lines.append(f"  parameters {p.params:,} ({fmt_count(p.params)}) in {p.num_shards} shards; largest: "
                 f"shard {p.largest_shard}, {p.largest_shard_params:,}")
    if p.params_offset_heads:
        lines.append(f"  of which DSA offset heads {p.params_offset_heads:,} ({fmt_count(p.params_offset_heads)}, "
                     f"{100 * p.params_offset_heads / (p.params - p.params_offset_heads):.0f}% on top of the rest; "
                     f"attention.offset_groups shares them between heads)")

    if gen:
        lines.append("\nhost memory (the weights sampling maps)")
        row(f"{f'w ({p.w_dtype})':<52}{wb:>3} B", fmt_bytes(p.host_bytes["w"]))
    else:
        lines.append("\nhost memory (ParameterStore, B/param)")
        for kind, bpp, label in (("w", wb, f"w, compute copy ({p.w_dtype}); gradients land here"),
                                 ("master", 4, "master (fp32)"), ("m", 4, "m (fp32)"), ("v", 4, "v (fp32)")):
            row(f"{label:<52}{bpp:>3} B", fmt_bytes(p.host_bytes[kind]))
        state_label = "= state (the paper's 14 B/param)" if wb == 2 else "= state"
        row(f"{state_label:<52}{p.host_state_bytes_per_param:>3} B", fmt_bytes(p.host_state_bytes))
        row(f"{'    of which moments m + v':<52}{8:>3} B", fmt_bytes(p.moment_bytes))
        if p.scratch_bytes:
            row(f"fp32 update scratch: 4 B x shard {p.largest_shard}", fmt_bytes(p.scratch_bytes))
        if p.host_offloaded_bytes:
            label = (f"offloaded block inputs: (L - {p.offload_keep}) x B x N x D x a" if p.offload_keep
                     else "offloaded block inputs: L x B x N x D x a")
            row(label, fmt_bytes(p.host_offloaded_bytes))
    row("reserve (OS, Ray, processes; --host-reserve-gb)", fmt_bytes(p.host_reserve_bytes))

    lines.append("\ndevice memory")
    parts = p.activation_parts
    row(f"shard buffers: {p.prefetch_depth + 1} x ({'w' if gen else 'w + grad'}) of shard {p.largest_shard}",
        fmt_bytes(p.device_shard_bytes))
    if not gen:
        if p.offload_keep:
            row(f"checkpoints: min(L, {p.prefetch_depth + 1} + {p.offload_keep} kept) x B x N x D x {wb} B",
                fmt_bytes(parts["checkpoints"]), f"(host: {fmt_bytes(parts['offloaded_checkpoints'])})")
        elif parts["offloaded_checkpoints"]:
            row(f"checkpoints: {p.prefetch_depth + 1} x B x N x D x {wb} B (offloaded)",
                fmt_bytes(parts["checkpoints"]), f"(host: {fmt_bytes(parts['offloaded_checkpoints'])})")
        else:
            row(f"checkpoints: L x B x N x D x {wb} B", fmt_bytes(parts["checkpoints"]))
    lines.append("  one block's working set:")
    for name, v in p.block_terms.items():
        row(f"  {name}", fmt_bytes(v))
    row("  = block (without its attention)", fmt_bytes(parts["block_linear"]))
    row("input side: patch embedding, position table", fmt_bytes(parts["input_side"]),
        "(counted instead of the block when larger)")
    row("input tensors (x_t, target, prediction; fp32)" if not gen else "input tensors (x_t, prediction, target; fp32)",
        fmt_bytes(parts["pixels"]))
    q = "" if p.attention_chunk_tokens == p.tokens_per_sample else ", per query chunk"
    lines.append(f"  activations in total, by attention{q}:")
    shown = ["dense_flash", "dense_materialised", "dsa_fused", "dsa_reference"]
    if p.activation_variant not in shown:
        shown.append(p.activation_variant)
    for v in shown:
        mark = "  <- selected" if v == p.activation_variant else ""
        row(f"  {VARIANT_LABELS[v]}", fmt_bytes(p.activation_bytes[v]), f"(attention part {fmt_bytes(parts[v])}){mark}")

    lines.append("\nper denoising step" if gen else "\nper step")
    if gen:
        row("host -> device: weights once", fmt_bytes(p.h2d_bytes))
    else:
        inputs = " + block inputs" if parts["offloaded_checkpoints"] else ""
        row("host -> device: weights twice" + (inputs or " (fwd + bwd)"), fmt_bytes(p.h2d_bytes))
        row("device -> host: gradients" + inputs, fmt_bytes(p.d2h_bytes))
        row(f"AdamW DRAM traffic, {p.adamw_bytes_per_param} B/param", fmt_bytes(p.adamw_dram_bytes),
            f"(the store: fused {p.adamw_store_bytes_per_param} B/param, "
            f"compiled {p.adamw_compiled_bytes_per_param})")
    row("FLOPs executed", f"{p.flops_executed:.3e}")
    if gen:
        row("  linear: 2 x P_tok x tokens", f"{p.flops_linear:.3e}", f"(2 x P x tokens: {p.flops_6pt:.3e})")
        row("  attention: forward", f"{p.flops_attention:.3e}")
    else:
        row("  linear: 6 x P_tok x tokens", f"{p.flops_linear:.3e}", f"(6 x P x tokens: {p.flops_6pt:.3e})")
        row("  attention: forward + backward", f"{p.flops_attention:.3e}")
        row("  recompute: one more forward" + (" (+ one per chunk)" if p.token_chunk else ""),
            f"{p.flops_recompute:.3e}")

    lines.append(f"\n{'denoising-step' if gen else 'step'}-time floor (PCIe {p.pcie_gbps:g} GB/s, "
                 f"{'' if gen else f'DRAM {p.dram_gbps:g} GB/s, '}device {p.device_tflops:g} TFLOP/s)")
    labels = {"h2d": "host -> device / PCIe", "d2h": "device -> host / PCIe", "adamw": "AdamW bytes / DRAM",
              "compute": "FLOPs executed / device"}
    for k, s in p.time_terms.items():
        row(labels[k], fmt_seconds(s), "<- binds" if k == p.binding else "")
    row("= floor", fmt_seconds(p.step_floor_s), f"({p.binding}-bound)")
    if gen:
        row(f"x {p.sample_steps} denoising steps (--sample-steps)", fmt_seconds(p.step_floor_s * p.sample_steps))

    if p.ram_gb is not None or p.gpu_gb is not None:
        lines.append("\nfit")
        if p.ram_gb is not None:
            verdict = "fits" if p.fits_host else f"DOES NOT FIT, short by {fmt_bytes(p.host_shortfall_bytes)}"
            row("host: " + " + ".join(_short_names(p.host_terms)), fmt_bytes(p.host_required_bytes),
                f"vs {p.ram_gb:g} GB RAM: {verdict}")
        if p.gpu_gb is not None:
            verdict = "fits" if p.fits_device else f"DOES NOT FIT, short by {fmt_bytes(p.device_shortfall_bytes)}"
            row("device: shard buffers + activations", fmt_bytes(p.device_required_bytes),
                f"vs {p.gpu_gb:g} GB: {verdict}")
        bind = p.binding_memory
        if bind:
            side, term, short = bind
            row(f"binds: {side}, by {fmt_bytes(short)}; term: {term}",
                fmt_bytes((p.host_terms if side == 'host' else p.device_terms)[term]))
        lines.append(f"  => {'fits: this machine can run it' if p.fits else 'DOES NOT FIT: this machine cannot run it as planned'}")
    for note in p.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _short_names(terms: dict[str, int]) -> list[str]:
    return [k.split(" (")[0] for k in terms]


def render_search(s: FrameSearch, asked: tuple[int, int], mode: str) -> str:
    what = "generation" if mode == "generate" else "training"
    p = s.best if s.best is not None else s.next
    size = f"{asked[0]} x {asked[1]}"
    if (p.height, p.width) != tuple(asked):
        size += f" pixels, padded to {p.height} x {p.width}"
    lines = [f"max-frames search ({what}, {size}): {s.tried} plans"]
    if s.best is None:
        lines.append(f"  not even the shortest clip ({s.next_frames} frames) fits:")
    else:
        b = s.best
        chunk = f", token chunk {b.token_chunk:,}" if b.token_chunk else ""
        lines.append(f"  longest clip that fits: {s.best_frames} frames (latent/token grid "
                     f"{' x '.join(map(str, b.token_grid))}, {b.tokens_per_sample:,} tokens{chunk}; host "
                     f"{fmt_bytes(b.host_required_bytes)}, device {fmt_bytes(b.device_required_bytes)})")
    if s.next is not None:
        bind = s.next.binding_memory
        why = f"{bind[0]} short by {fmt_bytes(bind[2])} (term: {bind[1]})" if bind else "?"
        lines.append(f"  next length, {s.next_frames} frames, does not fit: {why}")
    elif s.best is not None:
        lines.append("  (the search limit was reached)")
    lines.append("")
    lines.append(render(s.best if s.best is not None else s.next))
    if s.best is not None and s.next is not None:
        lines.append("")
        lines.append(f"--- one length further: {s.next_frames} frames ---")
        lines.append(render(s.next))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def config_for(preset: str = "tiny", frames: int | None = None, height: int | None = None,
               width: int | None = None, batch_size: int | None = None, attention: str | None = None,
               config_file: str | None = None, pad: bool = True) -> Config:
    """The preset (or config file) with the shape / attention overrides of the CLI. In latent
    space the clip is padded to the next valid size (``padded_clip``) unless ``pad`` is False;
    ``requested_clip`` then tells what was asked."""
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
    if pad and probe.latent_space:
        f, h, w = padded_clip(probe, probe.data.num_frames, probe.data.height, probe.data.width)
        overrides.update({"data.num_frames": f, "data.height": h, "data.width": w})
        probe.data.num_frames, probe.data.height, probe.data.width = f, h, w
    check_shape(probe)
    return build_config(preset, config_file, overrides)


def requested_clip(preset: str, frames: int | None, height: int | None, width: int | None,
                   config_file: str | None = None) -> tuple[int, int, int]:
    base = build_config(preset, config_file).data
    return (frames or base.num_frames, height or base.height, width or base.width)


def _token_chunk_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens or 'auto'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (0: whole clip) or 'auto'")
    return value


def _offload_keep_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of block inputs or 'auto'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (0: all offloaded) or 'auto'")
    return value


def _positive(kind: type):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{text} must be > 0")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megaslide_ray.plan", description=__doc__.split("\n\n")[0],
                                 epilog="All sizes in decimal GB (1e9 B): a '1.5 TB' server of 24 x 64 GiB DIMMs "
                                        "has --ram-gb 1649; an H200 --gpu-gb 141.")
    ap.add_argument("--preset", default="tiny", help="config preset (tiny, dit-105b, dit-33b, dit-28b, "
                                                     "wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-ti2v-5b)")
    ap.add_argument("--config", default=None, help="TOML config file (as for training)")
    ap.add_argument("--frames", type=_positive(int), default=None,
                    help="clip length in pixel frames (default: the preset's; latent presets pad to 4k+1)")
    ap.add_argument("--height", type=_positive(int), default=None,
                    help="clip height in pixels (default: the preset's; latent presets pad to a multiple of 16)")
    ap.add_argument("--width", type=_positive(int), default=None, help="clip width in pixels (default: the preset's)")
    ap.add_argument("--batch-size", type=_positive(int), default=None, help="clips per step (default: the preset's)")
    ap.add_argument("--attention", default=None, choices=["dense", "swin", "neighborhood", "dsa"],
                    help="attention kind (default: the preset's)")
    ap.add_argument("--w-dtype", default="bfloat16", choices=list(W_DTYPES), help="compute-copy dtype")
    ap.add_argument("--pcie-gbps", type=_positive(float), default=55.0, help="host<->device GB/s each way")
    ap.add_argument("--dram-gbps", type=_positive(float), default=300.0, help="host DRAM GB/s AdamW reaches")
    ap.add_argument("--device-tflops", type=_positive(float), default=990.0, help="device TFLOP/s (bf16 dense)")
    ap.add_argument("--ram-gb", type=_positive(float), default=None, help="host RAM in GB (1e9 B): check the fit")
    ap.add_argument("--gpu-gb", type=_positive(float), default=None,
                    help="device memory in GB (1e9 B): check the fit")
    ap.add_argument("--host-reserve-gb", type=_non_negative_float, default=None,
                    help=f"host RAM kept for the OS, Ray and the processes (default {HOST_RESERVE_GB:g}, or a "
                         f"quarter of --ram-gb when that is less)")
    ap.add_argument("--prefetch-depth", type=int, default=None,
                    help="shards staged ahead of the one computing (runtime.prefetch_depth; default: the config's)")
    ap.add_argument("--offload-activations", action="store_true",
                    help="plan with runtime.offload_activations (block inputs in host RAM)")
    ap.add_argument("--offload-keep", type=_offload_keep_arg, default=None, metavar="N|auto",
                    help="with --offload-activations: runtime.offload_keep, the last N block inputs stay on the "
                         "device (the host segment holds the rest); auto (needs --gpu-gb and --ram-gb): the "
                         "smallest N whose host fits, then the token chunk for it (with --token-chunk auto the "
                         "largest that fits the device). Default: the config's (0: all offloaded)")
    ap.add_argument("--token-chunk", type=_token_chunk_arg, default=None, metavar="N|auto",
                    help="runtime.token_chunk: tokens per chunk of a block's per-token parts (0: whole clip); "
                         "auto: the largest chunk that fits --gpu-gb. Default: the config's, or auto when the "
                         "config does not chunk and the whole clip does not fit --gpu-gb")
    ap.add_argument("--generate", action="store_true",
                    help="plan one denoising step of sampling (forward only) instead of a training step")
    ap.add_argument("--guidance", action="store_true",
                    help="with --generate: classifier-free guidance in one batch (twice the batch)")
    ap.add_argument("--sample-steps", type=_positive(int), default=50,
                    help="with --generate: denoising steps of one sample, for the time floor (default 50)")
    ap.add_argument("--max-frames", action="store_true",
                    help="search the longest clip at --height x --width that fits --gpu-gb (and --ram-gb)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        if args.guidance and not args.generate:
            raise ConfigError("--guidance plans sampling: add --generate")
        if args.max_frames and args.frames is not None:
            raise ConfigError("--max-frames searches the clip length: leave out --frames")
        batch = args.batch_size
        if args.guidance:
            batch = 2 * (batch or build_config(args.preset, args.config).data.batch_size)
        asked = requested_clip(args.preset, args.frames, args.height, args.width, args.config)
        cfg = config_for(args.preset, args.frames, args.height, args.width, batch, args.attention, args.config)
        if args.offload_activations:
            cfg.runtime.offload_activations = True
        if args.prefetch_depth is not None:
            if args.prefetch_depth < 1:
                raise ConfigError(f"--prefetch-depth {args.prefetch_depth} must be >= 1")
            cfg.runtime.prefetch_depth = args.prefetch_depth
        kw = dict(w_dtype=args.w_dtype, pcie_gbps=args.pcie_gbps, dram_gbps=args.dram_gbps,
                  device_tflops=args.device_tflops, ram_gb=args.ram_gb, gpu_gb=args.gpu_gb,
                  generate=args.generate, sample_steps=args.sample_steps, host_reserve_gb=args.host_reserve_gb)
        if args.max_frames:
            search = max_frames(cfg, args.token_chunk, keep=args.offload_keep, **kw)
            if args.json:
                print(json.dumps({"max_frames": search.best_frames, "next_frames": search.next_frames,
                                  "tried": search.tried, "best": search.best.to_dict() if search.best else None,
                                  "next": search.next.to_dict() if search.next else None}))
            else:
                print(render_search(search, asked[1:], "generate" if args.generate else "train"))
            return 0
        result = plan_with_keep(cfg, args.token_chunk, args.offload_keep, requested_clip=asked, **kw)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
