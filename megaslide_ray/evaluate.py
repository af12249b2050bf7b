"""``python -m megaslide_ray.evaluate --checkpoint RUN [--data VAL_MANIFEST] [--json]``

The command line of ``megaslide_ray.evaluation.validation``: the held-out validation loss of a
checkpoint. It parses the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from megaslide_ray.config import ConfigError
from megaslide_ray.evaluation.validation import ValResult, evaluate_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.evaluate",
                                description="The held-out flow-matching loss of a checkpoint (forward only, streamed).")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (its latest)")
    p.add_argument("--data", default=None,
                   help="validation manifest (video for videodit, latents for wan); default: the checkpoint's "
                        "data.val_manifest")
    p.add_argument("--clips", type=int, default=None,
                   help="validation clips (default: every readable row of --data; without --data, training.val_clips)")
    p.add_argument("--buckets", type=int, default=None, help="t-buckets (default: training.val_t_buckets)")
    p.add_argument("--seed", type=int, default=None, help="seed of noise and t (default: training.seed)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="items per forward (default: data.batch_size; another value may change the last bits)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--weights", choices=["auto", "trained", "ema"], default="auto",
                   help="the trained weights or their moving average (training.ema_decay); auto: the average where "
                        "the run kept one and evaluated with it (training.ema_eval), else the trained weights")
    p.add_argument("--json", action="store_true", help="print one JSON object (val_loss, per-bucket losses)")
    p.add_argument("--log-level", default="WARNING")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    for flag, value in (("--clips", a.clips), ("--buckets", a.buckets), ("--batch-size", a.batch_size)):
        if value is not None and value < 1:
            print(f"error: {flag} {value} must be >= 1", file=sys.stderr)
            return 2
    try:
        r = evaluate_checkpoint(a.checkpoint, a.data, a.clips, a.buckets, a.seed, a.batch_size, a.device, a.weights)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r.as_json()) if a.json else format_result(r))
    return 0



def format_result(r: ValResult) -> str:
    n = len(r.bucket_losses)
    lines = [f"validation loss {r.val_loss:.6f} (step {r.version}, {r.clips} clips x {n} t-buckets, "
             f"{r.seconds:.1f} s)"]
    (lo, hi), d = r.t_range, 2 if r.t_range == (0.0, 1.0) else 4  # an expert's range: its boundary shown whole
    for b, v in enumerate(r.bucket_losses):
        lines.append(f"  t in [{lo + b * (hi - lo) / n:.{d}f}, {lo + (b + 1) * (hi - lo) / n:.{d}f}): {v:.6f}")
    for name, v in r.expert_losses:  # a two-expert model
        lines.append(f"  {name}-noise expert ({'transformer' if name == 'high' else 'transformer_2'}): {v:.6f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
