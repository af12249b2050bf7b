"""``python -m megaslide_ray.motion_metric CLIP.mp4 --caption TEXT [--json]``

The command line of ``megaslide_ray.evaluation.motion_score``: the motion fidelity of a
generated clip. It parses the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.motion_score import KEYS, motion_fidelity, read_video


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.motion_metric",
                                description="Motion fidelity of clips against their captions (model-free).")
    p.add_argument("path", help="a video file (with --caption), or a video manifest (.parquet) with captions")
    p.add_argument("--caption", default=None, help="the caption the clip was generated from")
    p.add_argument("--json", action="store_true", help="one JSON object per clip")
    a = p.parse_args(argv)
    try:
        if a.path.endswith(".parquet"):

            clips = [(e.path, a.caption or e.caption) for e in read_manifest(a.path)]
        else:
            if not a.caption:
                raise ValueError("a single video needs --caption")
            clips = [(a.path, a.caption)]
        results = [(path, motion_fidelity(read_video(path), cap)) for path, cap in clips]
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path, r in results:
        if a.json:
            print(json.dumps({"path": path, **r}))
        else:
            print(f"{path}: " + ", ".join(f"{k} {r[k]:.3f}" for k in KEYS))
    if not a.json and len(results) > 1:
        print("mean: " + ", ".join(f"{k} {np.nanmean([r[k] for _, r in results]):.3f}" for k in KEYS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
