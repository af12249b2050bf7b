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
    shard buffers = (prefetch_depth + 1) * Smax * (w bytes + 4): the block being computed plus
    ``runtime.prefetch_depth`` staged ahead (none with ``runtime.overlap`` off), each with its
    weights and (training) its gradient, summed in fp32 whatever the weights' dtype (the one
    computing and the one on its way to the host: ``ComputeActor``'s ``grad_views``).
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
                                        backward's recompute: 420 GB for 105B in bf16), less
                                        the resident shards' weights (``runtime.resident_gb``:
                                        kept on the device from forward to backward, one fetch)
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

Several GPUs, nodes, micro-batches (``planning/scaleout.py``). ``training.micro_batches`` k: B is
one micro-batch; a GPU's step runs k of them (FLOPs, block inputs kept or offloaded, input tensors
x k) on the same weight traffic, so the transfer-to-compute ratio falls as 1/k. ``gpus_per_node`` G
and ``nodes`` M: device terms stay one GPU's, host terms become one node's (the gradient slots,
the owner's share of the optimizer state), the ``adamw`` term becomes ``host_dram`` (every GPU's
PCIe traffic, the gradient sum and AdamW against the node's DRAM), and with M > 1 a ``network``
term holds the bytes each node sends (and receives) per step against ``network_gbps``.

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

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megaslide_ray.config import Config, ConfigError
from megaslide_ray.models.registry import num_experts
from megaslide_ray.models.shards import grad_slot_numel, resident_shards
from megaslide_ray.planning.scaleout import ScaleOut, scale_out
from megaslide_ray.planning.schedule import predict_step
from megaslide_ray.planning.terms import (
    FIXED_TERMS,
    HOST_RESERVE_GB,
    SELECTED_VARIANT,
    VARIANT_LABELS,
    W_DTYPES,
    _activations,
    _attention_flops_fwd,
    _shard_counts,
    check_shape,
    fmt_bytes,
    offload_keep,
    staged_shards,
    text_tokens,
)

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
    params: int                    # one transformer's (two experts: each one's; the host holds both)
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
    device_shard_bytes: int        # (prefetch_depth + 1) * Smax * (w bytes [+ 4: the fp32 gradient])
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
    # -- several GPUs, nodes, micro-batches (planning/scaleout.py); host terms above are per node
    gpus_per_node: int = 1
    nodes: int = 1
    micro_batches: int = 1         # training.micro_batches: batch_size is one micro-batch
    global_batch: int = 0          # clips per step, all GPUs: gpus x nodes x micro_batches x batch_size
    transfer_compute_ratio: float = 0.0   # host -> device time / compute time, one GPU (falls as 1/k)
    scale: ScaleOut | None = None  # per node: network bytes, host DRAM bytes (training)
    experts: int = 1               # transformers in the host store (2: both experts of a Wan2.2 A14B model)
    resident_shards: tuple[int, ...] = ()  # runtime.resident_gb: shards kept from forward to backward
    resident_bytes: int = 0        # their weights on the device (one fetch per step each, not two)
    # -- the schedule's step (training; planning/schedule.py): not a floor, the predicted time
    step_s: float = 0.0            # with overlap: fetches, compute and returns position by position
    step_off_s: float = 0.0        # fetch, compute, return in sequence
    step_binding: str = ""         # link, compute or host DRAM: the busiest

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


def _refuse_experts_on_several_gpus(cfg: Config, gpus_per_node: int, nodes: int, generate: bool) -> None:
    if num_experts(cfg) > 1 and gpus_per_node * nodes > 1 and not generate:
        raise ConfigError(f"training.expert='both' trains with one compute actor on one node (asked: {gpus_per_node} "
                          f"GPUs x {nodes} nodes); plan each expert's run (training.expert high or low: one "
                          f"transformer, e.g. --preset wan2.1-t2v-14b, the same shape) for several GPUs")


def plan(cfg: Config, w_dtype: str = "bfloat16", pcie_gbps: float = 55.0, dram_gbps: float = 300.0,
         device_tflops: float = 990.0, ram_gb: float | None = None, gpu_gb: float | None = None, *,
         generate: bool = False, sample_steps: int = 50, host_reserve_gb: float | None = None,
         requested_clip: tuple[int, int, int] | None = None, gpus_per_node: int | None = None, nodes: int = 1,
         network_gbps: float = 25.0) -> Plan:
    """Memory, traffic and step-time floor of one training step of ``cfg``, or with ``generate``
    of one denoising step (module docstring). ``gpus_per_node`` (default: ``runtime.compute_actors``
    when a number, else 1), ``nodes`` and ``network_gbps`` (GB/s each way per node): the scale-out
    terms of ``planning/scaleout.py``; ``training.micro_batches`` is read from ``cfg``."""
    if gpus_per_node is None:
        n = cfg.runtime.compute_actors
        gpus_per_node = n if isinstance(n, int) else 1
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    if not (network_gbps > 0 and math.isfinite(network_gbps)):
        raise ConfigError(f"network_gbps={network_gbps!r} must be a finite number > 0 (GB/s)")
    _refuse_experts_on_several_gpus(cfg, gpus_per_node, nodes, generate)
    micro = 1 if generate else cfg.training.micro_batches
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
    tokens = micro * B * N  # one GPU's step: all its micro-batches
    largest = max(range(len(counts)), key=lambda i: counts[i])
    Smax = counts[largest]
    chunk = min(cfg.runtime.token_chunk, N)

    # -- host memory: every expert's state (two experts: both in the store); the traffic below is one's
    PH = num_experts(cfg) * P
    if generate:
        host = {"w": wb * PH}
        state, scratch = host["w"], 0
    else:
        scratch = 4 * Smax if wb == 2 else 0  # the bf16 gradient is upcast into it for AdamW
        host = {"w": wb * PH, "master": 4 * PH, "m": 4 * PH, "v": 4 * PH, "scratch": scratch}
        state = host["w"] + host["master"] + host["m"] + host["v"]
    store = state + scratch

    # -- device memory
    shard_bytes = staged_shards(cfg) * Smax * (wb if generate else wb + 4)  # gradients are summed in fp32
    resident = [] if generate else resident_shards(cfg.model.depth, counts, wb, cfg.runtime.resident_gb * 1e9)
    resident_bytes = sum(counts[i] for i in resident) * wb
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
        h2d = 2 * P * wb - resident_bytes + offloaded  # a resident shard's weights cross once
        d2h = P * wb + offloaded
        adamw_pp = wb + 12 + 12 + wb
        adamw_store_pp = adamw_pp + (12 if wb == 2 else 4)  # fused; bf16: g upcast and w cast; fp32: w.copy_
        adamw_bytes = P * adamw_pp
        flops_linear = 6.0 * p_tok * tokens + micro * (6.0 * p_sample * B + 6.0 * p_text * n_text)
        flops_attention = 3.0 * micro * attn_fwd
        flops_recompute = 2.0 * p_tok * tokens + micro * (2.0 * p_text * n_text + attn_fwd)
        if chunk:  # the nested per-chunk checkpoint: one more forward of the blocks
            flops_recompute += 2.0 * p_tok * tokens + micro * attn_fwd
        flops_6pt = 6.0 * P * tokens
    flops_executed = flops_linear + flops_attention + flops_recompute

    terms = {"h2d": h2d / (pcie_gbps * 1e9)}
    if not generate:
        terms["d2h"] = d2h / (pcie_gbps * 1e9)
        terms["adamw"] = adamw_bytes / (dram_gbps * 1e9)
    terms["compute"] = flops_executed / (device_tflops * 1e12)
    scale = None
    label = "offloaded block inputs ((L - k) x ND)" if offload_keep(cfg) else "offloaded block inputs (L x ND)"
    if micro > 1:
        label = label.replace("x ND)", f"x {micro} micro-batches x ND)")
    if not generate:
        scale = scale_out(counts, wb, gpus_per_node, nodes, cfg.runtime.grad_slots, micro, network_gbps, adamw_pp,
                          h2d, d2h, parts["offloaded_checkpoints"], label, cfg.runtime.grad_slot_mb, num_experts(cfg))
        if gpus_per_node * nodes > 1:  # the node's DRAM serves every GPU's link, the gradient sum and AdamW
            del terms["adamw"]
            terms["host_dram"] = scale.host_dram_bytes / (dram_gbps * 1e9)
        if nodes > 1:
            terms["network"] = scale.network_bytes / (network_gbps * 1e9)
    binding = max(terms, key=terms.__getitem__)
    node = {"host DRAM": terms["host_dram"]} if "host_dram" in terms else {}
    node.update({"network": terms["network"]} if "network" in terms else {})
    sched = None if generate else predict_step(cfg, wb, pcie_gbps, device_tflops, dram_gbps, node)

    # -- fit
    reserve = int(round(host_reserve_gb * 1e9))
    if generate:
        host_terms = {"weights w": state}
        if parts["offloaded_checkpoints"]:
            host_terms[label] = parts["offloaded_checkpoints"]
    else:
        host_terms = dict(scale.host_terms)
    host_terms["reserve (OS, Ray, processes)"] = reserve
    host_required = sum(host_terms.values())
    kernel_scratch = parts.get(variant + "_scratch", 0)  # on the device (``scratch`` is the host's)
    block_total = parts["block_linear"] + parts[variant] + kernel_scratch
    device_terms = {"shard buffers": shard_bytes}
    if resident_bytes:
        device_terms[f"resident shards ({len(resident)}, kept from forward to backward)"] = resident_bytes
    if parts["checkpoints"]:
        device_terms["block-input checkpoints"] = parts["checkpoints"]
    if parts["input_side"] > block_total:
        device_terms["input side (patch embedding, position table)"] = parts["input_side"]
    else:
        device_terms.update(block_terms)
        device_terms[f"attention ({VARIANT_LABELS[variant]})"] = parts[variant]
        if kernel_scratch:
            device_terms["attention kernels' scratch (records, scores or fp32 dk/dv)"] = kernel_scratch
    device_terms["input tensors (fp32)"] = parts["pixels"]
    device_required = shard_bytes + resident_bytes + act_totals[variant]
    assert device_required == sum(device_terms.values())
    fits_host = None if ram_gb is None else host_required <= ram_gb * 1e9
    fits_device = None if gpu_gb is None else device_required <= gpu_gb * 1e9
    host_short = 0 if ram_gb is None else max(0, host_required - int(ram_gb * 1e9))
    device_short = 0 if gpu_gb is None else max(0, device_required - int(gpu_gb * 1e9))

    notes = _notes(cfg, generate, wb, P, parts, block_terms, act_totals, variant, fits_host, fits_device,
                   host_short, device_short, device_required, gpu_gb, terms)
    if nodes > 1 and not generate:
        notes.append(f"{nodes} nodes (runtime.nodes = {nodes}): one store per node, the optimizer state of shard l on "
                     f"node l % {nodes}, each shard's gradients summed at its owner and the new w sent back through "
                     f"Ray (docs/architecture.md, several nodes); the received gradients wait in Ray's object store "
                     f"(the network receive slots term)")
    slots = cfg.runtime.grad_slots
    if fits_host is False and not generate and slots > 1 and gpus_per_node * nodes > 1:
        slot = grad_slot_numel(Smax, cfg.runtime.grad_slot_mb, wb)  # the GPUs' slots; network receive slots: whole
        saved = ((gpus_per_node if gpus_per_node > 1 else 0) * slot + (nodes - 1) * Smax) * (slots - 1) * wb
        notes.append(f"runtime.grad_slots = 1 (--grad-slots 1) would free {fmt_bytes(saved)} of host per node (a GPU "
                     f"then waits for each sum before it returns its next gradient)")
    if gpus_per_node > 1 and not generate and terms.get("host_dram", 0) >= max(terms["h2d"], terms["compute"]):
        notes.append(f"the node's DRAM binds: {gpus_per_node} GPUs read {fmt_bytes(gpus_per_node * h2d)} of weights "
                     f"per step over their links, all from the same DRAM ({dram_gbps:g} GB/s, --dram-gbps), "
                     f"beside the gradient sum and AdamW; micro-batches (--micro-batches) spread them over more "
                     f"compute")
    clip = (cfg.data.num_frames, cfg.data.height, cfg.data.width)
    return Plan(
        mode="generate" if generate else "train", preset=cfg.preset, attention=cfg.attention.kind,
        w_dtype=w_dtype, batch_size=B, frames=clip[0], height=clip[1], width=clip[2],
        requested_clip=tuple(requested_clip or clip), latent_space=cfg.latent_space,
        latent_grid=tuple(cfg.latent_grid), in_channels=cfg.model.in_channels,
        token_grid=tuple(cfg.token_grid), tokens_per_sample=N, tokens_per_step=tokens * gpus_per_node * nodes,
        token_chunk=chunk,
        attention_chunk_tokens=Q,
        experts=num_experts(cfg), params=P, params_per_token=p_tok, params_offset_heads=p_offsets, num_shards=len(counts),
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
        gpus_per_node=gpus_per_node, nodes=nodes, micro_batches=micro,
        global_batch=gpus_per_node * nodes * micro * B, transfer_compute_ratio=terms["h2d"] / terms["compute"],
        scale=scale, resident_shards=tuple(resident), resident_bytes=resident_bytes,
        step_s=sched.seconds if sched else 0.0, step_off_s=sched.off_seconds if sched else 0.0,
        step_binding=sched.binding if sched else "",
    )


def _notes(cfg: Config, generate: bool, wb: int, P: int, parts: dict[str, int], block_terms: dict[str, int],
           act_totals: dict[str, int], variant: str, fits_host, fits_device, host_short: int, device_short: int,
           device_required: int, gpu_gb: float | None, time_terms: dict[str, float]) -> list[str]:
    """What would change a plan that does not fit (or what it assumes)."""
    notes = []
    m = cfg.model
    ND1 = cfg.data.batch_size * cfg.tokens_per_sample * m.hidden_size * wb  # one micro-batch's whole-clip tensor
    ND = (1 if generate else cfg.training.micro_batches) * ND1  # a kept block holds every micro-batch's input
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
                     f"({whole // ND1} x {fmt_bytes(ND1)}): a smaller token chunk cannot help; computing k and v "
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
    a = cfg.attention
    if a.kind == "dsa" and a.max_offset == 0 and cfg.runtime.device != "cpu":
        notes.append("attention.max_offset = 0 leaves dsa's offsets unbounded: on a GPU the forward and the "
                     "backward's query side then run on CUDA cores (the gather kernels), and the backward adds "
                     "the dk and dv of the queries with an offset past 3 tokens by float atomics (in the "
                     "adaptation study 4-9% of them); attention.max_offset 1.5 with "
                     "attention.offset_bound clamp (the GPU presets' setting) keeps every pass on tensor cores "
                     "(benchmarks/RESULTS.md: what the bound costs in held-out loss)")
    if a.kind == "dense":
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


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
