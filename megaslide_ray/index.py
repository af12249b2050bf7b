"""``python -m megaslide_ray.index VIDEO_DIR --out manifest.parquet [--captions FILE.csv|FILE.jsonl] [--no-images]``

The command line of ``megaslide_ray.data.video_index``: a manifest of a folder of videos (and images). It parses
the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaslide_ray.data.clips import is_image
from megaslide_ray.data.manifest import write_manifest
from megaslide_ray.data.video_index import VIDEO_EXTENSIONS, _relative_to_manifest, index_videos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megaslide_ray.index",
                                     description="Build a Parquet manifest from a folder of videos.")
    parser.add_argument("video_dir", help="folder scanned recursively for video files")
    parser.add_argument("--out", required=True, help="manifest to write (e.g. manifest.parquet)")
    parser.add_argument("--captions", default=None, help="CSV (path,caption) or JSONL caption mapping")
    parser.add_argument("--first-frame-only", action="store_true",
                        help="decode only the first frame of each video (faster; misses truncated files)")
    parser.add_argument("--no-images", action="store_true",
                        help="leave image files (.png .jpg .jpeg .webp) out; by default each is a one-frame row")
    args = parser.parse_args(argv)

    try:
        rows, problems = index_videos(args.video_dir, args.captions, not args.first_frame_only,
                                       images=not args.no_images)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    found = len(rows) + len(problems)
    captioned = sum(1 for r in rows if r.caption)
    images = sum(1 for r in rows if is_image(r.path))
    print(f"found {found} video files in {args.video_dir}: {len(rows)} usable "
          f"({captioned} with captions{f', {images} images' if images else ''}), {len(problems)} unreadable")
    for path, reason in problems:
        print(f"  unreadable: {path}: {reason}")
    if not rows:
        print(f"error: no usable video in {args.video_dir} (looked for {', '.join(VIDEO_EXTENSIONS)}); "
              f"nothing written", file=sys.stderr)
        return 1
    out = Path(args.out)
    write_manifest(_relative_to_manifest(rows, out), out)
    print(f"wrote {out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
