"""Wiring: makes the three plain actor classes remote, names them, and runs the step schedule.

    decoder-i --batch ref--> compute --(shard, step, ||g||^2)--> param-store
                               ^-------- shard versions / weights -------'

The driver keeps the compute actor one step ahead: step k+1 is queued before step k's
update is collected, so the store's AdamW (shard order 0..L+1) overlaps step k+1's forward,
which waits shard by shard for ``version == k+1``. Before a checkpoint the driver does not
queue ahead, so the saved state is exactly the state after step k.

Several compute actors (``runtime.compute_actors``, ``pipelines/compute_group.py``): each step
goes to all of them, actor r on the step's batch slot r (``pipelines/decoder_pool.py``); the
store sums their gradients; the step's result combines theirs (mean loss, slowest times), and
each one's is kept for the metrics. A failure of one replaces them all.

Several nodes (``runtime.nodes`` M, ``pipelines/multinode.py``): one store per node, N compute
actors on each beside it; a step takes M x N batch slots, and the driver waits for every store's
update. An actor's death is recovered in place there too (``NodeStores.recover``: every compute
actor replaced, the step in flight finished or redone on every node alike); a node that is gone
stops the run with the ``--resume`` command (``NodeLostError``).

Failures: the store is restartable (``runtime.max_restarts``); a restarted store re-attaches
to its shared-memory state (see ``actors/param_store.py``); the store's client over Ray and its
failures' kinds: ``pipelines/store_client.py``. Gradients reported for an
unfinished step lived only in the dead process, so when a step fails because an actor died,
the driver waits for the store to come back, replaces the compute actor (it holds no state
between steps; a new one cannot be left blocked on a version that will never come), and
redoes the step on the same batch. Steps whose update the store already holds are not
redone. A store that cannot come back on its state (an update was cut inside a shard, or Ray
gave up restarting it) raises ``StoreLostError``: the Trainer then calls ``rollback_to`` with
the latest checkpoint, which rebuilds the actors in place on it, and redoes the steps after it.
Every recovery counts against ``runtime.max_restarts``; one more stops the run with
``RestartLimitError``. The recovery counters (``restarts``, ``redone_steps``,
``recovery_seconds``, ``rollbacks``, ``decoders_replaced``) are the whole run's: a rollback
keeps them.

The Trainer talks to the pipeline only through its methods (``run_step``, ``save_checkpoint``,
``predict``, ``status``, ``rollback_to``, ...); ``actor_handles`` is for tests and drills that
kill an actor on purpose.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.compute import StepResult
from actors.decoder import BatchInfo
from actors.param_store import ParameterStore, UpdateResult
from megaslide_ray.runtime import faults
from megaslide_ray.state.kept import is_kept, keep_state, release_state, state_path
from megaslide_ray.state.segments import run_owner
from pipelines.compute_group import ComputeGroup, NodeSide, combine, combine_batches, resolve_compute_actors
from pipelines.decoder_pool import DataCursor, DecoderPool
from pipelines.multinode import NodeStores, StateCutError, StoreCallError, on_node, pick_nodes, status_once_back
from pipelines.store_client import (
    RayStoreClient,
    StoreHungError,
    StoreLostError,
    is_actor_failure,
    raise_store_start_error,
)

log = logging.getLogger(__name__)

NAMESPACE = "megaslide"
STORE_RESTART_TIMEOUT_S = 300.0
"""How long the driver waits for a restarted store to answer."""
STORE_SETTLE_TIMEOUT_S = 120.0
"""How long a failed run waits for the store to finish its queued updates and answer."""


class RestartLimitError(RuntimeError):
    """More actor failures than ``runtime.max_restarts``: the run stops."""


def actor_options() -> dict:
    """Options every actor of a run gets: the fault-injection settings of the driver's
    environment (``megaslide_ray/runtime/faults.py``), so a fault can target any actor."""
    env = {k: os.environ[k] for k in (faults.ENV_SPEC, faults.ENV_DIR) if os.environ.get(k)}
    return {"runtime_env": {"env_vars": env}} if env else {}


def get_each(refs: list) -> list:
    """``ray.get(refs)``, but the first error raised as soon as it is there (on several nodes the
    other compute actors may wait for a lost node's weights for a long time)."""
    waiting = list(refs)
    while waiting:
        ready, waiting = ray.wait(waiting, num_returns=1)
        ray.get(ready[0])
    return ray.get(refs)


@dataclass(frozen=True)
class StepReport:
    compute: StepResult
    update: UpdateResult
    batch: BatchInfo | None = None
    """The step's batch as its decoder described it (rows, position)."""
    skipped_files: int = 0
    """Files skipped in all batches consumed so far, every decoder (resumes included)."""
    data_lost_seconds: float = 0.0
    """Time the step lost to a decoder that hung or died (its batch was redrawn); add it to the
    compute actor's own data wait."""
    computes: tuple[StepResult, ...] = ()
    """Several compute actors: each one's own result (``compute`` combines them)."""


@dataclass(frozen=True)
class ActorHandles:
    """The live actors of a pipeline at one moment (``StreamingPipeline.actor_handles``)."""
    store: object
    compute: object
    decoders: tuple
    computes: tuple = ()
    """Every compute actor (``compute`` is the first)."""
    stores: tuple = ()
    """Several nodes: every node's store, by node (``store`` is node 0's)."""


class StreamingPipeline:
    """Owns the actors of one run. ``run_step(k)`` returns step k's compute and update results."""

    def __init__(self, cfg, run_dir: str, resume_checkpoint: str | None = None,
                 start_position: int | DataCursor = 0, init_from: str | None = None,
                 kept_doc: dict | None = None):
        """``kept_doc``: continue from the shared-memory state a failed run kept (its
        ``resume.json``, ``megaslide_ray.state.kept``) instead of ``resume_checkpoint``."""
        self.cfg = cfg
        self.run_dir = run_dir
        self.init_from = init_from  # the weights a rollback with no checkpoint yet goes back to
        use_gpu = cfg.runtime.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
        if cfg.runtime.device == "cuda" and not use_gpu:
            raise RuntimeError("runtime.device='cuda' but the Ray cluster has no GPU; use 'auto' or 'cpu'")
        self.compute_actors = resolve_compute_actors(cfg)
        gpus = ray.cluster_resources().get("GPU", 0)
        if use_gpu and self.compute_actors > gpus:
            raise RuntimeError(f"runtime.compute_actors={cfg.runtime.compute_actors} asks for {self.compute_actors} "
                               f"GPU compute actors but the Ray cluster has {gpus:g} GPUs; use at most {gpus:g} "
                               f"(or 'auto'), or runtime.device=cpu")
        self.use_gpu = use_gpu
        self.nodes = cfg.runtime.nodes
        self.slots = self.compute_actors * self.nodes  # batch slots per step: every compute actor's
        self._node_stores: NodeStores | None = None
        if self.nodes > 1 and kept_doc is not None:
            raise RuntimeError(f"runtime.nodes={self.nodes}: a kept shared-memory state is one node's; continue it on "
                               f"one node (--runtime.nodes 1), then resume its checkpoint on several")
        self.w_dtype = "bfloat16" if use_gpu else "float32"
        # Recovery counters, the whole run's (a rollback keeps them).
        self.restarts = 0            # actor failures recovered from (bounded by runtime.max_restarts)
        self.redone_steps = 0        # steps redone because an actor died under them
        self.recovery_seconds = 0.0  # driver time spent recovering from actor failures, rollbacks included
        self.rollbacks = 0           # times the store's state was lost and a checkpoint restored
        self._replaced_before = 0    # decoders replaced by the pools before the last rollback
        self._computes = None
        self._decoder_pool = None
        self.state_dir, self.store_node = str(state_path(cfg, run_dir)), ""
        try:
            self._start_actors(resume_checkpoint, start_position, init_from, kept_doc is not None)
        except BaseException:
            self._stop_partial(kept_doc)
            raise

    def _stop_partial(self, kept_doc: dict | None) -> None:
        """The pipeline did not come up: stop what did, and leave no state behind (a kept state
        it was to continue from is kept again, as it was)."""
        stores = self._node_stores.handles if self._node_stores else (getattr(self, "_store", None),)
        for h in (*(self._computes.actors if self._computes else ()),
                  *(self._decoder_pool.actors if self._decoder_pool else ()), *stores):
            if h is not None:
                try:
                    ray.kill(h, no_restart=True)
                except Exception as e:  # noqa: BLE001 - already dead
                    log.debug("kill failed: %r", e)
        path = Path(self.state_dir)
        if not path.is_dir():
            return
        if kept_doc is not None:
            keep_state(path, kept_doc)
        elif not is_kept(path):
            release_state(path)

    def _start_actors(self, resume_checkpoint: str | None, start_position: int | DataCursor,
                      init_from: str | None, attach: bool = False) -> None:
        """Build the store (on ``resume_checkpoint``, else ``init_from``, else fresh weights; with
        ``attach`` on the state a failed run kept), the compute actor and the decoder pool
        (continuing from ``start_position``), with no step in flight. Used by ``__init__`` and
        ``rollback_to``."""
        cfg, run_dir = self.cfg, self.run_dir
        # The store serves many blocking calls (wait_version) at once: a threaded actor. On a
        # restart Ray re-runs __init__ with these arguments; it then re-attaches to its segments.
        if self.nodes > 1:  # one store per node, pinned there (pipelines/multinode.py)
            nodes = pick_nodes(self.nodes, self.compute_actors if self.use_gpu else 0)
            try:
                self._node_stores = NodeStores(cfg, run_dir, nodes, actor_options(),
                                               w_dtype=self.w_dtype, resume_checkpoint=resume_checkpoint,
                                               init_from=init_from,
                                               owner=run_owner(), compute_actors=self.compute_actors)
            except StoreCallError as e:
                raise_store_start_error(e)
                raise
            self._store = self._node_stores.handles[0]
        else:
            store_cls = ray.remote(ParameterStore).options(
                name=f"{NAMESPACE}/param-store", num_cpus=0, max_concurrency=64,
                max_restarts=cfg.runtime.max_restarts, **actor_options())
            self._store = store_cls.remote(cfg, run_dir, self.w_dtype, resume_checkpoint, attach, init_from,
                                           owner=run_owner(), compute_actors=self.compute_actors)
        try:
            self.infos = ray.get(self._store.shard_infos.remote())
        except RayActorError as e:
            raise_store_start_error(e)
            raise
        status = self.status()
        self.store_node, self.state_dir = status.node_id, status.state_dir
        self._computes = ComputeGroup(cfg, self.infos, self.store_node, ray.get(self._store.grad_slots.remote()),
                                      self.use_gpu, self.compute_actors, actor_options(),
                                      lambda gen, rank: RayStoreClient(self._store, gen, rank,
                                                                                self.cfg.runtime.store_timeout_s),
                                      sides=self._node_sides())
        self.transport = self._computes.transport()

        # ``start_position``: where the data continues (a checkpoint's DataCursor; an int is one
        # decoder's position). The pool's watchdog replaces decoders that hang or die.
        cursor = (start_position if isinstance(start_position, DataCursor)
                  else DataCursor.start(cfg.data.num_decoders, int(start_position)))
        self._decoder_pool = DecoderPool(cfg, f"{run_dir}/decoders", cursor, NAMESPACE, actor_options(),
                                         per_step=self.slots)
        self._data_lost: dict[int, float] = {}      # step -> seconds lost to a replaced decoder
        self._queued: dict[int, list] = {}          # step -> refs of the compute actors' StepResults
        self._computed: dict[int, list[StepResult]] = {}  # step -> results whose update is not confirmed yet
        self._batches: dict[tuple[int, int], object] = {}  # (step, actor) -> batch ref, kept until the step is done
        self._first_batch: dict[int, object] = {}   # actor -> its first batch (training.overfit_one_batch)
        log.info("pipeline up: %d shards, weights %s, transport %s, %d compute actor(s) on %s", len(self.infos),
                 self.w_dtype, self.transport, self.compute_actors, "GPU" if self.use_gpu else "CPU")

    def _node_sides(self) -> list[NodeSide]:
        """Several nodes: each node's store, shards and gradient slots, for the compute group."""
        if self._node_stores is None:
            return []
        sides = []
        for handle, node in zip(self._node_stores.handles, self._node_stores.nodes):
            sides.append(NodeSide(ray.get(handle.shard_infos.remote()), node["NodeID"],
                                  ray.get(handle.grad_slots.remote()), on_node(node["NodeID"]),
                                  lambda gen, rank, h=handle: RayStoreClient(h, gen, rank,
                                                                             self.cfg.runtime.store_timeout_s)))
        return sides

    def _batch(self, step: int, rank: int = 0):
        if (step, rank) not in self._batches:
            if self.cfg.training.overfit_one_batch and rank in self._first_batch:
                self._batches[step, rank] = self._first_batch[rank]
            else:
                self._batches[step, rank] = self._decoder_pool.batch_ref(step, rank)
                self._first_batch.setdefault(rank, self._batches[step, rank])
        return self._batches[step, rank]

    def _submit(self, step: int) -> None:
        if step in self._queued or step in self._computed:
            return
        self._queued[step] = self._computes.submit(step, [self._batch(step, r) for r in range(self.slots)])

    def count_restart(self, what: str, error: BaseException | None = None) -> None:
        """One more actor failure recovered from; past ``runtime.max_restarts``, stop the run."""
        self.restarts += 1
        limit = self.cfg.runtime.max_restarts
        if self.restarts > limit:
            raise RestartLimitError(
                f"{what}: that is {self.restarts} actor failures in this run, more than runtime.max_restarts={limit}; "
                f"stopping. Look for the cause in the log above (and `ray logs`), then continue from the latest "
                f"checkpoint: python -m megaslide_ray.train --run-dir {self.run_dir} --resume "
                f"(raise --runtime.max_restarts to tolerate more)") from error

    def run_step(self, step: int, queue_next: bool) -> StepReport:
        """Run step ``step``; with ``queue_next`` also queue step + 1 behind it. A step that an
        actor's death cut short is redone, within the run's ``runtime.max_restarts``."""
        while True:
            try:
                return self._run_step_once(step, queue_next)
            except Exception as e:
                if not is_actor_failure(e):
                    raise
                self.count_restart(f"step {step + 1}: an actor died ({type(e).__name__})", e)
                t0 = time.monotonic()
                log.warning("step %d: an actor died (%s); recovering and redoing the step (failure %d of at most %d)",
                            step + 1, type(e).__name__, self.restarts, self.cfg.runtime.max_restarts)
                if isinstance(e, StoreHungError) and self._node_stores is None:
                    self._kill_hung_store()
                self._recover(step)
                self.redone_steps += 1
                self.recovery_seconds += time.monotonic() - t0

    def is_queued(self, step: int) -> bool:
        """Whether ``step`` was already handed to the compute actor (queued ahead)."""
        return step in self._queued or step in self._computed

    def _run_step_once(self, step: int, queue_next: bool) -> StepReport:
        self._submit(step)
        # Step k+1 is queued only once step k's batch exists: if k's decoder hangs or dies, k is
        # then the last step on the compute actor and can be handed to it again (_await_batch).
        self._await_batch(step)
        if queue_next:
            self._submit(step + 1)
        if step not in self._computed:
            self._computed[step] = get_each(self._queued.pop(step))
            unanswered = sum(r.store_unanswered for r in self._computed[step])
            if unanswered:  # kept: the store may have applied the update
                raise StoreHungError(f"the parameter store did not answer {unanswered} "
                                     f"gradient report(s) of step {step + 1} within runtime.store_timeout_s="
                                     f"{self.cfg.runtime.store_timeout_s} s")
        if self._node_stores is not None:
            update, _ = self._node_stores.wait_step(step)
        else:
            update = ray.get(self._store.wait_step.remote(step))
        for r in range(self.slots):
            self._batches.pop((step, r), None)
        info = combine_batches(self._decoder_pool.infos(step))
        self._decoder_pool.commit(step)
        results = self._computed.pop(step)
        return StepReport(combine(results), update, info, self._decoder_pool.skipped_files,
                          self._data_lost.pop(step, 0.0), tuple(results) if len(results) > 1 else ())

    def _await_batch(self, step: int) -> None:
        """Wait until ``step``'s batches exist (the decoder watchdog: ``pipelines/decoder_pool.py``).
        A decoder that hung or died was replaced and the batch redrawn; the compute actor's run of
        the step waited on the lost batch, which is its first input, so it failed before touching
        any weight or gradient: hand it the step again with the new batch (the other compute
        actors wait in the store for its part of each gradient sum)."""
        if step in self._computed:
            return
        for rank in range(self.slots):
            ready = self._decoder_pool.wait_ready(step, rank)
            if ready is None or not ready.redrawn:
                continue
            if ready.replacements:  # once per failure: a slot asked again of the same replacement is not one
                self.count_restart(f"step {step + 1}: the decoder of its batch hung or died and was replaced")
            self._data_lost[step] = self._data_lost.get(step, 0.0) + ready.lost_seconds
            self.recovery_seconds += ready.lost_seconds
            old = self._batches.get((step, rank))
            self._batches[step, rank] = self._decoder_pool.batch_ref(step, rank)
            if self._first_batch.get(rank) is old:
                self._first_batch[rank] = self._batches[step, rank]
            refs = self._queued.get(step)
            if refs is None:
                continue
            try:
                ray.get(refs[rank])  # it had its batch after all
            except RayTaskError as e:  # raised in train_step: the lost batch; nothing was computed
                log.debug("step %d: compute actor %d's run on the lost batch failed as expected: %r",
                          step + 1, rank, e)
                refs[rank] = self._computes.resubmit(rank, step, self._batches[step, rank])
            # (a RayActorError that is not a RayTaskError: the compute actor itself died, and
            # run_step's usual recovery takes over)

    def _kill_hung_store(self) -> None:
        """A store that hangs is made a dead one: killed, and Ray restarts it on its state. Returns
        once the restarted process answers (the hung one may still answer on its other threads
        until the kill lands)."""
        try:
            old = ray.get(self._store.status.remote(), timeout=30).pid
        except Exception as e:  # noqa: BLE001 - not even status answers: restart it all the same
            log.debug("the hung store's status: %r", e)
            old = None
        log.warning("killing the parameter store (pid %s), which does not answer; Ray restarts it on its state", old)
        ray.kill(self._store, no_restart=False)
        deadline = time.monotonic() + STORE_RESTART_TIMEOUT_S
        while self._wait_for_store().pid == old and old is not None:
            if time.monotonic() > deadline:
                raise StoreLostError(f"the parameter store (pid {old}) hung and did not restart after a kill; resume "
                                     f"from the latest checkpoint: python -m megaslide_ray.train --run-dir "
                                     f"{self.run_dir} --resume")
            time.sleep(0.5)

    def _wait_for_store(self):
        """The store's status once it answers again (Ray restarts it after a crash), or
        ``StoreLostError`` when it cannot come back within ``STORE_RESTART_TIMEOUT_S``."""
        def lost(e: BaseException) -> StoreLostError:
            return StoreLostError(f"the parameter store died and cannot be restarted on its state ({e}). "
                                  f"Resume from the latest checkpoint: python -m megaslide_ray.train "
                                  f"--run-dir {self.run_dir} --resume")

        return status_once_back(self._store, time.monotonic() + STORE_RESTART_TIMEOUT_S, lost)

    def _recover(self, step: int) -> None:
        """After an actor died during ``step``: wait for the store, replace the compute actor,
        and keep only the results of steps whose update the store holds. Several nodes: every
        store, ``NodeStores.recover``. With ``runtime.device_shards`` the state of those shards
        since the latest checkpoint lived on the compute actor only: ``StoreLostError``, and the
        Trainer rolls back to the latest checkpoint."""
        if self.cfg.runtime.device_shards:
            raise StoreLostError(
                f"step {step + 1}: an actor died while runtime.device_shards={self.cfg.runtime.device_shards} kept the "
                f"state of the first shards on the compute actor's device, which is not recovered in place")
        if self._node_stores is None:
            self._wait_for_store()
        for s, refs in list(self._queued.items()):  # finished results of queued steps are kept
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) == len(refs):
                try:
                    self._computed[s] = ray.get(refs)
                except Exception:  # noqa: BLE001 - a failed run of that step: it is redone
                    pass
        self._queued.clear()
        self._computes.replace()
        # Reports the dead compute actors still had in flight must not count towards a step.
        if self._node_stores is not None:
            try:
                applied = self._node_stores.recover(self._computes.generation, STORE_RESTART_TIMEOUT_S)
            except StateCutError as e:
                raise StoreLostError(f"{e}; resume from the latest checkpoint: python -m megaslide_ray.train "
                                     f"--run-dir {self.run_dir} --resume") from e
            versions = (applied,)
        else:
            versions = ray.get(self._store.set_client_generation.remote(self._computes.generation))
            applied = min(versions)  # the restarted store finished any update cut between shards
        self._computes.start()
        # A result counts only if the store applied its update (the gradients are gone otherwise).
        self._computed = {s: r for s, r in self._computed.items() if s < applied}
        if applied > step and step not in self._computed:
            raise RuntimeError(f"the parameter store applied step {step + 1} but the compute result of that "
                               f"step was lost; resume from the latest checkpoint (--resume)")
        log.warning("recovered: store at versions %s, compute actor(s) replaced; redoing from step %d",
                    sorted(set(versions)), applied + 1)

    def _put_device_state(self, timeout: float | None = None) -> None:
        """``runtime.device_shards``: the compute actor's device shards into the store's segments,
        which a checkpoint or a kept state then reads. A compute actor that is gone took them with
        it: ``StoreLostError`` (the Trainer rolls back to the latest checkpoint)."""
        if not self.cfg.runtime.device_shards:
            return
        try:
            version, states = self._computes.first.device_state.options(num_returns=2).remote()
            ray.get(self._store.put_device_state.remote(version, states), timeout=timeout)
        except Exception as e:
            if not is_actor_failure(e):
                raise
            raise StoreLostError(f"the compute actor holding the device shards (runtime.device_shards="
                                 f"{self.cfg.runtime.device_shards}) is gone ({type(e).__name__}): their state since the "
                                 f"latest checkpoint went with it") from e

    def save_checkpoint(self, run_dir: str, step: int, extra: dict) -> str:
        self._put_device_state()
        while self._node_stores is not None:
            try:
                return self._node_stores.save_checkpoint(run_dir, step, extra)
            except StoreCallError as e:  # (no step in flight: the recovery leaves every shard at `step`)
                self.count_restart(f"a parameter store failed while saving the step-{step} checkpoint", e)
                log.warning("a parameter store failed while saving the step-%d checkpoint (%r); recovering and "
                            "saving again", step, e.error)
                t0 = time.monotonic()
                self._recover(step)
                self.recovery_seconds += time.monotonic() - t0
        while True:
            try:
                return ray.get(self._store.save_checkpoint.remote(run_dir, step, extra))
            except RayActorError as e:
                self.count_restart(f"the parameter store died while saving the step-{step} checkpoint", e)
                # A cut save leaves only a temporary directory; the state itself is intact.
                log.warning("the parameter store died while saving the step-%d checkpoint; saving again", step)
                t0 = time.monotonic()
                self._wait_for_store()
                self.recovery_seconds += time.monotonic() - t0

    def decoder_stats(self):
        """Counters of the decoders that answer promptly (a stuck one may not)."""
        return self._decoder_pool.stats()

    @property
    def decoders_replaced(self) -> int:
        """Decoders replaced in this run because they hung or died (rollbacks included)."""
        return self._replaced_before + self._decoder_pool.replacements

    def use_weights(self, kind: str) -> None:
        """The weights predictions read until the next call: ``ema`` (the moving average,
        ``training.ema_decay``) or ``master`` (the trained weights; before any training step).
        Between steps only (``ParameterStore.use_weights``)."""
        ray.get(self._store.use_weights.remote(kind))

    def status(self):
        """The parameter store's ``StoreStatus`` now: shard versions, host state bytes, state dir
        and node."""
        return ray.get(self._store.status.remote())

    def predict(self, x_t, t, caption, caption_len, version: int, **condition):
        """The model's velocity for ``x_t`` at times ``t`` with the weights of ``version``, forward
        only through the compute actor (``ComputeActor.predict``); so the pipeline can be handed to
        ``euler_sample`` for sampling during training. Call it with no step queued past
        ``version`` (the Trainer does not queue ahead of a sample). ``condition``: an image-to-video
        model's ``condition`` and ``image`` (``ComputeActor.predict``)."""
        return ray.get(self._computes.first.predict.remote(x_t, t, caption, caption_len, version, **condition))

    def actor_handles(self) -> ActorHandles:
        """The live actors' handles, for tests and fault drills that kill one on purpose. They
        change when an actor is replaced or the pipeline rolls back: take them again after that.
        Training code uses the pipeline's methods instead."""
        return ActorHandles(self._store, self._computes.first, tuple(self._decoder_pool.actors),
                            tuple(self._computes.actors),
                            tuple(self._node_stores.handles) if self._node_stores else (self._store,))

    def rollback_to(self, checkpoint: str | None, start_position: int | DataCursor = 0) -> None:
        """The store's state is lost (``StoreLostError``): kill every actor, drop the dead state and
        rebuild the store, compute actor and decoder pool in place on ``checkpoint`` (the data
        continuing from ``start_position``, that checkpoint's cursor), or on the run's initial
        weights (``init_from``, else fresh ones) when there is no checkpoint yet. The steps in
        flight are dropped; the caller redoes those after the checkpoint. The recovery counters
        carry on, the rollback's own time counted in ``recovery_seconds``. (The store's death was
        already counted in ``restarts`` where it was noticed.)"""
        t0 = time.monotonic()
        self._replaced_before += self._decoder_pool.replacements
        self.abort()
        self._start_actors(checkpoint, start_position, None if checkpoint else self.init_from)
        self.rollbacks += 1
        self.recovery_seconds += time.monotonic() - t0

    def close_after_error(self, done: int, checkpoint_step: int, doc: dict) -> tuple[str, int] | None:
        """The run failed: stop every actor, and keep the store's state if it holds progress that
        would be lost (every shard at ``done``, the steps the driver completed, newer than
        ``checkpoint_step``; ``doc``: the data cursor after ``done``, for ``--resume``); else release
        it. Returns the kept state's (path, bytes), or None when it was released. With
        ``runtime.device_shards`` the state is kept only once the compute actor handed its device
        shards back."""
        synced = True
        if done > checkpoint_step and self.cfg.runtime.device_shards:
            try:
                self._put_device_state(timeout=STORE_SETTLE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - a failed run: release instead of keeping a stale state
                log.warning("the device shards' state could not be handed to the parameter store (%r): the state "
                            "after step %d is released; --resume continues from the latest checkpoint", e, done)
                synced = False
        for h in (*self._computes.actors, *self._decoder_pool.actors):  # they hold no state
            try:
                ray.kill(h, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill failed: %r", e)
        # Collect what the queued steps left (their actor is gone), so Ray does not print their
        # errors again as unhandled ones when the refs go.
        refs = [ref for step_refs in self._queued.values() for ref in step_refs]
        for ref in ray.wait(refs, num_returns=len(refs), timeout=10)[0] if refs else ():
            try:
                ray.get(ref)
            except Exception as e:  # noqa: BLE001 - expected: the actor was killed, or the step failed
                log.debug("a queued step ended with %r", e)
        self._queued.clear()
        self._batches.clear()
        kept = None
        if self._node_stores is not None:  # several nodes: no kept state, every store releases its own
            self._node_stores.close()
            return None
        if done > checkpoint_step and synced:
            try:  # a store that died or hangs is not asked twice: its state is not trusted
                versions = ray.get(self._store.settle.remote(), timeout=STORE_SETTLE_TIMEOUT_S)
                if all(v == done for v in versions):
                    kept = tuple(ray.get(self._store.keep.remote({**doc, "step": done}),
                                         timeout=STORE_SETTLE_TIMEOUT_S))
                else:
                    log.warning("the parameter store's shards are at versions %s, not all at step %d (the last the "
                                "driver completed): its state cannot be resumed exactly and is released",
                                sorted(set(versions)), done)
            except Exception as e:  # noqa: BLE001 - dead or not answering: release
                log.warning("the parameter store did not answer (%s); its state is released", type(e).__name__)
        if kept is None:
            try:
                ray.get(self._store.close.remote(), timeout=STORE_SETTLE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - dead or not answering
                log.debug("closing the parameter store failed: %r", e)
        try:
            ray.kill(self._store, no_restart=True)
        except Exception as e:  # noqa: BLE001 - already dead
            log.debug("kill failed: %r", e)
        if kept is None:
            self._remove_state()
        return kept

    def data_cursor(self, step: int) -> DataCursor:
        """Where the data continues after ``step`` completed steps (for a checkpoint)."""
        return self._decoder_pool.cursor(step)

    def abort(self) -> None:
        """Kill every actor now and remove the store's shared-memory state (same node only)."""
        self._computes.kill()
        if self._node_stores is not None:
            self._node_stores.close()
        for h in [*self._decoder_pool.actors, self._store]:
            try:
                ray.kill(h, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill failed: %r", e)
        self._remove_state()

    def _remove_state(self) -> None:
        """Remove the store's shared-memory state, when it is on this node."""
        if self.store_node == ray.get_runtime_context().get_node_id():
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def close(self) -> None:
        for refs in self._queued.values():
            for ref in refs:
                ray.cancel(ref, force=False)
        self._queued.clear()
        self._batches.clear()
        closing = self._computes.close_refs()
        self._decoder_pool.close()  # all decoders at once: a frozen one is killed after one timeout
        try:
            ray.get(closing, timeout=30)
        except Exception as e:  # noqa: BLE001 - closing best-effort, then killed below
            log.debug("closing the compute actor failed: %r", e)
        if self._node_stores is not None:
            self._computes.kill()
            self._node_stores.close()
            return
        closed = False
        try:
            ray.get(self._store.close.remote(), timeout=60)
            closed = True
        except Exception as e:  # noqa: BLE001
            log.warning("parameter store did not close cleanly: %r", e)
        self._computes.kill()
        ray.kill(self._store)
        if not closed:  # a dead store (e.g. one that could not be restarted) left its state behind
            self._remove_state()
