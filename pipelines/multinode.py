"""A run on several nodes (``runtime.nodes`` M > 1): one parameter store per node, placed on it.

``NodeStores`` starts the M stores, store ``i`` pinned to node ``i`` of ``pick_nodes`` (the
driver's node first, so node 0's store, which writes the checkpoints, runs beside the driver)
with Ray's ``NodeAffinitySchedulingStrategy``; each has its own state directory
(``megaslide-<hash>-node<i>``). It hands every store the M handles (``connect``), and from then
on the stores talk to each other through Ray (``actors/node_sync.py``: node-sums of gradients to
each shard's owner, partial norms to all, new weights from each owner to all). Each node's
compute actors run on its node beside its store and read its shared memory (``shm``).

The driver waits for a step on every store (``wait_step``: one ``UpdateResult``, the bytes each
store sent added up), and node 0's store writes a checkpoint holding every shard (the other
owners' optimizer state reaches it through Ray): the format is the one-node one, so a checkpoint
of M nodes resumes on any other M, one included (every store reads it, so ``--resume`` needs the
run directory on a filesystem every node reads).

Failures are recovered in place, as on one node (``recover``; the protocol is in
``actors/node_sync.py``): Ray restarts a store that died (``runtime.max_restarts``), on its node,
where it re-attaches to its shared memory; the driver replaces every compute actor, and every store
either finishes the step in flight (its global norm was known) or drops it to be redone, then the
owners send their shards' weights to every node. A store cut inside a shard's update cannot be
trusted (``StateCutError``: the driver rolls back to the latest checkpoint, on every node). A node
that is gone (its store cannot come back: the machine or its Ray node manager died) takes the
optimizer state of its shards with it, and the other nodes cannot go on without it:
``NodeLostError`` names the node and gives the ``--resume`` command from the latest checkpoint."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import ray
from ray.exceptions import ActorUnavailableError, ActorUnschedulableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.param_store import ParameterStore, UpdateResult
from megaslide_ray.state.checkpoint import latest_checkpoint

log = logging.getLogger(__name__)


class NodeLostError(RuntimeError):
    """A node of a run on several nodes was lost (its parameter store died): the run stops."""


class StoreCallError(RuntimeError):
    """A call to node ``node``'s store failed: the store died, or it raised (for instance because a
    call it made to another node's store failed). The driver's recovery tells which nodes are gone."""

    def __init__(self, node: int, error: BaseException):
        super().__init__(f"the parameter store of node {node} failed: {error!r}")
        self.node, self.error = node, error


STORE_FAILURES = (RayActorError, ActorUnschedulableError, ray.exceptions.RayTaskError)
"""What a call to a store raises when the store died, cannot be placed again (its node is gone), or raised."""


class StateCutError(RuntimeError):
    """A store of a run on several nodes was cut inside a shard's update: roll back to a checkpoint."""


class NodesUnavailableError(RuntimeError):
    """``runtime.nodes`` asks for more nodes than the Ray cluster has alive."""


def alive_nodes() -> list[dict]:
    """The Ray cluster's alive nodes: the driver's first, then the others by node id."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeID"]))


def pick_nodes(count: int, gpus: int = 0) -> list[dict]:
    """``count`` distinct alive nodes for the run's stores, each with at least ``gpus`` GPUs (its
    compute actors'), or ``NodesUnavailableError``."""
    nodes = alive_nodes()
    if gpus:
        enough = [n for n in nodes if n.get("Resources", {}).get("GPU", 0) >= gpus]
        if len(enough) < count:
            have = ", ".join(f"{n['NodeManagerAddress']}: {n.get('Resources', {}).get('GPU', 0):g}" for n in nodes)
            raise NodesUnavailableError(
                f"runtime.nodes={count} with {gpus} GPU compute actor(s) per node needs {count} nodes of {gpus} GPUs, "
                f"but {len(enough)} of the cluster's alive nodes have that many (GPUs per node: {have}); set "
                f"--runtime.compute_actors to the smallest node's GPU count, or use fewer nodes")
        nodes = enough
    if count > len(nodes):
        raise NodesUnavailableError(
            f"runtime.nodes={count} asks for {count} nodes but the Ray cluster has {len(nodes)} alive node(s) "
            f"({', '.join(n['NodeManagerAddress'] for n in nodes)}); start Ray on {count - len(nodes)} more "
            f"(ray start --address=HEAD:6379 on each) and pass --ray.address, or set --runtime.nodes {len(nodes)}")
    return nodes[:count]


