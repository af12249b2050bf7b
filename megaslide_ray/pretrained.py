"""``python -m megaslide_ray.pretrained CHECKPOINT OUT [--format safetensors|diffusers]``

The command line of ``megaslide_ray.state.pretrained_io``: export a checkpoint's weights under
standard names. It parses the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import sys

import torch

from megaslide_ray.state.pretrained_io import export_diffusers, export_state_dict


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.pretrained",
                                description="Export a checkpoint's weights as a standard-named safetensors "
                                            "state dict (loadable by VideoDiT(cfg).load_state_dict and --init-from).")
    p.add_argument("checkpoint", help="RUN/checkpoints/step_N")
    p.add_argument("out", help="OUT.safetensors (one file) or a directory (one file per shard)")
    p.add_argument("--kind", default="master", choices=["master", "w", "ema"],
                   help="which weights: master (fp32, the default), w (the compute copy) or ema (the fp32 moving "
                        "average of a run with training.ema_decay)")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "diffusers"],
                   help="safetensors: the project's standard names; diffusers: a WanTransformer3DModel folder "
                        "(config.json + shards + index; wan checkpoints)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast the weights on export (default: as stored, fp32 master)")
    p.add_argument("--drop-offsets", action="store_true",
                   help="--format diffusers: leave out the DSA offset heads (attn1.offsets.*)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUT (a file, or a directory's earlier export); without it an existing "
                        "OUT is refused")
    args = p.parse_args(argv)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype)
    try:
        if args.format == "diffusers":
            if args.kind not in ("master", "ema"):
                raise ValueError("--format diffusers exports the fp32 weights: --kind master or ema")
            paths = export_diffusers(args.checkpoint, args.out, dtype, args.drop_offsets, args.overwrite, args.kind)
        else:
            paths = export_state_dict(args.checkpoint, args.out, args.kind, dtype, args.overwrite)
    except (ValueError, OSError) as e:  # a missing checkpoint, an unwritable OUT: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
