"""The parameter store's update thread, and what makes an update crash-consistent.

The update thread (``_update_loop``) takes the steps whose every shard reported its gradient, in
order, and runs AdamW on the owned shards in shard order 0..L+1 (``_apply_update``): the fused
torch kernel, or the single-pass one (``optim.adamw``, ``megaslide_ray/training/adamw.py``). Each
shard's update is bracketed by its crash marker ``updating[l]``, and the step's clipping
coefficient and learning rate go to the ``records`` ring before the first shard is touched; a store
that re-attaches to the segments (``_recover``) finishes an update cut between two shards from
that record, and refuses a shard cut in the middle (``actors/param_store.py``'s docstring says
which state leads to what)."""

from __future__ import annotations

import logging
import math
import time

import torch

from actors.store_types import StateNotTrustedError, UpdateResult
from megaslide_ray.runtime.faults import fault_point
from megaslide_ray.training.adamw import adamw_fused, adamw_scalars
from megaslide_ray.training.schedule import global_norm, step_constants

log = logging.getLogger(__name__)

RECORDS = 4          # update records kept in shared memory (ring indexed by step % RECORDS)
RECORD_FIELDS = 6    # step, grad_norm, clip_coef, lr, skipped, optimizer_seconds


class UpdateMethods:
    """Mixed into ``ParameterStore`` (which sets ``cfg``, ``n``, ``seg``, ``owned``, ``versions``,
    ``updating``, ``records``, ``threads``, ``_lock``, ``_queue``, ``_pending``, ``_totals``,
    ``_results``, ``_inflight``, ``_applying``, ``_saving``, ``_closed``, ``_error``, ``_middle``,
    ``_grad32``, ``_single_pass``, ``adamw``, ``sync``, ``_reduce_seconds``, ``device_shards`` and
    ``_restore_w``)."""

    def _update_loop(self) -> None:
        # OpenMP keeps the thread count per thread: a new thread starts from OMP_NUM_THREADS,
        # which Ray sets to 1 in its workers, whatever __init__ set. Without this call AdamW
        # ran on one core in the store actor (torch.get_num_threads() still said all of them).
        torch.set_num_threads(self.threads)
        while True:
            with self._lock:
                while (not self._queue or self._saving) and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                step = self._queue.pop(0)
                total = (global_norm(self._pending.pop(step).values()) if self.sync is None
                         else math.sqrt(self._totals.pop(step)))
                self._applying = True
            try:
                result = self._apply_update(step, total)
            except BaseException as e:  # surfaced to every waiter
                log.exception("AdamW update of step %d failed", step + 1)
                with self._lock:
                    self._error = e
                    self._applying = False
                    self._lock.notify_all()
                return
            with self._lock:
                self._results[step] = result
                self._inflight.discard(step)
                self._applying = False
                self._lock.notify_all()

    def _apply_update(self, step: int, total: float) -> UpdateResult:
        """AdamW of ``step`` on the owned shards (every shard on one node), ``total`` the global
        gradient norm; several nodes: each updated shard's weights go to the other nodes."""
        t0 = time.perf_counter()
        coef, lr, finite = self._step_constants(step, total)
        # The record goes first: a store that restarts between two shards finishes from it.
        self._write_record(step, total, coef, lr, skipped=not finite, seconds=0.0)
        if not finite:
            log.warning("step %d: gradient norm is %s; update skipped on every shard", step + 1, total)
        trained = self.step_shards(step)
        for i in self.owned:  # shard order: the next forward needs shard 0 first
            if i == self._middle:
                fault_point("store.mid_update", step)
            if i not in trained or i in self.device_shards:
                # the idle expert's shard, or one the compute actor updates on its device
                # (runtime.device_shards): its weights and moments here stay as they are
                self._pass_shard(i, step)
                continue
            # Several nodes: the new weights go to the other nodes before the version bump lets this
            # node's next backward write a gradient into w.
            self._update_shard(i, step, coef, lr, skip=not finite,
                               publish=None if self.sync is None else (lambda i=i: self.sync.send_weights(i, step)))
        seconds = time.perf_counter() - t0
        self.records[step % RECORDS, 5] = seconds
        with self._lock:
            reduce_seconds = self._reduce_seconds.pop(step, 0.0)
        return UpdateResult(step, total, coef, lr, seconds, skipped=not finite, reduce_seconds=reduce_seconds,
                            network_bytes=self.sync.pop_sent(step) if self.sync is not None else 0)

    def _step_constants(self, step: int, total: float) -> tuple[float, float, bool]:
        """The clipping coefficient and learning rate of ``step`` for the global norm ``total``, and
        whether the norm is finite (if not, the update is skipped)."""
        return step_constants(self.cfg.optim, self.cfg.training.steps, step, total, self.expert_lr_factor(step))

    def _update_shard(self, i: int, step: int, coef: float, lr: float, skip: bool = False, publish=None) -> None:
        """AdamW of step ``step`` on shard ``i`` (its gradient is in ``w``), bracketed by its
        crash marker. ``skip`` (non-finite gradients): no update, ``w`` gets its weights back.
        ``publish``: called once the new ``w`` is written, before the version bump."""
        s = self.seg[i]
        self.updating[i] = step  # from here until the marker is cleared, shard i is half-written
        if i == self._middle:
            fault_point("store.mid_shard_update", step)
        if skip:
            s["w"].copy_(s["master"])
        elif self._single_pass is not None:
            self._single_pass_update(s, step, coef, lr)
        else:
            self._fused_update(s, step, coef, lr)
        if not skip:
            self._update_ema(s, step)
        if publish is not None:
            publish()
        with self._lock:
            self.versions[i] = step + 1
            self.updating[i] = -1
            self._lock.notify_all()

    def _fused_update(self, s: dict[str, torch.Tensor], step: int, coef: float, lr: float) -> None:
        o = self.cfg.optim
        step = self.adam_step(step)
        if self._grad32 is None:
            g = s["w"]  # fp32 run: the gradient is scaled in place (the marker of this shard is set)
        else:
            g = self._grad32[:s["w"].numel()]
            g.copy_(s["w"])
        # One fused pass over master, m, v and the gradient (torch's vectorised CPU kernel).
        adamw_fused(s["master"], g, s["m"], s["v"], o, step, coef, lr)
        s["w"].copy_(s["master"])  # the gradient is consumed: w becomes the compute copy again

    def _single_pass_update(self, s: dict[str, torch.Tensor], step: int, coef: float, lr: float) -> None:
        o = self.cfg.optim
        self._single_pass(s["w"], s["master"], s["m"], s["v"], *adamw_scalars(o, self.adam_step(step), coef, lr))

    # -- crash consistency --------------------------------------------------------------------
    def _write_record(self, step: int, total: float, coef: float, lr: float, skipped: bool,
                      seconds: float) -> None:
        row = self.records[step % RECORDS]
        row[1:] = torch.tensor([total, coef, lr, float(skipped), seconds], dtype=torch.float64)
        row[0] = step  # written last: a row is valid once its step field names it

    def _record(self, step: int) -> UpdateResult | None:
        row = self.records[step % RECORDS].tolist()
        if int(row[0]) != step:
            return None
        return UpdateResult(step, row[1], row[2], row[3], row[5], skipped=bool(row[4]))

    def _recover(self) -> None:
        """Re-attached to segments a previous store process left: check them, finish a cut update."""
        for i in range(self.n):
            marker = int(self.updating[i])
            if marker >= 0 and int(self.versions[i]) == marker + 1:
                self.updating[i] = -1  # the cut came after the version bump: the shard is complete
        cut = [i for i in range(self.n) if int(self.updating[i]) >= 0]
        if cut:
            raise StateNotTrustedError(
                f"the parameter store in {self.dir} was stopped in the middle of updating shard(s) {cut} "
                f"(step {int(self.updating[cut[0]]) + 1}): their weights and moments are half-written and cannot be "
                f"trusted. Resume from the latest checkpoint (python -m megaslide_ray.train --run-dir RUN --resume)")
        versions = self.versions.tolist()
        lo, hi = min(versions), max(versions)
        if lo == hi:
            # The step in flight (if any) is redone: gradients the compute actor already wrote
            # into w are dropped, every shard's w is its weights again.
            self._restore_w()
            return
        rec = self._record(lo)
        if hi != lo + 1 or rec is None:
            raise StateNotTrustedError(
                f"the parameter store in {self.dir} holds shard versions {versions} with no record of the update "
                f"of step {lo + 1}; it cannot be finished. Resume from the latest checkpoint "
                f"(python -m megaslide_ray.train --run-dir RUN --resume)")
        todo = [i for i in range(self.n) if versions[i] == lo]
        log.warning("the update of step %d was cut between shards; finishing it on shards %s", lo + 1, todo)
        trained = self.step_shards(lo)
        for i in todo:  # their gradients of step lo are still in their w segments
            if i in trained and i not in self.device_shards:
                self._update_shard(i, lo, rec.clip_coef, rec.lr, skip=rec.skipped)
            else:
                self._pass_shard(i, lo)
