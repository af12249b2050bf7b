"""The parameter store seen from the other processes, over Ray: the compute actors' client
(``RayStoreClient``: reads through the store's methods, gradient reports fire-and-forget and
checked once per step), and the driver's reading of the store's failures: lost (``StoreLostError``:
back to the latest checkpoint), hung (``StoreHungError``: killed, restarted on its state), an
actor's death that redoing the step recovers (``is_actor_failure``), a refused start
(``raise_store_start_error``). ``pipelines/streaming.py`` acts on them."""

from __future__ import annotations

import logging

import ray
from ray.exceptions import (
    ActorUnschedulableError,
    GetTimeoutError,
    RayActorError,
    RayTaskError,
)

from actors.store_types import GradientsLostError
from megaslide_ray.state.checkpoint import CheckpointDamagedError
from megaslide_ray.state.preflight import StateSpaceError
from pipelines.multinode import StoreCallError

log = logging.getLogger(__name__)


class StoreLostError(RuntimeError):
    """The parameter store died and could not come back on its shared state: the run must
    restore its latest checkpoint (the Trainer does)."""


class StoreHungError(RuntimeError):
    """The parameter store did not answer a step's gradient reports within
    ``runtime.store_timeout_s``: it is killed, Ray restarts it on its state, the step is recovered."""


def raise_store_start_error(e: BaseException) -> None:
    """The store's constructor refused for want of room (``StateSpaceError``) or because a tensor
    of the checkpoint it loads does not match its checksum (``CheckpointDamagedError``): raise it
    again here with its own message, instead of Ray's actor traceback around it."""
    text = str(getattr(e, "error", e))  # several nodes: a StoreCallError around the store's failure
    for cls in (StateSpaceError, CheckpointDamagedError):
        key = f"{cls.__name__}: "
        if key in text:
            raise cls(text[text.rindex(key) + len(key):].strip().splitlines()[0]) from None


def is_actor_failure(error: BaseException) -> bool:
    """An actor died under the call (directly, or inside the task that made the call; or it cannot
    be placed again: its node is gone), or a restarted store no longer holds a step's gradients:
    redoing the step recovers (or the recovery finds the node lost)."""
    kinds = (RayActorError, ActorUnschedulableError, GradientsLostError, StoreHungError, StoreCallError)
    return isinstance(error, kinds) or isinstance(getattr(error, "cause", None), kinds)


class RayStoreClient:
    """The compute actor's view of a remote ParameterStore. Gradient reports are fire-and-
    forget (their refs are kept and checked once per step, so an error is never lost).
    ``rank``: which of several compute actors this one is (``pipelines/compute_group.py``)."""

    def __init__(self, store_handle, generation: int = 0, rank: int = 0, timeout_s: float = 0.0):
        self._store = store_handle
        self._generation = generation  # which compute actor this is: the store drops stale reports
        self._rank = rank
        self._timeout = timeout_s or None  # runtime.store_timeout_s (0: wait forever)
        self._inflight: list = []

    @property
    def generation(self) -> int:
        """The compute actors' generation this client reports for (written into gradient slots)."""
        return self._generation

    def wait_version(self, shard: int, step: int) -> int:
        return ray.get(self._store.wait_version.remote(shard, step))

    def get_weights(self, shard: int, step: int):
        return ray.get(self._store.get_weights.remote(shard, step))

    def get_teacher_weights(self, shard: int):
        return ray.get(self._store.get_teacher_weights.remote(shard))

    def device_state(self, step: int) -> dict:
        return ray.get(self._store.device_state.remote(step))

    def report_grad(self, shard: int, step: int, sqnorm: float, grad, slot: int = -1, piece: int = 0) -> None:
        if slot >= 0:  # several compute actors: the gradient (its piece ``piece``) is in (or goes to) this actor's slot
            ref = self._store.report_grad.remote(shard, step, sqnorm, grad, self._generation, self._rank, slot,
                                                 piece)
        else:
            ref = self._store.report_grad.remote(shard, step, sqnorm, grad, self._generation)
        self._inflight.append(ref)

    def wait_grad_slot(self, slot: int) -> None:
        ray.get(self._store.wait_grad_slot.remote(self._rank, slot, self._generation))

    def flush(self) -> int:
        """Wait until this step's reports are answered; returns how many were not answered within
        ``runtime.store_timeout_s`` (0 normally). An error the store raised surfaces here.
        A store that died under a report is not this step's error: it may have counted every
        report before dying (then its restart finishes the update from shared memory) or not
        (then the gradients are gone); the driver, which waits for the step's update next,
        tells the two apart and redoes the step only in the second case. Raising here would
        lose the step's result in the first case, with its update already applied. A store that
        hangs is the same case once the driver has killed it: the step's result says so
        (``StepResult.store_unanswered``), and the driver does."""
        refs, self._inflight = self._inflight, []
        try:
            ray.get(refs, timeout=self._timeout)
        except RayTaskError:
            raise
        except RayActorError as e:
            log.warning("the parameter store died while this step's gradient reports were answered (%s); "
                        "the driver checks whether it applied them", type(e).__name__)
        except GetTimeoutError:
            ready, waiting = ray.wait(refs, num_returns=len(refs), timeout=0)
            log.warning("the parameter store did not answer %d of this step's %d gradient reports within "
                        "runtime.store_timeout_s=%s s; the driver treats it as dead", len(waiting), len(refs),
                        self._timeout)
            return len(waiting)
        return 0

    def __getstate__(self):
        return {"_store": self._store, "_generation": self._generation, "_rank": self._rank, "_timeout": self._timeout,
                "_inflight": []}
