"""``python -m megaslide_ray.plan --preset dit-105b``

The command line of ``megaslide_ray.planning``: will a preset fit, and what bounds its step. It
parses the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import json
import math
import sys

from megaslide_ray import planning
from megaslide_ray.config import Config, ConfigError, build_config
from megaslide_ray.planning.render import render, render_search
from megaslide_ray.planning.search import config_for, max_frames, plan_with_resident, requested_clip
from megaslide_ray.planning.terms import HOST_RESERVE_GB, W_DTYPES, validate_plan


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


def _resident_arg(text: str) -> float | str:
    if text == "auto":
        return text
    return _non_negative_float(text)


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


def _parser() -> argparse.ArgumentParser:
    """The command line: the clip and the model, the machine, the runtime, the mode."""
    ap = argparse.ArgumentParser(prog="python -m megaslide_ray.plan", description=planning.__doc__.split("\n\n")[0],
                                 epilog="All sizes in decimal GB (1e9 B): a '1.5 TB' server of 24 x 64 GiB DIMMs "
                                        "has --ram-gb 1649; an H200 --gpu-gb 141.")
    ap.add_argument("--preset", default="tiny", help="config preset (tiny, dit-105b, dit-33b, dit-28b, "
                                                     "wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-ti2v-5b, "
                                                     "wan2.2-t2v-a14b, wan2.2-i2v-a14b: both experts on the host; "
                                                     "wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p, "
                                                     "wan2.1-flf2v-14b-720p)")
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
    _add_runtime_args(ap)
    ap.add_argument("--generate", action="store_true",
                    help="plan one denoising step of sampling (forward only) instead of a training step")
    ap.add_argument("--guidance", action="store_true",
                    help="with --generate: classifier-free guidance in one batch (twice the batch)")
    ap.add_argument("--sample-steps", type=_positive(int), default=50,
                    help="with --generate: denoising steps of one sample, for the time floor (default 50)")
    ap.add_argument("--max-frames", action="store_true",
                    help="search the longest clip at --height x --width that fits --gpu-gb (and --ram-gb)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def _add_runtime_args(ap: argparse.ArgumentParser) -> None:
    """The runtime settings a plan may override: reserve, prefetch, offload, chunk, GPUs and nodes,
    resident shards, gradient slots, network."""
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
    ap.add_argument("--gpus-per-node", type=_positive(int), default=None,
                    help="GPUs (compute actors) per node sharing the node's store (runtime.compute_actors; "
                         "default: the config's, 1 for auto): host terms per node, the DRAM all of them draw")
    ap.add_argument("--nodes", type=_positive(int), default=1,
                    help="nodes (runtime.nodes), one store each, optimizer state sharded by owner: "
                         "host bytes and network bytes per node")
    ap.add_argument("--micro-batches", type=_positive(int), default=None,
                    help="training.micro_batches: layer-major micro-batches of --batch-size per GPU and step "
                         "(default: the config's)")
    ap.add_argument("--resident-gb", type=_resident_arg, default=None, metavar="GB|auto",
                    help="runtime.resident_gb: device GB for shards kept from their forward to their backward "
                         "(one fetch per step instead of two); auto (needs --gpu-gb): what the plan leaves free")
    ap.add_argument("--device-shards", type=int, default=None, metavar="N",
                    help="runtime.device_shards: the forward's first N shards kept and updated on the device (no "
                         "step boundary; their w and fp32 state there; default: the config's)")
    ap.add_argument("--grad-slots", type=_positive(int), default=None,
                    help="runtime.grad_slots: gradient slots per GPU in the store's scratch (default: the config's)")
    ap.add_argument("--grad-slot-mb", type=float, default=None, metavar="MB",
                    help="runtime.grad_slot_mb: one gradient slot's MB (a larger shard goes in pieces; 0: the "
                         "largest shard; default: the config's, 512)")
    ap.add_argument("--ema-decay", type=float, default=None,
                    help="training.ema_decay: the store keeps a moving average of the weights (4 B/param more, "
                         "fp32; 0: none; default: the config's)")
    ap.add_argument("--distill-weight", type=float, default=None, metavar="W",
                    help="training.distill_weight: W > 0 counts the frozen dense teacher (its host weights, its "
                         "forward and one more crossing of its weights per step)")
    ap.add_argument("--network-gbps", type=_positive(float), default=25.0,
                    help="with --nodes > 1: network GB/s each way per node (default 25: 200 Gb/s)")


def _config(args: argparse.Namespace) -> tuple[Config, tuple[int, int, int]]:
    """The config the flags describe, and the clip asked for (before padding); ``ConfigError``
    for a combination of flags that plans nothing."""
    if args.guidance and not args.generate:
        raise ConfigError("--guidance plans sampling: add --generate")
    if args.max_frames and args.frames is not None:
        raise ConfigError("--max-frames searches the clip length: leave out --frames")
    if args.generate and args.offload_keep == "auto":  # one command line plans training and, with
        # --generate, sampling; a number of kept inputs with --generate is still refused (no backward)
        print("note: --offload-keep auto is ignored with --generate: sampling runs no backward, so it keeps no "
              "block input", file=sys.stderr)
        args.offload_keep = None
    batch = args.batch_size
    if args.guidance:
        batch = 2 * (batch or build_config(args.preset, args.config).data.batch_size)
    asked = requested_clip(args.preset, args.frames, args.height, args.width, args.config)
    cfg = config_for(args.preset, args.frames, args.height, args.width, batch, args.attention, args.config)
    if args.resident_gb == "auto" and args.max_frames:
        raise ConfigError("--resident-gb auto uses the device a plan leaves free; with --max-frames give GB")
    _apply_flags(cfg, args)
    return cfg, asked


_FIELD_FLAGS = (("offload_activations", "runtime.offload_activations"), ("micro_batches", "training.micro_batches"),
                ("resident_gb", "runtime.resident_gb"), ("device_shards", "runtime.device_shards"),
                ("grad_slots", "runtime.grad_slots"),
                ("grad_slot_mb", "runtime.grad_slot_mb"), ("ema_decay", "training.ema_decay"),
                ("distill_weight", "training.distill_weight"), ("prefetch_depth", "runtime.prefetch_depth"))
"""The flags that set one config field each (the argument's name, the field)."""


def _apply_flags(cfg: Config, args: argparse.Namespace) -> None:
    """Set the fields of ``_FIELD_FLAGS`` the command line gives, then check ``cfg`` as a run's
    config is checked: a bad value is refused by the config's own rule, its message naming the flag."""
    set_by = {}
    for name, field in _FIELD_FLAGS:
        value = getattr(args, name)
        if value is None or value is False or value == "auto":  # not given (auto: the plan picks it)
            continue
        section, key = field.split(".")
        setattr(getattr(cfg, section), key, value)
        flag = "--" + name.replace("_", "-")
        set_by[field] = flag if value is True else f"{flag} {value}"
    try:
        validate_plan(cfg)
    except ConfigError as e:
        flags = [flag for field, flag in set_by.items() if f"{field}=" in str(e)]
        raise ConfigError(f"{e}" + (f" (set by {', '.join(flags)})" if flags else "")) from None


def _machine(args: argparse.Namespace) -> dict:
    """The machine and mode arguments of ``plan``."""
    return dict(w_dtype=args.w_dtype, pcie_gbps=args.pcie_gbps, dram_gbps=args.dram_gbps,
                device_tflops=args.device_tflops, ram_gb=args.ram_gb, gpu_gb=args.gpu_gb,
                generate=args.generate, sample_steps=args.sample_steps, host_reserve_gb=args.host_reserve_gb,
                gpus_per_node=args.gpus_per_node, nodes=args.nodes, network_gbps=args.network_gbps)


def _print_search(args: argparse.Namespace, cfg: Config, asked: tuple[int, int, int], kw: dict) -> None:
    """``--max-frames``: the longest clip that fits, as a table or JSON."""
    search = max_frames(cfg, args.token_chunk, keep=args.offload_keep, **kw)
    if args.json:
        print(json.dumps({"max_frames": search.best_frames, "next_frames": search.next_frames,
                          "tried": search.tried, "best": search.best.to_dict() if search.best else None,
                          "next": search.next.to_dict() if search.next else None}))
    else:
        print(render_search(search, asked[1:], "generate" if args.generate else "train"))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg, asked = _config(args)
        kw = _machine(args)
        if args.max_frames:
            _print_search(args, cfg, asked, kw)
            return 0
        result = plan_with_resident(cfg, args.token_chunk, args.offload_keep,
                                    "auto" if args.resident_gb == "auto" else None, requested_clip=asked,
                                    **kw)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
