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

A store of such a run does not re-attach after a crash: a lost node stops the run
(``pipelines/multinode.py``)."""

from __future__ import annotations

import logging
import math
import threading
import warnings

import numpy as np
import torch

from megaslide_ray.state.checkpoint import CHECKPOINT_KINDS
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

    # -- gradients ------------------------------------------------------------------------------
    def node_grad_ready(self, shard: int, step: int, sqnorm: float) -> None:
        """This node's sum of its compute actors' gradients of ``shard`` is in the shard's ``w``."""
        owner = owner_of(shard, self.nodes)
        if owner == self.node:
            self.add_node_grad(shard, step, self.node, None, sqnorm)
            return
        w = self.store.seg[shard]["w"]
        ref = _put(w)  # copied now: w_shard may receive the new weights from here on
        self._count_sent(step, w.numel() * w.element_size())
        self._call(self.peers[owner].add_node_grad.remote(shard, step, self.node, ref, float(sqnorm)))

    def add_node_grad(self, shard: int, step: int, node: int, data, sqnorm: float) -> None:
        """Node ``node``'s sum of ``shard``'s gradients of ``step`` (``data`` its raw bytes; None:
        this node's, in ``w``). The last of the M sums them into ``w`` and counts the shard."""
        if owner_of(shard, self.nodes) != self.node:
            raise RuntimeError(f"node {node} sent its gradient of shard {shard} to node {self.node}, which does not "
                               f"own it (node {owner_of(shard, self.nodes)} does)")
        with self._lock:
            parts = self._parts.setdefault((step, shard), {})
            if node in parts:
                raise RuntimeError(f"node {node} sent its gradient of shard {shard} for step {step} twice")
            parts[node] = (data, float(sqnorm))
            if len(parts) < self.nodes:
                return
            del self._parts[(step, shard)]
        with self._sum_lock:
            sq = self._sum(shard, parts)
        self._owned_reported(shard, step, sq)

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

    def _owned_reported(self, shard: int, step: int, sq: float) -> None:
        with self._lock:
            got = self._owned_sq.setdefault(step, {})
            got[shard] = sq
            if len(got) < len(self.store.owned):
                return
            del self._owned_sq[step]
        partial = sum(got[i] for i in sorted(got))
        for node, peer in enumerate(self.peers):
            if node == self.node:
                self.add_norm_part(step, node, partial)
            else:
                self._call(peer.add_norm_part.remote(step, self.node, partial))

    def add_norm_part(self, step: int, node: int, partial: float) -> None:
        """Node ``node``'s sum of the squared norms of its shards' gradients of ``step``; with all M
        of them, the store queues its update with the global squared norm."""
        with self._lock:
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
            if int(store.versions[shard]) != step:
                raise RuntimeError(f"weights of shard {shard} after step {step} arrived but node {self.node}'s copy "
                                   f"is at version {int(store.versions[shard])}")
        w = store.seg[shard]["w"]
        w.view(torch.uint8).copy_(_read_only(data).view(torch.uint8))
        with store._lock:
            store.versions[shard] = step + 1
            store._lock.notify_all()

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

    def add_node_grad(self, shard: int, step: int, node: int, data, sqnorm: float) -> None:
        self.sync.add_node_grad(shard, step, node, data, sqnorm)

    def add_norm_part(self, step: int, node: int, partial: float) -> None:
        self.sync.add_norm_part(step, node, partial)

    def receive_weights(self, shard: int, step: int, data) -> None:
        self.sync.receive_weights(shard, step, data)

    def shard_state(self, shard: int, step: int) -> dict:
        """An owned shard's ``master``, ``m``, ``v`` at step ``step`` (for the checkpoint node 0 writes)."""
        self.wait_version(shard, step)
        if not self.owns(shard) or int(self.versions[shard]) != step:
            raise RuntimeError(f"node {self.node} asked for shard {shard} at step {step}: it owns it "
                               f"{self.owns(shard)}, at version {int(self.versions[shard])}")
        return {kind: self.seg[shard][kind].numpy() for kind in CHECKPOINT_KINDS}

    def checkpoint_state(self, shard: int, step: int) -> dict:
        """``master``, ``m``, ``v`` of ``shard`` at ``step``, for the checkpoint this store writes: its
        own, or (several nodes) its owner's, fetched through Ray."""
        if self.owns(shard):
            return {kind: self.seg[shard][kind] for kind in CHECKPOINT_KINDS}
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
