"""ComputeActor: runs the model block by block with weights it does not own.

One training step, in the order ``train_step`` reads:

1. ``_forward``: shards 0..L, each fetched when the store says it is valid for this step
   (the next ``prefetch_depth`` shards are staged while the current one computes); only the
   block inputs are kept (activation checkpointing at block boundaries).
2. ``_loss``: the head (shard L+1) with gradients on, the flow-matching loss, its backward.
3. ``_backward``: blocks L..1 recomputed from their saved inputs, newest first, then shard 0;
   each shard's gradient goes to the store as soon as it exists.

Distillation (``training.distill_weight``): before step 1 the frozen dense teacher streams for a
forward without gradients (``actors/teacher.py``); ``_loss`` adds its term. The curriculum
(``attention.dense_warmup_steps``) hands shard 0 the step's dense weights (``FlowInputs.dense_mix``); with
it or ``attention.dense_above_t`` the blocks choose their kinds by the host's (``FlowInputs.host_mix``).

With ``runtime.recompute_blocks=false`` (CPU, weights read in place) step 1 keeps every shard's
graph and step 3 walks them (``_forward_keeping_graphs``, ``_backward_graphs``).

Layer-major micro-batches (``training.micro_batches`` k): the batch is cut into k micro-batches
and every shard runs all k while its weights are on the device (k block inputs kept per block);
its gradient accumulates over the k backwards in one device buffer and goes to the store once,
so the weights still cross the link twice per step whatever k. Each micro-batch's loss is scaled
by 1/k, and by 1/N with N data-parallel compute actors (``runtime.compute_actors``; the store
sums their gradients), so the step's gradient is that of the mean loss over the global batch.

Device shards (``runtime.device_shards`` N): shards 0..N-1 stay on the device across steps with
their optimizer state and are updated here after the backward (``actors/device_shards.py``); the
store gets their norms only.

Between steps the actor holds no other weights. The model is built on ``meta`` and called with
``functional_call`` on views into the fetched flat buffer; moving the bytes is
``actors/transfer.py``'s job (schedule: docs/architecture.md, "One training step").
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch.func import functional_call

from actors.activations import ActivationStash
from actors.device_shards import DeviceShards
from actors.grad_reduce import GradSlots
from actors.param_store import ShardInfo
from actors.step_inputs import FlowInputs, step_inputs
from actors.teacher import DenseTeacher
from actors.transfer import ShardFeed, StagingPool, Transfers
from megaslide_ray.config import Config
from megaslide_ray.models.attention_levers import host_weights, weights_on_host
from megaslide_ray.models.chunking import FP32_GRAD, fp32_grad_params
from megaslide_ray.models.prediction import as_velocity
from megaslide_ray.models.registry import build_shard, distills, expert_shards, num_experts, num_shards
from megaslide_ray.models.shards import resident_shards
from megaslide_ray.runtime.faults import fault_point
from megaslide_ray.runtime.faults import set_node as set_fault_node
from megaslide_ray.state.segments import DTYPES
from megaslide_ray.training.flow import caption_dropout, distill_loss, model_loss, route_expert, step_expert

log = logging.getLogger(__name__)


class StoreClient(Protocol):
    """How the compute actor talks to the store: in-process (tests) or through Ray."""

    def wait_version(self, shard: int, step: int) -> int: ...
    def get_weights(self, shard: int, step: int) -> np.ndarray: ...
    def report_grad(self, shard: int, step: int, sqnorm: float, grad: np.ndarray | None) -> None: ...
    def flush(self) -> int: ...
    # several compute actors only: ``report_grad`` then also takes ``slot=`` and ``piece=``, and
    # def wait_grad_slot(self, slot: int) -> None: ...
    # generation: int (a property: the compute actors' generation, written into a filled slot)


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    tokens: int
    seconds: float               # forward + backward: from the batch's arrival to the last gradient sent
    forward_seconds: float
    backward_seconds: float
    weight_wait_seconds: float   # time blocked on a shard version or a weight transfer
    data_position: int
    device: str
    data_wait_seconds: float = 0.0  # time blocked waiting for the decoded batch
    h2d_bytes: int = 0              # bytes copied towards the compute (weights, offloaded inputs; 0 when read in place)
    h2d_seconds: float = 0.0        # time those copies took (on the staging thread / H2D stream)
    d2h_bytes: int = 0              # bytes returned to the host (gradients, offloaded inputs)
    d2h_seconds: float = 0.0
    device_memory_peak_bytes: int = 0  # CUDA: max_memory_allocated of this step; CPU: the process's peak RSS
    store_unanswered: int = 0       # gradient reports the store did not answer within runtime.store_timeout_s
    rank: int = 0                   # which compute actor (several: runtime.compute_actors)
    grad_slot_wait_seconds: float = 0.0  # several compute actors: time blocked on a full gradient slot
    t: tuple = ()                   # the flow time of each of its clips
    expert: int = -1                # two-expert model: the expert it trained (0 high noise, 1 low); -1: none
    distill_loss: float = 0.0       # training.distill_weight > 0: the distillation term (before its weight)
    teacher_seconds: float = 0.0    # the dense teacher's forward (its weight waits included)


class BlockGraph(NamedTuple):
    """One shard's forward kept for its backward (``runtime.recompute_blocks=false``), per micro-batch."""
    x_in: list                  # per micro-batch: the block's input leaf (None: shard 0)
    c_in: list                  # per micro-batch: its conditioning leaf
    out: list                   # per micro-batch: (output, conditioning): shard 0's (x, c); a block's (y, c)
    grad: torch.Tensor          # the flat buffer its backwards accumulate the gradient into


