"""The driver's side of the decoder actors: a pool of ``data.num_decoders`` ``VideoDecoder``
actors, batch slot ``u``'s batch from decoder ``u % n``, a watchdog on every batch, and replacement
of a decoder that hangs or dies.

Slots, steps and resume
-----------------------
A **batch slot** is one compute actor's batch of one step (``data.batch_size x
training.micro_batches`` clips). Each step takes ``per_step`` consecutive slots, one per compute
actor (``runtime.compute_actors``): step ``k``'s slot for compute actor ``r`` is ``first_slot + (k
- first_step) x per_step + r``. With one compute actor, slot = step. Decoder ``i`` fills the slots
``u % n == i`` and draws the data positions ``p % n == i`` (see ``actors/decoder.py``), so with one
decoder the clips of a step's slots are consecutive positions: actor ``r`` of N with batch b gets
exactly clips ``r b .. r b + b - 1`` of the batch one actor with batch N b would draw.

The pool keeps, per decoder, the position and skipped count after the last batch it *received*
(where a replacement starts) and after the last batch *consumed* by a completed step (``commit``;
what a checkpoint stores, as ``DataCursor``, with the first slot not consumed). A run resumed from
a ``DataCursor`` with the same ``n`` sees exactly the batches of the uninterrupted run. Resumed
with another number of compute actors (or batch size, or micro-batches) it continues the same
stream of clips from the same slot: with one decoder the next clips are exactly those the
interrupted run would have drawn, only grouped into steps of the new global batch.

Watchdog
--------
decord can spin forever, holding the GIL, on a file that over-reports its frame count, so a
decoder cannot be trusted to notice its own hang (or even to answer). Each decoder writes what it
is decoding to a small status file (``DecodeStatus``) before entering decord. While the driver
waits for a batch it polls that file: when one file has been in decord for longer than
``data.decode_timeout_s`` (or nothing has moved for that long, or, for a decoder still starting,
``STARTUP_GRACE_S``), the decoder is killed with ``ray.kill`` and replaced by a new actor that
starts at the position after the last batch received from the old one. A file that hung is
marked bad ("decode timed out after X s"): logged once, counted as skipped, told to the other
decoders, kept in the checkpoint. Skipping depends only on the file, so the redrawn batch is the
one an uninterrupted run would have drawn had the file been bad from the start. A decoder that
dies is replaced the same way and its batch redrawn identically; only a file that was being
decoded at two deaths is marked bad ("decoder died twice while decoding it"). The replacement is
also asked again for every later slot the old decoder owed (with more compute actors than
decoders, a step's other slots), so one failure is one replacement and one restart counted.

Caution: the status files live in the run directory, so the watchdog needs the decoders on the
driver's node (or a shared run directory).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from actors.decoder import BatchInfo, DecoderStats, DecodeStatus, VideoDecoder

log = logging.getLogger(__name__)

STARTUP_GRACE_S = 120.0
"""How long a new decoder may take to start (process, imports, manifest) before it counts as stuck."""
MAX_REPLACEMENTS_PER_STEP = 5
"""Replacements of one step's decoder before the run stops."""
POLL_S = 0.25
"""How often the watchdog reads a waited-on decoder's status."""


@dataclass(frozen=True)
class DataCursor:
    """Where each decoder of a pool continues: the data part of a checkpoint."""

    step: int
    """Steps completed when these positions were recorded: the first step a pool built on it serves."""
    positions: tuple[int, ...]
    """Per decoder: the data position after the last batch consumed (0: none yet)."""
    skipped: tuple[int, ...]
    """Per decoder: skipped draws up to that batch."""
    bad_rows: tuple[tuple[int, str], ...] = ()
    """Rows the watchdog found unusable (decodes that hung), with the reason: not tried again."""
    slot: int | None = None
    """The first batch slot not consumed (None: ``step``, as with one compute actor throughout)."""

    @property
    def first_slot(self) -> int:
        return self.step if self.slot is None else self.slot

    @classmethod
    def start(cls, num_decoders: int, position: int = 0, skipped: int = 0, step: int = 0) -> DataCursor:
        """A fresh pool (or, for one decoder, a bare position and skipped count)."""
        if num_decoders != 1 and (position or skipped):
            raise ValueError("a single start position only describes a pool of one decoder")
        return cls(step, (position,) * num_decoders, (skipped,) + (0,) * (num_decoders - 1))

    def to_state(self) -> dict:
        """JSON-able entries for a checkpoint's ``state.json``."""
        state = {"data_positions": list(self.positions), "data_skipped": list(self.skipped),
                 "data_bad_rows": [[r, why] for r, why in self.bad_rows]}
        if self.slot is not None:
            state["data_slot"] = self.slot
        return state

    @classmethod
    def from_state(cls, state: dict, num_decoders: int, where: str = "the checkpoint") -> DataCursor:
        """Read ``to_state``'s entries back (or a checkpoint from before decoder pools, which holds
        one ``data_position``); a different ``num_decoders`` is refused: the positions of a pool
        of one size do not continue the order of another."""
        if "data_positions" not in state:
            saved = 1
            positions, skipped = [int(state.get("data_position", 0))], [int(state.get("skipped_files", 0))]
        else:
            positions = [int(p) for p in state["data_positions"]]
            skipped = [int(s) for s in state.get("data_skipped", [0] * len(positions))]
            saved = len(positions)
        if saved != num_decoders:
            raise ValueError(f"{where} was written with data.num_decoders={saved}, but this run has "
                             f"data.num_decoders={num_decoders}: the data order would not continue exactly. "
                             f"Resume with --data.num_decoders {saved} (or start a new run)")
        bad = tuple((int(r), str(why)) for r, why in state.get("data_bad_rows", []))
        slot = int(state["data_slot"]) if "data_slot" in state else None
        return cls(int(state.get("step", 0)), tuple(positions), tuple(skipped), bad, slot)


