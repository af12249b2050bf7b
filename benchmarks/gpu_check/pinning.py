"""Part 2, ``pinning``: a registered shared-memory segment's H2D / D2H bandwidth against ``pin_memory()``
and pageable memory, data intact, a refused registration falls back."""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from actors import pinned
from actors.pinned import PINNED, HostPinning, copy_in_pieces, copy_pieces
from megaslide_ray.state.segments import map_segment

from .common import Clock, state_root

if TYPE_CHECKING:
    from .run import Run


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


def part_pinning(ctx: Run) -> dict:


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
        pinned._REGISTER_FAILED_LOGGED = False  # that warning was this check's; real ones still log
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

    step = 64 << 20
    base = torch.arange(step, dtype=torch.int64).remainder_(251).to(torch.uint8)
    for i in range(0, seg.numel(), step):
        piece = seg[i:i + step]
        piece.copy_(base[:piece.numel()])


def _same(device_t, host_t) -> bool:
    """Spot check: every 4097th byte and the last MiB equal."""

    a = device_t[::4097].cpu()
    b = host_t[::4097]
    tail = min(1 << 20, host_t.numel())
    return bool(torch.equal(a, b) and torch.equal(device_t[-tail:].cpu(), host_t[-tail:]))