def select_device(cfg: Config) -> str:
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("runtime.device='cuda' but this process sees no CUDA device; use 'auto' or 'cpu'")
    if cfg.runtime.device in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


class ComputeActor:
    def __init__(self, cfg: Config, shards: list[ShardInfo], store: StoreClient, transport: str = "shm",
                 store_node: str | None = None, rank: int = 0, grad_slots: GradSlots | None = None,
                 node: int = 0, nodes: int = 1):
        """``rank``, ``grad_slots``: with several compute actors, which one this is and the store's
        gradient slots (``ParameterStore.grad_slots``; None with one compute actor). ``node``,
        ``nodes``: on several nodes (``runtime.nodes``), this actor's node and how many there are:
        its batch is slot ``node x N + rank`` of the step's global batch (N actors per node)."""
        set_fault_node(node)  # a fault spec with /NODE fires in the actors of that node only
        if transport == "auto":
            transport = "shm" if store_node in (None, self.node_id()) else "object_ref"
        if transport not in ("shm", "object_ref"):
            raise ValueError(f"transport={transport!r}: use 'auto', 'shm' or 'object_ref'")
        self.cfg = cfg
        self._caption_dropout = caption_dropout(cfg)
        self.device = torch.device(select_device(cfg))
        if self.device.type == "cuda":  # with its index, as tensors report it (staging pool keys)
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.runtime.compute_threads or os.cpu_count() or 1)
        # Kept block graphs hold their block's weights: only a CPU compute reading them in place
        # (the config refuses a simulated link and offloaded inputs) can keep them. A GPU step
        # streams weights through reused device buffers, so there it recomputes (said once).
        self.keep_graphs = not cfg.runtime.recompute_blocks and self.device.type == "cpu"
        if not cfg.runtime.recompute_blocks and not self.keep_graphs:
            log.warning("runtime.recompute_blocks=false applies to a CPU compute only; this compute actor got %s "
                        "(runtime.device=%r), whose streamed weights pass through reused buffers, so its backward "
                        "recomputes each block as with runtime.recompute_blocks=true", self.device,
                        cfg.runtime.device)
        self.store = store
        self.transport = transport
        self.infos = shards
        self.n = num_shards(cfg)
        if len(shards) != self.n:
            raise ValueError(f"store has {len(shards)} shards, the model needs {self.n}")
        # One transformer's shards: with two experts both have these modules and layouts, and a
        # step streams one expert's (``_base``: the first shard of the step's expert in the store).
        self.per_expert = expert_shards(cfg)
        self.experts = num_experts(cfg)
        self._base = 0
        self.modules = [build_shard(cfg, i, "meta") for i in range(self.per_expert)]
        self.teacher = DenseTeacher(cfg, self.per_expert, [i.numel for i in shards]) if distills(cfg) else None
        rt = cfg.runtime
        self.rank = rank
        self.actors = grad_slots.actors if grad_slots is not None else 1
        self.global_rank = node * self.actors + rank  # which slot of the step's global batch it trains
        self.micro_batches = cfg.training.micro_batches
        # Each micro-batch's loss is scaled so that the gradients summed over the micro-batches, the
        # actors and the nodes are those of the mean loss over the global batch (1: no scaling at all).
        self.loss_scale = 1.0 / (nodes * self.actors * self.micro_batches)
        self.w_dtype = DTYPES[shards[0].w_dtype]  # the weights' dtype: gradients are sent in it
        # runtime.device_shards: shards 0..N-1 kept and updated on this device (actors/device_shards.py)
        self.dev = DeviceShards(cfg, self.device, self.w_dtype)
        self._dev_bufs: list[torch.Tensor] = []  # CPU: their pooled gradient buffers, released after the update
        self.link = Transfers(self.device, store, shards, transport, DTYPES[shards[0].w_dtype],
                              rt.overlap, rt.prefetch_depth, rt.link_gbps, grad_slots, rank,
                              self.teacher.store_numels(self.n) if self.teacher is not None else None)
        self.stash = ActivationStash(self.link, rt.offload_activations, rt.state_dir, rt.offload_keep)
        # CPU: the shards' fp32 gradient buffers are reused from step to step (``grad_views``); a
        # GPU's caching allocator already reuses device memory.
        self._grad_pool = StagingPool() if self.device.type == "cpu" else None
        self._returns: list[Future | None] = []  # this step's gradient reports in flight
        # The last step whose gradients this actor sent: they replaced that step's weights in
        # the store's w segments (a shard's gradient lands in its w), so predict cannot ask for
        # that version any more.
        self._grads_sent = -1
        # The last step's (start, ShardFeed.log, end) on the perf_counter clock (benchmarks).
        self.last_timeline: tuple[float, list[tuple[float, float]], float] = (0.0, [], 0.0)

    def _run(self, shard: int, flat: torch.Tensor, *args, mix: torch.Tensor | None = None, **kwargs):
        """Run shard ``shard`` on the weights ``flat``; ``mix``: the batch's dense weights on the
        host (``FlowInputs.host_mix``), which a block chooses its kinds by (``weights_on_host``)."""
        with weights_on_host(mix):
            return functional_call(self.modules[shard], self.infos[shard].layout.views(flat), args, kwargs)

    def _run_with_grad(self, shard: int, params: dict, *args, mix: torch.Tensor | None = None, **kwargs):
        """``_run`` on ``params`` from ``grad_views`` (their backward adds the gradient into that
        flat buffer; the micro-batches of a step add into the same one, in fp32 whatever the
        weights' dtype: each call is one use, ``fp32_grad_params``)."""
        with weights_on_host(mix):
            return functional_call(self.modules[shard], fp32_grad_params(params), args, kwargs)

    def _push_grad(self, shard: int, step: int, grad: torch.Tensor, poison: torch.Tensor | None = None) -> None:
        """Hand shard ``shard``'s flat gradient to the store with its squared norm, computed on
        the device without an fp32 copy of the gradient and read on the return thread (no host
        sync here). ``poison``: a 0-d bool tensor, True when the loss was not finite: the norm is
        then reported as NaN, so the store skips the step's update on every shard. ``grad`` is
        the fp32 sum (``grad_views``); weights of another dtype get it rounded once to theirs."""
        acc = grad
        if grad.dtype != self.w_dtype:
            grad = round_in_place(grad, self.w_dtype)
        sqnorm = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        if poison is not None:
            sqnorm = torch.where(poison, torch.full_like(sqnorm, float("nan")), sqnorm)
        if self.dev:
            self.dev.add_norm(sqnorm)
            if shard in self.dev:  # kept for the update on this device; the store gets its norm only
                self.dev.keep_grad(shard, grad)
                if self._grad_pool is not None:  # released once the device update has read it
                    self._dev_bufs.append(acc)
                self._returns.append(self.link.report_norm(shard, step, sqnorm))
                return
        sent = self.link.return_grad(self._base + shard, step, grad, sqnorm)
        self._returns.append(sent)
        if self._grad_pool is not None:  # the buffer is free once the gradient is sent
            if sent is None:
                self._grad_pool.release(acc)
            else:
                sent.add_done_callback(lambda _, pool=self._grad_pool, acc=acc: pool.release(acc))

    # -- one step -----------------------------------------------------------------------------
    def resident_shards(self) -> list[int]:
        """The shards kept on the device from their forward to their backward within
        ``runtime.resident_gb`` (``models.shards.resident_shards``: blocks L-1, L-2, ..., then
        shard 0, while they fit)."""
        return resident_shards(self.cfg.model.depth, [info.numel for info in self.infos],
                               DTYPES[self.infos[0].w_dtype].itemsize, self.cfg.runtime.resident_gb * 1e9)

    def step_order(self) -> tuple[list[int], dict[int, int]]:
        """The shards a training step takes, in order (forward 0..L+1, backward L..0), and which
        positions reuse an earlier one's weights instead of fetching them: the last block's,
        the forward's last fetch before the head, are kept for its backward (the turn costs
        one fetch less). They take the slot the head's prefetch would use, so the device never
        holds more than prefetch_depth + 1 shards. The resident shards (``runtime.resident_gb``)
        are kept from their forward fetch to their backward the same way: one fetch per step,
        and their weights on the device in between."""
        L, n = self.cfg.model.depth, self.per_expert
        if self.keep_graphs:  # the backward reads the graphs' weights
            return list(range(n)), {}
        reuse = {n: L}
        for shard in self.resident_shards():
            reuse[n + L - shard] = shard  # the backward's position of ``shard`` reuses its forward fetch
        return list(range(n)) + list(range(L, -1, -1)), reuse

    def _feed(self, order: list[int], step: int, reuse: dict[int, int] | None = None,
              fetch=None) -> "ShardFeed | ExpertFeed":
        """The step's ``ShardFeed`` over ``order`` (one transformer's shard indices), fetching the
        shards of the expert that starts at ``_base`` in the store (``fetch``: the teacher's)."""
        if self.experts == 1:  # (device shards: one expert only)
            device = self.dev.weights() if fetch is None else None
            return ShardFeed(self.link, order, step, reuse, fetch, device=device)
        return ExpertFeed(ShardFeed(self.link, [self._base + i for i in order], step, reuse, fetch), self._base)

    def _teacher_forward(self, micro: list[FlowInputs], step: int) -> tuple[list | None, float]:
        """The dense teacher's velocity per micro-batch (None without distillation), and its seconds."""
        if self.teacher is None:
            return None, 0.0
        t0, feed = time.perf_counter(), self._feed(list(range(self.per_expert)), step, fetch=self.link.fetch_teacher)
        return self.teacher.forward(feed, micro, self.link.staging), time.perf_counter() - t0

    def train_step(self, batch, step: int) -> StepResult:
        """One step. ``batch``: the decoder's dict, or ``[ObjectRef]`` of it (the pipeline wraps
        the ref in a list so Ray does not resolve it before the call: the wait is then measured)."""
        t_start = time.perf_counter()
        fault_point("compute.before_weights", step)
        if isinstance(batch, list):
            import ray

            batch = ray.get(batch[0])
        t_data = time.perf_counter()
        data_wait = t_data - t_start  # the rest of the step is compute: the report counts the wait apart
        if self.device.type == "cuda":  # the step's own peak (StepResult.device_memory_peak_bytes)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.link.begin_step()
        self._returns = []
        if self.dev:
            self.dev.begin_step()
            self.dev.load(self.store, step)
        expert = step_expert(self.cfg, step)
        self._base = expert * self.per_expert if self.experts > 1 else 0  # one expert alone: the store holds it only
        order, reuse = self.step_order()
        feed = self._feed(order, step, reuse)
        inputs = self._inputs(batch, step)
        micro = inputs.split(self.micro_batches)
        teachers, teacher_seconds = self._teacher_forward(micro, step)

        if not self.keep_graphs:
            xs, cs = self._forward(feed, micro, step)
            self._grads_sent = max(self._grads_sent, step)
            t_fwd = time.perf_counter()
            loss, distill, dxs, dcs = self._loss(feed, micro, xs, cs, step, teachers)
            self._backward(feed, micro, cs, dxs, dcs, step)
        else:
            graphs = self._forward_keeping_graphs(feed, micro, step)
            self._grads_sent = max(self._grads_sent, step)
            t_fwd = time.perf_counter()
            xs = [y.detach() for y, _ in graphs[-1].out]
            cs = [c for _, c in graphs[-1].out]
            loss, distill, dxs, dcs = self._loss(feed, micro, xs, cs, step, teachers)
            self._backward_graphs(graphs, dxs, dcs, step)

        if self.dev:  # its shards' AdamW, while the last gradients are still on their way to the store
            self.dev.update(step)
            for buf in self._dev_bufs:
                self._grad_pool.release(buf)
            self._dev_bufs = []
        for r in self._returns:  # every gradient has reached the store (errors surface here)
            if r is not None:
                r.result()
        unanswered = self.store.flush() or 0  # a store that hangs: the driver treats it as dead
        h2d_bytes, h2d_seconds, d2h_bytes, d2h_seconds = self.link.step_counters()
        t_end = time.perf_counter()
        self.last_timeline = (t_data, feed.log, t_end)
        B, (pt, ph, pw) = inputs.x_t.shape[0], self.cfg.model.patch_size
        f, h, w = inputs.x_t.shape[1:4]  # this batch's clip (data.buckets: its bucket's), not the config's
        return StepResult(
            step=step, loss=float(loss.detach()), tokens=B * (f // pt) * (h // ph) * (w // pw), seconds=t_end - t_data,
            forward_seconds=t_fwd - t_data, backward_seconds=t_end - t_fwd, weight_wait_seconds=feed.wait,
            data_position=int(batch.get("position", -1)), device=str(self.device), data_wait_seconds=data_wait,
            h2d_bytes=h2d_bytes, h2d_seconds=h2d_seconds, d2h_bytes=d2h_bytes, d2h_seconds=d2h_seconds,
            device_memory_peak_bytes=peak_memory(self.device), store_unanswered=unanswered, rank=self.rank,
            grad_slot_wait_seconds=self.link.slot_wait_seconds,
            t=tuple(float(x) for x in inputs.t.float().cpu()), expert=-1 if expert is None else expert,
            distill_loss=0.0 if distill is None else float(distill), teacher_seconds=teacher_seconds,
        )

    def _inputs(self, batch: dict, step: int) -> FlowInputs:
        """``step_inputs`` of this actor's clips: samples ``rank x B ...`` of the step's global batch."""
        first = self.global_rank * len(batch["latents"] if "latents" in batch else batch["video"])  # every actor's batch is as large
        return step_inputs(self.cfg, batch, step, first, self._caption_dropout, self.device)

    @torch.no_grad()
    def _forward(self, feed: ShardFeed, micro: list[FlowInputs], step: int) -> tuple[list, list]:
        """Shards 0..L without gradients, each on every micro-batch while its weights are here;
        each block's inputs go to the stash (slot ``block x k + micro-batch``). Returns the last
        block's outputs ``xs`` and the conditionings ``cs``, one per micro-batch."""
        L, k = self.cfg.model.depth, len(micro)
        w = feed.take(0)
        fault_point("compute.after_weights", step)
        xs, cs = map(list, zip(*(self._run(0, w, *m.embed_args(), **m.embed_kwargs()) for m in micro)))
        feed.done(w)
        self.stash.begin(L * k, group=k)
        for shard in range(1, L + 1):
            if shard == (L + 2) // 2:
                fault_point("compute.mid_forward", step)
            for j in range(k):
                self.stash.put((shard - 1) * k + j, xs[j])
            w = feed.take(shard)
            xs = [self._run(shard, w, xs[j], cs[j], mix=micro[j].host_mix) for j in range(k)]
            feed.done(w)
        return xs, cs

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss whose gradient this actor adds to the global batch's (``loss_scale``)."""
        return loss if self.loss_scale == 1.0 else loss * self.loss_scale

    def _loss(self, feed: ShardFeed, micro: list[FlowInputs], xs: list, cs: list, step: int,
              teachers: list | None = None) -> tuple[torch.Tensor, torch.Tensor | None, list, list]:
        """The head and loss of every micro-batch (distillation: plus the weighted ``distill_loss`` to
        ``teachers``), with gradients; the head's gradient (summed over them) goes to the store. Returns
        (the mean task loss, the mean distillation term or None, d loss / d x and d c per micro-batch)."""
        L, k = self.cfg.model.depth, len(micro)
        head = L + 1
        w_staged = feed.take(head)
        for i in range(L * k - 1, L * k - 1 - self.link.prefetch_depth * k, -1):  # the backward's first inputs
            self.stash.prefetch(i)
        params, grad = grad_views(self.infos[head].layout, w_staged, self._grad_pool)
        losses, terms, dxs, dcs = [], [], [], []
        bad_loss = None
        clean = self.cfg.model.arch == "wan" and self.cfg.model.clean_first_frame
        for j, (m, x, c) in enumerate(zip(micro, xs, cs)):
            x_last = x.detach().requires_grad_(True)
            c_leaf = c.detach().requires_grad_(True)
            velocity = as_velocity(self._run_with_grad(head, params, x_last, c_leaf), m.x_t, m.t,
                                   self.cfg.model.prediction)
            loss = model_loss(velocity, m.target, clean)
            if fault_point("compute.loss", step) == "nan":
                loss = loss * float("nan")
            terms += [] if teachers is None else [distill_loss(velocity, teachers[j], clean)]
            total = loss if teachers is None else loss + self.teacher.weight * terms[-1]
            # A NaN/Inf loss with finite gradients must not slip through: poison the step's norm (on the device).
            bad = ~torch.isfinite(total.detach())
            bad_loss = bad if bad_loss is None else bad_loss | bad
            self._scaled(total).backward()
            losses.append(loss.detach())
            dxs.append(x_last.grad)
            # dc sums one term per block: fp32 whatever c's dtype (bf16 on CUDA runs).
            dcs.append(c_leaf.grad.to(torch.float32, copy=True))
        self._push_grad(head, step, grad, poison=bad_loss)
        feed.done(w_staged)
        loss = losses[0] if k == 1 else torch.stack(losses).mean()
        distill = None if teachers is None else torch.stack([d.detach() for d in terms]).mean()
        return loss, distill, dxs, dcs

    def _backward(self, feed: ShardFeed, micro: list[FlowInputs], cs: list, dxs: list, dcs: list,
                  step: int) -> None:
        """Blocks L..1, each recomputed from its saved inputs with gradients on every micro-batch
        (newest first), then shard 0; every shard's gradient, accumulated over the micro-batches
        on the device, goes to the store as soon as it is complete."""
        L, k = self.cfg.model.depth, len(micro)
        stash = self.stash
        ahead = self.link.prefetch_depth * k
        for shard in range(L, 0, -1):
            w_staged = feed.take(shard)
            params, grad = grad_views(self.infos[shard].layout, w_staged, self._grad_pool)
            for j in range(k - 1, -1, -1):
                i = (shard - 1) * k + j
                x_saved = stash.take(i)
                stash.prefetch(i - ahead)
                x_in = x_saved.detach().requires_grad_(True)
                c_leaf = cs[j].detach().requires_grad_(True)
                y = self._run_with_grad(shard, params, x_in, c_leaf, mix=micro[j].host_mix)
                torch.autograd.backward(y, dxs[j])
                stash.give_back(i, x_saved)
                del x_saved, y
                dxs[j] = x_in.grad
                dcs[j] += c_leaf.grad  # (fp32 accumulator)
            self._push_grad(shard, step, grad)
            feed.done(w_staged)
            if shard == (L + 1) // 2:
                fault_point("compute.mid_backward", step)
            del grad, params
        w_staged = feed.take(0)
        params, grad = grad_views(self.infos[0].layout, w_staged, self._grad_pool)
        for j in range(k - 1, -1, -1):
            m = micro[j]
            x0, c0 = self._run_with_grad(0, params, *m.embed_args(), **m.embed_kwargs())
            torch.autograd.backward([x0, c0], [dxs[j], dcs[j].to(c0.dtype)])
        self._push_grad(0, step, grad)
        feed.done(w_staged)

    # -- without recomputation (runtime.recompute_blocks=false) ------------------------------
    def _forward_keeping_graphs(self, feed: ShardFeed, micro: list[FlowInputs], step: int) -> list["BlockGraph"]:
        """Shards 0..L with gradients on, on every micro-batch, each block cut from the last at its
        input and its conditioning (leaves, as in the recomputing backward), every graph kept. The
        weights are the store's mapped pages, read in place: they stay valid until the shard's own
        gradient replaces them, after its backward."""
        L = self.cfg.model.depth
        w = feed.take(0)
        fault_point("compute.after_weights", step)
        params, grad = grad_views(self.infos[0].layout, w, self._grad_pool)
        outs = [self._run_with_grad(0, params, *m.embed_args(), **m.embed_kwargs()) for m in micro]
        feed.done(w)
        graphs = [BlockGraph([None] * len(micro), [None] * len(micro), outs, grad)]
        for shard in range(1, L + 1):
            if shard == (L + 2) // 2:
                fault_point("compute.mid_forward", step)
            w = feed.take(shard)
            params, grad = grad_views(self.infos[shard].layout, w, self._grad_pool)
            g = BlockGraph([], [], [], grad)
            for m, (x, c) in zip(micro, graphs[-1].out):
                x_in = x.detach().requires_grad_(True)
                c_leaf = c.detach().requires_grad_(True)
                y = self._run_with_grad(shard, params, x_in, c_leaf, mix=m.host_mix)
                g.x_in.append(x_in)
                g.c_in.append(c_leaf)
                g.out.append((y, c))
            feed.done(w)
            graphs.append(g)
        return graphs

    def _backward_graphs(self, graphs: list["BlockGraph"], dxs: list, dcs: list, step: int) -> None:
        """The kept graphs' backwards, blocks L..1 then shard 0, micro-batches newest first, in the
        order and with the accumulation of ``_backward``, so the gradients are the same to the
        bit; each graph is freed once its gradient has gone to the store."""
        L, k = self.cfg.model.depth, len(dxs)
        for shard in range(L, 0, -1):
            g = graphs[shard]
            for j in range(k - 1, -1, -1):
                torch.autograd.backward(g.out[j][0], dxs[j])
                dxs[j] = g.x_in[j].grad
                dcs[j] += g.c_in[j].grad
            self._push_grad(shard, step, g.grad)
            if shard == (L + 1) // 2:
                fault_point("compute.mid_backward", step)
            graphs[shard] = None  # its activations go now
            del g
        g = graphs[0]
        for j in range(k - 1, -1, -1):
            x0, c0 = g.out[j]
            torch.autograd.backward([x0, c0], [dxs[j], dcs[j].to(c0.dtype)])
        self._push_grad(0, step, g.grad)
        graphs.clear()

    # -- forward only (sampling) -------------------------------------------------------------
    @torch.no_grad()
    def predict(self, x_t, t, caption, caption_len, step: int, condition=None, image=None) -> torch.Tensor:
        """The model's velocity for ``x_t`` at times ``t``, with the weights of version ``step``.

        Forward only: shards 0..L+1 fetched as in training (prefetched while the current one
        computes), no activations kept, nothing sent back to the store.
        ``x_t: (B, F, H, W, C)`` in [-1, 1] scale, ``t: (B,)``, ``caption: (B, Lc)`` uint8 bytes,
        ``caption_len: (B,)``; an image-to-video model also takes ``condition`` ``(B, F, H, W, mask
        + C)`` and, with CLIP, ``image`` ``(B n, Li, image_dim)`` (``FlowInputs``). Returns the
        prediction as float32 on the CPU, shaped like ``x_t``.
        """
        def as_tensor(a) -> torch.Tensor:
            # np.array copies: arrays from Ray are read-only views of the object store.
            return (a if isinstance(a, torch.Tensor) else torch.from_numpy(np.array(a))).to(self.device)

        if step <= self._grads_sent:
            # Shards at version ``step`` hold (or held) that step's gradients in w, not weights.
            raise RuntimeError(f"predict with the weights of step {step} asked for after this compute actor ran "
                               f"training step {self._grads_sent + 1}: those weights were replaced by its gradients. "
                               f"Predict before queueing the next training step (the trainer queues nothing "
                               f"ahead of a sample or an evaluation)")
        x_t, t, cap, cap_len = (as_tensor(a) for a in (x_t, t, caption, caption_len))
        mix = host_weights(self.cfg, t)  # the blocks' dense weights: one read of t, not one per block
        self._base = self._predict_base(t)
        if self.dev.state is not None and self.dev.version != step:
            raise RuntimeError(f"predict with the weights of step {step}, but the device shards {self.dev.ids} hold "
                               f"those of step {self.dev.version}")
        self.link.begin_step()  # (predictions report no transfer counters)
        feed = self._feed(list(range(self.per_expert)), step)
        w = feed.take(0)
        extra = (None if a is None else as_tensor(a).float() for a in (condition, image))
        x, c = self._run(0, w, *FlowInputs(x_t.float(), t.float(), x_t, cap, cap_len, *extra).embed_args())
        feed.done(w)
        for shard in range(1, self.per_expert):
            w = feed.take(shard)
            x = self._run(shard, w, x, c, mix=mix)
            feed.done(w)
            del w
        x = as_velocity(x, x_t, t, self.cfg.model.prediction)
        return x.float().cpu()  # host sync: the caller integrates on the CPU

    def _predict_base(self, t: torch.Tensor) -> int:
        """The first shard of the expert diffusers' pipeline runs at the times ``t`` (0 with one
        transformer); the clips of one call must share an expert."""
        if self.experts == 1:
            return 0
        experts = {route_expert(float(x), self.cfg.training.boundary_ratio) for x in t.flatten().tolist()}
        if len(experts) != 1:
            raise ValueError(f"predict at times {t.tolist()} straddles the experts' boundary "
                             f"{self.cfg.training.boundary_ratio}: call it once per expert")
        return experts.pop() * self.per_expert

    def device_state(self) -> tuple[int, dict]:
        """``runtime.device_shards``: (their version, their master, m and v as host arrays), which
        the driver hands to ``ParameterStore.put_device_state`` before a checkpoint."""
        return self.dev.export()

    def transport_name(self) -> str:
        return self.transport

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"

    def close(self) -> None:
        self.link.close()
        self.stash.release_host()


class LocalStoreClient:
    """In-process store client (unit tests and single-process tools); ``rank``: which compute
    actor it serves when the store has several."""

    def __init__(self, store, rank: int = 0):
        self._store, self._rank = store, rank

    @property
    def generation(self) -> int:
        """The store's current compute-actor generation (this client's reports carry none)."""
        return self._store._generation

    def wait_version(self, shard: int, step: int) -> int:
        return self._store.wait_version(shard, step)

    def get_weights(self, shard: int, step: int) -> np.ndarray:
        return self._store.get_weights(shard, step)

    def get_teacher_weights(self, shard: int) -> np.ndarray:
        return self._store.get_teacher_weights(shard)

    def device_state(self, step: int) -> dict:
        return self._store.device_state(step)

    def report_grad(self, shard: int, step: int, sqnorm: float, grad, slot: int = -1, piece: int = 0) -> None:
        slots = {"actor": self._rank, "slot": slot, "piece": piece} if slot >= 0 else {}  # several actors
        self._store.report_grad(shard, step, sqnorm, grad, **slots)

    def wait_grad_slot(self, slot: int) -> None:
        self._store.wait_grad_slot(self._rank, slot)

    def flush(self) -> int:
        return 0


class ExpertFeed:
    """A ``ShardFeed`` over one expert's shards, taken by their index within the expert (the
    model code and the schedule speak of one transformer; the store holds two)."""

    def __init__(self, feed: ShardFeed, base: int):
        self.feed, self.base = feed, base

    def take(self, shard: int) -> torch.Tensor:
        return self.feed.take(self.base + shard)

    def done(self, w: torch.Tensor) -> None:
        self.feed.done(w)

    @property
    def wait(self) -> float:
        return self.feed.wait

    @property
    def log(self) -> list:
        return self.feed.log


def grad_views(layout, w: torch.Tensor, pool: "StagingPool | None" = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Parameters for ``functional_call`` that send their gradients into one flat buffer.

    Returns ``(params, grad)``: ``grad`` is a zeroed fp32 buffer shaped like ``w``. With fp32
    weights every parameter is a leaf view of ``w`` whose ``.grad`` is preset to its view of
    ``grad``, so the backward adds each parameter's gradient in place (autograd accumulates into
    an existing ``.grad``). The alternative, a flat leaf that requires grad with the parameters
    sliced out of it, makes autograd's ``slice_backward`` build a zero tensor the size of the
    whole shard per parameter (tests/test_overlap.py counts the zero fills). Adding to zeros is
    exact, so the gradient is bit-identical to that of the flat leaf.

    With weights of another dtype (bf16 on a GPU) ``.grad`` would have theirs, and every
    micro-batch and token chunk would be added in bf16: each leaf instead carries its view of
    the fp32 ``grad`` (``chunking.FP32_GRAD``), and ``_run_with_grad`` and ``chunking.bind`` add
    each use's gradient into it in fp32 (``chunking.fp32_grad_params``). The sum is rounded to
    the weights' dtype once, when it is sent (``ComputeActor._push_grad``).

    ``pool``: take the buffer from it (zeroed in place; ``_push_grad`` hands it back once the
    gradient is sent) instead of allocating a fresh one: on a CPU a fresh shard-sized buffer is
    fresh pages, and faulting them in costs about as much again as the zero fill."""
    if pool is None:
        grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    else:
        grad = pool.acquire(w.numel(), torch.float32, w.device)[0].zero_()
    params = {}
    for (name, view), gview in zip(layout.views(w).items(), layout.views(grad).values()):
        leaf = view.detach().requires_grad_(True)
        if w.dtype == torch.float32:
            leaf.grad = gview
        else:
            setattr(leaf, FP32_GRAD, gview)
        params[name] = leaf
    return params, grad


def round_in_place(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The flat fp32 ``acc`` rounded to a 2-byte ``dtype`` (bf16) in ``acc``'s own storage (no
    second buffer on the device): a view of its first half. Pieces of doubling size, in order:
    piece ``[a, b)`` with ``b <= 2a`` writes bytes ``[2a, 2b)``, which hold only elements before
    ``a``, already read (the first piece, which overlaps itself, goes through a small copy).
    The copies run in order on one stream, so each reads before anything overwrites it."""
    if acc.dtype != torch.float32 or dtype.itemsize != 2 or acc.dim() != 1:
        raise ValueError(f"round_in_place rounds a flat float32 tensor to a 2-byte dtype, not {acc.dtype} "
                         f"of shape {tuple(acc.shape)} to {dtype}")
    n = acc.numel()
    out = acc.view(dtype)[:n]
    first = min(n, 4096)
    out[:first].copy_(acc[:first].clone())
    a = first
    while a < n:
        b = min(n, 2 * a)
        out[a:b].copy_(acc[a:b])
        a = b
    return out


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