@dataclass(frozen=True)
class BatchReady:
    """``DecoderPool.wait_ready``'s answer."""

    info: BatchInfo
    redrawn: bool
    """The batch ref handed out before was lost with its decoder; ``batch_ref(step)`` is a new one."""
    lost_seconds: float
    """Time spent waiting for the lost batch and replacing its decoder (0 when not redrawn)."""
    replacements: int = 0
    """Decoders replaced while waiting for this batch: a batch redrawn because its decoder was
    replaced while another slot's batch was awaited says ``redrawn`` with 0 here, so that one
    failure is counted once."""


@dataclass
class _Pending:
    batch_ref: object
    info_ref: object
    decoder: int


@dataclass
class _Watch:
    """The driver's view of one decoder's status file: when did ``seq`` last change."""

    token: str
    seq: int | None = None
    since: float = field(default_factory=time.monotonic)
    record: dict | None = None


def latent_captions(cfg) -> str:
    """How decoders condition latent batches: ``bytes`` (the caption column as byte captions) for
    a videodit on latents, ``text`` (the manifest's text embeddings) otherwise."""
    return "bytes" if cfg.model.arch == "videodit" and cfg.model.inputs == "latents" else "text"


class DecoderPool:
    """``per_step``: batch slots per step (the compute actors); each slot's batch holds
    ``data.batch_size x training.micro_batches`` clips."""

    def __init__(self, cfg, status_dir: str | Path, cursor: DataCursor | None = None,
                 namespace: str = "megaslide", actor_options: dict | None = None, per_step: int = 1):
        n = cfg.data.num_decoders
        cursor = cursor or DataCursor.start(n)
        self.per_step = per_step
        self._first_step, self._first_slot = cursor.step, cursor.first_slot
        first_slot = self._first_slot
        self._options = dict(actor_options or {})
        if len(cursor.positions) != n:
            raise ValueError(f"cursor holds {len(cursor.positions)} decoder positions, data.num_decoders={n}")
        self.cfg, self.n, self.namespace = cfg, n, namespace
        self.timeout = float(cfg.data.decode_timeout_s)
        self.status_dir = Path(status_dir)
        self._received = [(p, s) for p, s in zip(cursor.positions, cursor.skipped)]
        self._consumed = list(self._received)
        self._bad_rows: dict[int, str] = dict(cursor.bad_rows)
        # the next slot each decoder fills: the first u >= first_slot with u % n == i
        self._next_slot = [first_slot + (i - first_slot) % n for i in range(n)]
        self._generation = [0] * n
        self._actors: list = [None] * n
        self._watch: list[_Watch] = [_Watch("")] * n
        self._pending: dict[int, _Pending] = {}  # by slot
        self._infos: dict[int, BatchInfo] = {}   # by slot: received, not committed yet
        self._deaths: dict[str, int] = {}         # path -> deaths while decoding it
        self._reissued: set[int] = set()          # slots asked again of a replacement while another was awaited
        self.replacements = 0
        for i in range(n):
            self._start(i)

    # -- actors ---------------------------------------------------------------------------------

    def _status_path(self, i: int) -> Path:
        return self.status_dir / f"decoder-{i}.json"

    def _start(self, i: int) -> None:
        gen = self._generation[i]
        token = f"{i}.{gen}"
        position, skipped = self._received[i]
        d = self.cfg
        name = f"{self.namespace}/decoder-{i}" + (f"-r{gen}" if gen else "")
        # One batch is one slot: a compute actor's clips of one step, all its micro-batches.
        data = replace(d.data, batch_size=d.data.batch_size * d.training.micro_batches)
        self._actors[i] = ray.remote(VideoDecoder).options(name=name, num_cpus=0, **self._options).remote(
            data, d.training.seed, d.model.caption_max_bytes, position, i, self.n, first_step=self._next_slot[i],
            skipped_before=skipped, bad_rows=dict(self._bad_rows), status_path=str(self._status_path(i)),
            status_token=token, latent_captions=latent_captions(d))
        self._watch[i] = _Watch(token)

    @property
    def actors(self) -> list:
        return list(self._actors)

    # -- batches --------------------------------------------------------------------------------

    def slot(self, step: int, rank: int = 0) -> int:
        """The batch slot of compute actor ``rank`` in step ``step``."""
        return self._first_slot + (step - self._first_step) * self.per_step + rank

    def _step_of(self, slot: int) -> int:
        return self._first_step + (slot - self._first_slot) // self.per_step

    def batch_ref(self, step: int, rank: int = 0):
        """The ref of compute actor ``rank``'s batch of step ``step``; asks its decoder on the first call."""
        return self._slot_ref(self.slot(step, rank))

    def _slot_ref(self, slot: int):
        if slot in self._pending:
            return self._pending[slot].batch_ref
        i = slot % self.n
        if slot != self._next_slot[i]:
            raise RuntimeError(f"decoder {i} fills batch slot {self._next_slot[i]} next, not slot {slot} "
                               f"(step {self._step_of(slot) + 1}; steps and actors must be asked for in order)")
        batch_ref, info_ref = self._actors[i].next_batch_and_info.options(num_returns=2).remote()
        self._pending[slot] = _Pending(batch_ref, info_ref, i)
        self._next_slot[i] += self.n
        return batch_ref

    def wait_ready(self, step: int, rank: int = 0) -> BatchReady | None:
        """Block until compute actor ``rank``'s batch of ``step`` exists (None for one never asked
        for). A decoder that dies, or is stuck past ``data.decode_timeout_s``, is replaced and the
        batch redrawn. A decoder's own error (e.g. too many unusable files) is raised."""
        return self._wait_slot(self.slot(step, rank))

    def _wait_slot(self, slot: int) -> BatchReady | None:
        step = self._step_of(slot)
        if slot in self._infos:
            return BatchReady(self._infos[slot], False, 0.0)
        if slot not in self._pending:
            return None
        reissued = slot in self._reissued
        self._reissued.discard(slot)
        t0 = time.monotonic()
        replaced = 0
        i = self._pending[slot].decoder
        self._watch[i].since = t0  # the clock runs while someone waits for the decoder
        while True:
            p = self._pending[slot]
            ready, _ = ray.wait([p.info_ref], timeout=POLL_S)
            if ready:
                try:
                    info = ray.get(p.info_ref)
                except RayActorError as e:
                    problem = self._died(i, step, e)
                else:
                    self._received[i] = (info.position, info.skipped)
                    self._infos[slot] = info
                    return BatchReady(info, replaced > 0 or reissued, time.monotonic() - t0 if replaced else 0.0,
                                      replaced)
            else:
                problem = self._stalled(i, step)
                if problem is None:
                    continue
            replaced += 1
            if replaced > MAX_REPLACEMENTS_PER_STEP:
                raise RuntimeError(f"decoder {i} was replaced {replaced - 1} times for step {step + 1} and still "
                                   f"produced no batch (last problem: {problem}); check the data and the logs")
            if self._replace(i, slot):
                # the old decoder answered after all, just before it was killed: keep its batch
                replaced -= 1

    def _stalled(self, i: int, step: int) -> str | None:
        """A reason to replace decoder ``i``, or None while it makes progress."""
        w = self._watch[i]
        record = DecodeStatus.read(self._status_path(i))
        seq = record["seq"] if record and record.get("token") == w.token else None
        now = time.monotonic()
        if seq != w.seq:
            w.seq, w.since, w.record = seq, now, record
            return None
        limit = self.timeout if seq is not None else max(STARTUP_GRACE_S, self.timeout)
        if now - w.since <= limit:
            return None
        if w.record and w.record.get("state") == "decoding":
            path, row = w.record["path"], int(w.record["row"])
            reason = f"decode timed out after {self.timeout:g} s"
            self._mark_bad(row, path, reason)
            return f"{path}: {reason}"
        state = "started" if seq is None else (w.record or {}).get("state")
        log.warning("decoder %d made no progress for %.0f s while step %d's batch was owed (state %s); "
                    "replacing it", i, limit, step + 1, state)
        return f"no progress for {limit:g} s"

    def _died(self, i: int, step: int, error: BaseException) -> str:
        if "creation task" in str(error):  # its constructor raised: a replacement would too
            raise RuntimeError(f"decoder {i} could not start: {error}") from error
        record = DecodeStatus.read(self._status_path(i))
        if record and record.get("token") == self._watch[i].token and record.get("state") == "decoding":
            path, row = record["path"], int(record["row"])
            self._deaths[path] = self._deaths.get(path, 0) + 1
            if self._deaths[path] >= 2:
                self._mark_bad(row, path, f"the decoder died {self._deaths[path]} times while decoding it")
            log.warning("decoder %d died while decoding %s (%s); replacing it and redrawing step %d's batch",
                        i, path, type(error).__name__, step + 1)
            return f"died while decoding {path}"
        log.warning("decoder %d died (%s); replacing it and redrawing step %d's batch", i, type(error).__name__,
                    step + 1)
        return f"died ({type(error).__name__})"

    def _mark_bad(self, row: int, path: str, reason: str) -> None:
        if row in self._bad_rows:
            return
        self._bad_rows[row] = reason
        log.warning("skipping video %s: %s", path, reason)
        for actor in self._actors:  # fire-and-forget: a stuck one is replaced anyway
            actor.mark_bad.remote(row, reason)

    def _replace(self, i: int, slot: int) -> bool:
        """Kill decoder ``i`` and start a new one owing batch slot ``slot`` and every later slot
        asked of the old one (with several compute actors per decoder, a step's other slots: they
        are asked again of the replacement, in order, rather than found dead one by one, which
        would replace the healthy replacement). True if ``slot``'s batch turned out to be ready
        after all (it stands, and the replacement starts after it)."""
        ray.kill(self._actors[i], no_restart=True)
        owed = sorted(s for s, p in self._pending.items() if p.decoder == i and s >= slot and s not in self._infos)
        kept, lost = False, []
        for s in owed:
            info = None
            if not lost:  # batches come in order: after the first lost one, all are lost
                # A batch may have been sealed just before the kill: then it stands, and is
                # identical to what a replacement would draw; otherwise its refs now fail.
                ref = self._pending[s].info_ref
                ready, _ = ray.wait([ref], timeout=10 if s == slot else 0)
                if ready:
                    try:
                        info = ray.get(ref)
                    except RayActorError:
                        pass
            if info is None:
                lost.append(s)
                continue
            self._received[i] = (info.position, info.skipped)
            self._infos[s] = info
            kept |= s == slot
        self._generation[i] += 1
        self.replacements += 1
        if lost:
            self._next_slot[i] = lost[0]
            for s in lost:
                del self._pending[s]
        self._start(i)
        for s in lost:
            self._slot_ref(s)
            if s != slot:
                self._reissued.add(s)
        return kept

    def commit(self, step: int) -> BatchInfo | None:
        """Step ``step`` completed: its batches are consumed (the positions a checkpoint keeps).
        Returns compute actor 0's batch info (``infos`` has them all)."""
        infos = self.infos(step)
        for rank in range(self.per_step):
            slot = self.slot(step, rank)
            info = self._infos.pop(slot, None)
            self._pending.pop(slot, None)
            if info is not None:
                self._consumed[info.rank] = (info.position, info.skipped)
        return infos[0]

    def infos(self, step: int) -> list[BatchInfo | None]:
        """Each compute actor's batch info of ``step`` (None where it was not received)."""
        return [self._infos.get(self.slot(step, rank)) for rank in range(self.per_step)]

    def cursor(self, step: int) -> DataCursor:
        """Positions after the batches consumed so far, for a checkpoint after ``step`` steps (with
        the first slot not consumed, when it is not ``step``)."""
        slot = self.slot(step)
        return DataCursor(step, tuple(p for p, _ in self._consumed), tuple(s for _, s in self._consumed),
                          tuple(sorted(self._bad_rows.items())), None if slot == step else slot)

    @property
    def skipped_files(self) -> int:
        """Skipped draws in the batches consumed so far, all decoders."""
        return sum(s for _, s in self._consumed)

    def stats(self, timeout: float = 5.0) -> list[DecoderStats]:
        """Counters of the decoders that answer within ``timeout`` (a stuck one may not)."""
        refs = [a.stats.remote() for a in self._actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for ref in ready:
            try:
                out.append(ray.get(ref))
            except RayActorError:
                pass
        return out

    def close(self) -> None:
        self._pending.clear()
        refs = [a.close.remote() for a in self._actors]
        try:
            ray.get(refs, timeout=10)
        except (GetTimeoutError, RayActorError) as e:  # a hung decoder does not close: killed below
            log.debug("closing a decoder failed: %r", e)
        except Exception as e:  # noqa: BLE001 - best effort, then killed below
            log.debug("closing a decoder failed: %r", e)
        for a in self._actors:
            ray.kill(a)
