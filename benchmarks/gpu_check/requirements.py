"""What the GPU check needs, checked before anything heavy is imported (standard library only):
``python -m benchmarks.gpu_check`` names everything missing in one message and exits 2, instead
of an import traceback part-way in.

* torch >= 2.6 and Triton >= 3.2 (the kernels use ``tl.gather``, new in Triton 3.2; torch 2.6 is
  the first release built against it), numpy and safetensors (the streaming and model parts run
  the parameter store), in every mode;
* a C compiler (``$CC``, or ``cc``, ``gcc`` or ``clang`` on ``PATH``) for a run on the GPU: Triton
  compiles its CUDA launcher with it the first time a kernel runs. ``--smoke`` (Triton's
  interpreter) and ``--compile-only`` (Triton's bundled ``ptxas``) need none."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import sys

NEEDS = (
    ("torch", "2.6", "the CUDA build of torch"),
    ("triton", "3.2", "tl.gather, in the DSA kernels"),
    ("numpy", "1.24", "the parameter store's segments"),
    ("safetensors", "0.4", "the checkpoint format"),
)
"""(distribution, lowest version, what needs it)."""
COMPILERS = ("cc", "gcc", "clang")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _numbers(version: str) -> tuple[int, ...]:
    """The leading numeric parts of a version ("2.13.0+cpu" -> (2, 13, 0))."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0].split("-")[0])[:3])


def c_compiler() -> str | None:
    """The C compiler Triton would use: ``$CC`` when set, else the first of ``COMPILERS`` on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return next((path for name in COMPILERS if (path := shutil.which(name))), None)


def missing(argv: list[str]) -> list[str]:
    """What the GPU check run with ``argv`` lacks, one line each (empty: nothing)."""
    problems = []
    for dist, floor, why in NEEDS:
        have = _version(dist)
        if have is None:
            problems.append(f"{dist} >= {floor} ({why}): not installed")
        elif _numbers(have) < _numbers(floor):
            problems.append(f"{dist} >= {floor} ({why}): {have} is installed")
    if "--smoke" not in argv and "--compile-only" not in argv and c_compiler() is None:
        problems.append("a C compiler (Triton builds its CUDA launcher with it): " +
                        (f"CC={os.environ['CC']} is not on PATH" if os.environ.get("CC")
                         else f"none of {', '.join(COMPILERS)} is on PATH and CC is not set"))
    return problems


def exit_if_missing(argv: list[str]) -> None:
    """Print what is missing and exit 2 (nothing run), or return when nothing is."""
    problems = missing(argv)
    if problems:
        print("gpu_check: this machine lacks what the GPU check needs; nothing was run:\n  "
              + "\n  ".join(problems)
              + "\nInstall them (e.g. pip install 'torch>=2.6' 'triton>=3.2' numpy safetensors; "
                "apt install gcc), then run it again.", file=sys.stderr)
        raise SystemExit(2)
