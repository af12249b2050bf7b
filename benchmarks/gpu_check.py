"""One prepared GPU check: the Triton DSA kernels' correctness on CUDA, pinned transfers, weight
streaming, the attention operators and a paper-width model, in under 6 minutes on one GPU.

    python -m benchmarks.gpu_check --out DIR [--budget-s 330] [--parts ...]
    python -m benchmarks.gpu_check --out DIR --smoke     # every part on the CPU at tiny sizes

Needs only torch, triton, numpy and safetensors: no Ray, no video decoding (batches are
synthetic: random uint8 clips and caption bytes from ``megaslide_ray.data.captions``); the store
and the compute actor run in this process. Parts, in order; each is guarded (a failure is
recorded and the next part still runs), each has a share of ``--budget-s`` (a part that would
start too late is skipped, loops inside a part stop at its deadline), and the results are
rewritten after every part and marked ``running`` before it, so a killed run still reports:

1. ``correctness``: the gather kernel ``dsa_triton`` and the tiled kernel ``dsa_triton_tiled``
   (each row says which ran: the tiled one falls back, logged, where its halo does not fit),
   forward and the gradients of q, k, v and offsets against ``dsa_reference``, per case,
   kernel and dtype. fp32: against the fp64 reference,
   ``|tri - ref| <= 2e-5 + 1e-4 |ref|``. bf16: the flash-attention rule of kernels/checks.py.
   Cases: odd sizes, head dims that are not powers of two, several query block sizes, offsets
   that clamp far outside the volume, positions on integers and clamp bounds; plus both
   identities of docs/architecture.md ("3D-DSA: the operator").
2. ``pinning``: a 2 GiB shared-memory segment registered in 256 MiB pieces
   (``actors/transfer.py``: ``HostPinning``, copies cut at the pieces): host->device and
   device->host GB/s against a ``pin_memory()`` buffer and a pageable one; the data arrive
   intact; whether ``is_pinned()`` sees registered memory; a refused registration (the same
   memory registered twice) falls back, and the CUDA error it left is cleared (a kernel
   launches after it).
3. ``streaming``: the compute actor with the store in this process on a small model (width
   512, depth 4, bf16 weights): overlap on, on again, off, and on with offloaded activations,
   on the same synthetic batches. Compared with ``on`` under the tolerance below; the
   ``on again`` run measures the device's own run-to-run noise.
4. ``attention``: 3D-DSA forward and backward timed apart -- ``dsa`` (the public ``triton``
   path: the tiled kernel, ``max_offset`` 1.5; its ``backend`` says when it fell back to the
   gather kernel), ``dsa_gather`` (the gather kernel, same offsets) -- against flash SDPA
   (``sdpa_kernel(FLASH_ATTENTION)``) and against the neighborhood case (zero offsets) at
   paper-like shapes: d = 128, nh = 8 (the paper's 44-96 heads scale time linearly and leave
   TFLOP/s as they are), K = 27 and 75, 16k / 64k / 256k tokens, bf16; TFLOP/s and the
   dense/DSA crossover (log-log interpolation between grids, extrapolated past the last one
   with dense ~ N^2 and DSA ~ N).
5. ``model``: a paper-width model (width 5120, 40 heads, 2 blocks, patch (1, 2, 2), window
   (3, 5, 5), bf16, ~1.1B parameters, ~18 GB of store) streamed with overlap on and off at a
   short clip (4x64x64 pixels: 4k tokens, transfer-bound) and a long one (16x128x128: 65k
   tokens, compute-bound): step time, per-stream busy seconds from CUDA events (H2D copies,
   D2H copies, compute on the default stream), H2D GB/s, peak device memory per step against
   ``megaslide_ray.plan`` for the same config, MFU from the planner's FLOPs (model FLOPs:
   linear + attention; HFU adds the recompute) against the GPU's dense bf16 peak.
6. ``speedup``: Triton ``dsa`` against the pure-PyTorch reference at 65,536 tokens
   (nh = 2, d = 32), forward + backward (goal: at least 3x).

The streaming tolerance. The four runs execute the same kernels on the same inputs in the same
order; only the transfer schedule differs, and on the CPU they are bit-identical (the tests use
``torch.equal``). On CUDA, reductions whose order is not fixed differ run to run: the Triton
backward adds dk and dv with fp32 atomics, and library kernels (cuDNN's weight gradients) may
too. Each accumulates in fp32 and is stored in bf16: two orders of an fp32 sum of M terms
differ by about M 2^-24 of the terms (2^-16 for M ~ 200), far below a bf16 ulp, so after
rounding they agree or differ by one ulp, at most 2^-7 of the value (bf16 keeps 8 significant
bits). Such a tensor differs by at most 2^-7 in relative L2. The backward hands dx from shard
to shard, and each shard's gradient is linear in it, so to first order the relative differences
add along the L + 2 shards: a shard's gradient differs by at most (L + 2) 2^-7. This part runs
AdamW with eps = 1, above every clipped gradient element, where the update ``m / (sqrt(v) +
eps)`` moves relatively by at most the gradient's relative change, plus as much again through
the clipping coefficient and sqrt(v): so each shard's parameter update (final minus initial
parameters) may differ by at most ``TOL = 2 (L + 2) 2^-7`` in relative L2 (0.094 at depth 4;
the trajectories' coupling through changed weights is second order over 3 small steps), and
the squared gradient norms of step 0 (same weights everywhere) by 2 (L + 2) 2^-7 as well. A
stream race (weights read mid-copy, a buffer overwritten by the next prefetch) gives
differences of order 1. The run-to-run noise measured by ``on again`` must stay under the same
bound (a check of the derivation); the report gives it and each variant's margin. The step-0
loss comes from a forward without atomics and is reported exactly.

``--smoke`` runs every part on the CPU at tiny sizes through the same code (the CUDA calls
aside: no streams, events or registration; a stand-in registration runs the piece logic), the
Triton kernels under ``TRITON_INTERPRET=1`` (set before triton is imported), and writes the
same JSON; ``tests/test_gpu_check.py`` runs it with ray, decord, av and diffusers unimportable.

Writes ``DIR/gpu_check.json`` (every number) and ``DIR/gpu_check.md`` (the summary).
Exit status: 0 every part ran and every check passed; 1 a check failed, a part raised or was
skipped for time; 2 no CUDA device and no ``--smoke`` (nothing is run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

PARTS = ("correctness", "pinning", "streaming", "attention", "model", "speedup")
RESERVE_S = {"correctness": 0, "pinning": 12, "streaming": 30, "attention": 70, "model": 80, "speedup": 8}
"""Seconds kept for each part when the parts before it set their deadlines (GPU run)."""
FP32_RTOL, FP32_ATOL = 1e-4, 2e-5
BF16_REL_ATOL = 1e-4
SPEEDUP_GOAL = 3.0
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 peak by device-name substring (SXM figures, no sparsity), for MFU."""


