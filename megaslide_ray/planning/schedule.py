"""The training step's schedule, position by position: what the planner predicts a step takes.

The compute actor takes a step's shards in order: the forward 0..L+1 (the head computes its
forward and backward at once), then the backward L..0; the turn's block L and the resident
shards (``runtime.resident_gb``) are kept from their forward fetch for their backward, every other
position fetches its shard (``actors/compute.py``, ``step_order``). ``schedule_seconds`` replays
that on an ideal machine: one compute thread, one link towards the compute that keeps
``prefetch_depth`` fetches ahead of the position computing, one link back that returns each
gradient as it appears (the head's after its position, each backward position's after its own),
no contention between them. Without overlap, fetch, compute and return run in sequence.

``predict_step`` prices it for a config: each position's compute from its FLOPs at
``device_tflops`` (a block's forward: 2 x its per-token parameters x tokens, plus its attention;
recompute + backward: 3x that; shard 0 and the head run forward and backward together: 3x), each
fetch and gradient at ``link_gbps``. With distillation (``training.distill_weight``) the step
starts with the dense teacher's forward, 0..L+1, each position fetching a teacher shard and
computing its forward (dense attention), returning nothing. ``benchmarks/overlap.py`` replays the same schedule with the
compute times it measured and holds both against the measured step.

The step boundary is in the replay: a step's first fetches start when it starts (the weights
are the previous step's update, which waits for every gradient: exact global-norm clipping), and
it ends when its last gradient is back. ``schedule_waits`` splits the time the compute waits
into that boundary's two halves, ``fill`` (the first positions' fetches, before the first block
computes) and ``drain`` (the gradients still on the link after the last compute), and the
``stalls`` between. What it leaves out: the AdamW time between one step's last gradient and the
next step's first fetch, AdamW competing with the compute for a CPU's cores, and the first
position's input preparation.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from megaslide_ray.config import Config
from megaslide_ray.models.registry import distills, teacher_config
from megaslide_ray.models.shards import prefetch_window, resident_shards
from megaslide_ray.planning.terms import _attention_flops_fwd, _shard_counts, shard_roles, text_tokens


@dataclass(frozen=True)
class StepPositions:
    """One step's positions (``order``: the shard each takes), the bytes each fetches (0: kept
    from an earlier position), the gradient bytes returned after a position, and the FLOPs each
    computes; ``device``: the positions of device shards (``runtime.device_shards``: nothing
    fetched, returned, nor counted in the prefetch window), whose update after the backward moves
    ``device_update_bytes``."""
    order: list[int]
    fetch_bytes: list[int]
    grad_bytes: dict[int, int]
    flops: list[float]
    device: frozenset = field(default_factory=frozenset)
    device_update_bytes: int = 0


@dataclass(frozen=True)
class StepPrediction:
    seconds: float            # the schedule with overlap (``runtime.overlap``)
    off_seconds: float        # fetch, compute, return in sequence
    compute_s: float          # the positions' compute, summed
    transfer_s: float         # the fetches at the link speed, summed
    return_s: float           # the gradients at the link speed, summed
    adamw_s: float            # the update's DRAM traffic (it overlaps the next forward)
    binding: str              # "link", "compute" or "host DRAM": the largest of the three
    boundary_s: float = 0.0   # the compute's waits at the step boundary (``schedule_waits``: fill + drain)
    stalls_s: float = 0.0     # its waits between (a link slower than the compute at those positions)

    @property
    def terms(self) -> dict[str, float]:
        return {"link": max(self.transfer_s, self.return_s), "compute": self.compute_s, "host DRAM": self.adamw_s}


def step_order(depth: int, counts: list[int], wbytes: int, resident_gb: float) -> tuple[list[int], dict[int, int]]:
    """The positions' shards (forward 0..L+1, backward L..0) and which positions reuse an earlier
    one's weights: the turn's block L and the resident shards (``ComputeActor.step_order``)."""
    n = depth + 2
    reuse = {n: depth}
    for shard in resident_shards(depth, counts, wbytes, resident_gb * 1e9):
        reuse[n + depth - shard] = shard
    return list(range(n)) + list(range(depth, -1, -1)), reuse


def step_positions(cfg: Config, wbytes: int) -> StepPositions:
    """``cfg``'s step, position by position (module docstring), for one compute actor with
    ``training.micro_batches`` micro-batches of ``data.batch_size`` clips."""
    counts = _shard_counts(cfg)[0]
    L, n = cfg.model.depth, cfg.model.depth + 2
    order, reuse = step_order(L, counts, wbytes, cfg.runtime.resident_gb)
    k, B = cfg.training.micro_batches, cfg.data.batch_size
    tokens, texts = k * B * cfg.tokens_per_sample, k * B * text_tokens(cfg)
    roles = shard_roles(cfg)
    attention = k * _attention_flops_fwd(cfg) / L

    def forward(shard: int) -> float:
        tok, sample, text, _ = roles[min(shard, 1) if shard <= L else L + 1]
        return 2.0 * (tok * tokens + sample * k * B + text * texts) + (attention if 1 <= shard <= L else 0.0)

    backward = 4.0 if cfg.runtime.token_chunk else 3.0  # recompute (+ the chunk's) + 2x the forward
    flops = [forward(s) for s in range(L + 1)] + [3.0 * forward(L + 1)]
    flops += [(backward if s else 3.0) * forward(s) for s in order[n:]]
    on_device = cfg.runtime.device_shards  # shards 0..N-1: neither fetched nor returned
    fetch = [0 if p in reuse or s < on_device else counts[s] * wbytes for p, s in enumerate(order)]
    grads = {n - 1: counts[n - 1] * wbytes,
             **{p: counts[order[p]] * wbytes for p in range(n, len(order)) if order[p] >= on_device}}
    device = {p for p, s in enumerate(order) if s < on_device}
    if distills(cfg):  # the teacher's forward first: n more positions, nothing returned
        t_fetch, t_flops = teacher_positions(cfg, wbytes)
        order, fetch, flops = list(range(n)) + order, t_fetch + fetch, t_flops + flops
        grads = {p + n: b for p, b in grads.items()}
        device = {p + n for p in device}
    update = sum(counts[:on_device]) * adamw_pass_bytes(wbytes)  # the device update's pass
    return StepPositions(order, fetch, grads, flops, frozenset(device), update)


def adamw_pass_bytes(wbytes: int) -> int:
    """Bytes per parameter of one ideal AdamW pass: the gradient, master, m and v read, master, m, v
    and the compute copy written (the store's update and the device shards' alike)."""
    return 2 * wbytes + 24


def teacher_positions(cfg: Config, wbytes: int) -> tuple[list[int], list[float]]:
    """The dense teacher's forward (distillation), shards 0..L+1: each one's fetch bytes and FLOPs."""
    tcfg = teacher_config(cfg)
    counts, roles, L = _shard_counts(tcfg)[0], shard_roles(tcfg), cfg.model.depth
    k, B = cfg.training.micro_batches, cfg.data.batch_size
    tokens, texts = k * B * cfg.tokens_per_sample, k * B * text_tokens(cfg)
    attention = k * _attention_flops_fwd(tcfg) / L

    def forward(shard: int) -> float:
        tok, sample, text, _ = roles[min(shard, 1) if shard <= L else L + 1]
        return 2.0 * (tok * tokens + sample * k * B + text * texts) + (attention if 1 <= shard <= L else 0.0)

    return [c * wbytes for c in counts], [forward(s) for s in range(L + 2)]


def schedule_seconds(pre: float, fetch_s: list[float], comp_s: list[float], grad_s: dict[int, float],
                     depth: int, overlap: bool = True, device: Collection[int] = ()) -> float:
    """The step time of the schedule on an ideal machine (module docstring): ``pre`` before the
    first position, each position's fetch (0: kept, it neither waits for nor uses the link) and
    compute, the gradients returned after the positions of ``grad_s``; ``device``: the device
    shards' positions (``prefetch_window``)."""
    if not overlap:
        return pre + sum(fetch_s) + sum(comp_s) + sum(grad_s.values())
    return _replay(pre, fetch_s, comp_s, grad_s, depth, device)[0]


