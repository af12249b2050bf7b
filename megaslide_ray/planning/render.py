"""The planner's printed tables: a ``Plan`` term by term, and a ``FrameSearch``."""

from __future__ import annotations

from megaslide_ray.planning.estimate import Plan
from megaslide_ray.planning.search import FrameSearch
from megaslide_ray.planning.terms import VARIANT_LABELS, W_DTYPES, fmt_bytes, fmt_count, fmt_seconds


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


class _Lines(list):
    """The lines of a printed plan; ``row`` writes one term: its label, its value right-aligned."""

    def row(self, label: str, value: str, extra: str = "") -> None:
        self.append(f"  {label:<58}{value:>11}{'   ' + extra if extra else ''}")


def render(p: Plan) -> str:
    """The plan as the command line prints it: the run, then host memory, device memory, the
    traffic and FLOPs of a step, the step-time floor, the fit, and the plan's notes."""
    out = _Lines()
    for part in (_header, _host_memory, _device_memory, _traffic, _floor, _fit):
        part(p, out)
    out += [f"note: {note}" for note in p.notes]
    return "\n".join(out)


def _header(p: Plan, out: _Lines) -> None:
    """The run: preset, mode, batch and GPUs, the clip, the token chunk, the parameters."""
    gen = p.mode == "generate"
    what = "generation, one denoising step (forward only)" if gen else "training, one optimizer step"
    out.append(f"megaslide-ray plan: preset {p.preset}, {what}, attention {p.attention}, w {p.w_dtype}, "
               f"batch {p.batch_size}")
    if not gen and (p.gpus_per_node > 1 or p.nodes > 1 or p.micro_batches > 1):
        out.append(f"  {p.gpus_per_node} GPU(s) per node x {p.nodes} node(s), {p.micro_batches} micro-batch(es) "
                   f"of {p.batch_size} per GPU: global batch {p.global_batch} clips per step; device terms are "
                   f"one GPU's, host terms one node's")
    out += clip_lines(p)
    out.append(f"  token chunk {p.token_chunk:,} tokens, attention query chunks of {p.attention_chunk_tokens:,}"
               if p.token_chunk else "  token chunk: none (whole clip at once; runtime.token_chunk = 0)")
    out.append(f"  parameters {p.params:,} ({fmt_count(p.params)}) in {p.num_shards} shards; largest: "
               f"shard {p.largest_shard}, {p.largest_shard_params:,}")
    if p.experts > 1:
        out.append(f"  two experts: the host holds both ({fmt_count(p.experts * p.params)} parameters); a step "
                   f"streams and updates one")
    if p.params_offset_heads:
        out.append(f"  of which DSA offset heads {p.params_offset_heads:,} ({fmt_count(p.params_offset_heads)}, "
                   f"{100 * p.params_offset_heads / (p.params - p.params_offset_heads):.0f}% on top of the rest; "
                   f"attention.offset_groups shares them between heads)")


def _host_memory(p: Plan, out: _Lines) -> None:
    """Host memory term by term (the store per parameter, or the weights sampling maps)."""
    gen = p.mode == "generate"
    wb = W_DTYPES[p.w_dtype]
    if gen:
        out.append("\nhost memory (the weights sampling maps)")
        out.row(f"{f'w ({p.w_dtype})':<52}{wb:>3} B", fmt_bytes(p.host_bytes["w"]))
    else:
        out.append("\nhost memory (ParameterStore, B/param)")
        for kind, bpp, label in (("w", wb, f"w, compute copy ({p.w_dtype}); gradients land here"),
                                 ("master", 4, "master (fp32)"), ("m", 4, "m (fp32)"), ("v", 4, "v (fp32)"),
                                 ("ema", 4, "ema, the weights' moving average (fp32)")):
            if kind in p.host_bytes:
                out.row(f"{label:<52}{bpp:>3} B", fmt_bytes(p.host_bytes[kind]))
        state_label = "= state (the paper's 14 B/param)" if wb == 2 and "ema" not in p.host_bytes else "= state"
        out.row(f"{state_label:<52}{p.host_state_bytes_per_param:>3} B", fmt_bytes(p.host_state_bytes))
        out.row(f"{'    of which moments m + v':<52}{8:>3} B", fmt_bytes(p.moment_bytes))
        if p.scratch_bytes:
            out.row(f"fp32 update scratch: 4 B x shard {p.largest_shard}", fmt_bytes(p.scratch_bytes))
        if p.host_offloaded_bytes:
            label = (f"offloaded block inputs: (L - {p.offload_keep}) x B x N x D x a" if p.offload_keep
                     else "offloaded block inputs: L x B x N x D x a")
            out.row(label, fmt_bytes(p.host_offloaded_bytes))
        if p.teacher_bytes:
            out.row(f"dense teacher (distillation): {p.teacher_params:,} params x {wb} B, frozen",
                    fmt_bytes(p.teacher_bytes))
    if p.scale is not None and (p.gpus_per_node > 1 or p.nodes > 1):
        out.append(f"\nhost memory per node ({p.gpus_per_node} GPU(s) x {p.nodes} node(s); planning/scaleout.py)")
        for name, v in p.scale.host_terms.items():
            out.row(name, fmt_bytes(v))
    out.row("reserve (OS, Ray, processes; --host-reserve-gb)", fmt_bytes(p.host_reserve_bytes))