@dataclass(frozen=True)
class Case:
    """One correctness case: q/k/v ``(B, T, H, W, nh, d)``, a window and an offset kind."""

    name: str
    shape: tuple[int, int, int, int, int, int]
    window: tuple[int, int, int]
    offsets: str  # "wild" (moves, whole tokens, far clamps), "edge" (kinks), "uniform", "small"
    block_m: int | None = None  # None: the launcher's default


CASES = (
    Case("odd sizes, d=64, wild offsets", (2, 5, 9, 11, 3, 64), (3, 5, 5), "wild"),
    Case("d=40, 7x13 planes, block 16", (1, 3, 7, 13, 2, 40), (3, 3, 5), "wild", 16),
    Case("integer / zero / clamp-bound positions", (2, 4, 6, 5, 2, 8), (3, 3, 3), "edge", 32),
    Case("window spans T, d=6, block 64", (2, 5, 3, 7, 2, 6), (5, 1, 3), "wild", 64),
    Case("benchmark shape, uniform [-1.5, 1.5]", (1, 8, 32, 32, 2, 32), (3, 3, 3), "uniform"),
    Case("halo inside the grid (tiled), uniform [-0.9, 0.9]", (2, 5, 24, 24, 3, 64), (3, 5, 5), "small"),
)
SMOKE_CASES = (  # small windows: the interpreter's time grows with K
    Case("smoke: odd sizes, wild offsets", (1, 3, 3, 5, 1, 8), (3, 1, 1), "wild", 16),
    Case("smoke: clamp bounds", (1, 3, 4, 3, 1, 8), (1, 3, 1), "edge", 16),
)


@dataclass(frozen=True)
class Sizes:
    """Everything a run's size depends on: the GPU run's, or the CPU smoke run's."""

    cases: tuple[Case, ...] = CASES
    dense_identity_grids: tuple = ((3, 1, 5), (5, 7, 9))
    neighborhood_identity: tuple = ((2, 4, 7, 6, 2, 16), (3, 5, 3))
    pin_bytes: int = 2 << 30
    pin_chunk: int = 256 << 20
    pin_reps: int = 5
    stream: dict = field(default_factory=lambda: {
        "model.hidden_size": 512, "model.num_heads": 8, "model.depth": 4, "data.num_frames": 16,
        "data.height": 64, "data.width": 64, "data.batch_size": 2})
    stream_steps: int = 3
    attn_grids: tuple = ((16, 32, 32), (16, 64, 64), (64, 64, 64))
    attn_windows: tuple = ((3, 3, 3), (3, 5, 5))
    attn_heads: int = 8
    attn_dim: int = 128
    attn_reps: int = 3
    attn_slow_s: float = 4.0
    model: dict = field(default_factory=lambda: {
        "model.hidden_size": 5120, "model.num_heads": 40, "model.depth": 2, "model.patch_size": "1,2,2",
        "model.caption_dim": 1024, "model.caption_max_bytes": 256, "attention.window": "3,5,5",
        "data.batch_size": 1})
    model_clips: tuple = (("short", (4, 64, 64)), ("long", (16, 128, 128)))
    model_steps: int = 3
    speedup_grid: tuple = (16, 64, 64)
    speedup_reps: int = 3
    reserve_scale: float = 1.0


SMOKE = Sizes(
    cases=SMOKE_CASES, dense_identity_grids=((3, 1, 1),), neighborhood_identity=((1, 3, 4, 3, 1, 8), (3, 1, 1)),
    pin_bytes=6 << 20, pin_chunk=1 << 20, pin_reps=2,
    stream={"model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.caption_dim": 16,
            "model.patch_size": "2,8,8", "data.num_frames": 4, "data.height": 16, "data.width": 16,
            "data.batch_size": 2, "attention.window": "1,1,1"},
    stream_steps=2, attn_grids=((3, 4, 4), (3, 4, 8)), attn_windows=((1, 3, 3), (3, 1, 3)), attn_heads=1,
    attn_dim=16, attn_reps=0,
    model={"model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.patch_size": "1,4,4",
           "model.caption_dim": 16, "model.caption_max_bytes": 32, "attention.window": "1,3,3",
           "data.batch_size": 1},
    model_clips=(("short", (1, 12, 12)), ("long", (2, 16, 16))), model_steps=2,
    speedup_grid=(3, 5, 5), speedup_reps=1, reserve_scale=0.0,
)


# -----------------------------------------------------------------------------
# Shared helpers


class Clock:
    """Marks and durations: CUDA events on the current stream, or the wall clock on the CPU."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True, blocking=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def reset_peak(device) -> int:
    """Start a peak-memory measurement; returns the bytes allocated now (CUDA) or 0."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_since(device, base: int) -> int | None:
    import torch

    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated() - base)
    return None


