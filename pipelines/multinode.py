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

A store that dies takes its node's optimizer state with it, and the other nodes cannot go on
without it: ``NodeLostError`` names the node and gives the ``--resume`` command from the latest
checkpoint. Stores of such a run are not restarted by Ray (``max_restarts=0``)."""

from __future__ import annotations

import logging
from dataclasses import replace

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.param_store import ParameterStore, UpdateResult
from megaslide_ray.state.checkpoint import latest_checkpoint

log = logging.getLogger(__name__)


class NodeLostError(RuntimeError):
    """A node of a run on several nodes was lost (its parameter store died): the run stops."""


class NodesUnavailableError(RuntimeError):
    """``runtime.nodes`` asks for more nodes than the Ray cluster has alive."""


def alive_nodes() -> list[dict]:
    """The Ray cluster's alive nodes: the driver's first, then the others by node id."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (n["NodeID"] != here, n["NodeID"]))


def pick_nodes(count: int) -> list[dict]:
    """``count`` distinct alive nodes for the run's stores, or ``NodesUnavailableError``."""
    nodes = alive_nodes()
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
                name=f"megaslide/param-store-node{i}", num_cpus=0, max_concurrency=64, max_restarts=0,
                **on_node(node["NodeID"]), **options)
            self.handles.append(cls.remote(cfg, run_dir, nodes=self.count, node=i, **store_args))
        self.call(lambda h: h.connect.remote(self.handles))

    def describe(self, i: int) -> str:
        node = self.nodes[i]
        return f"node {i} of {self.count} ({node['NodeManagerAddress']}, Ray node {node['NodeID'][:12]})"

    def lost(self, i: int, error: BaseException | None = None) -> NodeLostError:
        return NodeLostError(
            f"{self.describe(i)} was lost: its parameter store died{f' ({type(error).__name__})' if error else ''}, "
            f"and with it the optimizer state of the shards it owns (every {self.count}th shard from {i}); the run "
            f"cannot go on without it. Bring the node back (or use fewer nodes: a checkpoint resumes on any "
            f"--runtime.nodes), then {resume_command(self.run_dir)}")

    def call(self, make, timeout: float | None = None) -> list:
        """``make(handle)`` on every store, their answers by node. A store that dies is a lost node,
        noticed as soon as it dies (not after the other stores answered)."""
        refs = [make(h) for h in self.handles]
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"the parameter stores did not answer within {timeout} s")
            i = refs.index(ready[0])
            try:
                ray.get(ready[0])
            except RayActorError as e:
                raise self.lost(i, e) from e
            except ray.exceptions.RayTaskError as e:  # a store raised: because another node is gone?
                dead = self.dead()
                if dead:
                    raise self.lost(dead[0], e) from e
                raise
        return ray.get(refs)

    def dead(self) -> list[int]:
        """The nodes whose store does not answer a status call (within 10 s)."""
        gone = []
        for i, h in enumerate(self.handles):
            try:
                ray.get(h.status.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - dead or not answering: lost
                gone.append(i)
        return gone

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
        except (RayActorError, ray.exceptions.RayTaskError) as e:
            dead = self.dead()
            if dead:
                raise self.lost(dead[0], e) from e
            raise

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
