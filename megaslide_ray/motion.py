"""``python -m megaslide_ray.motion [--variant simple] [--out DIR]``

The command line of ``megaslide_ray.data.motion_set``: generate (or find) the motion set. It parses
the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import sys

from megaslide_ray.data import motion_set as motion
from megaslide_ray.data.motion_set import DEFAULT_TRAIN, DEFAULT_VAL, VARIANTS, ensure_motion_dataset


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.motion", description=motion.__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="cache directory (default: $MEGASLIDE_CACHE or ~/.cache/megaslide_ray)")
    p.add_argument("--num-train", type=int, default=DEFAULT_TRAIN)
    p.add_argument("--num-val", type=int, default=DEFAULT_VAL)
    p.add_argument("--variant", choices=sorted(VARIANTS), default="motion",
                   help="motion (default: the full set) or simple (a large shape, 8 frames, no bounces or occluders)")
    a = p.parse_args(argv)
    train, val = ensure_motion_dataset(a.out, a.num_train, a.num_val, a.variant)
    print(f"train: {train}\nval: {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
