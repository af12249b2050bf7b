"""Moving bytes between host memory and the compute device: the compute actor's transfer machinery.

The compute actor (``actors/compute.py``) decides *what* runs; this module moves the bytes:

* ``Transfers``: the link of one compute actor. It knows where a shard's weights come from
  (the store's mapped ``w`` segments on the same node, or Ray object refs across nodes),
  copies them towards the device (CUDA: an asynchronous H2D stream from pinned segments; CPU:
  in place, or through a throttled copy that simulates a PCIe link), returns gradients (into
  the shard's own ``w`` segment, which holds no weights between the shard's backward and its
  update; CUDA: a D2H stream into the pinned segments), and counts the bytes and seconds of each
  direction per step. Two single-thread executors stand in for the streams on the CPU: one
  stages weights ahead (host -> device), one returns gradients (device -> host).
* ``ShardFeed``: the weights of one step's shards in schedule order, with ``prefetch_depth``
  shards in flight behind the one computing, and the turn's kept shard.
* ``ActivationStash``: the block inputs kept for the backward (activation checkpointing), on
  the device or, with ``runtime.offload_activations``, in a host segment (all but the last
  ``runtime.offload_keep``, which stay on the device).
* ``StagingPool``, ``HostPinning``/``pin_ranges``/``PINNED``, ``throttled_copy``: the buffers,
  the pinned registration (and the registry of what is pinned, which every asynchronous copy
  consults) and the simulated link underneath.

Why the staging buffers are pooled: the device must hold at most ``prefetch_depth + 1`` shards
whatever the model's depth, and a fresh device allocation per shard would both fragment memory
and (on CUDA) need the caching allocator to know which stream last used it. Each buffer comes
back with a fence event the next copy into it waits for.

The step schedule these serve is described in docs/architecture.md ("One training step").
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from actors.param_store import default_state_root, map_segment

log = logging.getLogger(__name__)


class Transfers:
    """The host <-> device link of one compute actor (see the module docstring).

    ``store``: the compute actor's store client (``wait_version``, ``get_weights``,
    ``report_grad``); ``shards``: the store's ``ShardInfo`` list; ``transport``: ``shm`` (map the
    store's segments, same node) or ``object_ref``."""

    def __init__(self, device: torch.device, store, shards: list, transport: str, dtype: torch.dtype,
                 overlap: bool, prefetch_depth: int, link_gbps: float):
        self.device = device
        self.store = store
        self.transport = transport
        self.dtype = dtype
        self.overlap = overlap
        self.prefetch_depth = prefetch_depth if overlap else 0
        self.link_gbps = link_gbps
        self.cuda = device.type == "cuda"
        # Same node: map the store's segments. These are the store's pages, not a copy.
        # A shard's gradient lands in the same mapping once its backward is done.
        self.w_maps: list[torch.Tensor] = []
        if transport == "shm":
            for info in shards:
                self.w_maps.append(map_segment(info.paths["w"], info.numel, dtype))
        # Staging: on CUDA every shard is copied to the device; on CPU only when a link is
        # simulated (``link_gbps``), else the compute reads the mapped pages directly.
        self.staging = StagingPool()
        self.stage = device.type == "cpu" and link_gbps > 0
        # "Streams" on CPU: one thread stages shards ahead (host-to-device), one returns
        # gradients (device-to-host), so both transfers overlap the compute thread.
        # Their copies use the compute's torch threads: each thread sets them for itself (a new
        # thread's OpenMP count starts from OMP_NUM_THREADS, which Ray sets to 1 in its workers).
        threads = (torch.set_num_threads, (torch.get_num_threads(),))
        self.prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch",
                                             initializer=threads[0], initargs=threads[1])
        self.returner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-return",
                                           initializer=threads[0], initargs=threads[1])
        # Per-step counters. Both threads and the compute thread add to them: one lock.
        self._lock = threading.Lock()
        self._h2d = [0, 0.0]  # bytes, seconds of this step's host->device copies
        self._d2h = [0, 0.0]  # bytes, seconds of this step's device->host copies
        # CUDA: (start, end) timing events of this step per stream: H2D copies, D2H copies, and
        # each shard's compute on the default stream (from its weights being ready to its done).
        self._timing: dict[str, list[tuple]] = {"h2d": [], "d2h": [], "compute": []}
        self._compute_start = None
        # CUDA: real streams. Weights go host->device on their own stream, gradients device->host
        # on another, the model runs on the default stream; events order them. The store's mapped
        # segments are registered as pinned memory (in pieces), so both copies are asynchronous
        # DMA straight from/to shared memory, with no extra host copy of the model.
        self.pinning = HostPinning()
        # Object refs on CUDA: gradients go device->host on the D2H stream into reused pinned
        # buffers (``g.cpu()`` would queue on the default stream, behind later compute).
        self.host_staging = StagingPool(pin_memory=self.cuda)
        if self.cuda:
            self.h2d_stream = torch.cuda.Stream(device)
            self.d2h_stream = torch.cuda.Stream(device)
            for seg in self.w_maps:
                if not self.pinning.register(seg):
                    break  # copies from unpinned pages still work, only synchronously

    # -- per-step accounting --------------------------------------------------------------------
    def begin_step(self) -> None:
        """No transfer is in flight between steps: start this step's counters at zero."""
        with self._lock:
            self._h2d, self._d2h = [0, 0.0], [0, 0.0]
            self._timing = {"h2d": [], "d2h": [], "compute": []}
            self._compute_start = None

    def count(self, direction: str, nbytes: int, seconds: float = 0.0) -> None:
        """Add a copy to this step's ``h2d`` or ``d2h`` counters (any thread)."""
        with self._lock:
            c = self._h2d if direction == "h2d" else self._d2h
            c[0] += nbytes
            c[1] += seconds

    def step_counters(self) -> tuple[int, float, int, float]:
        """(h2d bytes, h2d seconds, d2h bytes, d2h seconds) of this step. CUDA: the seconds are
        the copies' own durations on their streams (host sync on each stream's last event)."""
        busy = self.stream_seconds()
        with self._lock:
            if self._timing["h2d"]:
                self._h2d[1] = busy["h2d"]
            if self._timing["d2h"]:
                self._d2h[1] = busy["d2h"]
            return self._h2d[0], self._h2d[1], self._d2h[0], self._d2h[1]

    def stream_seconds(self) -> dict[str, float]:
        """CUDA: this step's busy seconds per stream from its timing events (``h2d`` and ``d2h``:
        the copies; ``compute``: the shards' compute on the default stream, each from its weights
        being ready to its ``compute_end``). Waits for every end event (two threads may enqueue
        H2D copies, so the list's order need not be the stream's). CPU: zeros."""
        with self._lock:
            timing = {k: list(v) for k, v in self._timing.items()}
        out = {}
        for kind, pairs in timing.items():
            for _, end in pairs:
                end.synchronize()
            out[kind] = sum(a.elapsed_time(b) for a, b in pairs) / 1e3
        return out

    def _timed_event(self) -> "torch.cuda.Event":
        # blocking: the host may wait on it (stream_seconds); a spinning wait would take a core
        # from the CPU AdamW on the same node.
        return torch.cuda.Event(enable_timing=True, blocking=True)

    def compute_begin(self) -> None:
        """CUDA: the default stream starts computing with a shard's weights (after ``ready``)."""
        if self.cuda:
            self._compute_start = self._timed_event()
            self._compute_start.record(torch.cuda.current_stream(self.device))

    def compute_end(self) -> None:
        """CUDA: the default stream's work with the shard taken last is queued."""
        if self.cuda and self._compute_start is not None:
            end = self._timed_event()
            end.record(torch.cuda.current_stream(self.device))
            with self._lock:
                self._timing["compute"].append((self._compute_start, end))
            self._compute_start = None

    # -- weights towards the device ------------------------------------------------------------
    def fetch(self, shard: int, step: int) -> torch.Tensor:
        """Shard ``shard``'s compute weights, valid for ``step``, where the compute can use them
        (CUDA: a device buffer whose copy may still be in flight: pass it through ``ready``)."""
        if self.transport == "shm":
            self.store.wait_version(shard, step)
            src = self.w_maps[shard]
            t_copy, moved = time.perf_counter(), 0
        else:
            t_copy = time.perf_counter()  # the transfer is the object fetch itself
            raw = self.store.get_weights(shard, step)
            # np.array copies: arrays from Ray are read-only views of the object store.
            src = torch.from_numpy(np.array(raw, copy=True)).view(self.dtype)
            moved = src.numel() * src.element_size()
        if self.stage:  # simulated link: a throttled copy into a reused buffer
            w, _ = self.staging.acquire(src.numel(), src.dtype)
            throttled_copy(w, src, self.link_gbps)
            moved = src.numel() * src.element_size()
        elif self.cuda:  # enqueue the H2D copy on its stream; the compute waits on its event
            return self.to_device(src)
        else:  # CPU: compute straight from the mapped pages (no copy)
            w = src
        if moved:
            self.count("h2d", moved, time.perf_counter() - t_copy)
        return w

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """Host->device copy of ``src`` on the H2D stream, counted in this step's H2D bytes:
        asynchronous DMA, piece by piece, when ``src`` is pinned (see ``copy_pieces``), else one
        synchronous copy. The result carries the event that marks the copy done (see ``ready``)."""
        start, done = self._timed_event(), self._timed_event()
        with torch.cuda.stream(self.h2d_stream):
            # A reused device buffer: the copy waits until the compute is done with its last use.
            w, fence = self.staging.acquire(src.numel(), src.dtype, self.device)
            if fence is not None:
                self.h2d_stream.wait_event(fence)
            start.record()
            copy_in_pieces(w, src, copy_pieces(src))
            done.record()
        w._megaslide_ready = done  # read and dropped by ready() on the compute thread
        with self._lock:
            self._timing["h2d"].append((start, done))
        self.count("h2d", src.numel() * src.element_size())
        return w

    def ready(self, w: torch.Tensor) -> torch.Tensor:
        """Make the compute stream wait for ``w``'s copy, and keep the caching allocator from
        reusing its memory (allocated on the H2D stream) before the compute is done with it."""
        done = getattr(w, "_megaslide_ready", None)
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            w.record_stream(current)
            del w._megaslide_ready
        return w

    def release(self, w: torch.Tensor) -> None:
        """The compute is done with the weights ``w``: their staging buffer can be reused."""
        if self.stage or self.cuda:
            self.recycle(w)

    def recycle(self, buf: torch.Tensor) -> None:
        """Hand a staging buffer back. CUDA: with an event after the compute work queued so
        far, which the next copy into the buffer waits for."""
        fence = None
        if self.cuda:
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
        self.staging.release(buf, fence)

    # -- towards the host ---------------------------------------------------------------------
    def to_host(self, dst: torch.Tensor, src: torch.Tensor, extra: tuple = ()) -> "torch.cuda.Event":
        """CUDA: device->host copy of ``src`` into ``dst`` on the D2H stream, after the compute
        work queued so far (asynchronous DMA, piece by piece, when ``dst`` is pinned; else
        synchronous); ``extra``: more ``(dst, src)`` pairs copied after it (small ones: a norm).
        Returns the event that marks them done (blocking: the host waits on it)."""
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        start, copied = self._timed_event(), self._timed_event()
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(produced)
            start.record()
            copy_in_pieces(dst, src, copy_pieces(dst))
            for d, s_ in extra:
                copy_in_pieces(d, s_, copy_pieces(d))
            copied.record()
        for _, s_ in ((dst, src), *extra):
            s_.record_stream(self.d2h_stream)
        with self._lock:
            self._timing["d2h"].append((start, copied))
        return copied

    def return_grad(self, shard: int, step: int, g: torch.Tensor, sqnorm: torch.Tensor) -> Future | None:
        """Hand shard ``shard``'s flat gradient ``g`` and its squared norm (a 0-d float32 tensor
        on the compute device, NaN to poison the step) to the store: into the store's ``g``
        segment (same node; CUDA: on the D2H stream), or as raw bytes in an object ref (CUDA: on
        the D2H stream into a reused pinned buffer). The norm is read on the return thread, so
        the compute thread never waits for it. With overlap the report is sent from the return
        thread: the returned future surfaces its errors; without, it is sent now and None is
        returned."""
        copied = host = norm = None
        if self.cuda:  # both after the backward, on the D2H stream
            norm = self.host_staging.acquire(1, torch.float32)[0]
            if self.transport == "shm":
                dst = self.w_maps[shard]
            else:
                host = dst = self.host_staging.acquire(g.numel(), g.dtype)[0]
            copied = self.to_host(dst, g, extra=((norm, sqnorm.reshape(1)),))

        def send() -> None:
            t0 = time.perf_counter()
            grad = None
            if copied is not None:
                copied.synchronize()  # the gradient (and its norm) reached host memory
                value = float(norm[0])
                self.host_staging.release(norm)
                if host is not None:
                    grad = host.view(torch.uint8).numpy()
            elif self.transport == "shm":
                # CPU: the compute read w_shard in place; its backward has returned (this runs
                # after it), and no later work of this step reads shard ``shard`` again.
                throttled_copy(self.w_maps[shard], g, self.link_gbps)
                value = float(sqnorm)
            else:
                grad = g.view(torch.uint8).numpy()  # CPU: the report copies these bytes
                value = float(sqnorm)
            seconds = time.perf_counter() - t0
            # The report copies ``grad`` before it returns (in-process into the w segment; a Ray
            # actor call serializes its arguments when it is made), so the buffer is free after.
            self.store.report_grad(shard, step, value, grad)
            if host is not None:
                self.host_staging.release(host)
            self.count("d2h", g.numel() * g.element_size(), seconds)

        if not self.overlap:
            send()
            return None
        return self.returner.submit(send)

    def close(self) -> None:
        self.prefetcher.shutdown(wait=True)
        self.returner.shutdown(wait=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.pinning.release()
        self.w_maps = []


class ShardFeed:
    """The weights of ``order`` (shard indices) for one step, taken in that order: with overlap,
    the prefetch thread keeps ``prefetch_depth`` shards in flight behind the one being taken;
    without, each is fetched when taken. ``reuse`` maps a position to an earlier position whose
    weights it takes again instead of fetching them (the turn: see ``ComputeActor.step_order``).

    ``wait`` = time the compute thread was blocked; ``log`` = (asked, got) clock readings of each
    take, for the overlap benchmark's schedule model."""

    def __init__(self, link: Transfers, order: list[int], step: int, reuse: dict[int, int] | None = None):
        self.link, self.order, self.step = link, order, step
        self.reused_from = {src: dst for dst, src in (reuse or {}).items()}  # kept position -> reusing one
        if any(order[src] != order[dst] for src, dst in self.reused_from.items()):
            raise ValueError(f"reuse {reuse} pairs positions of different shards in {order}")
        self.reusing = set(self.reused_from.values())
        self.pos = -1  # the position last taken
        self.kept: dict[int, torch.Tensor] = {}
        self.futures: dict[int, Future] = {}
        self.wait = 0.0
        self.log: list[tuple[float, float]] = []

    def take(self, shard: int) -> torch.Tensor:
        """The next position's weights, which must be shard ``shard``'s (the caller states what
        it expects, so a schedule and its order cannot drift apart)."""
        pos = self.pos + 1
        if pos >= len(self.order) or self.order[pos] != shard:
            raise RuntimeError(f"the step takes shard {shard} at position {pos}, but the order is {self.order}")
        self.pos = pos
        link = self.link
        for ahead in range(pos + 1, min(pos + link.prefetch_depth + 1, len(self.order))):
            if ahead not in self.futures and ahead not in self.reusing:
                self.futures[ahead] = link.prefetcher.submit(link.fetch, self.order[ahead], self.step)
        t0 = time.perf_counter()
        if pos in self.reusing:
            w = self.kept.pop(pos)
        elif pos in self.futures:
            w = self.futures.pop(pos).result()
        else:  # the first shard, or no overlap: fetch now, in sequence
            w = link.fetch(shard, self.step)
        t1 = time.perf_counter()
        self.wait += t1 - t0
        self.log.append((t0, t1))
        w = link.ready(w)
        link.compute_begin()
        return w

    def done(self, w: torch.Tensor) -> None:
        """The compute is done with the weights ``w`` of the position last taken: keep them for
        the position that reuses them, else hand the buffer back."""
        self.link.compute_end()
        if self.pos in self.reused_from:
            self.kept[self.reused_from[self.pos]] = w
        else:
            self.link.release(w)


class ActivationStash:
    """The block-boundary inputs a step keeps for its backward (activation checkpointing).

    Default: a list on the compute device, which grows with model depth (L inputs of
    batch x tokens x width). With ``offload`` (``runtime.offload_activations``) each input goes
    to a host segment as soon as the next block has it (on the gradient-return thread: the
    device-to-host direction, idle during the forward) and comes back on the staging thread
    ahead of its block's backward, like the weights; at most ``prefetch_depth + 1`` inputs are
    then on the device whatever the depth. The host segment is one file-backed mapping in
    ``state_dir``, unlinked as soon as it is mapped (nothing is left behind by a crash),
    registered as pinned memory on CUDA. With ``link_gbps`` both copies cross the simulated
    link and count as link traffic.

    ``keep`` (``runtime.offload_keep``, with ``offload``): the inputs of the last ``keep`` blocks
    (``i >= L - keep``) stay on the device. They are the first the backward takes, so they need
    no round trip; the host segment has ``L - keep`` slots, and only the offloaded inputs count
    as traffic. The device then holds at most ``prefetch_depth + 1 + keep`` inputs
    (``peak_device_inputs`` records the most this step held: those kept, those still on their
    way out, those brought back or on their way in, those taken and not given back).
    """

    def __init__(self, link: Transfers, offload: bool, state_dir: str = "", keep: int = 0):
        if keep < 0:
            raise ValueError(f"keep={keep} must be >= 0")
        self.link, self.offload, self.state_dir, self.keep = link, offload, state_dir, keep
        self.kept: list[torch.Tensor] = []             # without offload: every input, on the device
        self._device: dict[int, torch.Tensor] = {}     # with offload: the last ``keep``, on the device
        self._first_kept = 0                           # inputs i >= this stay on the device
        self._host: torch.Tensor | None = None     # host slots x slot numel, flat
        self._slot = 0
        self._shape: tuple = ()
        self._slots = 0
        self._put: dict[int, object] = {}            # Future (CPU), cuda.Event (CUDA) or None
        self._get: dict[int, Future] = {}
        self._out: set[int] = set()                  # taken and not given back
        self._pinning = HostPinning()
        self.peak_device_inputs = 0

    def _ensure(self, slots: int, like: torch.Tensor) -> None:
        numel = like.numel()
        if self._host is not None and self._host.dtype == like.dtype and self._host.numel() >= slots * numel:
            return
        self.release_host()
        root = Path(self.state_dir) if self.state_dir else default_state_root()
        path = root / f"megaslide-activations-{os.getpid()}-{id(self):x}"
        try:
            root.mkdir(parents=True, exist_ok=True)  # (another node than the store's may lack it)
            self._host = map_segment(path, slots * numel, like.dtype, create=True)
        except OSError as e:
            raise RuntimeError(f"runtime.offload_activations: cannot make a {slots * numel * like.element_size()} "
                               f"byte host segment in {root} ({e}); free space there, set runtime.state_dir, "
                               f"raise runtime.offload_keep, or turn offload_activations off") from e
        finally:
            path.unlink(missing_ok=True)  # the mapping stays valid; no file outlives the process
        if self.link.cuda:
            self._pinning.register(self._host)

    def begin(self, slots: int) -> None:
        """A new step of ``slots`` block inputs (the model's depth)."""
        self.kept, self._device, self._put, self._get, self._out = [], {}, {}, {}, set()
        self._slots, self._first_kept = slots, max(0, slots - self.keep)
        self.peak_device_inputs = 0

    def offloaded(self, i: int) -> bool:
        """Whether block input ``i`` goes to the host segment (else it stays on the device)."""
        return self.offload and 0 <= i < self._first_kept

    def _outgoing(self) -> list[int]:
        """Offloaded inputs whose copy to the host has not finished (oldest first)."""
        if self.link.cuda:
            return [j for j, e in self._put.items() if e is not None and not e.query()]
        return [j for j, f in self._put.items() if isinstance(f, Future) and not f.done()]

    def _note_peak(self) -> None:
        if self.offload:
            held = set(self._device) | set(self._outgoing()) | set(self._get) | self._out
            self.peak_device_inputs = max(self.peak_device_inputs, len(held))
        else:
            self.peak_device_inputs = max(self.peak_device_inputs, len(self.kept))

    def put(self, i: int, x: torch.Tensor) -> None:
        """Keep block input ``i`` (0-based block index) for the backward."""
        if not self.offload:
            self.kept.append(x)
            self._note_peak()
            return
        if not self.offloaded(i):  # one of the last ``keep``: stays where it is
            self._device[i] = x
            self._note_peak()
            return
        link = self.link
        if self._host is None or self._shape != tuple(x.shape):
            self._ensure(self._first_kept, x)
            self._shape, self._slot = tuple(x.shape), x.numel()
        dst = self._host[i * self._slot:(i + 1) * self._slot]
        if link.cuda:
            self._put[i] = link.to_host(dst, x.reshape(-1))
            link.count("d2h", x.numel() * x.element_size())
            self._bound_outgoing()
            return

        def out() -> None:
            t0 = time.perf_counter()
            throttled_copy(dst, x.reshape(-1), link.link_gbps)
            link.count("d2h", x.numel() * x.element_size(), time.perf_counter() - t0)

        if not link.overlap:
            out()
            self._put[i] = None
            self._note_peak()
            return
        self._put[i] = link.returner.submit(out)
        self._bound_outgoing()

    def _bound_outgoing(self) -> None:
        """Bound what waits for the link: no more than prefetch_depth + 1 inputs on their way out
        (each holds its device tensor until its copy is done). CUDA: the host waits for the
        oldest copies' events, so the compute cannot queue ahead of the D2H stream without bound."""
        waiting = self._outgoing()
        for j in waiting[:max(0, len(waiting) - (self.link.prefetch_depth + 1))]:
            if self.link.cuda:
                self._put[j].synchronize()
            else:
                self._put[j].result()
        self._note_peak()

    def _load(self, i: int) -> torch.Tensor:
        link = self.link
        src = self._host[i * self._slot:(i + 1) * self._slot]
        if link.cuda:
            link.h2d_stream.wait_event(self._put[i])  # the input has reached the host
            return link.to_device(src)
        done = self._put[i]
        if isinstance(done, Future):
            done.result()
        t0 = time.perf_counter()
        buf, _ = link.staging.acquire(src.numel(), src.dtype)
        throttled_copy(buf, src, link.link_gbps)
        link.count("h2d", src.numel() * src.element_size(), time.perf_counter() - t0)
        return buf

    def prefetch(self, i: int) -> None:
        """Start bringing offloaded input ``i`` back (with overlap); a no-op for an input kept on
        the device, out of range, already on its way, or without offload or overlap."""
        if self.offloaded(i) and self.link.overlap and i not in self._get:
            self._get[i] = self.link.prefetcher.submit(self._load, i)
            self._note_peak()

    def take(self, i: int) -> torch.Tensor:
        """Block input ``i`` for its backward; inputs are taken newest first. Hand it back with
        ``give_back(i, x)`` once the backward is done with it."""
        if not self.offload:
            return self.kept.pop()
        self._out.add(i)
        if not self.offloaded(i):
            return self._device.pop(i)
        got = self._get.pop(i, None)
        buf = got.result() if isinstance(got, Future) else self._load(i)
        self._note_peak()
        return self.link.ready(buf).view(self._shape)

    def give_back(self, i: int, x: torch.Tensor) -> None:
        """Input ``i`` (``x``, from ``take``) is no longer needed: an offloaded one's staging
        buffer is reused; one kept on the device is simply dropped (it is no staging buffer)."""
        if not self.offload:
            return
        self._out.discard(i)
        if self.offloaded(i):
            self.link.recycle(x.view(-1))

    def release_host(self) -> None:
        self._pinning.release()
        self._host, self._shape = None, ()


class StagingPool:
    """Reused staging buffers, by size and device: the working set stays at prefetch_depth + 1
    shards whatever the depth of the model (buffers are handed back after each shard's compute).
    On CUDA these are the device buffers the H2D stream copies into; each comes back with a
    ``fence`` event that the next copy into it must wait for. ``pin_memory``: host buffers are
    allocated pinned (torch's pinned allocator: one allocation each, so one DMA copy)."""

    def __init__(self, pin_memory: bool = False):
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = {}
        self._lock = threading.Lock()
        self.pin_memory = pin_memory
        self.allocated = 0

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple[torch.Tensor, object]:
        device = torch.device(device or "cpu")
        with self._lock:
            free = self._free.get((numel, dtype, device))
            if free:
                return free.pop()
            self.allocated += 1
        pin = self.pin_memory and device.type == "cpu"
        return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin), None

    def release(self, buf: torch.Tensor, fence: object = None) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append((buf, fence))


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
