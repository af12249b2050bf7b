"""Ahead-of-time compile specs of the 3D-DSA gather kernels and the kernels they hand passes to (the
key-side pass, ``dsa_triton_pull``; the halo kernels, ``dsa_triton_halo``): every config the
launchers in ``dsa_triton`` may compile at a shape, for the compile-only check
(``benchmarks/gpu_check/compile.py``, ``python -m benchmarks.gpu_check --compile-only``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from . import dsa_triton as DT
from . import dsa_triton_pull as P
from .aot import AOT_POINTER_TYPES, aligned_pointer_attrs, signature_for
from .dsa_cost import span_class
from .dsa_gluon_halo import aot_variants as gluon_variants
from .dsa_triton_halo import aot_variants as halo_variants
from .dsa_triton_pull import aot_variants as pull_variants
from .dsa_triton_split import SPLIT_BOUNDS

__all__ = ["aot_variants", "bounds_run"]


def aot_variants(shape) -> list[dict]:
    """What the launchers of ``dsa_triton`` compile for ``shape`` (an object with ``dtype`` ("bf16"/"fp32"),
    ``head_dim``, ``window`` and ``max_offset``): forward and backward at every autotune config, as
    dicts for ``benchmarks.gpu_check.compile.Variant``. The backward in its three modes: ``pull`` (the
    query-side pass writing records; with ``max_offset`` within ``PULL_MAX_OFFSET`` the one that
    runs), ``atomic`` and ``split`` (larger or unknown offsets: ``dsa_triton_split``), then the
    key-side pass (``dsa_triton_pull``; the split mode's adds its atomics' sums, at every bound
    it may pick). The slab path launches the same kernels. The key-side pass and the halo
    kernels at the bound a call runs at (``bounds_run``): their configs follow the bound's span."""
    t = AOT_POINTER_TYPES[shape.dtype]
    d = shape.head_dim
    bounds = bounds_run(shape.max_offset)
    atomic = shape.max_offset is None or shape.max_offset > P.PULL_MAX_OFFSET  # offsets past the cap may come
    halo_at = _halo_everywhere(shape, bounds)
    out = []
    for fn, configs in ((DT._dsa_fwd, DT.FWD_CONFIGS), (DT._dsa_bwd, DT.BWD_CONFIGS)):
        ptrs = {n: t for n in ("Q", "Kx", "V", "OFF", "OUT", "DOUT", "DQ", "DOFF") if n in fn.arg_names}
        ptrs.update({n: "*fp32" for n in ("LSE", "DK", "DV", "REC") if n in fn.arg_names})
        ptrs.update({n: "*i8" for n in ("OUTL",) if n in fn.arg_names})
        # the backward: the pull mode, the atomic mode and the split mode (dsa_triton_split: past the cap)
        modes = ((True, bool(bounds)), (False, atomic), ("split", atomic)) if fn is DT._dsa_bwd else ((None, True),)
        for mode, runs in modes:
            for cfg in (DT.BWD_PULL_CONFIGS if mode else configs):
                consts = dict(HEAD_DIM=d, KT=shape.window[0], KH=shape.window[1], KW=shape.window[2],
                              BLOCK_D=DT._block_d(d), **cfg.kwargs)
                name = "gather_fwd"
                if mode is not None:
                    consts.update(PULL=bool(mode), SPLIT=mode == "split")
                    name = {True: "gather_bwd_pull", False: "gather_bwd_atomic", "split": "gather_bwd_split"}[mode]
                halo = halo_at["bwd" if mode else "fwd"] if mode in (None, True) else None
                note = ("the other backward mode at this bound (compiled for the record)" if not runs else
                        f"not picked: {halo} (compiled for the record)" if halo else "")
                out.append(dict(kernel=name, fn=fn,
                                signature=signature_for(fn, ptrs, ("qk_scale", "sm_scale"), consts),
                                constexprs=consts, attrs=aligned_pointer_attrs(fn, ptrs), num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages, config=f"BLOCK_M={cfg.kwargs['BLOCK_M']}",
                                tensor_cores=False, may_pick=runs and not halo, note=note))
    seen = set()

    def first(spec) -> bool:
        """Not yet listed: the same compile as at a larger bound is one (BX, ELO and EHI are run-time)."""
        key = (spec["kernel"], spec.get("archs"), tuple(sorted(spec["constexprs"].items())), spec["num_warps"],
               spec.get("maxnreg"))
        new = key not in seen
        seen.add(key)
        return new

    for bound in bounds:
        at = SimpleNamespace(dtype=shape.dtype, head_dim=d, window=tuple(shape.window), max_offset=bound,
                             grid=getattr(shape, "grid", None))
        out += filter(first, pull_variants(at) + halo_variants(at) + gluon_variants(at))
    if atomic:  # the split mode's key-side pass (adding its atomics' sums) at each bound it may pick
        for bound in SPLIT_BOUNDS:
            at = SimpleNamespace(dtype=shape.dtype, head_dim=d, window=tuple(shape.window), max_offset=bound)
            out += [dict(spec, note=f"the split mode at {span_class(bound)[1]}")
                    for spec in filter(first, pull_variants(at, accum=True))]
    return out


def _halo_everywhere(shape, bounds) -> dict:
    """Per pass ("fwd"; "bwd": the backward's query side in the pull mode), why ``auto`` never takes
    the gather kernels at ``shape`` -- ``dsa_triton.halo_choice`` takes the halo kernels at every
    bound a call may run at -- or None where it may (fp32, a bound past the
    key-side pass's cap, or a span where the gather kernels are predicted faster)."""
    grid = getattr(shape, "grid", None)
    if grid is None or not bounds:
        return {"fwd": None, "bwd": None}
    q = torch.empty(1, *grid, 1, shape.head_dim, device="meta",
                    dtype=torch.float32 if shape.dtype == "fp32" else torch.bfloat16)
    why = f"the cost model predicts the halo kernels faster at every bound up to {max(bounds):g}"
    return {p: why if all(DT.halo_choice(p, q, tuple(shape.window), b, "")[0] for b in bounds) else None
            for p in ("fwd", "bwd")}


def bounds_run(max_offset: float | None) -> list[float]:
    """The bounds the key-side pass (in the pull mode) and the halo kernels may run a call at, given
    ``max_offset``: the given bound where it is within ``PULL_MAX_OFFSET`` (a call runs at it: nothing
    is measured), else none (the split mode's key-side pass runs at ``SPLIT_BOUNDS``, listed apart)."""
    if max_offset is None or not float(max_offset) <= P.PULL_MAX_OFFSET:
        return []
    return [float(max_offset)]
