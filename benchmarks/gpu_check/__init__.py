"""The prepared GPU check (``python -m benchmarks.gpu_check``): the CLI and the parts' overview are
in ``__main__.py``; one module per part (``correctness``, ``pinning``, ``streaming``, ``attention``,
``model``), ``run`` (the run and its report), ``compile`` (ahead-of-time compilation of the Triton
kernels for a GPU that need not be there) and ``cost`` (the kernels' cost model).

Importing the package imports no torch, triton or ray (``common`` needs only the standard library)."""

from .common import synthetic_batches

__all__ = ["synthetic_batches"]
