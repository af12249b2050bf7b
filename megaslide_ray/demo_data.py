"""``python -m megaslide_ray.demo_data [--out DIR] [--num-videos N]``

The command line of ``megaslide_ray.data.demo``: generate (or find) the demo dataset. It parses
the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import sys

from megaslide_ray.data import demo
from megaslide_ray.data.demo import DEFAULT_NUM_VIDEOS, ensure_demo_dataset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaslide_ray.demo_data", description=demo.__doc__.split("\n")[0])
    parser.add_argument("--out", default=None,
                        help="cache directory (default: $MEGASLIDE_CACHE or ~/.cache/megaslide_ray)")
    parser.add_argument("--num-videos", type=int, default=DEFAULT_NUM_VIDEOS)
    args = parser.parse_args(argv)
    print(ensure_demo_dataset(args.out, args.num_videos))
    return 0


if __name__ == "__main__":
    sys.exit(main())