def state_root(need_bytes: int) -> tuple[str, str]:
    """A directory for ``need_bytes`` of store segments: shared memory (/dev/shm) when it has
    room (with a 25% margin), else the temporary directory. Returns (path, filesystem type)."""
    candidates = ["/dev/shm", tempfile.gettempdir()]
    for path in candidates:
        if os.path.isdir(path) and os.access(path, os.W_OK) and shutil.disk_usage(path).free > 1.25 * need_bytes:
            return path, fs_type(path)
    return tempfile.gettempdir(), fs_type(tempfile.gettempdir())


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; '?' if unknown)."""
    try:
        best, kind = "", "?"
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, kind = mount, parts[2]
        return kind
    except OSError:
        return "?"


def synthetic_batches(cfg, n: int, seed: int = 0) -> list[dict]:
    """``n`` decoder-shaped batches: random uint8 clips and caption bytes (no decoder, no files)."""
    import numpy as np

    from megaslide_ray.data.captions import empty_captions, set_caption

    rng = np.random.default_rng(seed)
    d = cfg.data
    batches = []
    for i in range(n):
        video = rng.integers(0, 256, (d.batch_size, d.num_frames, d.height, d.width, cfg.model.in_channels),
                             dtype=np.uint8)
        caption, caption_len = empty_captions(d.batch_size, cfg.model.caption_max_bytes)
        for row in range(d.batch_size):
            set_caption(caption, caption_len, row, f"synthetic clip {i}.{row}: a red circle moving right")
        batches.append({"video": video, "caption": caption, "caption_len": caption_len, "position": i})
    return batches


def w_dtype_for(device) -> str:
    import torch

    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


# -----------------------------------------------------------------------------
# Part 1: correctness


def _case_offsets(t, case: Case, seed: int):
    import torch

    if case.offsets == "wild":
        return t.wild_offsets(case.shape, case.window, dtype=torch.float32, seed=seed)
    if case.offsets == "edge":
        return t.edge_offsets(case.shape, case.window, dtype=torch.float32, seed=seed)
    if case.offsets == "uniform":
        K = math.prod(case.window)
        g = torch.Generator().manual_seed(seed)
        return (2 * torch.rand((*case.shape[:5], K, 3), generator=g) - 1) * 1.5
    if case.offsets == "small":
        K = math.prod(case.window)
        g = torch.Generator().manual_seed(seed)
        return (2 * torch.rand((*case.shape[:5], K, 3), generator=g) - 1) * 0.9
    raise ValueError(f"unknown offsets kind {case.offsets!r}")


def check_case(t, case: Case, dtype, device: str, kernel: str = "gather") -> dict:
    """Triton vs reference for one case in one dtype: max errors and the verdict. ``kernel``:
    "gather" (``dsa_triton``) or "tiled" (``dsa_triton_tiled``; a case its tiles cannot take
    runs the gather kernel, and the result says so)."""
    import torch

    from kernels import dsa_reference
    from kernels import dsa_triton_tiled as tiled
    from kernels.dsa_triton import dsa_triton

    q, k, v = (x.to(device) for x in t.make_qkv(case.shape, seed=40))
    offsets = _case_offsets(t, case, seed=41).to(device)
    dout = torch.randn(case.shape, generator=torch.Generator().manual_seed(42)).to(device)
    inputs = [x.to(dtype) for x in (q, k, v, offsets)]

    def tri(*a):
        if kernel == "tiled":
            return tiled.dsa_triton_tiled(*a, case.window, block_m=case.block_m)
        return dsa_triton(*a, case.window, block_m=case.block_m)

    def ref(*a, **kw):
        return dsa_reference(*a, case.window, **kw)

    fallbacks = sum(tiled.FALLBACKS.values())
    got = t.grads(tri, inputs, dout)
    ran = kernel if sum(tiled.FALLBACKS.values()) == fallbacks else "gather (tiled fell back, logged)"
    result = {"case": f"{case.name} [{kernel}]", "shape": case.shape, "window": case.window,
              "dtype": str(dtype).replace("torch.", ""), "block_m": case.block_m, "kernel": ran}
    if dtype == torch.float32:
        want = t.grads(ref, [x.double() for x in inputs], dout.double())
        errors, max_err = [], {}
        for name, a, b in zip(t.GRAD_NAMES, got, want):
            diff = (a.double() - b).abs()
            max_err[name] = diff.max().item()
            bad = ~(diff <= FP32_ATOL + FP32_RTOL * b.abs())  # NaN counts as bad
            if bad.any():
                errors.append(f"{name}: {int(bad.sum())} of {b.numel()} beyond "
                              f"atol {FP32_ATOL} + rtol {FP32_RTOL} (max err {max_err[name]:.3g})")
        result.update(rule=f"fp64 reference, atol {FP32_ATOL}, rtol {FP32_RTOL}", max_err=max_err)
    else:
        ref32 = t.grads(ref, [x.float() for x in inputs], dout)
        same = t.grads(lambda *a: ref(*a, upcast=False), inputs, dout)
        errors = t.flash_rule_errors(got, ref32, same, rel_atol=BF16_REL_ATOL)
        max_err = {n: (a.float() - r).abs().max().item() for n, a, r in zip(t.GRAD_NAMES, got, ref32)}
        result.update(rule=f"flash rule vs fp32 reference, rel atol {BF16_REL_ATOL}", max_err=max_err)
    result.update(ok=not errors, errors=errors)
    return result


def check_identities(t, device: str, sz: Sizes) -> list[dict]:
    """The identities of docs/architecture.md ("3D-DSA: the operator") through the public API
    with ``backend="triton"`` (fp32)."""
    import torch

    from kernels import deformable_slide_attention

    def on_device(q, k, v, offsets, window, scale=None):
        args = (x.to(device) for x in (q, k, v, offsets))
        out = deformable_slide_attention(*args, window, scale=scale, backend="triton")
        return out.cpu()

    results = []
    # offsets == 0 and window == grid: dense attention (forward and dq, dk, dv)
    for grid in sz.dense_identity_grids:
        name = f"dense identity, grid {grid}"
        try:
            t.assert_dense_identity(on_device, grid, torch.float32, 2e-5, seed=43)
            results.append({"case": name, "dtype": "float32", "ok": True, "errors": []})
        except AssertionError as e:
            results.append({"case": name, "dtype": "float32", "ok": False, "errors": [str(e)[:500]]})
    # offsets == 0: neighborhood attention (window shifted inward at borders)
    shape, window = sz.neighborhood_identity
    q, k, v = t.make_qkv(shape, seed=44)
    offsets = torch.zeros(*shape[:5], math.prod(window), 3)
    out = on_device(q, k, v, offsets, window).double()
    want = t.naive_neighborhood_attention(*(x.double() for x in (q, k, v)), window)
    err = (out - want).abs().max().item()
    ok = bool(err <= 1e-5)
    results.append({"case": f"neighborhood identity, {shape} window {window}", "dtype": "float32",
                    "ok": ok, "max_err": {"out": err},
                    "errors": [] if ok else [f"out: max err {err:.3g} > 1e-05"]})
    return results


def part_correctness(ctx: "Run") -> dict:
    import torch

    from kernels import checks as t  # inputs, identities, the bf16 rule (shared with the tests)
    results = []
    for case in ctx.sizes.cases:
        for kernel, dtype in ((kn, dt) for kn in ("gather", "tiled") for dt in (torch.float32, torch.bfloat16)):
            if ctx.past_deadline():
                results.append({"case": f"{case.name} [{kernel}]", "dtype": str(dtype).replace("torch.", ""),
                                "ok": False, "errors": ["skipped: time budget (--budget-s)"]})
                continue
            try:
                results.append(check_case(t, case, dtype, ctx.device, kernel))
            except Exception as e:  # one broken case must not hide the others
                results.append({"case": f"{case.name} [{kernel}]", "dtype": str(dtype).replace("torch.", ""),
                                "ok": False, "errors": [f"raised {type(e).__name__}: {e}"[:500]],
                                "traceback": traceback.format_exc()[-3000:]})
    results += check_identities(t, ctx.device, ctx.sizes)
    return {"ok": all(r["ok"] for r in results), "results": results}


# -----------------------------------------------------------------------------
# Part 2: pinned transfers


class _StandInCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` that succeed without CUDA (smoke runs: the
    registry and the piece logic run as on a GPU), or refuse piece number ``fail_at``."""

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.calls = fail_at, 0

    def cudaHostRegister(self, ptr, n, flags):
        self.calls += 1
        return 712 if self.fail_at is not None and self.calls >= self.fail_at else 0

    def cudaHostUnregister(self, ptr):
        return 0


def _copy_gbps(clock: Clock, dst, src, reps: int, pieces=None, stream=None) -> float:
    """Median GB/s of ``dst.copy_(src)`` over ``reps`` (asynchronous per piece when ``pieces``
    is given, else as torch does it for this memory), timed with events on ``stream``."""
    import torch

    from actors.pinned import copy_in_pieces

    times = []
    for _ in range(reps):
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            a = clock.mark()
            if pieces is not None:
                copy_in_pieces(dst, src, pieces)
            else:
                dst.copy_(src, non_blocking=clock.cuda)
            b = clock.mark()
        times.append(clock.seconds(a, b))
    return src.numel() * src.element_size() / statistics.median(times) / 1e9


