"""The planner's terms for several GPUs per node and several nodes: host bytes per node, the host
DRAM traffic all GPUs of a node draw together, and the network bytes per node per step.

G GPUs of a node (``--gpus-per-node``, ``runtime.compute_actors``) share the node's one store:
each reads every shard's weights twice per step over its own PCIe link, but all of them read the
same DRAM, so the node's DRAM carries G x (h2d + d2h) plus the store's sum of their gradients
((G + 2) x P x w bytes: G slots read, the sum written into ``w``, its norm read) plus AdamW. On
many servers 8 x 55 GB/s of pinned reads already exceed what DRAM delivers: the ``host_dram``
term of the step-time floor (with one GPU per node the ``adamw`` term stands for the DRAM, as
before: the PCIe reads are small next to AdamW's).

Host per node, G GPUs: the 14 B/param state, the fp32 update scratch, the gradient slots (G x
``runtime.grad_slots`` x one slot, ``runtime.grad_slot_mb`` or the largest shard if smaller, x w
bytes: a larger shard's gradient goes through the slots in pieces, ``actors/grad_reduce.py``)
and, on a bf16 run, the fp32 accumulator of the sum (4 B x one slot); every GPU's offloaded block
inputs.

M nodes (``--nodes``, ``runtime.nodes``; ``actors/node_sync.py``, ``pipelines/multinode.py``): every node keeps the compute copy ``w`` of every shard (w bytes x P)
and the optimizer state (master, m, v: 12 B/param) of the shards it owns (shard l owned by node
l % M), so about ``w + 12 / M`` B/param per node. A shard's gradient, summed over the node's GPUs,
goes to its owner, which sums the M of them, updates, and sends the new ``w`` back: each node sends
and receives ``w bytes x ((P - own) + own x (M - 1))`` per step, about ``2 x w bytes x P x (M - 1) /
M`` each way, held against ``--network-gbps`` (the ``network`` term). The received gradients wait in Ray's object store until
the owner sums them; the planner counts ``(M - 1) x grad_slots`` shards of them (the runtime does
not bound them by slots: as the nodes run the backward in step, a few shards are in flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megaslide_ray.models.shards import grad_slot_numel


@dataclass(frozen=True)
class ScaleOut:
    gpus_per_node: int
    nodes: int
    micro_batches: int
    grad_slots: int
    network_gbps: float            # GB/s each way per node (1e9 B/s)
    owner_params: int              # optimizer-state parameters of the busiest node (all with one node)
    host_terms: dict[str, int] = field(default_factory=dict)   # the store's terms per node
    network_bytes: int = 0         # per node per step, each direction
    host_dram_bytes: int = 0       # per node per step: all GPUs' PCIe traffic, the gradient sum, AdamW, network


def owner_params(counts: list[int], nodes: int) -> int:
    """Parameters whose optimizer state the busiest node owns (shard l on node l % nodes)."""
    return max(sum(c for i, c in enumerate(counts) if i % nodes == n) for n in range(nodes))


def network_bytes(params: int, own: int, wb: int, nodes: int) -> int:
    """Bytes a node owning ``own`` of the ``params`` parameters sends (and receives) per step:
    its gradients of the shards it does not own out, the new weights of its own to every other node."""
    return wb * ((params - own) + own * (nodes - 1)) if nodes > 1 else 0


def scale_out(counts: list[int], wb: int, gpus: int, nodes: int, grad_slots: int, micro_batches: int,
              network_gbps: float, adamw_pp: int, h2d_gpu: int, d2h_gpu: int, offloaded_gpu: int,
              offload_label: str, slot_mb: float = 0.0, experts: int = 1, ema: bool = False) -> ScaleOut:
    """The per-node terms (module docstring) for ``gpus`` GPUs on each of ``nodes`` nodes;
    ``h2d_gpu``, ``d2h_gpu``: one GPU's PCIe bytes per step, ``offloaded_gpu`` its offloaded block
    inputs (host bytes), ``adamw_pp`` AdamW's DRAM bytes per parameter; ``slot_mb``:
    ``runtime.grad_slot_mb`` (a gradient slot and the fp32 sum hold that much of a shard at a time;
    0: the largest shard); ``experts``: transformers the store holds (``counts`` is one's; a step
    streams and updates one); ``ema``: the store keeps the moving average of the weights
    (``training.ema_decay``), 4 B/param more (one node only)."""
    P, Smax = sum(counts), max(counts)
    slot = grad_slot_numel(Smax, slot_mb, wb)
    own = owner_params(counts, nodes)
    terms: dict[str, int] = {}
    if nodes == 1:
        terms["store state (w + master + m + v)" + (f", {experts} experts" if experts > 1 else "")] = \
            (wb + 12) * P * experts
    else:
        terms["weights w (every node)"] = wb * P
        terms[f"optimizer state master + m + v (this node's shards, about 1/{nodes})"] = 12 * own
    if ema:
        terms["weight average ema (fp32, training.ema_decay)"] = 4 * P * experts
    if wb == 2:
        terms["fp32 update scratch (largest shard)"] = 4 * Smax
    if gpus > 1:
        what = "largest shard" if slot == Smax else f"{slot_mb:g} MB"
        terms[f"gradient slots ({gpus} GPUs x {grad_slots} x {what})"] = gpus * grad_slots * slot * wb
        if wb == 2:
            terms[f"fp32 sum of the GPUs' gradients ({'largest shard' if slot == Smax else 'one slot'})"] = 4 * slot
    if nodes > 1:
        terms[f"network receive slots ({nodes - 1} nodes x {grad_slots} x largest shard)"] = \
            (nodes - 1) * grad_slots * Smax * wb
    if offloaded_gpu:
        terms[offload_label if gpus == 1 else f"{offload_label}, x {gpus} GPUs"] = gpus * offloaded_gpu
    network = network_bytes(P, own, wb, nodes)
    dram = gpus * (h2d_gpu + d2h_gpu) + adamw_pp * own
    if gpus > 1:
        dram += (gpus + 2) * P * wb  # the store reads G slots, writes the sum into w, reads it for the norm
    if nodes > 1:
        dram += 2 * network + (nodes - 1) * own * wb  # sent and received bytes, and the owner's sum of them
    return ScaleOut(gpus, nodes, micro_batches, grad_slots, network_gbps, own, terms, network, dram)
