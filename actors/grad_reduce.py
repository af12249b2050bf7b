"""GradientReducer: the parameter store sums the gradients of N data-parallel compute actors.

With one compute actor a shard's gradient lands in the shard's own ``w`` segment (see
``actors/param_store.py``). With N > 1 (``runtime.compute_actors``) that is not possible:
``w_l`` still holds weights that the other actors read in their own backward of shard l, and it
may be overwritten only once every actor has finished reading it. So each actor writes its
gradient of a shard into one of its own **gradient slots** (``runtime.grad_slots`` of them, each
``runtime.grad_slot_mb``, at most the largest shard, in the compute dtype; shared-memory segments
beside the state)
and reports it. Once all N reports of a shard are in (each sent after that actor's backward of
the shard returned, so nobody reads ``w_l`` any more), the reducer thread sums them **in fp32 in
the fixed order actor 0, 1, ..., N-1** (bit-identical run to run) into ``w_l``, computes the
squared norm of the sum there, frees the N slots and hands the norm to the store, which counts
the shard as reported. From then on the shard is exactly where a one-actor step leaves it: its
gradient in ``w_l``, the update reading it from there. Host memory beyond the 14 B/param state:
``N x grad_slots`` slots plus, on a bf16 run, one fp32 accumulator of one slot's size (the
planner counts both): never a second gradient buffer of the model.

A slot holds ``runtime.grad_slot_mb`` (at most the largest shard): a larger shard's gradient goes
in **pieces** of a slot's size, each reported (and summed into its range of ``w_l``) on its own;
the shard counts as reported once its last piece is summed, with the squared norms of its pieces
added up. So the slots and the fp32 accumulator are sub-block sized, whatever the block.

Slots are used in turn (the j-th report of an actor's step goes to slot ``j % grad_slots``): the
store sums shards in the order every actor reports them (L+1, L, ..., 0), so slots come free in
the order they were filled. A slot's state (``-1`` free, else the step whose gradient it holds)
is a small shared segment (``slot_value``: the generation of the compute actor that filled it in
the high 32 bits, so a write of a replaced actor that lands after the store freed every slot is
recognised as stale and ignored): an actor on the same node reads it and asks the store to wait
(``wait_slot``) only when the slot it needs is still full, which is where a fast actor waits
for a slow one. The loss scaling (each actor's loss divided by N, so the sum is the mean over
the global batch) is the compute actor's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megaslide_ray.state.segments import DTYPES, map_segment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GradSlots:
    """Where the gradient slots of every compute actor are: what a compute actor maps."""
    actors: int
    slots: int
    numel: int                            # each slot's capacity (runtime.grad_slot_mb, at most the largest shard)
    w_dtype: str
    paths: tuple[tuple[str, ...], ...]    # [actor][slot] -> segment file
    state_path: str                       # int64 [actors * slots]: -1 free, else the step it holds

    def index(self, actor: int, slot: int) -> int:
        return actor * self.slots + slot


def slot_value(generation: int, step: int) -> int:
    """A full slot's state: the step its gradient belongs to and the generation of the actor that
    wrote it (``-1``: free)."""
    return (int(generation) << 32) | int(step)


class SlotsAbandoned(RuntimeError):
    """The compute actors were replaced while this one waited for a slot: its step is dropped."""


class GradientReducer:
    """The store's side of the gradient slots (module docstring). ``targets[l]`` is shard l's
    ``w`` segment; ``on_reduced(shard, step, sqnorm, generation, seconds)`` is called, on the
    reducer thread, once shard ``shard``'s sum is in ``targets[shard]``."""

    def __init__(self, directory: Path, actors: int, slots: int, targets: list[torch.Tensor], w_dtype: str,
                 create: bool, threads: int, on_reduced: Callable[[int, int, float, int, float], None],
                 slot_numel: int | None = None):
        """``slot_numel``: one slot's capacity (``models.shards.grad_slot_numel``; default, and at
        most, the largest shard): a shard larger than it is reported in pieces of that size."""
        self.actors, self.slots, self.w_dtype = actors, slots, w_dtype
        self.targets = targets
        largest = max(t.numel() for t in targets)
        self.numel = min(largest, slot_numel) if slot_numel else largest
        dtype = DTYPES[w_dtype]
        paths = tuple(tuple(str(directory / f"grad_{a}_{s}.{w_dtype}") for s in range(slots))
                      for a in range(actors))
        state_path = directory / "grad_slots.i64"
        fresh = create or not state_path.is_file()
        self.seg = [[map_segment(p, self.numel, dtype, create=fresh) for p in row] for row in paths]
        self.state = map_segment(state_path, actors * slots, torch.int64, create=fresh)
        # A (re)started store has no report in flight: every slot is free.
        self.state.fill_(-1)
        self.info = GradSlots(actors, slots, self.numel, w_dtype, paths, str(state_path))
        # bf16 runs sum in fp32 here, then round once into w (private memory: the planner counts it).
        self._acc = torch.empty(self.numel, dtype=torch.float32) if dtype != torch.float32 else None
        self._threads = threads
        self._on_reduced = on_reduced
        self._lock = threading.Condition()
        # (step, shard, piece) -> actor -> (slot, sqnorm)
        self._parts: dict[tuple[int, int, int], dict[int, tuple[int, float]]] = {}
        self._queue: list[tuple[int, int, int, int, dict]] = []  # (generation, step, shard, piece, parts)
        self._summed: dict[tuple[int, int], list] = {}  # (step, shard) -> [pieces summed, sqnorm, seconds]
        self._generation = 0
        self._busy = False
        self._busy_step = -1
        self._closed = False
        self.error: BaseException | None = None
        self._worker = threading.Thread(target=self._loop, name="grad-reduce", daemon=True)
        self._worker.start()

    def pieces(self, shard: int) -> int:
        """How many slot-sized pieces shard ``shard``'s gradient is sent in."""
        return -(-self.targets[shard].numel() // self.numel)

    def scratch_bytes(self) -> int:
        """Host bytes of the slots and the fp32 accumulator."""
        wbytes = DTYPES[self.w_dtype].itemsize
        return self.actors * self.slots * self.numel * wbytes + (self._acc.numel() * 4 if self._acc is not None else 0)

    # -- reports ------------------------------------------------------------------------------
    def wait_slot(self, actor: int, slot: int, generation: int, timeout: float = 600.0) -> None:
        """Block until ``actor``'s slot ``slot`` is free. ``SlotsAbandoned`` when the compute
        actors of ``generation`` were replaced meanwhile (their steps are redone)."""
        i = self.info.index(actor, slot)
        deadline = time.monotonic() + timeout
        with self._lock:
            while int(self.state[i]) != -1:
                self.raise_if_failed()
                if generation != self._generation:
                    raise SlotsAbandoned(f"compute actors of generation {generation} were replaced")
                if int(self.state[i]) >> 32 != self._generation:
                    # written by a replaced actor whose process outlived its kill by a moment,
                    # after ``reset`` freed every slot: nothing of it will ever be summed
                    log.warning("gradient slot %d of compute actor %d held a stale mark of a replaced actor; freed",
                                slot, actor)
                    self.state[i] = -1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"gradient slot {slot} of compute actor {actor} still holds the gradient of "
                                       f"step {(int(self.state[i]) & 0xFFFFFFFF) + 1} after {timeout:.0f} s: another "
                                       f"compute actor has not reported that shard")
                self._lock.wait(min(left, 1.0))

    def add(self, shard: int, step: int, actor: int, slot: int, sqnorm: float, generation: int,
            grad: np.ndarray | None = None, piece: int = 0) -> None:
        """Compute actor ``actor``'s gradient of ``shard`` for ``step`` (its piece ``piece``: elements
        ``piece x numel`` on) is in its slot ``slot`` (same node: it wrote it there), or in ``grad``
        (raw bytes, object-ref transport: copied into the slot here, once the slot is free).
        ``sqnorm``: the actor's own squared norm of the shard, read only for finiteness (a NaN
        poisons the step, see ``ComputeActor._push_grad``)."""
        if not (0 <= actor < self.actors and 0 <= slot < self.slots):
            raise ValueError(f"gradient report from actor {actor}, slot {slot}: the store has {self.actors} actors "
                             f"x {self.slots} slots (runtime.compute_actors, runtime.grad_slots)")
        if not 0 <= piece < self.pieces(shard):
            raise ValueError(f"gradient report of shard {shard}, piece {piece}: the shard has {self.pieces(shard)} "
                             f"piece(s) of {self.numel} elements")
        with self._lock:
            if generation != self._generation:
                return  # a replaced actor's report: its step is redone (and its slot is not touched)
        if grad is not None:
            self.wait_slot(actor, slot, generation)
            dst = self.seg[actor][slot].view(torch.uint8)
            src = torch.from_numpy(np.asarray(grad)).view(torch.uint8)
            dst[:src.numel()].copy_(src)
            self.state[self.info.index(actor, slot)] = slot_value(generation, step)
        with self._lock:
            if generation != self._generation:
                return  # a replaced actor's report: its step is redone
            parts = self._parts.setdefault((step, shard, piece), {})
            if actor in parts:
                raise RuntimeError(f"compute actor {actor} reported shard {shard} (piece {piece}) of step {step} "
                                   f"twice")
            parts[actor] = (slot, float(sqnorm))
            if len(parts) == self.actors:
                del self._parts[(step, shard, piece)]
                self._queue.append((generation, step, shard, piece, parts))
                self._lock.notify_all()

    def holds(self, step: int) -> bool:
        """Whether a report of ``step`` is here and not yet handed to the store (so the step's
        gradients are not lost: the store counts them once summed)."""
        with self._lock:
            return (any(k[0] == step for k in self._parts) or any(q[1] == step for q in self._queue)
                    or any(k[0] == step for k in self._summed) or (self._busy and self._busy_step == step))

    def reset(self, generation: int) -> None:
        """The compute actors were replaced (``generation`` is the new one): forget every partial
        report and queued sum, wait for a sum in progress, free every slot, wake the waiters. The
        caller then restores ``w`` from ``master`` (some shards may hold sums of the dropped step)."""
        with self._lock:
            self._generation = generation
            self._parts.clear()
            self._queue.clear()
            self._summed.clear()
            while self._busy:
                self._lock.wait(1.0)
            self.state.fill_(-1)
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._worker.join(timeout=30)
        self.seg = []

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"gradient reduction failed: {self.error!r}") from self.error

    # -- the reducer thread ------------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_num_threads(self._threads)  # a new thread starts from OMP_NUM_THREADS (1 in Ray workers)
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                generation, step, shard, piece, parts = self._queue.pop(0)
                self._busy, self._busy_step = True, step
            try:
                t0 = time.perf_counter()
                sqnorm = self._sum(shard, piece, parts)
                seconds = time.perf_counter() - t0
            except BaseException as e:  # surfaced to every waiter and to the store
                log.exception("summing the gradients of shard %d, step %d failed", shard, step)
                with self._lock:
                    self.error = e
                    self._busy = False
                    self._lock.notify_all()
                return
            with self._lock:
                for actor, (slot, _) in parts.items():
                    self.state[self.info.index(actor, slot)] = -1
                current = generation == self._generation
                done = None
                if current:  # the shard counts once its last piece is summed: the pieces' norms added
                    acc = self._summed.setdefault((step, shard), [0, 0.0, 0.0])
                    acc[0], acc[1], acc[2] = acc[0] + 1, acc[1] + sqnorm, acc[2] + seconds
                    if acc[0] == self.pieces(shard):
                        done = self._summed.pop((step, shard))
                self._lock.notify_all()
            try:
                if done is not None:  # (still busy meanwhile: ``holds(step)`` stays true until the store counted it)
                    self._on_reduced(shard, step, done[1], generation, done[2])
            finally:
                with self._lock:
                    self._busy = False
                    self._lock.notify_all()

    def _sum(self, shard: int, piece: int, parts: dict[int, tuple[int, float]]) -> float:
        """Sum the N slots of ``shard``'s piece ``piece`` into its range of ``w`` in fp32, actor 0
        first; the squared norm of what that range then holds (NaN when an actor poisoned its part)."""
        lo = piece * self.numel
        w = self.targets[shard][lo:lo + self.numel]
        n = w.numel()
        order = [self.seg[a][parts[a][0]][:n] for a in range(self.actors)]
        acc = w if self._acc is None else self._acc[:n]
        acc.copy_(order[0])
        for g in order[1:]:
            acc.add_(g)  # fp32 += slot (upcast from bf16): elementwise, the same every run
        if self._acc is not None:
            w.copy_(acc)  # one rounding to the compute dtype, where the update reads the gradient
        if not all(math.isfinite(sq) for _, sq in parts.values()):
            return float("nan")
        return float(torch.linalg.vector_norm(w, dtype=torch.float32).square())