def part_pinning(ctx: "Run") -> dict:
    import torch

    from actors import transfer
    from megaslide_ray.state.segments import map_segment
    from actors.pinned import PINNED, HostPinning, copy_pieces

    sz, dev, cuda = ctx.sizes, ctx.device, ctx.cuda
    n = sz.pin_bytes
    root, fs = state_root(n)
    clock = Clock(dev)
    stream = torch.cuda.Stream() if cuda else None
    path = Path(root) / f"megaslide-gpu-check-pin-{os.getpid()}"
    info: dict = {"bytes": n, "piece_bytes": sz.pin_chunk, "state_root": root, "filesystem": fs}
    try:
        seg = map_segment(path, n, torch.uint8, create=True)
    finally:
        path.unlink(missing_ok=True)  # the mapping stays valid
    _fill_pattern(seg)
    before = PINNED.total()
    pinning = HostPinning(cudart=None if cuda else _StandInCudart(), chunk=sz.pin_chunk)
    t0 = time.perf_counter()
    registered = pinning.register(seg)
    info["register_seconds"] = round(time.perf_counter() - t0, 3)
    info["registered"] = registered
    info["registered_bytes"] = PINNED.total() - before
    pieces = copy_pieces(seg)
    info["copy_pieces"] = len(pieces) if pieces else 0
    want_pieces = -(-n // sz.pin_chunk)
    checks = {"registered": registered,  # False: this machine refuses to pin the segment (see the log)
              "pieces_match_registration": (pieces is not None and len(pieces) == want_pieces
                                            and sum(c for _, c in pieces) == n) if registered else None}
    # A slice across a piece boundary is cut there; one inside a piece is one copy.
    half = sz.pin_chunk // 2
    across = copy_pieces(seg[half:half + sz.pin_chunk]) if registered and n >= 2 * sz.pin_chunk else None
    checks["slice_across_boundary_cut_in_two"] = (across is not None and len(across) == 2) if registered else None
    if cuda:
        info["torch_is_pinned_on_registered"] = bool(seg.is_pinned())
        info["torch_is_pinned_past_first_piece"] = bool(seg[sz.pin_chunk + 1:].is_pinned()) if n > sz.pin_chunk else None

    rows = {}
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned_buf = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    pinned_buf.copy_(seg)
    pageable = seg.clone()
    reps = sz.pin_reps
    rows["h2d_registered_gbps"] = _copy_gbps(clock, dst, seg, reps, pieces, stream)
    checks["h2d_data_intact"] = _same(dst, seg)
    rows["h2d_pin_memory_gbps"] = _copy_gbps(clock, dst, pinned_buf, reps, stream=stream)
    rows["h2d_pageable_gbps"] = _copy_gbps(clock, dst, pageable, reps, stream=stream)
    back = torch.empty(n, dtype=torch.uint8)
    seg.zero_()  # the device->host copies must bring the pattern back
    rows["d2h_registered_gbps"] = _copy_gbps(clock, seg, dst, reps, pieces, stream)
    checks["d2h_data_intact"] = _same(dst, seg)
    rows["d2h_pin_memory_gbps"] = _copy_gbps(clock, pinned_buf, dst, reps, stream=stream)
    rows["d2h_pageable_gbps"] = _copy_gbps(clock, back, dst, reps, stream=stream)
    info.update({k: round(v, 2) for k, v in rows.items()})
    if registered and rows["h2d_pin_memory_gbps"]:
        info["h2d_registered_vs_pin_memory"] = round(rows["h2d_registered_gbps"] / rows["h2d_pin_memory_gbps"], 3)

    # A refused registration: the same memory again (CUDA: cudaErrorHostMemoryAlreadyRegistered;
    # smoke: a stand-in that refuses the second piece). Falls back, leaves nothing registered,
    # and the CUDA error it raised is cleared: the next kernel launch works.
    # (When the first registration was refused already, that refusal is the one checked.)
    if registered:
        second = HostPinning(cudart=None if cuda else _StandInCudart(fail_at=2), chunk=sz.pin_chunk)
        target = seg if cuda else torch.empty(3 * sz.pin_chunk, dtype=torch.uint8)
        total = PINNED.total()
        print("pinning: provoking a refused registration; its warning below is expected", flush=True)
        refused = not second.register(target)
        transfer._REGISTER_FAILED_LOGGED = False  # that warning was this check's; real ones still log
        checks["refused_registration_falls_back"] = refused and PINNED.total() == total and not second.ranges
        second.release()
    launch_ok = True
    if cuda:
        try:
            torch.ones(8, device=dev).sum().item()
        except RuntimeError as e:
            launch_ok = False
            info["launch_after_refusal_error"] = str(e)[:300]
    checks["kernel_launches_after_refusal"] = launch_ok
    pinning.release()
    checks["released"] = PINNED.total() == before
    info["checks"] = checks
    info["ok"] = all(v is not False for v in checks.values())
    del seg
    return info


def _fill_pattern(seg) -> None:
    """A non-constant byte pattern, written in 64 MiB pieces (no 8x int64 temporary)."""
    import torch

    step = 64 << 20
    base = torch.arange(step, dtype=torch.int64).remainder_(251).to(torch.uint8)
    for i in range(0, seg.numel(), step):
        piece = seg[i:i + step]
        piece.copy_(base[:piece.numel()])


def _same(device_t, host_t) -> bool:
    """Spot check: every 4097th byte and the last MiB equal."""
    import torch

    a = device_t[::4097].cpu()
    b = host_t[::4097]
    tail = min(1 << 20, host_t.numel())
    return bool(torch.equal(a, b) and torch.equal(device_t[-tail:].cpu(), host_t[-tail:]))


# -----------------------------------------------------------------------------
# Part 3: streaming variants against each other


def streaming_tolerance(depth: int) -> float:
    """The relative L2 bound of the module docstring: 2 (L + 2) 2^-7."""
    return 2 * (depth + 2) * 2.0 ** -7


def part_streaming(ctx: "Run") -> dict:
    import torch

    from actors.compute import ComputeActor, LocalStoreClient
    from actors.param_store import ParameterStore
    from megaslide_ray.config import build_config

    sz, dev = ctx.sizes, ctx.device
    steps = sz.stream_steps

    class Recorder(LocalStoreClient):
        """The in-process client, keeping every reported squared norm: (shard, step) -> value."""

        def __init__(self, store):
            super().__init__(store)
            self.sqnorms: dict[tuple[int, int], float] = {}

        def report_grad(self, shard, step, sqnorm, grad):
            self.sqnorms[(shard, step)] = sqnorm
            super().report_grad(shard, step, sqnorm, grad)

    variants = (("on", True, False), ("on_again", True, False), ("off", False, False), ("on_offload", True, True))
    results, masters, init, norms = {}, {}, None, {}
    tmp = tempfile.mkdtemp(prefix="megaslide-gpu-stream-", dir=state_root(1 << 30)[0])
    try:
        for name, overlap, offload in variants:
            if ctx.past_deadline():
                results[name] = {"status": "skipped: time budget (--budget-s)"}
                continue
            cfg = build_config("tiny", None, {
                **sz.stream, "training.steps": 100, "runtime.overlap": overlap,
                "runtime.offload_activations": offload, "runtime.prefetch_depth": 2, "runtime.state_dir": tmp,
                "runtime.device": ctx.device_kind, "optim.lr": 0.1, "optim.eps": 1.0, "optim.weight_decay": 0.0,
                "optim.schedule": "constant", "optim.warmup_steps": 0, "optim.grad_clip": 1.0})
            batches = synthetic_batches(cfg, steps, seed=1)
            store = ParameterStore(cfg, f"{tmp}/run-{name}", w_dtype_for(dev), adamw="fused")
            client = Recorder(store)
            rows = []
            try:
                compute = ComputeActor(cfg, store.shard_infos(), client, "shm")
                try:
                    if init is None:
                        init = [seg["master"].clone() for seg in store.seg]
                    for k in range(steps):
                        t0 = time.perf_counter()
                        r = compute.train_step(batches[k], k)
                        store.wait_step(k)
                        rows.append((time.perf_counter() - t0, r))
                    masters[name] = [seg["master"].clone() for seg in store.seg]
                    norms[name] = dict(client.sqnorms)
                finally:
                    compute.close()
            except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others'
                results[name] = {"status": f"error: {type(e).__name__}: {e}"[:300],
                                 "traceback": traceback.format_exc()[-2000:]}
                print(results[name]["traceback"], file=sys.stderr, flush=True)
                continue
            finally:
                store.close()
            timed = rows[1:] or rows
            results[name] = {"status": "ok", "step_s": statistics.median(t for t, _ in timed),
                             "losses": [r.loss for _, r in rows],
                             "device_peak_mib": round(max(r.device_memory_peak_bytes for _, r in rows) / 2**20, 1)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    depth = int(sz.stream["model.depth"])
    tol = streaming_tolerance(depth)
    out = {"tolerance": tol, "tolerance_rule": "2 (L + 2) 2^-7 relative L2 of each shard's update (module docstring)",
           "variants": results}
    if "on" not in masters:
        return {**out, "ok": False, "error": "the reference run (overlap on) did not finish"}
    ref = masters["on"]
    comparisons = {}
    for name in ("on_again", "off", "on_offload"):
        if name not in masters:
            comparisons[name] = {"ok": False, "status": results.get(name, {}).get("status", "missing")}
            continue
        update_rel = max(_rel(a, b, i) for a, b, i in zip(masters[name], ref, init))
        norm_rel = max(abs(norms[name][key] - norms["on"][key]) / max(norms["on"][key], 1e-30)
                       for key in norms["on"] if key[1] == 0)
        loss0_equal = results[name]["losses"][0] == results["on"]["losses"][0]
        loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(results[name]["losses"], results["on"]["losses"]))
        finite = all(math.isfinite(x) for x in results[name]["losses"])
        comparisons[name] = {"update_rel_l2_max": update_rel, "step0_sqnorm_rel_max": norm_rel,
                             "loss_rel_max": loss_rel, "step0_loss_bit_equal": loss0_equal,
                             "params_bit_equal": all(torch.equal(a, b) for a, b in zip(masters[name], ref)),
                             "ok": finite and update_rel <= tol and norm_rel <= tol and loss_rel <= tol}
    noise = comparisons.get("on_again", {}).get("update_rel_l2_max")
    for name, c in comparisons.items():
        if noise and "update_rel_l2_max" in c and name != "on_again":
            c["vs_noise"] = c["update_rel_l2_max"] / noise
    out.update(comparisons=comparisons, noise_update_rel_l2=noise,
               speedup_on_vs_off=(results["off"]["step_s"] / results["on"]["step_s"]
                                  if "step_s" in results.get("off", {}) else None),
               ok=all(c["ok"] for c in comparisons.values()))
    return out


def _rel(a, b, init) -> float:
    """||a - b|| / ||b - init||: the difference of two runs relative to the update b made."""
    import torch

    moved = torch.linalg.vector_norm((b - init).double()).item()
    diff = torch.linalg.vector_norm((a - b).double()).item()
    return diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf)


