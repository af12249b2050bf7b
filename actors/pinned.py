"""Pinned host memory and the copies that use it.

CUDA copies from host memory run at full speed (and asynchronously) only from page-locked
(pinned) memory. The store's shared-memory segments are registered with ``cudaHostRegister`` in
chunks of ``PIN_CHUNK_BYTES`` (never as one power-of-two pinned allocation, which would double
the footprint); ``PINNED`` knows which ranges of host memory are registered, so a copy can be
split into pieces that are pinned and pieces that are not. ``throttled_copy`` simulates a slower
link for tests and benchmarks."""

from __future__ import annotations

import bisect
import logging
import threading
import time

import torch

log = logging.getLogger(__name__)


PIN_CHUNK_BYTES = 256 << 20
"""Pinned registration works in pieces of at most this size (never one huge registration)."""


def pin_ranges(ptr: int, nbytes: int, chunk: int = PIN_CHUNK_BYTES, page: int = 4096) -> list[tuple[int, int]]:
    """Page-aligned ``(start, length)`` pieces of at most ``chunk`` bytes that cover
    ``[ptr, ptr + nbytes)``. A mapped file's pages are whole, so rounding out stays inside it."""
    if nbytes <= 0:
        return []
    if chunk < page or chunk % page:
        raise ValueError(f"chunk={chunk} must be a positive multiple of the page size {page}")
    start = ptr - ptr % page
    end = ptr + nbytes
    end += -end % page
    return [(s, min(chunk, end - s)) for s in range(start, end, chunk)]