def on_node(node_id: str) -> dict:
    """Actor options that pin an actor to node ``node_id``."""
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)}


def resume_command(run_dir: str) -> str:
    """The command that continues the run from its latest checkpoint (or says there is none)."""
    ckpt = latest_checkpoint(run_dir)
    where = f"from its latest checkpoint, {ckpt}" if ckpt else "(no checkpoint was written yet: it starts over)"
    return f"resume {where}: python -m megaslide_ray.train --run-dir {run_dir} --resume"


def status_once_back(store, deadline: float, gone):
    """``store.status()`` once the store answers. While Ray restarts it (unavailable, or no answer
    yet) this asks again until ``deadline`` (``time.monotonic()``); past it, or when the store
    cannot come back (Ray gave up, or its node is gone), raises ``gone(error)``."""
    while True:
        try:
            return ray.get(store.status.remote(), timeout=max(1.0, deadline - time.monotonic()))
        except (ActorUnavailableError, GetTimeoutError) as e:  # restarting
            if time.monotonic() > deadline:
                raise gone(e) from e
            time.sleep(0.5)
        except (RayActorError, ActorUnschedulableError) as e:
            raise gone(e) from e


class NodeStores:
    """The M stores of a run, ``handles[i]`` on node ``nodes[i]``. ``store_args``: the
    ``ParameterStore`` arguments after ``cfg, run_dir`` (keywords)."""

    def __init__(self, cfg, run_dir: str, nodes: list[dict], options: dict, **store_args):
        self.cfg, self.run_dir = cfg, run_dir
        self.nodes = nodes
        self.count = len(nodes)
        self.handles = []
        for i, node in enumerate(nodes):
            cls = ray.remote(ParameterStore).options(
                name=f"megaslide/param-store-node{i}", num_cpus=0, max_concurrency=64,
                max_restarts=cfg.runtime.max_restarts,
                **on_node(node["NodeID"]), **options)
            self.handles.append(cls.remote(cfg, run_dir, nodes=self.count, node=i, **store_args))
        self.call(lambda h: h.connect.remote(self.handles))

    def describe(self, i: int) -> str:
        node = self.nodes[i]
        return f"node {i} of {self.count} ({node['NodeManagerAddress']}, Ray node {node['NodeID'][:12]})"

    def lost(self, i: int, error: BaseException | None = None) -> NodeLostError:
        return NodeLostError(
            f"{self.describe(i)} was lost: its parameter store died{f' ({type(error).__name__})' if error else ''}, "
            f"and with it the optimizer state of the shards it owns (shard l for l % {self.count} == {i}); the run "
            f"cannot go on without it. Bring the node back (or use fewer nodes: a checkpoint resumes on any "
            f"--runtime.nodes), then {resume_command(self.run_dir)}")

    def call(self, make, timeout: float | None = None) -> list:
        """``make(handle)`` on every store, their answers by node. A store that dies or raises is a
        ``StoreCallError``, noticed as soon as it happens (not after the other stores answered)."""
        refs = [make(h) for h in self.handles]
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"the parameter stores did not answer within {timeout} s")
            i = refs.index(ready[0])
            try:
                ray.get(ready[0])
            except STORE_FAILURES as e:
                raise StoreCallError(i, e) from e
        return ray.get(refs)

    def await_alive(self, timeout: float) -> None:
        """Every store answers (Ray restarts one that died, on its node, within ``timeout`` s), or
        ``NodeLostError`` for the first that cannot come back (its node is gone or Ray gave up)."""
        deadline = time.monotonic() + timeout
        for i, h in enumerate(self.handles):
            status_once_back(h, deadline, lambda e, i=i: self.lost(i, e))

    def recover(self, generation: int, timeout: float) -> int:
        """After an actor of the run died (the compute actors already killed): bring every store to
        one version of every shard, with ``generation`` the compute actors' next (protocol:
        ``actors/node_sync.py``). Returns that version: the steps before it are applied, the ones
        from it on are redone. ``NodeLostError`` when a store cannot come back, ``StateCutError``
        when one was cut inside a shard's update. A store that fails during the recovery (its node
        died meanwhile, before Ray noticed) starts it again, which finds it restarting or gone: each
        phase can be repeated (a finished shard is at the next version, its norm recorded)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._recover_once(generation, timeout)
            except StoreCallError as e:
                if time.monotonic() > deadline:
                    raise self.lost(e.node, e.error) from e
                log.warning("recovery: node %d's parameter store failed during the recovery (%r); again", e.node,
                            e.error)

    def _recover_once(self, generation: int, timeout: float) -> int:
        self.await_alive(timeout)
        self.call(lambda h: h.connect.remote(self.handles), timeout)  # a restarted store lost its peers
        states = self.call(lambda h: h.sync_pause.remote(generation), timeout)
        cut = {i: s["cut"] for i, s in enumerate(states) if s["cut"]}
        if cut:
            i, shards = next(iter(cut.items()))
            raise StateCutError(f"{self.describe(i)}: its parameter store stopped inside the update of shard(s) "
                                f"{shards}, whose weights and moments are half-written")
        shards = len(states[0]["versions"])
        owned = [states[i % self.count]["versions"][i] for i in range(shards)]  # the owners' versions count
        step, top = min(owned), max(owned)
        total = next((s["records"][step] for s in states if step in s["records"]), None)
        if top > step + 1 or (top > step and total is None):
            raise StateCutError(f"the owners' shard versions {owned} cannot come from one update of step {step + 1}")
        if total is not None:  # the global norm of step `step` was known: its update ends everywhere
            done = self.call(lambda h: h.sync_finish.remote(step, total), timeout)
            log.warning("recovery: step %d's update finished on %d shard(s) (it was under way)", step + 1,
                        sum(len(d) for d in done))
            step += 1
        else:
            self.call(lambda h: h.sync_restore.remote(), timeout)
        self.call(lambda h: h.sync_share.remote(step), timeout)
        return step

    def wait_step(self, step: int) -> tuple[UpdateResult, tuple[UpdateResult, ...]]:
        """Step ``step``'s update on every node: one result (the slowest node's optimizer time, the
        bytes every store sent to the others added up) and each node's."""
        results = self.call(lambda h: h.wait_step.remote(step))
        first = results[0]
        return replace(first, optimizer_seconds=max(r.optimizer_seconds for r in results),
                       reduce_seconds=max(r.reduce_seconds for r in results),
                       network_bytes=sum(r.network_bytes for r in results)), tuple(results)

    def save_checkpoint(self, run_dir: str, step: int, extra: dict) -> str:
        """Node 0's store writes it, every shard in it (``NodeSyncMethods.checkpoint_state``)."""
        self.call(lambda h: h.wait_version.remote(0, step))  # every node reached the step
        ref = self.handles[0].save_checkpoint.remote(run_dir, step, extra)
        try:
            return ray.get(ref)
        except STORE_FAILURES as e:
            raise StoreCallError(0, e) from e

    def status(self) -> list:
        return self.call(lambda h: h.status.remote())

    def close(self) -> None:
        """Close every store that answers (their state goes), then kill them all."""
        for h in self.handles:
            try:
                ray.get(h.close.remote(), timeout=60)
            except Exception as e:  # noqa: BLE001 - dead or not answering
                log.debug("closing a parameter store failed: %r", e)
        self.kill()

    def kill(self) -> None:
        for h in self.handles:
            try:
                ray.kill(h, no_restart=True)
            except Exception as e:  # noqa: BLE001 - already dead
                log.debug("kill failed: %r", e)
