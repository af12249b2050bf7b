"""``python -m megaslide_ray.report RUN_DIR [RUN_DIR ...] [--out DIR]``

The command line of ``megaslide_ray.evaluation.run_report``: plots and a summary of runs. It parses
the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megaslide_ray.evaluation.run_report import (
    compare_runs,
    format_samples,
    format_summary,
    read_metrics,
    read_samples,
    report,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.report",
                                description="Plot a run's metrics.jsonl and print a summary.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="run directory (holds metrics.jsonl); several: each is reported and their validation "
                        "losses are also drawn side by side")
    p.add_argument("--out", default=None, help="where to write the PNGs (default RUN_DIR/report; with several runs "
                                               "the comparison goes to the first run's)")
    a = p.parse_args(argv)
    try:
        for run in a.run_dirs:
            out = Path(a.out) / Path(run).name if a.out and len(a.run_dirs) > 1 else a.out
            summary, plots = report(run, out)
            print(f"run {run}")
            print(format_summary(summary))
            print("plots: " + ", ".join(str(x) for x in plots))
            samples = format_samples(read_samples(run), read_metrics(Path(run) / "metrics.jsonl"), run)
            if samples:
                print(samples)
        if len(a.run_dirs) > 1:
            where = Path(a.out) if a.out else Path(a.run_dirs[0]) / "report"
            print(f"comparison: {compare_runs(a.run_dirs, where)}")
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