def schedule_waits(fetch_s: list[float], comp_s: list[float], grad_s: dict[int, float],
                   depth: int, device: Collection[int] = ()) -> dict[str, float]:
    """Where the overlapped schedule's step exceeds its compute (seconds): ``fill``, the compute's
    waits for the fetches of positions 0 and 1 (shard 0 and the first block, or the distillation
    teacher's: the step boundary's first half); ``stalls``, its waits at every later position; ``drain``, the
    gradients still on the link after the last position computed (the boundary's second half).
    ``step - sum(comp_s) == fill + stalls + drain``."""
    step, c_start, c_end = _replay(0.0, fetch_s, comp_s, grad_s, depth, device)
    waits = [c_start[p] - (c_end[p - 1] if p else 0.0) for p in range(len(comp_s))]
    return {"fill": sum(waits[:2]), "stalls": sum(waits[2:]),
            "drain": step - c_end[-1]}


def _replay(pre: float, fetch_s: list[float], comp_s: list[float], grad_s: dict[int, float],
            depth: int, device: Collection[int] = ()) -> tuple[float, list[float], list[float]]:
    """The overlapped schedule (``schedule_seconds``): the step time, and each position's compute
    start and end. A fetch is submitted when the first position whose prefetch window holds it
    starts (the step's start for the first position's window), else when its own position is taken."""
    P = len(comp_s)
    flags = [p in device for p in range(P)]
    submitter: dict[int, int] = {}
    for p in range(P):
        for q in prefetch_window(flags, p, depth):
            submitter.setdefault(q, p)
    link = pre
    f_end, c_start, c_end = [0.0] * P, [0.0] * P, [0.0] * P
    ret = 0.0
    for p in range(P):
        sp = submitter.get(p, p)
        submit = pre if sp == 0 else c_start[sp] if sp < p else c_end[p - 1]  # (sp == p: when it is taken)
        if fetch_s[p]:
            f_end[p] = max(link, submit) + fetch_s[p]
            link = f_end[p]
        c_start[p] = max(c_end[p - 1] if p else pre, f_end[p])
        c_end[p] = c_start[p] + comp_s[p]
        if p in grad_s:
            ret = max(ret, c_end[p]) + grad_s[p]
    return max(c_end[-1], ret), c_start, c_end


