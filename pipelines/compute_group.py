"""The compute actors of a run, made remote and handled as one: ``runtime.compute_actors`` N of
them on the store's node, each training its own batch slot of every step, all reporting to the
one parameter store (which sums their gradients: ``actors/grad_reduce.py``).

A failure of any of them replaces all of them (``replace``): the others may be blocked on the
dead one's part of a gradient sum and may already hold the next step queued, and a step is only
worth anything with every actor's gradient, so the step is redone by N fresh actors. Between
steps a compute actor holds no state, so replacing one costs only its start.

On several nodes (``runtime.nodes`` M, ``pipelines/multinode.py``) the group holds N actors on
each node, each pinned beside its node's store (``NodeSide``): actor ``node x N + r`` trains batch
slot ``node x N + r`` of every step and reports to its own node's store."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from actors.compute import ComputeActor, StepResult
from actors.decoder import BatchInfo

log = logging.getLogger(__name__)

KILL_WAIT_S = 30.0
"""How long ``kill`` waits for the killed compute actors to be dead (their names free)."""


def resolve_compute_actors(cfg) -> int:
    """``runtime.compute_actors`` as a number: ``auto`` is the GPUs of the driver's node (where a
    local run's store lands), at least 1; 1 when both experts of a two-expert model train."""
    n = cfg.runtime.compute_actors
    if n != "auto":
        return int(n)
    if cfg.training.expert == "both":  # both experts in one store: one compute actor (config validation)
        return 1
    here = ray.get_runtime_context().get_node_id()
    gpus = next((node["Resources"].get("GPU", 0) for node in ray.nodes() if node["NodeID"] == here), 0)
    return max(1, int(gpus))


def combine(results: list[StepResult]) -> StepResult:
    """One step's results of every compute actor as one: the loss (and the distillation term) is
    the mean (each actor's batch is as large), tokens and bytes add up, times are the slowest actor's (the step waits for it)."""
    if len(results) == 1:
        return results[0]
    r0 = results[0]

    def slowest(name: str) -> float:
        return max(getattr(r, name) for r in results)

    def total(name: str):
        return sum(getattr(r, name) for r in results)

    return StepResult(
        step=r0.step, loss=total("loss") / len(results), tokens=total("tokens"), seconds=slowest("seconds"),
        forward_seconds=slowest("forward_seconds"), backward_seconds=slowest("backward_seconds"),
        weight_wait_seconds=slowest("weight_wait_seconds"), data_position=max(r.data_position for r in results),
        device=r0.device, data_wait_seconds=slowest("data_wait_seconds"), h2d_bytes=total("h2d_bytes"),
        h2d_seconds=total("h2d_seconds"), d2h_bytes=total("d2h_bytes"), d2h_seconds=total("d2h_seconds"),
        device_memory_peak_bytes=max(r.device_memory_peak_bytes for r in results), rank=0,
        grad_slot_wait_seconds=slowest("grad_slot_wait_seconds"), t=tuple(x for r in results for x in r.t),
        expert=r0.expert, distill_loss=total("distill_loss") / len(results),
        teacher_seconds=slowest("teacher_seconds"))


def combine_batches(infos: list[BatchInfo | None]) -> BatchInfo | None:
    """The batch infos of one step's slots as one: every clip's row, in actor order."""
    got = [i for i in infos if i is not None]
    if not got:
        return None
    if len(got) == 1:
        return got[0]
    last = max(got, key=lambda i: i.position)
    return BatchInfo(step=got[0].step, rank=got[0].rank, position=last.position, skipped=last.skipped,
                     rows=tuple(r for i in got for r in i.rows))


@dataclass(frozen=True)
class NodeSide:
    """One node of a run on several nodes: its store's shards, node, gradient slots, the actor
    options that pin an actor there, and ``client(generation, rank)``, a client of its store."""
    infos: list
    store_node: str
    grad_slots: object
    options: dict
    client: Callable


