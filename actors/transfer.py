"""Moving bytes between host memory and the compute device: the compute actor's transfer machinery.

The compute actor (``actors/compute.py``) decides *what* runs; this module moves the bytes:

* ``Transfers``: the link of one compute actor. It knows where a shard's weights come from
  (the store's mapped ``w`` segments on the same node, or Ray object refs across nodes),
  copies them towards the device (CUDA: an asynchronous H2D stream from pinned segments; CPU:
  in place, or through a throttled copy that simulates a PCIe link), returns gradients (into
  the shard's own ``w`` segment, which holds no weights between the shard's backward and its
  update; CUDA: a D2H stream into the pinned segments; with several compute actors, into this
  actor's gradient slots instead, see ``actors/grad_reduce.py``), and counts the bytes and seconds of each
  direction per step. Two single-thread executors stand in for the streams on the CPU: one
  stages weights ahead (host -> device), one returns gradients (device -> host).
* ``ShardFeed``: the weights of one step's shards in schedule order, with ``prefetch_depth``
  shards in flight behind the one computing, and the turn's kept shard.
* ``StagingPool``: the device buffers the shards are staged into.

Beside it: ``actors/activations.py`` (``ActivationStash``: the block inputs kept for the
backward, on the device or, with ``runtime.offload_activations``, in a host segment) and
``actors/pinned.py`` (``HostPinning``/``pin_ranges``/``PINNED``: the pinned registration and the
registry of what is pinned, which every asynchronous copy consults; ``throttled_copy``: the
simulated link).

Why the staging buffers are pooled: the device must hold at most ``prefetch_depth + 1`` shards
whatever the model's depth, and a fresh device allocation per shard would both fragment memory
and (on CUDA) need the caching allocator to know which stream last used it. Each buffer comes
back with a fence event the next copy into it waits for.

The step schedule these serve is described in docs/architecture.md ("One training step").
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from actors.grad_reduce import GradSlots, slot_value
from actors.pinned import HostPinning, copy_in_pieces, copy_pieces, throttled_copy
from megaslide_ray.models.shards import prefetch_window
from megaslide_ray.state.segments import map_segment

log = logging.getLogger(__name__)


class Transfers:
    """The host <-> device link of one compute actor (see the module docstring).

    ``store``: the compute actor's store client (``wait_version``, ``get_weights``,
    ``report_grad``); ``shards``: the store's ``ShardInfo`` list; ``transport``: ``shm`` (map the
    store's segments, same node) or ``object_ref``. ``grad_slots``: with several compute actors,
    the store's gradient slots; this actor (``rank``) returns its gradients through its own.
    ``teacher_numels``: with distillation (``training.distill_weight``), the dense teacher's shard
    sizes: its frozen weights come through ``fetch_teacher`` as ``w`` comes through ``fetch``."""

    def __init__(self, device: torch.device, store, shards: list, transport: str, dtype: torch.dtype,
                 overlap: bool, prefetch_depth: int, link_gbps: float, grad_slots: GradSlots | None = None,
                 rank: int = 0, teacher_numels: list[int] | None = None):
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
        # Distillation: the teacher's segments, mapped the same way (never written: no version).
        self.teacher_maps = [map_segment(info.paths["teacher"], numel, dtype)
                             for info, numel in zip(shards, teacher_numels or [])] if transport == "shm" else []
        # Several compute actors: w_l holds weights the others still read, so gradients go to this
        # actor's slots, used in turn, each claimed once the store has summed what it held last.
        self.grad_slots, self.rank = grad_slots, rank
        self.slot_maps: list[torch.Tensor] = []
        self.slot_state: torch.Tensor | None = None
        self._reports = 0          # this step's gradient reports so far: the next goes to slot reports % slots
        self._slot_wait = 0.0      # this step's time blocked on a full slot
        if grad_slots is not None and transport == "shm":
            self.slot_maps = [map_segment(path, grad_slots.numel, dtype) for path in grad_slots.paths[rank]]
            self.slot_state = map_segment(grad_slots.state_path, grad_slots.actors * grad_slots.slots, torch.int64)
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
            for seg in self.w_maps + self.slot_maps + self.teacher_maps:
                if not self.pinning.register(seg):
                    break  # copies from unpinned pages still work, only synchronously

    # -- per-step accounting --------------------------------------------------------------------
    def begin_step(self) -> None:
        """No transfer is in flight between steps: start this step's counters at zero."""
        with self._lock:
            self._h2d, self._d2h = [0, 0.0], [0, 0.0]
            self._timing = {"h2d": [], "d2h": [], "compute": []}
            self._compute_start = None
            self._reports, self._slot_wait = 0, 0.0

    @property
    def slot_wait_seconds(self) -> float:
        """This step's time blocked on a full gradient slot (several compute actors)."""
        return self._slot_wait

    def _next_slot(self) -> int:
        """The gradient slot this step's next report goes to (-1: one compute actor, none)."""
        if self.grad_slots is None:
            return -1
        slot = self._reports % self.grad_slots.slots
        self._reports += 1
        return slot

    def _claim_slot(self, slot: int, step: int) -> torch.Tensor:
        """Wait until gradient slot ``slot`` is free (the store has summed what it held), mark it
        as holding ``step`` and return its mapping. The state is read in shared memory; only a
        full slot costs a call to the store, which blocks until the slot is summed."""
        i = self.grad_slots.index(self.rank, slot)
        if int(self.slot_state[i]) != -1:
            t0 = time.perf_counter()
            self.store.wait_grad_slot(slot)
            with self._lock:
                self._slot_wait += time.perf_counter() - t0
        self.slot_state[i] = slot_value(self.store.generation, step)
        return self.slot_maps[slot]

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
        return self._deliver(src, moved, t_copy)

    def fetch_teacher(self, shard: int, step: int) -> torch.Tensor:
        """The dense teacher's weights of shard ``shard`` (distillation), delivered as ``fetch``
        delivers ``w``; frozen, so valid at any ``step`` (no version to wait for)."""
        t_copy, moved = time.perf_counter(), 0
        if self.transport == "shm":
            src = self.teacher_maps[shard]
        else:
            # np.array copies: arrays from Ray are read-only views of the object store.
            src = torch.from_numpy(np.array(self.store.get_teacher_weights(shard), copy=True)).view(self.dtype)
            moved = src.numel() * src.element_size()
        return self._deliver(src, moved, t_copy)

    def _deliver(self, src: torch.Tensor, moved: int, t_copy: float) -> torch.Tensor:
        """``src`` (host weights) where the compute can use them; ``moved`` bytes already copied
        since ``t_copy`` (an object fetch) are counted with the staging copy."""
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
        returned. Several compute actors: a gradient larger than a slot goes in slot-sized pieces,
        each through its own slot and report, in order (each piece's report is queued before the
        next piece claims a slot, so a full slot is always freed by a report already on its way)."""
        cap = max(1, self.grad_slots.numel if self.grad_slots is not None else g.numel())
        futures = []
        for piece, lo in enumerate(range(0, max(g.numel(), 1), cap)):
            send = self._prepare_return(shard, step, g[lo:lo + cap], sqnorm, piece)
            if not self.overlap:
                send()
            else:
                futures.append(self.returner.submit(send))
        if not futures:
            return None
        if len(futures) == 1:
            return futures[0]
        return self.returner.submit(lambda: [f.result() for f in futures])  # after the pieces (one thread, FIFO)

    def report_norm(self, shard: int, step: int, sqnorm: torch.Tensor) -> Future | None:
        """Report shard ``shard``'s squared gradient norm without its gradient (a shard updated on
        the device, ``runtime.device_shards``), in order with the gradients returned before it:
        from the return thread with overlap, now without."""
        def send() -> None:
            self.store.report_grad(shard, step, float(sqnorm), None)

        if not self.overlap:
            send()
            return None
        return self.returner.submit(send)

    def _prepare_return(self, shard: int, step: int, g: torch.Tensor, sqnorm: torch.Tensor, piece: int):
        """``return_grad`` for one piece (the whole gradient with one compute actor): starts the
        device copy (CUDA) and returns the function that finishes it and sends the report."""
        copied = host = norm = None
        slot = self._next_slot()
        if self.cuda:  # both after the backward, on the D2H stream
            norm = self.host_staging.acquire(1, torch.float32)[0]
            if self.transport == "shm" and slot >= 0:
                # (the compute thread waits here for a full slot: device memory stays bounded)
                dst = self._claim_slot(slot, step)[:g.numel()]
            elif self.transport == "shm":
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
            elif self.transport == "shm" and slot >= 0:
                throttled_copy(self._claim_slot(slot, step)[:g.numel()], g, self.link_gbps)
                value = float(sqnorm)
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
            if slot >= 0:
                if self.transport != "shm":  # the store copies the bytes into the slot: wait until it is free
                    # here, so the store never holds a report thread waiting for one
                    t_wait = time.perf_counter()
                    self.store.wait_grad_slot(slot)
                    with self._lock:
                        self._slot_wait += time.perf_counter() - t_wait
                self.store.report_grad(shard, step, value, grad, slot=slot, piece=piece)
            else:
                self.store.report_grad(shard, step, value, grad)
            if host is not None:
                self.host_staging.release(host)
            self.count("d2h", g.numel() * g.element_size(), seconds)

        return send

    def close(self) -> None:
        self.prefetcher.shutdown(wait=True)
        self.returner.shutdown(wait=True)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.pinning.release()
        self.w_maps, self.slot_maps, self.slot_state, self.teacher_maps = [], [], None, []


class ShardFeed:
    """The weights of ``order`` (shard indices) for one step, taken in that order: with overlap,
    the prefetch thread keeps ``prefetch_depth`` shards in flight behind the one being taken;
    without, each is fetched when taken. ``reuse`` maps a position to an earlier position whose
    weights it takes again instead of fetching them (the turn: see ``ComputeActor.step_order``).
    ``fetch``: where the weights come from (default ``link.fetch``; ``link.fetch_teacher`` for the
    distillation teacher's forward). ``device``: shards whose weights already live on the device
    (``runtime.device_shards``): taken from there, never fetched nor handed back.

    ``wait`` = time the compute thread was blocked; ``log`` = (asked, got) clock readings of each
    take, for the overlap benchmark's schedule model."""

    def __init__(self, link: Transfers, order: list[int], step: int, reuse: dict[int, int] | None = None,
                 fetch=None, device: dict[int, torch.Tensor] | None = None):
        self.link, self.order, self.step = link, order, step
        self.device = device or {}
        self.on_device = [s in self.device for s in order]  # positions that fetch nothing (prefetch_window)
        self.fetch = fetch or link.fetch  # ``link.fetch_teacher``: the dense teacher's weights instead
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
        for ahead in self._window(pos):
            if ahead not in self.futures and ahead not in self.reusing:
                self.futures[ahead] = link.prefetcher.submit(self.fetch, self.order[ahead], self.step)
        t0 = time.perf_counter()
        if shard in self.device:
            w = self.device[shard]
        elif pos in self.reusing:
            w = self.kept.pop(pos)
        elif pos in self.futures:
            w = self.futures.pop(pos).result()
        else:  # the first shard, or no overlap: fetch now, in sequence
            w = self.fetch(shard, self.step)
        t1 = time.perf_counter()
        self.wait += t1 - t0
        self.log.append((t0, t1))
        w = link.ready(w)
        link.compute_begin()
        return w

    def _window(self, pos: int) -> list[int]:
        """The ``prefetch_depth`` positions after ``pos`` whose weights are staged while ``pos``
        computes; device shards' positions are passed over (they fetch nothing), so the first
        fetch of a step starts with its first position even when device shards come first
        (``models.shards.prefetch_window``, which the planner's replay uses too)."""
        return prefetch_window(self.on_device, pos, self.link.prefetch_depth)

    def done(self, w: torch.Tensor) -> None:
        """The compute is done with the weights ``w`` of the position last taken: keep them for
        the position that reuses them, else hand the buffer back."""
        self.link.compute_end()
        if self.on_device[self.pos]:
            return
        if self.pos in self.reused_from:
            self.kept[self.reused_from[self.pos]] = w
        else:
            self.link.release(w)


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

    def drop_sizes(self, numels: set[int]) -> int:
        """Forget the free buffers of ``numels`` elements (another weight set's, e.g. the
        distillation teacher's, once its forward is done); returns how many. On CUDA each was
        recorded on the stream that last used it, so its memory is reused only after that work."""
        with self._lock:
            gone = [key for key in self._free if key[0] in numels]
            return sum(len(self._free.pop(key)) for key in gone)