def _device_memory(p: Plan, out: _Lines) -> None:
    """Device memory: shard buffers, resident shards, kept block inputs, one block's working set,
    and the activations by attention kind."""
    gen = p.mode == "generate"
    wb = W_DTYPES[p.w_dtype]
    out.append("\ndevice memory")
    parts = p.activation_parts
    out.row(f"shard buffers: {p.prefetch_depth + 1} x ({'w' if gen else 'w + fp32 grad'}) of shard {p.largest_shard}",
            fmt_bytes(p.device_shard_bytes))
    if p.resident_bytes:
        out.row(f"resident shards: {len(p.resident_shards)} kept from forward to backward (runtime.resident_gb)",
                fmt_bytes(p.resident_bytes))
    if p.device_state_bytes:
        out.row("device shards: w + fp32 master, m, v, gradient, updated here (runtime.device_shards)",
                fmt_bytes(p.device_state_bytes))
    if not gen:
        if p.offload_keep:
            out.row(f"checkpoints: min(L, {p.prefetch_depth + 1} + {p.offload_keep} kept) x B x N x D x {wb} B",
                    fmt_bytes(parts["checkpoints"]), f"(host: {fmt_bytes(parts['offloaded_checkpoints'])})")
        elif parts["offloaded_checkpoints"]:
            out.row(f"checkpoints: {p.prefetch_depth + 1} x B x N x D x {wb} B (offloaded)",
                    fmt_bytes(parts["checkpoints"]), f"(host: {fmt_bytes(parts['offloaded_checkpoints'])})")
        else:
            out.row(f"checkpoints: L x B x N x D x {wb} B", fmt_bytes(parts["checkpoints"]))
    out.append("  one block's working set:")
    for name, v in p.block_terms.items():
        out.row(f"  {name}", fmt_bytes(v))
    out.row("  = block (without its attention)", fmt_bytes(parts["block_linear"]))
    out.row("input side: patch embedding, position table", fmt_bytes(parts["input_side"]),
            "(counted instead of the block when larger)")
    out.row("input tensors (x_t, target, prediction; fp32)" if not gen else "input tensors (x_t, prediction, target; fp32)",
            fmt_bytes(parts["pixels"]))
    q = "" if p.attention_chunk_tokens == p.tokens_per_sample else ", per query chunk"
    out.append(f"  activations in total, by attention{q}:")
    shown = ["dense_flash", "dense_materialised", "dsa_fused", "dsa_reference"]
    if p.activation_variant not in shown:
        shown.append(p.activation_variant)
    for v in shown:
        mark = "  <- selected" if v == p.activation_variant else ""
        extra = f", kernel scratch {fmt_bytes(parts[v + '_scratch'])}" if parts.get(v + "_scratch") else ""
        out.row(f"  {VARIANT_LABELS[v]}", fmt_bytes(p.activation_bytes[v]),
                f"(attention part {fmt_bytes(parts[v])}{extra}){mark}")


