"""``python -m megaslide_ray.precompute --model-dir WAN_DIR --data MANIFEST --out CACHE --frames F ...``

The command line of ``pipelines/latent_precompute.py`` (and, with ``--buckets``,
``pipelines/bucket_precompute.py``): VAE latents and text embeddings of a video manifest. It
parses the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from megaslide_ray.config.buckets import parse_buckets
from megaslide_ray.config.sections import ConfigError
from megaslide_ray.data.encoders import read_model_info
from megaslide_ray.data.latent_cache import LATENTS_DIR, SKIPPED_NAME
from pipelines.bucket_precompute import precompute_buckets
from pipelines.encoder_pool import HANG_TIMEOUT_S
from pipelines.latent_precompute import precompute


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaslide_ray.precompute",
                                     description="Precompute Wan VAE latents and UMT5 text embeddings of a video "
                                                 "manifest (a latent manifest for training).")
    parser.add_argument("--model-dir", required=True,
                        help="local diffusers Wan folder (vae/, text_encoder/, tokenizer/)")
    parser.add_argument("--data", required=True, help="video manifest (Parquet; make one with megaslide_ray.index)")
    parser.add_argument("--out", required=True, help="cache folder: latents/, text/, manifest.parquet")
    parser.add_argument("--frames", type=int, default=None, help="pixel frames per clip, 4k+1 (e.g. 81)")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--buckets", default="", metavar="HxWxF,...",
                        help="instead of --frames/--height/--width: each video at its bucket's shape, one sub-folder "
                             "per bucket (train with the same data.buckets)")
    parser.add_argument("--fps", type=float, default=0.0, help="resample clips to this rate (0: consecutive frames)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="storage dtype")
    parser.add_argument("--num-encoders", type=int, default=None,
                        help="encoder actors (default: one per GPU, or min(CPUs, 4) on CPU); "
                             "0: in this process, no Ray")
    parser.add_argument("--hang-timeout", type=float, default=HANG_TIMEOUT_S, metavar="SECONDS",
                        help=f"an encoder actor that finishes no call (two clips) for this long is killed as hung and "
                             f"replaced, its clips retried one at a time (default {HANG_TIMEOUT_S:.0f}; 0: never)")
    parser.add_argument("--ray-address", default=None, help="join a running Ray cluster")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if bool(args.buckets) == (None not in (args.frames, args.height, args.width)):
        parser.error("give --frames, --height and --width, or --buckets (not both)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # what the folder is, before Ray starts
        read_model_info(args.model_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ray_address and args.num_encoders != 0:
        import ray

        ray.init(address=args.ray_address, namespace="megaslide")
    try:
        if args.buckets:
            return _run_buckets(args)
        rep = precompute(args.model_dir, args.data, args.out, args.frames, args.height, args.width, fps=args.fps,
                         device=args.device, dtype=args.dtype, num_encoders=args.num_encoders,
                         progress=not args.no_progress, hang_timeout_s=args.hang_timeout)
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        done = len(list((Path(args.out) / LATENTS_DIR).glob("*.safetensors")))
        print(f"interrupted: the {done} clip(s) already encoded are kept in {Path(args.out) / LATENTS_DIR}; run the "
              f"same command again to continue (it skips every clip and caption already written)",
              file=sys.stderr, flush=True)
        return 130
    how = (f"{rep.encoders} encoder actors on {rep.device}" if rep.encoders else f"in this process on {rep.device}"
           ) if rep.device else "nothing left to encode"
    print(f"{rep.clips} clips in {rep.manifest}: {rep.encoded} encoded, {rep.reused} already done, "
          f"{len(rep.skipped)} skipped; captions: {rep.texts_encoded} encoded, {rep.texts_reused} already done "
          f"({rep.seconds:.1f} s, {how})")
    for path, reason in rep.skipped:
        print(f"  skipped: {path}: {reason}")
    if rep.skipped:
        print(f"  (listed in {Path(args.out) / SKIPPED_NAME})")
    return 0 if rep.clips else 1


def _run_buckets(args: argparse.Namespace) -> int:
    """``--buckets``: ``pipelines/bucket_precompute.py``."""
    try:
        buckets = parse_buckets(args.buckets)
    except ConfigError as e:
        raise ValueError(str(e).replace("data.buckets", "--buckets")) from None
    reports = precompute_buckets(args.model_dir, args.data, args.out, buckets, fps=args.fps, device=args.device,
                                 dtype=args.dtype, num_encoders=args.num_encoders, progress=not args.no_progress,
                                 hang_timeout_s=args.hang_timeout)
    for bucket, rep in reports:
        print(f"{bucket}: {rep.clips} clips ({rep.encoded} encoded, {rep.reused} already done, "
              f"{len(rep.skipped)} skipped)")
        for path, reason in rep.skipped:
            print(f"  skipped: {path}: {reason}")
    print(f"wrote {Path(args.out) / 'manifest.parquet'} ({sum(r.clips for _, r in reports)} clips)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
