"""Memory and step-time planner: will a preset run on a machine, and what bounds its step?

``plan`` builds the config's shards on the ``meta`` device (no memory is touched), counts host
and device memory term by term, the host<->device traffic, the AdamW DRAM traffic and the FLOPs
of one training step (or, ``generate``, one denoising step), and returns a ``Plan`` holding each
term, the step-time floor and, given the machine's memory, whether it fits. The formulas are in
``terms.py`` and ``scaleout.py``; docs/planner.md derives every term.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from megaslide_ray.config import Config, ConfigError
from megaslide_ray.config.buckets import largest_bucket
from megaslide_ray.models.registry import distills, num_experts, teacher_config
from megaslide_ray.models.shards import grad_slot_numel, resident_shards
from megaslide_ray.planning.scaleout import ScaleOut, scale_out
from megaslide_ray.planning.schedule import StepPrediction, predict_step
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
    dense_share,
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
    device_state_bytes: int = 0    # runtime.device_shards: their w, fp32 master, m, v and gradient on the device
    # -- the schedule's step (training; planning/schedule.py): not a floor, the predicted time
    step_s: float = 0.0            # with overlap: fetches, compute and returns position by position
    step_off_s: float = 0.0        # fetch, compute, return in sequence
    step_binding: str = ""         # link, compute or host DRAM: the busiest
    step_boundary_s: float = 0.0   # of step_s, the compute's waits at the step boundary (first fetches, last gradients)
    # -- distillation (training.distill_weight > 0): the frozen dense teacher
    teacher_params: int = 0        # one transformer's dense teacher (no offset heads)
    teacher_bytes: int = 0         # its weights in host RAM, compute dtype (every expert's; per node)
    flops_teacher: float = 0.0     # its forward per step (dense attention, no backward), in flops_executed

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
                          f"GPUs x {nodes} nodes); plan each expert's run for several GPUs: --preset "
                          f"{cfg.preset} with a --config TOML holding [training] expert = \"high\" (or \"low\"): one "
                          f"transformer")


@dataclass(frozen=True)
class _Sizes:
    """What one step moves and computes: the shards and the tokens (``plan``'s first step)."""
    wb: int                    # bytes of one compute-copy weight (w_dtype)
    counts: list[int]          # parameters per shard
    p_tok: int                 # parameters applied to every video token
    p_sample: int              # ... once per sample
    p_text: int                # ... to every text token (wan)
    p_offsets: int             # the DSA offset heads' parameters
    P: int                     # one transformer's parameters
    B: int                     # clips per micro-batch
    N: int                     # tokens per clip
    micro: int                 # micro-batches per step (1 in generation)
    tokens: int                # one GPU's step: all its micro-batches
    largest: int               # index of the largest shard
    Smax: int                  # its parameters
    chunk: int                 # token chunk (0: whole clip)


@dataclass(frozen=True)
class _Memory:
    """Host and device memory of one step, before the fit."""
    teacher: int               # distillation: the dense teacher's frozen w (0 without)
    host: dict[str, int]       # w, master, m, v, scratch (training); w (generation)
    state: int                 # w + master + m + v (generation: w)
    scratch: int
    store: int                 # state + scratch
    shard_bytes: int
    resident: list[int]        # the resident shards' indices
    resident_bytes: int
    device_params: int         # runtime.device_shards: their parameters (state on the device, not streamed)
    device_bytes: int          # their w + fp32 master, m, v + the fp32 gradient kept until their update
    parts: dict[str, int]
    block_terms: dict[str, int]
    act_totals: dict[str, int]
    Q: int                     # query tokens per attention chunk
    variant: str               # the attention variant the configured kind runs as


@dataclass(frozen=True)
class _Traffic:
    """Bytes over the link and through host DRAM, and the FLOPs of one step."""
    h2d: int
    d2h: int
    adamw_pp: int
    adamw_store_pp: int
    adamw_bytes: int
    flops_linear: float
    flops_attention: float
    flops_recompute: float
    flops_6pt: float
    flops_executed: float
    flops_teacher: float       # distillation: the dense teacher's forward (in flops_executed)


@dataclass(frozen=True)
class _Timing:
    """The step-time floor's terms, the scale-out terms and the schedule's predicted step."""
    terms: dict[str, float]
    binding: str
    scale: ScaleOut | None
    label: str                 # the host term of offloaded block inputs
    sched: StepPrediction | None   # planning/schedule.py's predicted step (None in generation)


@dataclass(frozen=True)
class _Fit:
    """What host and device need, and whether the machine holds it."""
    reserve: int
    host_terms: dict[str, int]
    host_required: int
    device_terms: dict[str, int]
    device_required: int
    fits_host: bool | None
    fits_device: bool | None
    host_short: int
    device_short: int


def plan(cfg: Config, w_dtype: str = "bfloat16", pcie_gbps: float = 55.0, dram_gbps: float = 300.0,
         device_tflops: float = 990.0, ram_gb: float | None = None, gpu_gb: float | None = None, *,
         generate: bool = False, sample_steps: int = 50, host_reserve_gb: float | None = None,
         requested_clip: tuple[int, int, int] | None = None, gpus_per_node: int | None = None, nodes: int = 1,
         network_gbps: float = 25.0) -> Plan:
    """Memory, traffic and step-time floor of one training step of ``cfg``, or with ``generate``
    of one denoising step (module docstring). ``gpus_per_node`` (default: ``runtime.compute_actors``
    when a number, else 1), ``nodes`` and ``network_gbps`` (GB/s each way per node): the scale-out
    terms of ``planning/scaleout.py``; ``training.micro_batches`` is read from ``cfg``. With
    ``data.buckets`` it answers for the bucket of the most tokens."""
    cfg = largest_bucket(cfg)
    gpus_per_node, host_reserve_gb = _checked_arguments(
        cfg, w_dtype, pcie_gbps, dram_gbps, device_tflops, ram_gb, gpu_gb, generate, sample_steps, host_reserve_gb,
        gpus_per_node, nodes, network_gbps)
    sizes = _sizes(cfg, w_dtype, generate)
    memory = _memory(cfg, sizes, generate)
    traffic = _traffic(cfg, sizes, memory, generate)
    timing = _timing(cfg, sizes, memory, traffic, generate, pcie_gbps, dram_gbps, device_tflops, gpus_per_node,
                     nodes, network_gbps)
    fit = _fit(memory, timing, generate, ram_gb, gpu_gb, host_reserve_gb)
    notes = _notes(cfg, sizes, memory, timing, fit, generate, gpu_gb)
    notes += _scale_out_notes(cfg, sizes, traffic, timing, fit, generate, dram_gbps, gpus_per_node, nodes)
    return _assemble(cfg, sizes, memory, traffic, timing, fit, notes, w_dtype=w_dtype, pcie_gbps=pcie_gbps,
                     dram_gbps=dram_gbps, device_tflops=device_tflops, ram_gb=ram_gb, gpu_gb=gpu_gb,
                     generate=generate, sample_steps=sample_steps, requested_clip=requested_clip,
                     gpus_per_node=gpus_per_node, nodes=nodes)


def _checked_arguments(cfg: Config, w_dtype: str, pcie_gbps: float, dram_gbps: float, device_tflops: float,
                       ram_gb: float | None, gpu_gb: float | None, generate: bool, sample_steps: int,
                       host_reserve_gb: float | None, gpus_per_node: int | None, nodes: int,
                       network_gbps: float) -> tuple[int, float]:
    """``plan``'s refusals, in order (``ConfigError``); the defaults it fills in: (gpus_per_node,
    host_reserve_gb)."""
    if gpus_per_node is None:
        n = cfg.runtime.compute_actors
        gpus_per_node = n if isinstance(n, int) else 1
    for name, value in (("gpus_per_node", gpus_per_node), ("nodes", nodes)):
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(f"{name}={value!r} must be an integer >= 1")
    if not (network_gbps > 0 and math.isfinite(network_gbps)):
        raise ConfigError(f"network_gbps={network_gbps!r} must be a finite number > 0 (GB/s)")
    _refuse_experts_on_several_gpus(cfg, gpus_per_node, nodes, generate)
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
    return gpus_per_node, host_reserve_gb


def _sizes(cfg: Config, w_dtype: str, generate: bool) -> _Sizes:
    """The shards' parameter counts and the tokens of one GPU's step."""
    micro = 1 if generate else cfg.training.micro_batches
    counts, p_tok, p_sample, p_text, p_offsets = _shard_counts(cfg)
    B, N = cfg.data.batch_size, cfg.tokens_per_sample
    largest = max(range(len(counts)), key=lambda i: counts[i])
    return _Sizes(wb=W_DTYPES[w_dtype], counts=counts, p_tok=p_tok, p_sample=p_sample, p_text=p_text,
                  p_offsets=p_offsets, P=sum(counts), B=B, N=N, micro=micro, tokens=micro * B * N,
                  largest=largest, Smax=counts[largest], chunk=min(cfg.runtime.token_chunk, N))


def _memory(cfg: Config, s: _Sizes, generate: bool) -> _Memory:
    """Host memory (every expert's state: two experts are both in the store; the traffic is one's)
    and the device's shard buffers, resident shards and activations."""
    wb, PH = s.wb, num_experts(cfg) * s.P
    if generate:
        host = {"w": wb * PH}
        state, scratch = host["w"], 0
    else:
        scratch = 4 * s.Smax if wb == 2 else 0  # the bf16 gradient is upcast into it for AdamW
        host = {"w": wb * PH, "master": 4 * PH, "m": 4 * PH, "v": 4 * PH, "scratch": scratch}
        if cfg.training.ema_decay:  # the moving average of the weights, fp32 beside master
            host["ema"] = 4 * PH
        state = host["w"] + host["master"] + host["m"] + host["v"] + host.get("ema", 0)
    shard_bytes = staged_shards(cfg) * s.Smax * (wb if generate else wb + 4)  # gradients are summed in fp32
    on_device = 0 if generate else cfg.runtime.device_shards  # (kept across steps: not resident as well)
    resident = [] if generate else [i for i in resident_shards(cfg.model.depth, s.counts, wb,
                                                                   cfg.runtime.resident_gb * 1e9) if i >= on_device]
    device_params = sum(s.counts[:on_device])
    parts, block_terms, act_totals, Q = _activations(cfg, wb, generate)
    teacher = 0 if generate else wb * num_experts(cfg) * teacher_params(cfg)
    return _Memory(teacher=teacher, host=host, state=state, scratch=scratch, store=state + scratch, shard_bytes=shard_bytes,
                   resident=resident, resident_bytes=sum(s.counts[i] for i in resident) * wb,
                   device_params=device_params, device_bytes=device_params * (wb + 16), parts=parts,
                   block_terms=block_terms, act_totals=act_totals, Q=Q, variant=SELECTED_VARIANT[cfg.attention.kind])


def _traffic(cfg: Config, s: _Sizes, mem: _Memory, generate: bool) -> _Traffic:
    """Host <-> device bytes, AdamW's DRAM bytes and the FLOPs of one step."""
    wb, P, B, micro, tokens = s.wb, s.P, s.B, s.micro, s.tokens
    attn_fwd = _attention_flops_fwd(cfg)
    n_text = B * text_tokens(cfg)
    if generate:
        h2d, d2h, adamw_pp, adamw_store_pp, adamw_bytes = P * wb, 0, 0, 0, 0
        flops_linear = 2.0 * s.p_tok * tokens + 2.0 * s.p_sample * B + 2.0 * s.p_text * n_text
        flops_attention = attn_fwd
        flops_recompute = 0.0
        flops_6pt = 2.0 * P * tokens
    else:
        # offloaded block inputs all go out and come back, the ones a step holds on the device included
        offloaded = mem.parts["offloaded_checkpoints"]
        # a resident shard's weights cross once, a device shard's never (runtime.device_shards)
        h2d = 2 * (P - mem.device_params) * wb - mem.resident_bytes + offloaded
        d2h = (P - mem.device_params) * wb + offloaded
        adamw_pp = wb + 12 + 12 + wb + (12 if cfg.training.ema_decay else 0)  # the average: master read, ema r/w
        adamw_store_pp = adamw_pp + (12 if wb == 2 else 4)  # fused; bf16: g upcast and w cast; fp32: w.copy_
        adamw_bytes = (P - mem.device_params) * adamw_pp  # (device shards: updated on the device)
        flops_linear = 6.0 * s.p_tok * tokens + micro * (6.0 * s.p_sample * B + 6.0 * s.p_text * n_text)
        flops_attention = 3.0 * micro * attn_fwd
        flops_recompute = 2.0 * s.p_tok * tokens + micro * (2.0 * s.p_text * n_text + attn_fwd)
        if s.chunk:  # the nested per-chunk checkpoint: one more forward of the blocks
            flops_recompute += 2.0 * s.p_tok * tokens + micro * attn_fwd
        flops_6pt = 6.0 * P * tokens
    flops_teacher = 0.0 if generate else teacher_forward_flops(cfg)
    if flops_teacher:
        h2d += wb * teacher_params(cfg)  # the teacher's weights cross once per step (its forward)
    return _Traffic(h2d=h2d, d2h=d2h, adamw_pp=adamw_pp, adamw_store_pp=adamw_store_pp, adamw_bytes=adamw_bytes,
                    flops_linear=flops_linear, flops_attention=flops_attention, flops_recompute=flops_recompute,
                    flops_6pt=flops_6pt, flops_teacher=flops_teacher,
                    flops_executed=flops_linear + flops_attention + flops_recompute + flops_teacher)


def teacher_params(cfg: Config) -> int:
    """Parameters of one transformer's dense teacher (``training.distill_weight`` > 0; else 0)."""
    return sum(_shard_counts(teacher_config(cfg))[0]) if distills(cfg) else 0


def teacher_forward_flops(cfg: Config) -> float:
    """FLOPs of the dense teacher's forward per step (``training.distill_weight`` > 0; else 0):
    its linear layers on every token, sample and text token, and dense attention, once per
    micro-batch, with no backward and no recompute."""
    if not distills(cfg):
        return 0.0
    tcfg = teacher_config(cfg)
    _, p_tok, p_sample, p_text, _ = _shard_counts(tcfg)
    B, micro = cfg.data.batch_size, cfg.training.micro_batches
    linear = 2.0 * p_tok * micro * B * cfg.tokens_per_sample + micro * (2.0 * p_sample * B
                                                                       + 2.0 * p_text * B * text_tokens(cfg))
    return linear + micro * _attention_flops_fwd(tcfg)


def _timing(cfg: Config, s: _Sizes, mem: _Memory, tr: _Traffic, generate: bool, pcie_gbps: float,
            dram_gbps: float, device_tflops: float, gpus_per_node: int, nodes: int, network_gbps: float) -> _Timing:
    """The step-time floor's terms (seconds) and the one that binds; in training the scale-out
    terms (several GPUs share the node's DRAM, several nodes the network) and the schedule's step."""
    terms = {"h2d": tr.h2d / (pcie_gbps * 1e9)}
    if not generate:
        terms["d2h"] = tr.d2h / (pcie_gbps * 1e9)
        terms["adamw"] = tr.adamw_bytes / (dram_gbps * 1e9)
    terms["compute"] = tr.flops_executed / (device_tflops * 1e12)
    scale = None
    label = "offloaded block inputs ((L - k) x ND)" if offload_keep(cfg) else "offloaded block inputs (L x ND)"
    if s.micro > 1:
        label = label.replace("x ND)", f"x {s.micro} micro-batches x ND)")
    if not generate:
        scale = scale_out(s.counts, s.wb, gpus_per_node, nodes, cfg.runtime.grad_slots, s.micro, network_gbps,
                          tr.adamw_pp, tr.h2d, tr.d2h, mem.parts["offloaded_checkpoints"], label,
                          cfg.runtime.grad_slot_mb, num_experts(cfg), ema=bool(cfg.training.ema_decay))
        if gpus_per_node * nodes > 1:  # the node's DRAM serves every GPU's link, the gradient sum and AdamW
            del terms["adamw"]
            terms["host_dram"] = scale.host_dram_bytes / (dram_gbps * 1e9)
        if nodes > 1:
            terms["network"] = scale.network_bytes / (network_gbps * 1e9)
    binding = max(terms, key=terms.__getitem__)
    node = {"host DRAM": terms["host_dram"]} if "host_dram" in terms else {}
    node.update({"network": terms["network"]} if "network" in terms else {})
    sched = None if generate else predict_step(cfg, s.wb, pcie_gbps, device_tflops, dram_gbps, node)
    return _Timing(terms=terms, binding=binding, scale=scale, label=label, sched=sched)


def _fit(mem: _Memory, timing: _Timing, generate: bool, ram_gb: float | None, gpu_gb: float | None,
         host_reserve_gb: float) -> _Fit:
    """The terms host and device memory add up to, and whether (and by how much not) they fit."""
    parts, variant = mem.parts, mem.variant
    reserve = int(round(host_reserve_gb * 1e9))
    if generate:
        host_terms = {"weights w": mem.state}
        if parts["offloaded_checkpoints"]:
            host_terms[timing.label] = parts["offloaded_checkpoints"]
    else:
        host_terms = dict(timing.scale.host_terms)
    if mem.teacher:
        host_terms["dense teacher (distillation, frozen w)"] = mem.teacher
    host_terms["reserve (OS, Ray, processes)"] = reserve
    host_required = sum(host_terms.values())
    kernel_scratch = parts.get(variant + "_scratch", 0)  # on the device (``scratch`` is the host's)
    block_total = parts["block_linear"] + parts[variant] + kernel_scratch
    device_terms = {"shard buffers": mem.shard_bytes}
    if mem.resident_bytes:
        device_terms[f"resident shards ({len(mem.resident)}, kept from forward to backward)"] = mem.resident_bytes
    if mem.device_bytes:
        device_terms["device shards (runtime.device_shards: w, fp32 master, m, v, gradient)"] = mem.device_bytes
    if parts["checkpoints"]:
        device_terms["block-input checkpoints"] = parts["checkpoints"]
    if parts["input_side"] > block_total:
        device_terms["input side (patch embedding, position table)"] = parts["input_side"]
    else:
        device_terms.update(mem.block_terms)
        device_terms[f"attention ({VARIANT_LABELS[variant]})"] = parts[variant]
        if kernel_scratch:
            device_terms["attention kernels' scratch (records, scores or fp32 dk/dv)"] = kernel_scratch
    device_terms["input tensors (fp32)"] = parts["pixels"]
    device_required = mem.shard_bytes + mem.resident_bytes + mem.device_bytes + mem.act_totals[variant]
    assert device_required == sum(device_terms.values())
    return _Fit(reserve=reserve, host_terms=host_terms, host_required=host_required, device_terms=device_terms,
                device_required=device_required,
                fits_host=None if ram_gb is None else host_required <= ram_gb * 1e9,
                fits_device=None if gpu_gb is None else device_required <= gpu_gb * 1e9,
                host_short=0 if ram_gb is None else max(0, host_required - int(ram_gb * 1e9)),
                device_short=0 if gpu_gb is None else max(0, device_required - int(gpu_gb * 1e9)))


def _scale_out_notes(cfg: Config, s: _Sizes, tr: _Traffic, timing: _Timing, fit: _Fit, generate: bool,
                     dram_gbps: float, gpus_per_node: int, nodes: int) -> list[str]:
    """The notes of a training plan on several GPUs or nodes (after ``_notes``')."""
    notes = []
    if nodes > 1 and not generate:
        notes.append(f"{nodes} nodes (runtime.nodes = {nodes}): one store per node, the optimizer state of shard l on "
                     f"node l % {nodes}, each shard's gradients summed at its owner and the new w sent back through "
                     f"Ray (docs/architecture.md, several nodes); the received gradients wait in Ray's object store "
                     f"(the network receive slots term)")
    slots, terms = cfg.runtime.grad_slots, timing.terms
    if fit.fits_host is False and not generate and slots > 1 and gpus_per_node * nodes > 1:
        slot = grad_slot_numel(s.Smax, cfg.runtime.grad_slot_mb, s.wb)  # the GPUs' slots; network receive slots: whole
        saved = ((gpus_per_node if gpus_per_node > 1 else 0) * slot + (nodes - 1) * s.Smax) * (slots - 1) * s.wb
        notes.append(f"runtime.grad_slots = 1 (--grad-slots 1) would free {fmt_bytes(saved)} of host per node (a GPU "
                     f"then waits for each sum before it returns its next gradient)")
    if gpus_per_node > 1 and not generate and terms.get("host_dram", 0) >= max(terms["h2d"], terms["compute"]):
        notes.append(f"the node's DRAM binds: {gpus_per_node} GPUs read {fmt_bytes(gpus_per_node * tr.h2d)} of weights "
                     f"per step over their links, all from the same DRAM ({dram_gbps:g} GB/s, --dram-gbps), "
                     f"beside the gradient sum and AdamW; micro-batches (--micro-batches) spread them over more "
                     f"compute")
    return notes


def _assemble(cfg: Config, s: _Sizes, mem: _Memory, tr: _Traffic, timing: _Timing, fit: _Fit, notes: list[str], *,
              w_dtype: str, pcie_gbps: float, dram_gbps: float, device_tflops: float, ram_gb: float | None,
              gpu_gb: float | None, generate: bool, sample_steps: int,
              requested_clip: tuple[int, int, int] | None, gpus_per_node: int, nodes: int) -> Plan:
    """The ``Plan`` of the steps' results."""
    clip = (cfg.data.num_frames, cfg.data.height, cfg.data.width)
    terms, sched, parts = timing.terms, timing.sched, mem.parts
    return Plan(
        mode="generate" if generate else "train", preset=cfg.preset, attention=cfg.attention.kind,
        w_dtype=w_dtype, batch_size=s.B, frames=clip[0], height=clip[1], width=clip[2],
        requested_clip=tuple(requested_clip or clip), latent_space=cfg.latent_space,
        latent_grid=tuple(cfg.latent_grid), in_channels=cfg.model.in_channels,
        token_grid=tuple(cfg.token_grid), tokens_per_sample=s.N, tokens_per_step=s.tokens * gpus_per_node * nodes,
        token_chunk=s.chunk, attention_chunk_tokens=mem.Q,
        experts=num_experts(cfg), params=s.P, params_per_token=s.p_tok, params_offset_heads=s.p_offsets,
        num_shards=len(s.counts), largest_shard=s.largest, largest_shard_params=s.Smax,
        host_bytes=mem.host, host_state_bytes=mem.state, host_state_bytes_per_param=s.wb if generate else s.wb + 12 + (4 if "ema" in mem.host else 0),
        moment_bytes=mem.host.get("m", 0) + mem.host.get("v", 0), scratch_bytes=mem.scratch,
        host_store_bytes=mem.store, host_offloaded_bytes=parts["offloaded_checkpoints"],
        host_reserve_bytes=fit.reserve,
        prefetch_depth=staged_shards(cfg) - 1, offload_keep=0 if generate else offload_keep(cfg),
        device_shard_bytes=mem.shard_bytes, activation_parts=parts,
        block_terms=mem.block_terms, activation_bytes=mem.act_totals, activation_variant=mem.variant,
        device_activation_bytes=mem.act_totals[mem.variant],
        h2d_bytes=tr.h2d, d2h_bytes=tr.d2h, adamw_bytes_per_param=tr.adamw_pp,
        adamw_store_bytes_per_param=tr.adamw_store_pp, adamw_compiled_bytes_per_param=tr.adamw_pp,
        adamw_dram_bytes=tr.adamw_bytes, flops_6pt=tr.flops_6pt, flops_linear=tr.flops_linear,
        flops_attention=tr.flops_attention, flops_recompute=tr.flops_recompute, flops_executed=tr.flops_executed,
        pcie_gbps=pcie_gbps, dram_gbps=dram_gbps, device_tflops=device_tflops, time_terms=terms,
        step_floor_s=terms[timing.binding], binding=timing.binding, sample_steps=sample_steps if generate else 0,
        ram_gb=ram_gb, gpu_gb=gpu_gb, host_required_bytes=fit.host_required,
        device_required_bytes=fit.device_required, host_terms=fit.host_terms, device_terms=fit.device_terms,
        fits_host=fit.fits_host, fits_device=fit.fits_device, host_shortfall_bytes=fit.host_short,
        device_shortfall_bytes=fit.device_short, notes=tuple(notes),
        gpus_per_node=gpus_per_node, nodes=nodes, micro_batches=s.micro,
        global_batch=gpus_per_node * nodes * s.micro * s.B, transfer_compute_ratio=terms["h2d"] / terms["compute"],
        scale=timing.scale, resident_shards=tuple(mem.resident), resident_bytes=mem.resident_bytes,
        device_state_bytes=mem.device_bytes,
        step_s=sched.seconds if sched else 0.0, step_off_s=sched.off_seconds if sched else 0.0,
        step_binding=sched.binding if sched else "", step_boundary_s=sched.boundary_s if sched else 0.0,
        teacher_params=teacher_params(cfg) if mem.teacher else 0, teacher_bytes=mem.teacher,
        flops_teacher=tr.flops_teacher,
    )


def _notes(cfg: Config, s: _Sizes, mem: _Memory, timing: _Timing, fit: _Fit, generate: bool,
           gpu_gb: float | None) -> list[str]:
    """What would change a plan that does not fit (or what it assumes), from ``plan``'s steps."""
    notes = []
    m, parts, fits_device, device_required = cfg.model, mem.parts, fit.fits_device, fit.device_required
    ND1 = cfg.data.batch_size * cfg.tokens_per_sample * m.hidden_size * s.wb  # one micro-batch's whole-clip tensor
    ND = (1 if generate else cfg.training.micro_batches) * ND1  # a kept block holds every micro-batch's input
    whole = sum(v for k, v in mem.block_terms.items() if k.startswith("whole clip"))
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
    if fit.fits_host is False:
        if parts["offloaded_checkpoints"]:
            ssd = parts["offloaded_checkpoints"] / 7e9
            notes.append(f"the offloaded block inputs take {fmt_bytes(parts['offloaded_checkpoints'])} of host RAM: "
                         f"a disk tier for them (a separate directory on NVMe; not implemented: they share "
                         f"runtime.state_dir with the store) would free it, at about {ssd:.0f} s each way per step "
                         f"at 7 GB/s, against a compute floor of {timing.terms['compute']:.0f} s")
            if gpu_gb is not None and fits_device:
                spare = int(gpu_gb * 1e9) - device_required
                room = min(m.depth - keep, spare // ND) if ND else 0
                if room:
                    notes.append(f"the device has {fmt_bytes(spare)} spare: runtime.offload_keep = {keep + room} "
                                 f"(--offload-keep {keep + room}, or auto) would keep {keep + room} of the {m.depth} "
                                 f"block inputs there, {fmt_bytes(room * ND)} off the host")
        if not generate:
            notes.append(f"bf16 AdamW moments (an option the store does not have) would save 4 B/param, "
                         f"{fmt_bytes(4 * s.P)}; runtime.state_dir on a fast disk lets the store exceed RAM, at "
                         f"disk speed for AdamW")
    a = cfg.attention
    if a.kind == "dsa" and a.max_offset == 0 and cfg.runtime.device != "cpu":
        notes.append("attention.max_offset = 0 leaves dsa's offsets unbounded: on a GPU the forward and the "
                     "backward's query side then run on CUDA cores (the gather kernels), and the backward adds "
                     "the dk and dv of the queries with an offset past 3 tokens by float atomics (in the "
                     "adaptation study 4-9% of them); attention.max_offset 1.5 with "
                     "attention.offset_bound clamp (the GPU presets' setting) keeps every pass on tensor cores "
                     "(docs/dsa.md, the bound a call runs at: what the bound costs in held-out loss)")
    if a.kind == "dense":
        notes.append("dense assumes flash/SDPA on the device; a materialised N^2 score matrix would need "
                     f"{fmt_bytes(mem.act_totals['dense_materialised'])} of activations")
    if a.kind != "dense" and (a.dense_blocks or a.dense_above_t > 0 or a.dense_warmup_steps > 0):
        notes.append(f"dense attention beside {a.kind}: {len(tuple(a.dense_blocks))} dense blocks and "
                     f"{dense_share(cfg):.1%} of the samples dense in every block (t >= attention.dense_above_t) "
                     f"are in the attention FLOPs; the curriculum's first {a.dense_warmup_steps} steps, which run both "
                     f"kinds, are not; the activations are counted as {a.kind}'s (python -m kernels.dsa_lever_cost "
                     f"prices the levers)")
    if not generate and not cfg.runtime.recompute_blocks:
        kept = cfg.model.depth * (parts["block_linear"] + parts[mem.variant])
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
