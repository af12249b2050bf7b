"""Compile specs for ahead-of-time compiles of the Triton kernels (``benchmarks/gpu_check/compile.py``
compiles them for a GPU that is not there): a kernel's full ``ASTSource`` signature and the
pointer alignment the JIT would see. Pure functions: no Triton import."""

from __future__ import annotations

AOT_POINTER_TYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
"""A shape's dtype name -> the ``ASTSource`` signature of a pointer to it."""


def aligned_pointer_attrs(fn, pointers: dict[str, str]) -> dict:
    """The JIT's specialization of pointer arguments: torch allocations are 16-byte aligned, so a
    launch sees ``tt.divisibility = 16`` on every pointer (what lets Triton vectorise loads)."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in pointers}


def signature_for(fn, pointers: dict[str, str], floats: tuple[str, ...], constexprs: dict) -> dict:
    """A full ``ASTSource`` signature: pointer args by element type (``"*bf16"``), float scalars,
    constexprs, and every other argument an ``i32``."""
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig
