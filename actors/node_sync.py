"""NodeSync: the parameter store's side of a run on several nodes (``runtime.nodes`` M > 1).

One parameter store per node. Every store keeps the compute copy ``w`` of every shard (its
compute actors read it from shared memory, as on one node), and the optimizer state (``master``,
``m``, ``v``) only of the shards it owns: shard l is owned by node ``l % M``. So a node holds
about ``w bytes + 12 / M`` bytes per parameter. Per step and shard l:

1. The node's compute actors report their gradients of l to their own store, which sums them
   (``actors/grad_reduce.py``) into ``w_l`` as on one node: the **node-sum**, with its squared
   norm (NaN when a compute actor poisoned its report).
2. A store that does not own l sends its node-sum to the owner (``ray.put`` of the bytes, then
   the owner's ``add_node_grad``: Ray object refs, no sockets). Its ``w_l`` then waits for the
   new weights.
3. The owner, once it has all M node-sums, adds them **in fp32 in node order 0, 1, ..., M-1**
   (bit-identical run to run) into its ``w_l``: the gradient of the global batch, exactly where a
   one-node step leaves it. Its squared norm is counted.
4. Global clipping needs the norm over every shard: once an owner counted all its shards it
   sends the sum of their squared norms (its *partial*) to every store (``add_norm_part``);
   each store, with the M partials, takes the global norm (partials added in node order) and
   runs AdamW on its own shards, in shard order, with the same clipping coefficient.
5. After updating shard l the owner sends the new ``w_l`` (one ``ray.put``, the same ref to every
   other node's ``receive_weights``), which writes it into its ``w_l`` segment and bumps the
   shard's version: the next forward on that node waits for exactly that, as on one node.

Bytes per node per step, each way: ``w bytes x ((P - own) + own x (M - 1))`` (gradients of the
shards it does not own out, weights of its own shards to every other node), the planner's
``network`` term (``megaslide_ray/planning/scaleout.py``); ``UpdateResult.network_bytes`` counts
what a store sent. Received node-sums wait in Ray's object store until the owner's own backward
of the shard is done and they are summed (a few shards in flight, as the nodes run the backward
in step; not bounded by slots: the planner's ``network receive slots`` term is the estimate); the
owner sums them in its fp32 update scratch on a bf16 run (idle then: a step's sums end before its
update starts), in a buffer of the largest owned shard on an fp32 run.

Every message between stores carries the driver's generation of the compute actors (as their
reports do): when an actor dies the driver replaces every compute actor and moves every store to a
new generation, and a late message of the old one is dropped.

**Recovery** (the driver's ``NodeStores.recover``, ``pipelines/multinode.py``), after any actor of
the run died (a compute actor, or a store that Ray restarted on its shared memory: it re-attaches
and counts nothing until then):

1. ``sync_pause``: every store moves to the new generation, drops the partial sums, norms and
   reports of the step in flight, lets an update that already has its global norm finish, and
   says its shard versions, the update records it holds, and any shard cut inside its update.
2. The step in flight either ends or is redone, the same on every node. An owner's update of step
   k starts only once the global norm is known, that is once every owner summed the M node-sums of
   every shard it owns into the shard's ``w`` (shared memory: it outlives a store's process). So if
   any owner holds a record of step k (or has a shard at k + 1), every owner's shards still at k
   hold the global gradient: ``sync_finish`` applies step k to them with the recorded norm, and the
   step is not redone. Otherwise no shard was updated: ``sync_restore`` gives every owned ``w`` its
   weights back, and the step is redone. A shard cut inside its update cannot be trusted: the
   driver rolls back to the latest checkpoint instead.
3. ``sync_share``: each owner sends the ``w`` of its shards to every other node
   (``install_weights``), whose copies may hold a gradient of the abandoned step.

A lost node (its store cannot come back) stops the run (``pipelines/multinode.py``)."""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings

import numpy as np
import torch

from megaslide_ray.state.checkpoint import CHECKPOINT_KINDS, OPTIONAL_KINDS
from megaslide_ray.state.segments import DTYPES

log = logging.getLogger(__name__)


def owner_of(shard: int, nodes: int) -> int:
    """The node that keeps shard ``shard``'s optimizer state and updates it."""
    return shard % nodes


class NodeSync:
    """Bound to one ``ParameterStore`` (``store``) of node ``store.node``; ``connect`` gives it the
    M stores' handles (index = node)."""

    def __init__(self, store):
        self.store = store
        self.nodes, self.node = store.nodes, store.node
        self.peers: list = []
        self._lock = threading.Lock()
        self._parts: dict[tuple[int, int], dict[int, tuple[object, float]]] = {}  # (step, shard) -> node -> part
        self._owned_sq: dict[int, dict[int, float]] = {}   # step -> owned shard -> squared norm of the sum
        self._norm_parts: dict[int, dict[int, float]] = {}  # step -> node -> partial squared norm
        self._sent: dict[int, int] = {}                      # step -> bytes sent to other nodes
        self._calls: list = []                               # refs of calls to other stores, checked later
        self.error: BaseException | None = None
        # The fp32 sum: on a bf16 run the store's update scratch (a store sums the nodes' gradients of
        # a step before any update of it starts, and updates before the next step's gradients), on an
        # fp32 run a buffer of the largest owned shard. One sum at a time (``_sum_lock``).
        owned = [store.layouts[i].numel for i in store.owned]
        self._own_acc = store._grad32 is None
        self._acc = store._grad32 if not self._own_acc else torch.empty(max(owned) if owned else 0,
                                                                         dtype=torch.float32)
        self._sum_lock = threading.Lock()
        self._wdtype = DTYPES[store.w_dtype]

    def connect(self, peers: list) -> None:
        if len(peers) != self.nodes:
            raise ValueError(f"{len(peers)} store handles for a run on {self.nodes} nodes")
        self.peers = list(peers)

    def scratch_bytes(self) -> int:
        """The fp32 sum's buffer when it is not the store's update scratch (fp32 runs)."""
        return self._acc.numel() * 4 if self._own_acc else 0

    def current(self, generation: int) -> bool:
        """Whether a message of ``generation`` still counts (not one of replaced actors, and not
        before the driver's recovery of a restarted store)."""
        return generation == self.store._generation and not self.store._awaiting_recovery

    # -- gradients ------------------------------------------------------------------------------
    def node_grad_ready(self, shard: int, step: int, sqnorm: float, generation: int) -> None:
        """This node's sum of its compute actors' gradients of ``shard`` is in the shard's ``w``."""
        owner = owner_of(shard, self.nodes)
        if owner == self.node:
            self.add_node_grad(shard, step, self.node, None, sqnorm, generation)
            return
        w = self.store.seg[shard]["w"]
        ref = _put(w)  # copied now: w_shard may receive the new weights from here on
        self._count_sent(step, w.numel() * w.element_size())
        self._call(self.peers[owner].add_node_grad.remote(shard, step, self.node, ref, float(sqnorm), generation))

    def add_node_grad(self, shard: int, step: int, node: int, data, sqnorm: float, generation: int) -> None:
        """Node ``node``'s sum of ``shard``'s gradients of ``step`` (``data`` its raw bytes; None:
        this node's, in ``w``). The last of the M sums them into ``w`` and counts the shard."""
        if owner_of(shard, self.nodes) != self.node:
            raise RuntimeError(f"node {node} sent its gradient of shard {shard} to node {self.node}, which does not "
                               f"own it (node {owner_of(shard, self.nodes)} does)")
        with self._lock:
            if not self.current(generation):
                log.debug("dropped node %d's gradient of shard %d, step %d: generation %d", node, shard, step,
                          generation)
                return
            parts = self._parts.setdefault((step, shard), {})
            if node in parts:
                raise RuntimeError(f"node {node} sent its gradient of shard {shard} for step {step} twice")
            parts[node] = (data, float(sqnorm))
            if len(parts) < self.nodes:
                return
            del self._parts[(step, shard)]
        with self._sum_lock:
            if not self.current(generation):  # a recovery began meanwhile: w is not this sum's any more
                return
            sq = self._sum(shard, parts)
        self._owned_reported(shard, step, sq, generation)

    def _sum(self, shard: int, parts: dict[int, tuple[object, float]]) -> float:
        """In fp32, node 0 first, into ``w``; the squared norm of the sum (NaN if a part's was not finite)."""
        w = self.store.seg[shard]["w"]
        n = w.numel()
        acc = self._acc[:n]

        def tensor(node: int) -> torch.Tensor:
            data = parts[node][0]
            if data is None:
                return w
            return _read_only(data).view(self._wdtype)[:n]

        acc.copy_(tensor(0))
        for node in range(1, self.nodes):
            acc.add_(tensor(node))
        w.copy_(acc)
        if not all(math.isfinite(sq) for _, sq in parts.values()):
            return float("nan")
        return float(torch.linalg.vector_norm(w, dtype=torch.float32).square())

    def _owned_reported(self, shard: int, step: int, sq: float, generation: int) -> None:
        with self._lock:
            if not self.current(generation):
                return
            got = self._owned_sq.setdefault(step, {})
            got[shard] = sq
            if len(got) < len(self.store.owned):
                return
            del self._owned_sq[step]
        partial = sum(got[i] for i in sorted(got))
        for node, peer in enumerate(self.peers):
            if node == self.node:
                self.add_norm_part(step, node, partial, generation)
            else:
                self._call(peer.add_norm_part.remote(step, self.node, partial, generation))

    def add_norm_part(self, step: int, node: int, partial: float, generation: int) -> None:
        """Node ``node``'s sum of the squared norms of its shards' gradients of ``step``; with all M
        of them, the store queues its update with the global squared norm."""
        with self._lock:
            if not self.current(generation):
                return
            got = self._norm_parts.setdefault(step, {})
            got[node] = float(partial)
            if len(got) < self.nodes:
                return
            del self._norm_parts[step]
        self.store._queue_update(step, sum(got[n] for n in range(self.nodes)))

    # -- weights --------------------------------------------------------------------------------
    def send_weights(self, shard: int, step: int) -> None:
        """The owner updated ``shard`` (step ``step``): its new ``w`` to every other node."""
        w = self.store.seg[shard]["w"]
        ref = _put(w)
        for node, peer in enumerate(self.peers):
            if node != self.node:
                self._count_sent(step, w.numel() * w.element_size())
                self._call(peer.receive_weights.remote(shard, step, ref))

    def receive_weights(self, shard: int, step: int, data) -> None:
        """The owner's ``w`` of ``shard`` after step ``step``'s update: into this node's ``w``."""
        store = self.store
        with store._lock:
            if int(store.versions[shard]) == step + 1 and store._awaiting_recovery:
                return  # a restarted store: the recovery sends every shard again
            if int(store.versions[shard]) != step:
                raise RuntimeError(f"weights of shard {shard} after step {step} arrived but node {self.node}'s copy "
                                   f"is at version {int(store.versions[shard])}")
        self.install_weights(shard, step + 1, data)

    def install_weights(self, shard: int, version: int, data) -> None:
        """``data`` (the owner's ``w`` of ``shard`` at ``version``) into this node's copy."""
        store = self.store
        store.seg[shard]["w"].view(torch.uint8).copy_(_read_only(data).view(torch.uint8))
        with store._lock:
            store.versions[shard] = version
            store._lock.notify_all()

    def share(self, version: int) -> int:
        """Recovery: the ``w`` of every owned shard (all at ``version``) to every other node; the bytes sent."""
        import ray  # lazy: as _put

        calls, sent = [], 0
        for i in self.store.owned:
            if int(self.store.versions[i]) != version:
                raise RuntimeError(f"node {self.node} was to send shard {i} at version {version}, but holds version "
                                   f"{int(self.store.versions[i])}")
            w = self.store.seg[i]["w"]
            ref = _put(w)
            for node, peer in enumerate(self.peers):
                if node != self.node:
                    calls.append(peer.install_weights.remote(i, version, ref))
                    sent += w.numel() * w.element_size()
        ray.get(calls)
        return sent

    def reset(self, timeout: float) -> None:
        """Recovery: wait for the calls to other stores in flight (those to a dead store fail: their
        errors go), and forget the partial sums and norms of the abandoned step."""
        import ray  # lazy: as _put

        with self._lock:
            calls, self._calls = list(self._calls), []
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=timeout)
        with self._lock:
            self._parts.clear()
            self._owned_sq.clear()
            self._norm_parts.clear()
            self._sent.clear()
            self.error = None

    # -- bookkeeping ----------------------------------------------------------------------------
    def _count_sent(self, step: int, nbytes: int) -> None:
        with self._lock:
            self._sent[step] = self._sent.get(step, 0) + nbytes

    def pop_sent(self, step: int) -> int:
        with self._lock:
            return self._sent.pop(step, 0)

    def _call(self, ref) -> None:
        with self._lock:
            self._calls.append(ref)

    def raise_if_failed(self) -> None:
        """An error of a call to another node's store (it raised, or its node is gone) surfaces here."""
        with self._lock:
            calls = list(self._calls)
        if calls:
            import ray  # lazy: only a run on several nodes (through Ray) has calls; the GPU check has no Ray

            ready, waiting = ray.wait(calls, num_returns=len(calls), timeout=0)
            with self._lock:  # (calls are only appended meanwhile)
                self._calls = waiting + self._calls[len(calls):]
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as e:  # noqa: BLE001 - kept and raised to every waiter
                    self.error = e
        if self.error is not None:
            raise RuntimeError(f"node {self.node}'s parameter store lost a call to another node's store: "
                               f"{self.error!r}") from self.error


class NodeSyncMethods:
    """The ``ParameterStore`` methods of a run on several nodes: what the other nodes' stores call
    (through Ray), and the update's queueing once the global norm is known."""

    def _queue_update(self, step: int, total_sq: float) -> None:
        """Several nodes: the global squared norm of ``step``'s gradients is known; update."""
        with self._lock:
            self._totals[step] = total_sq
            self._queue.append(step)
            self._inflight.add(step)
            self._lock.notify_all()

    def connect(self, peers: list) -> None:
        """The M stores of the run, by node index (this one's own entry included)."""
        self.sync.connect(peers)

    def add_node_grad(self, shard: int, step: int, node: int, data, sqnorm: float, generation: int) -> None:
        self.sync.add_node_grad(shard, step, node, data, sqnorm, generation)

    def add_norm_part(self, step: int, node: int, partial: float, generation: int) -> None:
        self.sync.add_norm_part(step, node, partial, generation)

    def receive_weights(self, shard: int, step: int, data) -> None:
        self.sync.receive_weights(shard, step, data)

    def install_weights(self, shard: int, version: int, data) -> None:
        self.sync.install_weights(shard, version, data)

    # -- recovery (module docstring) -------------------------------------------------------------
    def sync_pause(self, generation: int, timeout: float = 600.0) -> dict:
        """Recovery, phase 1: only ``generation``'s reports and messages count from now on; the step
        in flight's partial sums go; a queued update (its global norm known) finishes. Returns this
        store's ``versions``, ``records`` (step -> global norm of the updates it recorded) and ``cut``
        (owned shards cut inside their update)."""
        deadline = time.monotonic() + timeout
        if self.reducer is not None:
            self.reducer.reset(generation)
        with self._lock:
            self._generation = generation
            self._generation_seg[0] = generation
            self._awaiting_recovery = False
            self._pending.clear()
            self._reduce_seconds.clear()
        with self.sync._sum_lock:  # a sum of the old generation that began first ends first
            pass
        self.sync.reset(timeout)
        with self._lock:
            while self._queue or self._applying:
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"updates of steps {self._queue} not finished after {timeout:.0f} s")
                self._lock.wait(1.0)
            self._inflight.clear()
            for i in self.owned:  # a cut after the version bump left a complete shard
                if int(self.updating[i]) >= 0 and int(self.versions[i]) == int(self.updating[i]) + 1:
                    self.updating[i] = -1
            cut = [i for i in self.owned if int(self.updating[i]) >= 0]
            records = {int(r[0]): float(r[1]) for r in self.records.tolist() if r[0] >= 0}
            return {"versions": self.versions.tolist(), "records": records, "cut": cut}

    def sync_finish(self, step: int, total: float) -> list[int]:
        """Recovery, phase 2 when step ``step``'s global norm ``total`` is known somewhere: apply the
        update to the owned shards still at ``step`` (their ``w`` holds the global gradient), then
        ``w = master`` on every owned shard (a compute actor of the next step may have written a
        gradient into one). Returns the shards updated here."""
        coef, lr, finite = self._step_constants(step, total)
        if self._record(step) is None:
            self._write_record(step, total, coef, lr, skipped=not finite, seconds=0.0)
        todo = [i for i in self.owned if int(self.versions[i]) == step]
        for i in todo:
            self._update_shard(i, step, coef, lr, skip=not finite)
        self._restore_w()
        return todo

    def sync_restore(self) -> None:
        """Recovery, phase 2 when no shard was updated: ``w = master`` on every owned shard."""
        self._restore_w()

    def sync_share(self, version: int) -> int:
        """Recovery, phase 3: every owned shard's ``w`` (at ``version``) to every other node."""
        return self.sync.share(version)

    def shard_state(self, shard: int, step: int) -> dict:
        """An owned shard's ``master``, ``m``, ``v`` at step ``step`` (for the checkpoint node 0 writes)."""
        self.wait_version(shard, step)
        if not self.owns(shard) or int(self.versions[shard]) != step:
            raise RuntimeError(f"node {self.node} asked for shard {shard} at step {step}: it owns it "
                               f"{self.owns(shard)}, at version {int(self.versions[shard])}")
        return {kind: t.numpy() for kind, t in self.seg[shard].items() if kind in CHECKPOINT_KINDS + OPTIONAL_KINDS}

    def checkpoint_state(self, shard: int, step: int) -> dict:
        """``master``, ``m``, ``v`` of ``shard`` at ``step``, for the checkpoint this store writes: its
        own, or (several nodes) its owner's, fetched through Ray."""
        if self.owns(shard):
            return {kind: t for kind, t in self.seg[shard].items() if kind in CHECKPOINT_KINDS + OPTIONAL_KINDS}
        import ray  # lazy: another node's shard, so a run through Ray; the GPU check has no Ray

        got = ray.get(self.sync.peers[owner_of(shard, self.nodes)].shard_state.remote(shard, step))
        return {kind: torch.from_numpy(np.asarray(a)) for kind, a in got.items()}


def _read_only(data) -> torch.Tensor:
    """A tensor over the bytes of a Ray object (read-only memory: only ever read here)."""
    with warnings.catch_warnings():  # torch warns that it cannot mark the tensor read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(data))


def _put(w: torch.Tensor):
    """The bytes of ``w`` as a Ray object (copied now)."""
    import ray  # lazy: several nodes run through Ray; the GPU check runs the store without it

    return ray.put(w.view(torch.uint8).numpy())