# -----------------------------------------------------------------------------
# Part 4: attention operators at paper-like shapes


def attention_flops(kind: str, tokens: int, K: int, nh: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs: dense ``4 N^2 d nh``; DSA / neighborhood ``36 N K d nh``
    (4 for the dot products and the weighted sum, 32 for the trilinear gathers of k and v);
    backward = 2.5 x forward for both (FlashAttention's 5 matmuls against 2; the convention of
    benchmarks/attention.py, whose fwd+bwd is 3.5 x forward)."""
    fwd = 4.0 * tokens * tokens * d * nh if kind == "dense" else 36.0 * tokens * K * d * nh
    return fwd, 2.5 * fwd


def measure_attention(kind: str, grid, window, nh: int, d: int, device, reps: int) -> dict:
    """Forward and backward timed apart (medians over ``reps`` after one warm-up) and the peak
    memory of a forward + backward over its inputs."""
    import torch
    import torch.nn.functional as F

    from kernels import deformable_slide_attention

    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, *grid, nh, d)
    N, K = math.prod(grid), math.prod(window)

    def rand(*s):
        return torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k, v = (rand(*shape).requires_grad_() for _ in range(3))
    dout = rand(*shape)
    offsets = None
    if kind in ("dsa", "dsa_gather"):
        u = torch.rand((*shape[:5], K, 3), generator=gen, device=device)
        offsets = ((2 * u - 1) * 1.5).to(dtype).requires_grad_()
    elif kind == "neighborhood":
        offsets = torch.zeros((*shape[:5], K, 3), device=device, dtype=dtype)
    leaves = [x for x in (q, k, v, offsets) if x is not None and x.requires_grad]

    def forward():
        if kind == "dense":
            flat = [x.reshape(1, N, nh, d).transpose(1, 2) for x in (q, k, v)]
            return F.scaled_dot_product_attention(*flat).transpose(1, 2)
        if kind == "dsa_gather":
            return deformable_slide_attention(q, k, v, offsets, window, backend="triton_gather")
        # the bound the offsets were drawn with (a model passes attention.max_offset): no host sync
        return deformable_slide_attention(q, k, v, offsets, window, backend="triton",
                                          max_offset=1.5 if kind == "dsa" else 0.0)

    from kernels import dsa_triton_tiled as tiled

    fallbacks = sum(tiled.FALLBACKS.values())
    clock = Clock(device)

    def once() -> tuple[float, float]:
        for x in leaves:
            x.grad = None
        with _flash_only() if kind == "dense" else contextlib.nullcontext():
            a = clock.mark()
            out = forward()
            b = clock.mark()
            out.backward(dout.reshape(out.shape))
            c = clock.mark()
        return clock.seconds(a, b), clock.seconds(b, c)

    base = reset_peak(device)
    warm = once()
    peak = peak_since(device, base)
    n = reps if sum(warm) < 1.0 else min(reps, 1)
    runs = [once() for _ in range(n)] or [warm]  # reps=0 (smoke): the warm-up is the measurement
    fwd_s, bwd_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    ff, fb = attention_flops(kind, N, K, nh, d)
    return {"kind": kind, "grid": list(grid), "tokens": N, "window": list(window), "K": K, "heads": nh, "head_dim": d,
            "fwd_ms": fwd_s * 1e3, "bwd_ms": bwd_s * 1e3, "fwd_tflops": ff / fwd_s / 1e12,
            "bwd_tflops": fb / bwd_s / 1e12, "peak_mib": peak / 2**20 if peak is not None else None,
            "reps": n, "status": "ok",
            "backend": {"dense": "sdpa-flash", "dsa_gather": "triton gather"}.get(
                kind, "triton tiled" if sum(tiled.FALLBACKS.values()) == fallbacks
                else "triton gather (tiled fell back, logged)")}


@contextlib.contextmanager
def _flash_only():
    """Restrict SDPA to the FlashAttention backend (an error if it cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def crossover(rows: list[dict], window, key: str) -> dict:
    """Tokens where dense (flash) becomes slower than DSA, by ``key`` (``fwd_ms``, ``bwd_ms`` or
    ``total_ms``): log-log interpolation of time(dense)/time(dsa) between measured grids;
    past the largest grid extrapolated with the ratio growing like N (dense N^2, DSA N)."""
    def t(r):
        return r["fwd_ms"] + r["bwd_ms"] if key == "total_ms" else r[key]

    dense = {r["tokens"]: t(r) for r in rows if r["kind"] == "dense" and r["status"] == "ok"}
    dsa = {r["tokens"]: t(r) for r in rows if r["kind"] == "dsa" and r["status"] == "ok" and r["window"] == list(window)}
    pts = sorted((n, dense[n] / dsa[n]) for n in dense.keys() & dsa.keys())
    if not pts:
        return {"tokens": None, "how": "not measured"}
    if pts[0][1] >= 1:
        return {"tokens": pts[0][0], "how": f"dense already slower at the smallest grid (x{pts[0][1]:.2f})"}
    for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
        if r1 >= 1:
            f = math.log(1 / r0) / math.log(r1 / r0)
            return {"tokens": round(math.exp(math.log(n0) + f * math.log(n1 / n0))), "how": "interpolated"}
    n, r = pts[-1]
    return {"tokens": round(n / r), "how": f"extrapolated from {n} tokens (dense/dsa x{r:.2f})"}


def part_attention(ctx: "Run") -> dict:
    import torch

    sz, dev = ctx.sizes, ctx.device
    rows: list[dict] = []
    slow: set[tuple] = set()
    plan = []
    for grid in sz.attn_grids:
        plan.append(("dense", grid, sz.attn_windows[0]))
        for window in sz.attn_windows:
            plan += [("dsa", grid, window), ("dsa_gather", grid, window), ("neighborhood", grid, window)]
    for kind, grid, window in plan:
        key = (kind, tuple(window) if kind != "dense" else None)
        base = {"kind": kind, "grid": list(grid), "tokens": math.prod(grid), "window": list(window),
                "K": math.prod(window)}
        if ctx.past_deadline():
            rows.append({**base, "status": "skipped: time budget (--budget-s)"})
            continue
        if key in slow:
            rows.append({**base, "status": f"skipped: a smaller grid took over {sz.attn_slow_s} s"})
            continue
        try:
            r = measure_attention(kind, grid, window, sz.attn_heads, sz.attn_dim, dev, sz.attn_reps)
            if (r["fwd_ms"] + r["bwd_ms"]) / 1e3 > sz.attn_slow_s:
                slow.add(key)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the other rows still run
            r = {**base, "status": f"error: {type(e).__name__}: {e}"[:300]}
            if ctx.cuda:
                torch.cuda.empty_cache()
        rows.append(r)
        print(_attn_line(r), flush=True)
    cross = {f"window {'x'.join(map(str, w))} (K={math.prod(w)})":
             {k: crossover(rows, w, k) for k in ("fwd_ms", "bwd_ms", "total_ms")} for w in sz.attn_windows}
    return {"ok": all(r["status"] == "ok" for r in rows), "heads": sz.attn_heads, "head_dim": sz.attn_dim,
            "dtype": "bfloat16", "rows": rows, "crossover_tokens": cross,
            "flops_rule": "fwd: dense 4 N^2 d nh, dsa/neighborhood 36 N K d nh; bwd = 2.5 x fwd"}


def _attn_line(r: dict) -> str:
    def f(key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    window = "x".join(map(str, r["window"])) if r["kind"] != "dense" else "-"
    return (f"| {r['kind']} | {r['tokens']} | {window} | {f('fwd_ms', '.2f')} | {f('bwd_ms', '.2f')} | "
            f"{f('fwd_tflops', '.1f')} | {f('bwd_tflops', '.1f')} | {f('peak_mib', '.0f')} | {r['status']} | "
            f"{r.get('backend', '-')} |")


# -----------------------------------------------------------------------------
# Part 5: a paper-width model, streamed


def peak_flops(device) -> float | None:
    import torch

    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def part_model(ctx: "Run") -> dict:
    from actors.compute import ComputeActor, LocalStoreClient
    from actors.param_store import ParameterStore
    from megaslide_ray.config import build_config
    from megaslide_ray.planning.estimate import plan

    sz, dev = ctx.sizes, ctx.device
    w_dtype = w_dtype_for(dev)

    def config(clip, overlap: bool, root: str):
        frames, height, width = clip
        return build_config("tiny", None, {
            **sz.model, "data.num_frames": frames, "data.height": height, "data.width": width,
            "runtime.overlap": overlap, "runtime.prefetch_depth": 1, "runtime.state_dir": root,
            "runtime.device": ctx.device_kind, "training.steps": 1000})

    probe = plan(config(sz.model_clips[0][1], True, ""), w_dtype)
    root, fs = state_root(probe.host_store_bytes)
    info: dict = {"params": probe.params, "largest_shard_params": probe.largest_shard_params,
                  "store_bytes": probe.host_store_bytes, "state_root": root, "filesystem": fs,
                  "w_dtype": w_dtype, "peak_flops": peak_flops(dev), "config": dict(sz.model)}
    if fs not in ("tmpfs", "ramfs", "?") and ctx.cuda:
        info["note"] = (f"no shared memory with {probe.host_store_bytes / 1e9:.1f} GB free: the store lives on {fs}; "
                        "AdamW and pinning then run at that filesystem's pace")
    tmp = tempfile.mkdtemp(prefix="megaslide-gpu-model-", dir=root)
    runs = {}
    try:
        t0 = time.perf_counter()
        store = ParameterStore(config(sz.model_clips[0][1], True, tmp), f"{tmp}/run", w_dtype, adamw="fused")
        info["store_init_s"] = round(time.perf_counter() - t0, 1)
        step, broken = 0, False
        try:
            for clip_name, clip in sz.model_clips:
                for overlap in (True, False):
                    name = f"{clip_name}_{'on' if overlap else 'off'}"
                    if ctx.past_deadline() or broken:
                        runs[name] = {"status": "skipped: " + ("an earlier run failed" if broken
                                                               else "time budget (--budget-s)")}
                        continue
                    cfg = config(clip, overlap, tmp)
                    p = plan(cfg, w_dtype)
                    batches = synthetic_batches(cfg, sz.model_steps, seed=2)
                    _release_device_memory(dev)  # the last variant's buffers must not count in this one's peak
                    t0 = time.perf_counter()
                    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
                    setup_s = time.perf_counter() - t0  # CUDA: mostly registering the store's w and g segments
                    steps = []
                    try:
                        for k in range(sz.model_steps):
                            if k > 0 and ctx.past_deadline():
                                break
                            r = compute.train_step(batches[k], step)
                            busy = compute.link.stream_seconds()
                            store.wait_step(step)  # AdamW on the host, outside the timed step
                            step += 1
                            steps.append((r, busy))
                        pinned = sum(n for _, n in compute.link.pinning.ranges)
                        runs[name] = {**_model_row(steps, p, info["peak_flops"], pinned, clip),
                                      "setup_s": round(setup_s, 2)}
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory at the long clip: keep what ran
                        runs[name] = {"status": f"error: {type(e).__name__}: {e}"[:300],
                                      "traceback": traceback.format_exc()[-2000:]}
                        print(runs[name]["traceback"], file=sys.stderr, flush=True)
                        broken = True  # the store may hold half a step's reports: no later step can run
                    finally:
                        compute.close()
                        del compute
                    print(f"{name}: {json.dumps({k: v for k, v in runs[name].items() if k != 'steps'})}", flush=True)
        finally:
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for clip_name, _ in sz.model_clips:
        on, off = runs.get(f"{clip_name}_on", {}), runs.get(f"{clip_name}_off", {})
        if "step_s" in on and "step_s" in off:
            info[f"{clip_name}_speedup_on_vs_off"] = off["step_s"] / on["step_s"]
    info["runs"] = runs
    info["ok"] = bool(runs) and all(r.get("status") == "ok" for r in runs.values())
    return info


def _release_device_memory(device) -> None:
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _model_row(steps: list, p, peak: float | None, pinned: int, clip) -> dict:
    """One variant's numbers: medians over the steps after the first (warm-up)."""
    timed = steps[1:] or steps
    step_s = statistics.median(r.seconds for r, _ in timed)
    busy = {k: statistics.median(b[k] for _, b in timed) for k in ("h2d", "d2h", "compute")}
    h2d = statistics.median(r.h2d_bytes for r, _ in timed)
    peak_mem = max(r.device_memory_peak_bytes for r, _ in timed)
    model_flops = p.flops_linear + p.flops_attention  # MFU counts the model's FLOPs, not the recompute
    row = {"status": "ok", "clip": list(clip), "tokens": p.tokens_per_sample, "steps_timed": len(timed),
           "step_s": step_s, "busy_s": busy, "h2d_bytes": h2d,
           "h2d_gbps": h2d / busy["h2d"] / 1e9 if busy["h2d"] else None,
           "overlap_efficiency": max(busy.values()) / step_s if step_s else None,
           "peak_bytes": peak_mem, "plan_device_bytes": p.device_required_bytes,
           "peak_vs_plan": peak_mem / p.device_required_bytes if p.device_required_bytes else None,
           "plan_flops": p.flops_executed, "plan_model_flops": model_flops,
           "tflops": p.flops_executed / step_s / 1e12,
           "mfu": model_flops / step_s / peak if peak else None,
           "hfu": p.flops_executed / step_s / peak if peak else None, "pinned_bytes": pinned,
           "losses": [r.loss for r, _ in steps]}
    return row


# -----------------------------------------------------------------------------
# Part 6: Triton against the reference


def part_speedup(ctx: "Run") -> dict:
    from benchmarks.attention import make_row, measure

    grid, reps = ctx.sizes.speedup_grid, ctx.sizes.speedup_reps
    kind = "cpu" if not ctx.cuda else "cuda"
    tri = make_row("dsa", grid, kind, {"status": "ok", **measure("dsa", grid, kind, reps, 5.0, 0)})
    ref = make_row("dsa_ref", grid, kind, {"status": "ok", **measure("dsa_ref", grid, kind, reps, 5.0, 0)})
    speedup = ref.seconds / tri.seconds
    return {"grid": grid, "tokens": math.prod(grid), "fused": asdict(tri), "reference": asdict(ref),
            "speedup": speedup, "goal": SPEEDUP_GOAL, "ok": speedup >= SPEEDUP_GOAL or not ctx.cuda}


# -----------------------------------------------------------------------------
# The run and its report


@dataclass
class Run:
    out: Path
    sizes: Sizes
    device: str
    budget_s: float
    parts: tuple[str, ...]
    start: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    report: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_kind(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def run_part(self, name: str, fn) -> dict:
        """Run one part before its deadline (the budget minus what later parts keep); record its
        result or its traceback; rewrite the report before and after."""
        later = self.parts[self.parts.index(name) + 1:]
        end = self.start + self.budget_s
        self.deadline = end - self.sizes.reserve_scale * sum(RESERVE_S[p] for p in later)
        part_start = time.monotonic()
        print(f"== {name}", flush=True)
        if self.sizes.reserve_scale and self.deadline - part_start < 0.5 * RESERVE_S[name]:
            info = {"ok": False, "status": "skipped: time budget (--budget-s)"}
        else:
            self.report["parts"][name] = {"status": "running"}
            self.write()
            try:
                info = fn(self)
            except Exception:
                info = {"ok": False, "error": traceback.format_exc()[-4000:]}
                print(info["error"], file=sys.stderr, flush=True)
        info["seconds"] = round(time.monotonic() - part_start, 1)
        self.report["parts"][name] = info
        self.write()
        return info

    def write(self) -> None:
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "gpu_check.md").write_text("\n".join(markdown(self.report)) + "\n")


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": device, "cpus": os.cpu_count(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"import failed: {e}"
    if torch.cuda.is_available() and device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for path in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(path):
            env[f"free_gb {path}"] = round(shutil.disk_usage(path).free / 1e9, 1)
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        env["ulimit_l"] = "unlimited" if soft == resource.RLIM_INFINITY else soft
    except Exception:  # noqa: BLE001
        pass
    return env


def markdown(report: dict) -> list[str]:
    env = report.get("environment", {})
    lines = ["# GPU check (`python -m benchmarks.gpu_check`)", "",
             "- " + ", ".join(f"{k}: {v}" for k, v in env.items()),
             f"- wall time: {report.get('wall_s', 0):.0f} s{' (smoke run, CPU)' if report.get('smoke') else ''}", ""]
    for part, info in report.get("parts", {}).items():
        status = info.get("status") or ("ok" if info.get("ok") else "FAILED")
        lines += [f"## {part}: {status} ({info.get('seconds', '?')} s)", ""]
        if "error" in info:
            lines += ["```", info["error"], "```", ""]
        if part == "correctness" and "results" in info:
            lines += ["| case | dtype | ok | max abs err (out dq dk dv doffsets) | problems |", "|---|---|---|---|---|"]
            for r in info["results"]:
                errs = " ".join(f"{v:.2g}" for v in r.get("max_err", {}).values())
                lines.append(f"| {r['case']} | {r['dtype']} | {'yes' if r['ok'] else 'NO'} | {errs} | "
                             f"{'; '.join(r.get('errors', []))} |")
            lines.append("")
        if part == "pinning" and "checks" in info:
            lines += [f"- {info['bytes'] / 2**30:.2f} GiB in {info['state_root']} ({info['filesystem']}), "
                      f"registered: {info['registered']} in {info['copy_pieces']} pieces "
                      f"({info['register_seconds']} s)",
                      "- H2D GB/s registered / pin_memory / pageable: "
                      f"{info['h2d_registered_gbps']} / {info['h2d_pin_memory_gbps']} / {info['h2d_pageable_gbps']}",
                      "- D2H GB/s registered / pin_memory / pageable: "
                      f"{info['d2h_registered_gbps']} / {info['d2h_pin_memory_gbps']} / {info['d2h_pageable_gbps']}",
                      f"- torch is_pinned() on registered memory: {info.get('torch_is_pinned_on_registered', '-')}",
                      "- checks: " + ", ".join(f"{k} {v}" for k, v in info["checks"].items()), ""]
        if part == "streaming" and "comparisons" in info:
            lines.append(f"Tolerance {info['tolerance']:.3g} ({info['tolerance_rule']}); run-to-run noise "
                         f"{info['noise_update_rel_l2']}.")
            lines += ["", "| variant | step [s] | device peak [MiB] | update rel L2 | step-0 |g|^2 rel | "
                      "loss rel | step-0 loss equal | ok |", "|---|---|---|---|---|---|---|---|"]
            for name, r in info["variants"].items():
                c = info["comparisons"].get(name, {})
                lines.append(f"| {name} | {_fmt(r.get('step_s'), '.3f')} | {r.get('device_peak_mib', '-')} | "
                             f"{_fmt(c.get('update_rel_l2_max'), '.3g')} | {_fmt(c.get('step0_sqnorm_rel_max'), '.3g')} | "
                             f"{_fmt(c.get('loss_rel_max'), '.3g')} | {c.get('step0_loss_bit_equal', '-')} | "
                             f"{c.get('ok', '-') if name != 'on' else 'reference'} |")
            lines.append("")
        if part == "attention" and "rows" in info:
            lines += [f"bf16, B=1, nh={info['heads']}, d={info['head_dim']}; {info['flops_rule']}.", "",
                      "`dsa` and `neighborhood`: the tiled kernel (backend column: where it fell back to "
                      "the gather kernel); `dsa_gather`: the gather kernel, same offsets.", "",
                      "| kind | tokens | window | fwd [ms] | bwd [ms] | fwd TFLOP/s | bwd TFLOP/s | peak [MiB] | status "
                      "| backend |",
                      "|---|---|---|---|---|---|---|---|---|---|"]
            lines += [_attn_line(r) for r in info["rows"]]
            lines += ["", "Crossover (dense flash slower than DSA from):"]
            for K, c in info["crossover_tokens"].items():
                lines.append(f"- {K}: " + "; ".join(f"{k} {v['tokens']} ({v['how']})" for k, v in c.items()))
            lines.append("")
        if part == "model" and "runs" in info:
            lines += [f"{info['params'] / 1e9:.2f}B parameters, store {info['store_bytes'] / 1e9:.1f} GB in "
                      f"{info['state_root']} ({info['filesystem']}), init {info.get('store_init_s', '-')} s. "
                      + info.get("note", ""), "",
                      "| run | tokens | step [s] | busy h2d / d2h / compute [s] | H2D GB/s | overlap eff. | "
                      "peak / plan [GB] | TFLOP/s executed | MFU | HFU |", "|---|---|---|---|---|---|---|---|---|---|"]
            for name, r in info["runs"].items():
                if r.get("status") != "ok":
                    lines.append(f"| {name} | {r.get('status')} |||||||")
                    continue
                b = r["busy_s"]
                lines.append(f"| {name} | {r['tokens']} | {r['step_s']:.3f} | {b['h2d']:.3f} / {b['d2h']:.3f} / "
                             f"{b['compute']:.3f} | {_fmt(r['h2d_gbps'], '.1f')} | {_fmt(r['overlap_efficiency'], '.2f')} | "
                             f"{r['peak_bytes'] / 1e9:.1f} / {r['plan_device_bytes'] / 1e9:.1f} | {r['tflops']:.1f} | "
                             f"{_fmt(r['mfu'], '.3f')} | {_fmt(r['hfu'], '.3f')} |")
            lines.append("")
        if part == "speedup" and "speedup" in info:
            lines += [f"fused dsa {info['fused']['seconds'] * 1e3:.2f} ms vs reference "
                      f"{info['reference']['seconds'] * 1e3:.2f} ms at {info['tokens']} tokens: "
                      f"**x{info['speedup']:.1f}** (goal >= x{info['goal']:.0f}).", ""]
    return lines


def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


PART_FUNCS = {"correctness": part_correctness, "pinning": part_pinning, "streaming": part_streaming,
              "attention": part_attention, "model": part_model, "speedup": part_speedup}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json / .md")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="wall-time budget; parts and rows past their share are skipped (default 330)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    p.add_argument("--smoke", action="store_true",
                   help="every part on the CPU at tiny sizes (Triton under TRITON_INTERPRET=1)")
    args = p.parse_args(argv)

    if args.smoke:  # before anything imports triton: its kernels are then interpreted on the CPU
        if "triton" in sys.modules:
            print("gpu_check --smoke: triton was imported before TRITON_INTERPRET could be set", file=sys.stderr)
            return 1
        os.environ["TRITON_INTERPRET"] = "1"

    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              "run it on a GPU machine, or --smoke on the CPU. Nothing was run.", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else f"cuda:{torch.cuda.current_device()}"
    parts = tuple(x for x in PARTS if x in args.parts)
    run = Run(out=args.out, sizes=SMOKE if args.smoke else Sizes(), device=device, budget_s=args.budget_s,
              parts=parts)
    run.report = {"environment": environment(device), "smoke": args.smoke, "parts": {},
                  "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(run.report["environment"]), flush=True)
    for name in parts:
        run.run_part(name, PART_FUNCS[name])
    ok = all(info.get("ok") for info in run.report["parts"].values())
    run.report["ok"] = ok
    run.write()
    print(f"gpu_check: {'all ok' if ok else 'FAILURES'}; wrote {args.out / 'gpu_check.md'} "
          f"in {time.monotonic() - run.start:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