def _traffic(p: Plan, out: _Lines) -> None:
    """Bytes moved and FLOPs executed in one step."""
    gen = p.mode == "generate"
    parts = p.activation_parts
    out.append("\nper denoising step" if gen else "\nper step")
    if gen:
        out.row("host -> device: weights once", fmt_bytes(p.h2d_bytes))
    else:
        inputs = " + block inputs" if parts["offloaded_checkpoints"] else ""
        resident = f", {len(p.resident_shards)} resident shards once" if p.resident_shards else ""
        out.row("host -> device: weights twice" + (inputs or " (fwd + bwd)") + resident, fmt_bytes(p.h2d_bytes))
        out.row("device -> host: gradients" + inputs, fmt_bytes(p.d2h_bytes))
        out.row(f"AdamW DRAM traffic, {p.adamw_bytes_per_param} B/param", fmt_bytes(p.adamw_dram_bytes),
                f"(the store: fused {p.adamw_store_bytes_per_param} B/param, "
                f"compiled {p.adamw_compiled_bytes_per_param})")
    if p.scale is not None and (p.gpus_per_node > 1 or p.nodes > 1):
        out.row(f"host DRAM traffic per node ({p.gpus_per_node} GPUs' links, sum, AdamW)",
                fmt_bytes(p.scale.host_dram_bytes))
        if p.nodes > 1:
            out.row("network per node, each way (gradients to owners, w back)", fmt_bytes(p.scale.network_bytes))
    out.row("FLOPs executed" + (" (one GPU)" if p.gpus_per_node > 1 or p.nodes > 1 else ""), f"{p.flops_executed:.3e}")
    if gen:
        out.row("  linear: 2 x P_tok x tokens", f"{p.flops_linear:.3e}", f"(2 x P x tokens: {p.flops_6pt:.3e})")
        out.row("  attention: forward", f"{p.flops_attention:.3e}")
    else:
        out.row("  linear: 6 x P_tok x tokens", f"{p.flops_linear:.3e}", f"(6 x P x tokens: {p.flops_6pt:.3e})")
        out.row("  attention: forward + backward", f"{p.flops_attention:.3e}")
        out.row("  recompute: one more forward" + (" (+ one per chunk)" if p.token_chunk else ""),
                f"{p.flops_recompute:.3e}")
        if p.flops_teacher:
            out.row("  dense teacher: one forward (distillation; its weights cross once more)",
                    f"{p.flops_teacher:.3e}")


def _floor(p: Plan, out: _Lines) -> None:
    """The step-time floor: each bound's time, the one that binds."""
    gen = p.mode == "generate"
    net = f", network {p.scale.network_gbps:g} GB/s" if p.scale is not None and p.nodes > 1 else ""
    out.append(f"\n{'denoising-step' if gen else 'step'}-time floor (PCIe {p.pcie_gbps:g} GB/s, "
               f"{'' if gen else f'DRAM {p.dram_gbps:g} GB/s, '}device {p.device_tflops:g} TFLOP/s{net})")
    labels = {"h2d": "host -> device / PCIe", "d2h": "device -> host / PCIe", "adamw": "AdamW bytes / DRAM",
              "compute": "FLOPs executed / device", "host_dram": "host DRAM traffic of the node / DRAM",
              "network": "network bytes per node / network"}
    for k, s in p.time_terms.items():
        out.row(labels[k], fmt_seconds(s), "<- binds" if k == p.binding else "")
    out.row("= floor", fmt_seconds(p.step_floor_s), f"({p.binding}-bound)")
    if p.step_s:
        out.row(f"predicted step: the schedule, prefetch depth {p.prefetch_depth} (planning/schedule.py)",
                fmt_seconds(p.step_s), f"({p.step_binding} binds; overlap off: {fmt_seconds(p.step_off_s)})")
        if p.step_boundary_s:
            out.row("  of which the compute waits at the step boundary (first fetches, last gradients)",
                    fmt_seconds(p.step_boundary_s), "(its share falls with depth and with --micro-batches k; "
                    "--device-shards 2 removes it for the device memory of shard 0 and block 1)")
    if not gen:
        out.row("transfer / compute, one GPU (host -> device time / compute time)", f"{p.transfer_compute_ratio:.3g}",
                "(falls as 1/k with --micro-batches k)")
    if gen:
        out.row(f"x {p.sample_steps} denoising steps (--sample-steps)", fmt_seconds(p.step_floor_s * p.sample_steps))


def _fit(p: Plan, out: _Lines) -> None:
    """Whether the plan fits the given host and device memory, and what binds."""
    if p.ram_gb is None and p.gpu_gb is None:
        return
    out.append("\nfit")
    if p.ram_gb is not None:
        verdict = "fits" if p.fits_host else f"DOES NOT FIT, short by {fmt_bytes(p.host_shortfall_bytes)}"
        out.row("host: " + " + ".join(_short_names(p.host_terms)), fmt_bytes(p.host_required_bytes),
                f"vs {p.ram_gb:g} GB RAM: {verdict}")
    if p.gpu_gb is not None:
        verdict = "fits" if p.fits_device else f"DOES NOT FIT, short by {fmt_bytes(p.device_shortfall_bytes)}"
        out.row("device: shard buffers + " + ("resident shards + " if p.resident_bytes else "")
                + ("device shards + " if p.device_state_bytes else "") + "activations",
                fmt_bytes(p.device_required_bytes),
                f"vs {p.gpu_gb:g} GB: {verdict}")
    bind = p.binding_memory
    if bind:
        side, term, short = bind
        out.row(f"binds: {side}, by {fmt_bytes(short)}; term: {term}",
                fmt_bytes((p.host_terms if side == 'host' else p.device_terms)[term]))
    out.append(f"  => {'fits: this machine can run it' if p.fits else 'DOES NOT FIT: this machine cannot run it as planned'}")


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