def predict_step(cfg: Config, wbytes: int, link_gbps: float, device_tflops: float, dram_gbps: float,
                 node_terms: dict[str, float] | None = None) -> StepPrediction:
    """One compute actor's training step of ``cfg``: compute at ``device_tflops``, its link at
    ``link_gbps`` each way, the update's DRAM bytes (the ideal single pass, 2 x w bytes + 24
    B/param) at ``dram_gbps``. The update overlaps the next step's forward, so the step is at least
    as long as it; ``node_terms``: more seconds per step that overlap the whole step (several GPUs:
    ``host DRAM`` of the node, which then replaces the update's, and ``network``)."""
    pos = step_positions(cfg, wbytes)
    link, rate = link_gbps * 1e9, device_tflops * 1e12
    fetch = [b / link for b in pos.fetch_bytes]
    comp = [f / rate for f in pos.flops]
    # the device shards' AdamW ends the step (priced at the host's DRAM rate: an upper bound on a GPU)
    comp[-1] += pos.device_update_bytes / (dram_gbps * 1e9)
    grads = {p: b / link for p, b in pos.grad_bytes.items()}
    depth = cfg.runtime.prefetch_depth if cfg.runtime.overlap else 0
    counts = _shard_counts(cfg)[0]
    adamw = sum(counts[cfg.runtime.device_shards:]) * adamw_pass_bytes(wbytes) / (dram_gbps * 1e9)  # the store's
    terms = {"link": max(sum(fetch), sum(grads.values())), "compute": sum(comp), "host DRAM": adamw,
             **(node_terms or {})}
    floor = max(terms.values())  # what overlaps the whole step
    sched = schedule_seconds(0.0, fetch, comp, grads, depth, cfg.runtime.overlap, pos.device)
    on, off = max(floor, sched), max(floor, schedule_seconds(0.0, fetch, comp, grads, depth, overlap=False))
    # the waits are part of the step only where the schedule, not a whole-step floor, sets it
    waits = schedule_waits(fetch, comp, grads, depth, pos.device) if cfg.runtime.overlap and sched >= floor else {}
    return StepPrediction(on, off, sum(comp), sum(fetch), sum(grads.values()), terms["host DRAM"],
                          max(terms, key=terms.__getitem__), waits.get("fill", 0.0) + waits.get("drain", 0.0),
                          waits.get("stalls", 0.0))
