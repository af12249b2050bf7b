"""The prepared GPU check (``python -m benchmarks.gpu_check``): the CLI and the parts' overview are
in ``__main__.py``; one module per part (``correctness``, ``pinning``, ``streaming``, ``attention``,
``model``), ``run`` (the run and its report), ``compile`` (ahead-of-time compilation of the Triton
kernels for a GPU that need not be there), ``cost`` (the kernels' cost model) and
``requirements`` (what the check needs, checked before the rest is imported).

Importing the package imports no torch, triton or ray: ``synthetic_batches`` (``common``, which
needs torch and numpy) is imported on first use, so a machine that lacks them gets the
requirements' message from ``python -m benchmarks.gpu_check``, not an import traceback."""

__all__ = ["synthetic_batches"]


def __getattr__(name: str):
    if name == "synthetic_batches":
        from .common import synthetic_batches

        return synthetic_batches
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