def split_at_pieces(ptr: int, nbytes: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """``[ptr, ptr + nbytes)`` cut where it crosses from one registered range to the next:
    ``(offset from ptr, length)`` pieces, each inside one of ``ranges`` (sorted, disjoint
    ``(start, length)``); None when some byte lies in no range (not pinned: no async copy)."""
    if nbytes <= 0:
        return []
    starts = [s for s, _ in ranges]
    pieces, pos, end = [], ptr, ptr + nbytes
    while pos < end:
        i = bisect.bisect_right(starts, pos) - 1
        if i < 0 or pos >= ranges[i][0] + ranges[i][1]:
            return None
        stop = min(end, ranges[i][0] + ranges[i][1])
        pieces.append((pos - ptr, stop - pos))
        pos = stop
    return pieces


class PinnedRanges:
    """The host memory this process registered as pinned, as sorted disjoint ``(start, length)``
    ranges (thread-safe). Every asynchronous copy asks it where its host side may be cut.

    Why copies are cut at registration boundaries rather than segments registered whole: a
    dit-105b block is ~6 GB per segment, and one ``cudaHostRegister`` of that size takes long,
    all or nothing, and fails more readily against ``ulimit -l``; pieces of 256 MiB keep the
    registration bounded. But CUDA treats a copy as pinned DMA only within one registration:
    one copy across two is undefined (staged or refused), so a shard larger than a piece is
    copied as one asynchronous copy per piece, each at full DMA speed (about 24 for 6 GB)."""

    def __init__(self):
        self._ranges: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def add(self, start: int, length: int) -> None:
        with self._lock:
            bisect.insort(self._ranges, (start, length))

    def remove(self, start: int) -> None:
        with self._lock:
            self._ranges = [r for r in self._ranges if r[0] != start]

    def split(self, ptr: int, nbytes: int) -> list[tuple[int, int]] | None:
        with self._lock:
            return split_at_pieces(ptr, nbytes, self._ranges)

    def touches(self, ptr: int, nbytes: int) -> bool:
        with self._lock:
            return any(s < ptr + nbytes and ptr < s + n for s, n in self._ranges)

    def total(self) -> int:
        with self._lock:
            return sum(n for _, n in self._ranges)


PINNED = PinnedRanges()
"""Every range HostPinning registered in this process."""


def copy_pieces(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """Where an asynchronous copy to or from host tensor ``t`` must be cut: ``(element offset,
    element count)`` pieces; None when ``t`` is not entirely pinned (copy it synchronously).
    Registered memory is cut at its registration pieces (``PinnedRanges``); memory from torch's
    own pinned allocator (``is_pinned()``, one allocation) is one piece. Device tensors: None."""
    if t.device.type != "cpu":
        return None
    size = t.element_size()
    nbytes = t.numel() * size
    pieces = PINNED.split(t.data_ptr(), nbytes)
    if pieces is None:
        if PINNED.touches(t.data_ptr(), nbytes):
            return None  # partly registered: only some of it could be DMA'd
        if not (torch.cuda.is_available() and t.is_pinned()):
            return None
        pieces = [(0, nbytes)]
    # Piece boundaries are page multiples and t's start is element-aligned: whole elements.
    assert all(o % size == 0 and n % size == 0 for o, n in pieces), (pieces, size)
    return [(o // size, n // size) for o, n in pieces]


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, pieces: list[tuple[int, int]] | None) -> None:
    """``dst.copy_(src)`` for flat tensors: with ``pieces`` (from ``copy_pieces`` of the host
    side) one asynchronous copy per piece on the current stream, else one synchronous copy (its
    host side is not pinned: a ``non_blocking`` copy would stage it through pageable memory
    anyway, and a device->host one could return before the data landed)."""
    if pieces is None:
        dst.copy_(src)
        return
    d, s_ = dst.view(-1), src.view(-1)
    for offset, n in pieces:
        d[offset:offset + n].copy_(s_[offset:offset + n], non_blocking=True)


_REGISTER_FAILED_LOGGED = False


def clear_cuda_error() -> int:
    """Clear this thread's last CUDA runtime error (``cudaGetLastError``) after a failure that
    was handled (a refused ``cudaHostRegister``): the runtime keeps it until it is read, and the
    next kernel launch's check would report it as its own failure. Returns the error
    code read (0: none). torch's ``cudart()`` does not bind ``cudaGetLastError``, so: the libcudart
    this process has loaded (torch's, found in /proc/self/maps) through ctypes; then a tiny kernel
    launch, whose check reads (and so clears) any error still set."""
    code = 0
    try:
        import ctypes

        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "libcudart" in line.split()[-1]})
        for lib in libs:
            code = int(ctypes.CDLL(lib).cudaGetLastError()) or code
    except Exception:  # noqa: BLE001 - no /proc, no such symbol: the launch below still clears it
        pass
    try:
        torch.empty(1, device="cuda").fill_(0)
    except Exception as e:  # noqa: BLE001 - the check raised on the stale error and read it: clear now
        code = code or -1
        log.debug("cleared a stale CUDA error through a launch check: %s", e)
    return code


class HostPinning:
    """Host memory registered as pinned (``cudaHostRegister``) in ``pin_ranges`` pieces, so
    copies from and to it are asynchronous DMA (each cut at the pieces: see ``PinnedRanges``);
    ``release`` unregisters every piece. ``cudart``: the runtime bindings (tests pass a fake)."""

    def __init__(self, cudart=None, chunk: int = PIN_CHUNK_BYTES):
        self.ranges: list[tuple[int, int]] = []
        self._cudart = cudart
        self.chunk = chunk

    def _rt(self):
        return self._cudart if self._cudart is not None else torch.cuda.cudart()

    def register(self, t: torch.Tensor) -> bool:
        """Register ``t``'s memory; False when the driver refuses (e.g. over the locked-memory
        limit): nothing of ``t`` stays registered, the CUDA error is cleared, and a warning is
        logged once per process."""
        global _REGISTER_FAILED_LOGGED
        cudart = self._rt()
        done = []
        for start, n in pin_ranges(t.data_ptr(), t.numel() * t.element_size(), self.chunk):
            err = int(cudart.cudaHostRegister(start, n, 0))
            if err != 0:
                for s, _ in done:
                    cudart.cudaHostUnregister(s)
                    PINNED.remove(s)
                if self._cudart is None:
                    clear_cuda_error()
                if not _REGISTER_FAILED_LOGGED:
                    _REGISTER_FAILED_LOGGED = True
                    log.warning("could not register %d bytes of host memory as pinned (cudaError %d); copies "
                                "from and to it will be synchronous. Check `ulimit -l` and the state_dir's "
                                "filesystem (shared memory pins; some disk filesystems refuse).",
                                t.numel() * t.element_size(), err)
                return False
            done.append((start, n))
            PINNED.add(start, n)
        self.ranges.extend(done)
        return True

    def release(self) -> None:
        if not self.ranges:
            return
        cudart = self._rt()
        for start, _ in self.ranges:
            cudart.cudaHostUnregister(start)
            PINNED.remove(start)
        self.ranges = []


THROTTLE_CHUNK_BYTES = 4 << 20


def throttled_copy(dst: torch.Tensor, src: torch.Tensor, gbps: float) -> None:
    """``dst.copy_(src)`` at no more than ``gbps`` GB/s (0: unthrottled), in 4 MiB pieces with
    sleeps: a CPU stand-in for a PCIe link, so overlap can be tested without a GPU."""
    if gbps <= 0:
        dst.copy_(src)
        return
    d, s_ = dst.view(-1), src.view(-1)
    step = max(1, THROTTLE_CHUNK_BYTES // s_.element_size())
    t0 = time.perf_counter()
    done = 0
    for i in range(0, s_.numel(), step):
        piece = s_[i:i + step]
        d[i:i + step].copy_(piece)
        done += piece.numel() * piece.element_size()
        ahead = done / (gbps * 1e9) - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
