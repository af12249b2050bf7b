"""Kernels: 3D Deformable Slide Attention (3D-DSA) and its PyTorch reference.

``deformable_slide_attention`` is the one entry point model code calls. It picks a
backend per call:

- ``"reference"``: ``dsa_reference`` (pure PyTorch autograd; the spec every other
  path is tested against; slow, O(N*K*d) activations).
- ``"cpu"``: ``dsa_cpu`` (fast CPU path from embedding_bag kernels: same function and
  gradients as the reference up to rounding, queries in chunks, backward recomputes;
  ~15x (forward) / ~10x (forward+backward) faster than the reference on CPU, and
  bounded memory).
- ``"matrix"``: ``dsa_matrix`` (small grids: the operator as two dense products through an
  N x N interpolation matrix per batch item and head; same function and gradients, O(N^2)
  time and memory, refused above ``MATRIX_LIMIT_TOKENS`` tokens).
- ``"chunked"``: ``dsa_reference_chunked`` (the reference's math, queries in chunks,
  backward recomputes: bounded memory, reference speed).
- ``"triton"``: the fused Triton kernels. The forward and the backward's query side run,
  per pass, either the gather kernels (``dsa_triton``: a strip of queries per program, one
  trilinear corner per loop iteration, CUDA-core FMAs) or the halo kernels (``dsa_triton_halo``:
  64 queries of a row against whole key rows, tensor-core dots), whichever the cost model
  (``dsa_cost``) predicts faster at the call's bound (``modes``, ``dsa_modes.KernelModes``; logged). The bound
  is the caller's ``max_offset`` (``attention.max_offset``), a constant of the config: nothing is
  measured per call, so a call makes no host sync and compiles nothing new mid-run. The backward
  sums dk, dv with the key-side pass (``dsa_triton_pull``): tensor-core dots, no atomics,
  deterministic, for offsets bounded by at most ``PULL_MAX_OFFSET``. Past it, and for unbounded
  offsets (no ``max_offset``), the split mode (``dsa_triton_split``) runs it at its cap for the
  queries whose offsets stay within (flagged on the device) and scatters the others' samples with
  fp32 atomics. Every autotune config compiles for sm_90 at the presets' shapes without spills (the
  compile-only check, ``python -m benchmarks.gpu_check --compile-only``). Verified so far only under
  the Triton CPU interpreter and by compiling for sm_90 and sm_100.
- ``"auto"`` (``backend=None``, the default): for CUDA tensors when Triton imports, the kernel the
  compile-only check passes at the call's shape (``pick_cuda_kernel``: ``triton``); for CPU tensors ``matrix`` up to ``MATRIX_MAX_TOKENS`` tokens per clip (while its
  matrices stay within ``MATRIX_MAX_ELEMENTS``) and ``cpu`` above; else reference. The first
  automatic pick per device type and kernel is logged once (INFO) with its reason.

``deformable_slide_attention_slab`` is the same operator for the queries of a slab of frames
against only the frames of k and v they reach (token-chunked blocks, ``runtime.token_chunk``),
on the same backends.

Force a path with ``backend=...`` (``attention.backend`` in the config); ``None`` means ``auto``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Literal, Sequence

import torch

from .dsa_cpu import dsa_cpu, dsa_cpu_slab
from .dsa_matrix import MATRIX_MAX_TOKENS, dsa_matrix, matrix_path_fits
from .dsa_modes import KernelModes
from .dsa_reference import dsa_reference, dsa_reference_chunked, dsa_slab, slab_kv_frames, window_base_positions

__all__ = [
    "deformable_slide_attention",
    "deformable_slide_attention_slab",
    "slab_kv_frames",
    "dsa_cpu",
    "dsa_matrix",
    "dsa_reference",
    "dsa_reference_chunked",
    "resolve_dsa_backend",
    "window_base_positions",
    "pick_cuda_kernel",
    "aot_variants",
    "KernelModes",
]

log = logging.getLogger(__name__)

DSABackend = Literal["reference", "cpu", "matrix", "chunked", "triton", "auto"]
_BACKENDS = ("reference", "cpu", "matrix", "chunked", "triton", "auto")
_RENAMED = {"triton_gather": "triton"}  # old backend names, refused with the new one


def resolve_dsa_backend(q: torch.Tensor, backend: str | None = None) -> str:
    """The concrete backend ("reference", "cpu", "matrix", "chunked" or "triton") a call on ``q``
    uses; ``backend=None`` means ``"auto"``."""
    choice = "auto" if backend is None else str(backend).strip().lower()
    if choice in _RENAMED:
        raise ValueError(f"DSA backend {backend!r} is now called {_RENAMED[choice]!r} (the same kernels); "
                         f"set attention.backend {_RENAMED[choice]}")
    if choice not in _BACKENDS:
        raise ValueError(f"unknown DSA backend backend={backend!r}; choose one of {_BACKENDS}")
    if choice == "auto":
        if q.device.type == "cpu":  # small clips: two dense matmuls beat the linear path's gathers
            return "matrix" if matrix_path_fits(q, MATRIX_MAX_TOKENS) else "cpu"
        if q.is_cuda and _triton_available():
            path, why = pick_cuda_kernel(q)
            _log_pick(q, path, why)
            return path
        _warn_fallback(q)
        return "reference"
    return choice


def pick_cuda_kernel(q: torch.Tensor) -> tuple[str, str]:
    """(backend, reason) for a CUDA call under ``auto``: the fused Triton kernels, whose every
    autotune config the compile-only check (``python -m benchmarks.gpu_check --compile-only --arch
    sm_90``) passes at the presets' shapes (bf16 and fp32, head dims 64 and 128, windows up to
    3x7x7): it launches and does not spill."""
    return "triton", (f"fused Triton kernels (halo or gather per pass, by the cost model) at head dim {q.shape[-1]}: "
                      "every config compiles for sm_90 without spills (compile-only check)")


_TRITON_ERROR: list[str] = []  # why the Triton kernels did not import (once known)
_WARNED: set[str] = set()


def _triton_available() -> bool:
    try:
        importlib.import_module(f"{__name__}.dsa_triton")
    except Exception as e:  # triton missing or broken: the reference still works
        if not _TRITON_ERROR:
            _TRITON_ERROR.append(f"{type(e).__name__}: {e}")
        return False
    return True


def _log_pick(q: torch.Tensor, path: str, why: str) -> None:
    key = f"pick:{q.device.type}:{path}"
    if key not in _WARNED:
        _WARNED.add(key)
        log.info("3D-DSA: backend 'auto' picks %r on %s: %s", path, q.device, why)


def _warn_fallback(q: torch.Tensor) -> None:
    """The automatic choice fell back to the reference on a device tensor: say so once (it is
    O(N*K*d) in memory and far slower than the fused kernels)."""
    key = q.device.type
    if key in _WARNED:
        return
    _WARNED.add(key)
    why = (f"the Triton kernels did not import ({_TRITON_ERROR[0]})" if _TRITON_ERROR
           else f"no fused kernel for {q.device.type} tensors")
    log.warning("3D-DSA: backend 'auto' falls back to the pure-PyTorch reference on %s: %s. Pass backend= "
                "(attention.backend) to choose one explicitly.", q.device, why)


def deformable_slide_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
    backend: DSABackend | None = None,
    max_offset: float | None = None,
    modes: KernelModes | None = None,
) -> torch.Tensor:
    """3D-DSA: ``(B, T, H, W, nh, d)`` q, k, v and ``(B, T, H, W, nh, K, 3)`` offsets.

    Returns ``out`` ``(B, T, H, W, nh, d)`` in q's dtype; half inputs are computed in
    fp32 internally. The exact semantics: docs/dsa.md
    and ``dsa_reference``.

    ``max_offset``: a bound on ``|offsets|`` the caller guarantees (``attention.max_offset``: the
    offset head's tanh or clamp bound); the Triton path reads it, the others ignore it. It sizes the
    backward's key-side dk/dv pass (``dsa_triton_pull``) and picks the halo kernels where the cost
    model predicts them faster at it; a query with an offset beyond it gets a NaN ``dq`` (and a NaN
    output row in the halo forward). Without it the Triton path runs the gather forward and the
    backward's split mode at the key-side pass's cap: nothing is measured per call. ``modes``
    (``KernelModes``): which Triton kernel families run (default ``auto``; the others force one
    family, for measurements and tests); the other backends ignore it.
    """
    path = resolve_dsa_backend(q, backend)
    if path == "triton":
        from .dsa_triton import dsa_triton  # lazy: needs triton, which a CPU machine may lack

        return dsa_triton(q, k, v, offsets, window, scale=scale, max_offset=max_offset, modes=modes)
    if path == "matrix":
        return dsa_matrix(q, k, v, offsets, window, scale=scale)
    if path == "cpu":
        return dsa_cpu(q, k, v, offsets, window, scale=scale)
    if path == "chunked":
        return dsa_reference_chunked(q, k, v, offsets, window, scale=scale)
    return dsa_reference(q, k, v, offsets, window, scale=scale)


def deformable_slide_attention_slab(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    q_start: int,
    kv_start: int,
    frames: int,
    scale: float | None = None,
    backend: DSABackend | None = None,
    max_offset: float | None = None,
    modes: KernelModes | None = None,
) -> torch.Tensor:
    """3D-DSA for the queries of frames ``[q_start, q_start + Tq)`` of a ``frames``-frame grid,
    against k, v holding frames ``[kv_start, kv_start + Tk)`` (``dsa_reference.dsa_slab``): the
    slab's rows of ``deformable_slide_attention`` on the whole grid, when k and v hold every
    frame the samples reach (``slab_kv_frames``). Used by token-chunked blocks
    (``runtime.token_chunk``). Backends as ``deformable_slide_attention`` (``chunked`` runs the
    reference; ``matrix``, and ``auto`` on CPU, the ``cpu`` path: a slab is part of a long clip)."""
    path = resolve_dsa_backend(q, backend)
    if path == "triton":
        from .dsa_triton import dsa_triton_slab  # lazy: needs triton, which a CPU machine may lack

        return dsa_triton_slab(q, k, v, offsets, window, q_start, kv_start, frames, scale=scale,
                               max_offset=max_offset, modes=modes)
    if path in ("cpu", "matrix"):
        return dsa_cpu_slab(q, k, v, offsets, window, q_start, kv_start, frames, scale=scale)
    return dsa_slab(q, k, v, offsets, window, q_start, kv_start, frames, scale=scale)


def aot_variants(shape) -> list[dict]:
    """Every Triton kernel and config the dispatcher may launch at ``shape`` (dtype, head dim, window,
    grid, ``max_offset``), as compile specs for ``benchmarks.gpu_check.compile`` (the compile-only
    check): the kernel modules list their own launches."""
    from . import dsa_triton_variants  # lazy: needs triton, which a CPU machine may lack

    return dsa_triton_variants.aot_variants(shape)