@dataclass
class ComputeGroup:
    """N compute actors (``actors[r]`` trains batch slot r of each step), remote, of one
    ``generation``; ``client(generation, rank)`` makes an actor's store client."""
    cfg: object
    infos: list
    store_node: str
    grad_slots: object
    use_gpu: bool
    count: int
    options: dict
    client: Callable
    generation: int = 0
    sides: list[NodeSide] = field(default_factory=list)
    """Several nodes: each node's side, ``count`` actors on each (empty: one node, the fields above)."""

    def __post_init__(self):
        self.actors = [self._make(r) for r in range(self.total)]

    @property
    def total(self) -> int:
        """Compute actors of the run: ``count`` on each node."""
        return self.count * max(1, len(self.sides))

    @property
    def names(self) -> list[str]:
        """The Ray names of this generation's actors: ``megaslide/compute`` (the first; a replaced
        one gets ``-1``, ``-2``, ... as before), ``megaslide/compute-r1``, ..."""
        gen, n = self.generation, self.count
        if self.sides:  # several nodes: megaslide/compute-node1-r0, ...
            return [f"megaslide/compute-node{r // n}-r{r % n}" + (f"-{gen}" if gen else "") for r in range(self.total)]
        return ["megaslide/compute" + (f"-r{rank}" if rank else "") + (f"-{gen}" if gen else "")
                for rank in range(self.count)]

    def _make(self, rank: int):
        name = self.names[rank]
        if self.use_gpu:
            resources = {"num_cpus": 0, "num_gpus": 1}
        else:  # a CPU each, or an equal share of a smaller cluster (said once, by rank 0)
            cpus = ray.cluster_resources().get("CPU", 1.0) / max(1, len(self.sides))  # (several nodes: per node)
            share = min(1.0, cpus / self.count)
            if share < 1.0 and rank == 0:
                log.warning("runtime.compute_actors=%d CPU compute actors on a Ray cluster of %g CPUs: each reserves "
                            "%.2f CPU", self.count, cpus, share)
            resources = {"num_cpus": share, "num_gpus": 0}
        # transport "auto": the compute actor compares its node with the store's once placed.
        if self.sides:
            node, local = divmod(rank, self.count)
            side = self.sides[node]
            return ray.remote(ComputeActor).options(name=name, **resources, **self.options, **side.options).remote(
                self.cfg, side.infos, side.client(self.generation, local), self.cfg.runtime.transport, side.store_node,
                local, side.grad_slots, node, len(self.sides))
        return ray.remote(ComputeActor).options(name=name, **resources, **self.options).remote(
            self.cfg, self.infos, self.client(self.generation, rank), self.cfg.runtime.transport, self.store_node,
            rank, self.grad_slots)

    @property
    def first(self):
        return self.actors[0]

    def transport(self) -> str:
        return ray.get(self.first.transport_name.remote())

    def submit(self, step: int, batch_refs: list) -> list:
        """Step ``step`` on every actor, actor r on ``batch_refs[r]`` (in a list, the ref reaches the
        actor unresolved, so it can measure its wait for data). The refs of their results."""
        return [a.train_step.remote([ref], step) for a, ref in zip(self.actors, batch_refs)]

    def resubmit(self, rank: int, step: int, batch_ref):
        """Step ``step`` on actor ``rank`` alone (its batch was redrawn)."""
        return self.actors[rank].train_step.remote([batch_ref], step)

    def replace(self) -> None:
        """Kill every actor, wait until they are gone (a killed actor must not write a gradient
        slot the new ones use), and move to the next generation; ``start`` starts its N actors.
        The caller tells the store the new generation in between (``set_client_generation``)."""
        self.kill()
        self.generation += 1
        self.actors = []

    def start(self) -> None:
        """Start the actors of the current generation (after ``replace``)."""
        self.actors = [self._make(r) for r in range(self.total)]

    def close_refs(self) -> list:
        return [a.close.remote() for a in self.actors]

    def kill(self) -> None:
        """Kill every actor and wait (up to ``KILL_WAIT_S``) until Ray has them dead, so their names
        are free and none of them still writes to the store's memory."""
        for a in self.actors:
            try:
                ray.kill(a)  # (no_restart: a compute actor is replaced, never restarted)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill failed: %r", e)
        # The GCS frees a killed actor's name once the actor is dead: wait for that.
        deadline = time.monotonic() + KILL_WAIT_S
        while time.monotonic() < deadline:
            alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
            if not alive & set(self.names):
                return
            time.sleep(0.1)
        log.warning("compute actors %s still listed %.0f s after they were killed", self.names, KILL_WAIT_S)
