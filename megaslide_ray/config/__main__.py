"""``python -m megaslide_ray.config [--write PATH]``: print (or write) the configuration
reference, docs/configuration.md, generated from the field docstrings."""

from __future__ import annotations

import sys
from pathlib import Path

from megaslide_ray.config.reference import REFERENCE_PATH, reference_markdown


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m megaslide_ray.config",
                                description="Render the configuration reference (every section, field, default "
                                            "and meaning, and the presets) as Markdown.")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--markdown", action="store_true", help="print it to stdout")
    out.add_argument("--write", metavar="PATH", help=f"write it to PATH (the repository's copy: {REFERENCE_PATH})")
    args = p.parse_args(argv)
    text = reference_markdown()
    if args.write:
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
