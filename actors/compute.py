"""ComputeActor: runs the model block by block with weights it does not own.

For each step: forward over shards 0..L+1 fetching each shard's weights when the store says
they are valid for this step (prefetching the next shard while the current one computes),
keeping only block inputs; loss; backward L..0 recomputing each block from its saved input;
each shard's gradient handed to the store as soon as it exists. Between steps the actor holds
no weights: only mappings of the store's segments (same node) or nothing (object refs).

The model is built on the ``meta`` device and called with ``torch.func.functional_call`` on
views into the fetched flat buffer, so the model code does not know it is streamed.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.func import functional_call

from actors.param_store import DTYPES, ShardInfo, default_state_root, map_segment
from megaslide_ray.config import Config
from megaslide_ray.diffusion import flow_loss, sample_flow_inputs
from megaslide_ray.faults import fault_point
from megaslide_ray.model import build_shard, num_shards

log = logging.getLogger(__name__)


class StoreClient(Protocol):
    """How the compute actor talks to the store: in-process (tests) or through Ray."""

    def wait_version(self, shard: int, step: int) -> int: ...
    def get_weights(self, shard: int, step: int) -> np.ndarray: ...
    def report_grad(self, shard: int, step: int, sqnorm: float, grad: np.ndarray | None) -> None: ...
    def flush(self) -> None: ...


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    tokens: int
    seconds: float
    forward_seconds: float
    backward_seconds: float
    weight_wait_seconds: float   # time blocked on a shard version or a weight transfer
    data_position: int
    skipped_files: int
    device: str
    data_wait_seconds: float = 0.0  # time blocked waiting for the decoded batch
    h2d_bytes: int = 0              # weight bytes copied towards the compute (0 when read in place)
    h2d_seconds: float = 0.0        # time those copies took (on the staging thread)
    d2h_bytes: int = 0              # gradient bytes returned to the store
    d2h_seconds: float = 0.0
    device_memory_peak_bytes: int = 0  # CUDA: max_memory_allocated; CPU: the process's peak RSS


def select_device(cfg: Config) -> str:
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("runtime.device='cuda' but this process sees no CUDA device; use 'auto' or 'cpu'")
    if cfg.runtime.device in ("auto", "cuda") and torch.cuda.is_available():
        return "cuda"
    return "cpu"


class ComputeActor:
    def __init__(self, cfg: Config, shards: list[ShardInfo], store: StoreClient, transport: str = "shm",
                 store_node: str | None = None):
        if transport == "auto":
            transport = "shm" if store_node in (None, self.node_id()) else "object_ref"
        if transport not in ("shm", "object_ref"):
            raise ValueError(f"transport={transport!r}: use 'auto', 'shm' or 'object_ref'")
        self.cfg = cfg
        self.device = torch.device(select_device(cfg))
        if self.device.type == "cuda":  # with its index, as tensors report it (staging pool keys)
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.runtime.compute_threads or os.cpu_count() or 1)
        self.store = store
        self.transport = transport
        self.infos = shards
        self.n = num_shards(cfg)
        if len(shards) != self.n:
            raise ValueError(f"store has {len(shards)} shards, the model needs {self.n}")
        self.dtype = DTYPES[shards[0].w_dtype]
        self.modules = [build_shard(cfg, i, "meta") for i in range(self.n)]
        # Same node: map the store's segments. These are the store's pages, not a copy.
        self.w_maps: list[torch.Tensor] = []
        self.g_maps: list[torch.Tensor] = []
        if transport == "shm":
            for info in shards:
                self.w_maps.append(map_segment(info.paths["w"], info.numel, self.dtype))
                self.g_maps.append(map_segment(info.paths["g"], info.numel, self.dtype))
        rt = cfg.runtime
        self.overlap = rt.overlap
        self.prefetch_depth = rt.prefetch_depth if rt.overlap else 0
        self.link_gbps = rt.link_gbps
        # Staging: on CUDA every shard is copied to the device; on CPU only when a link is
        # simulated (``link_gbps``), else the compute reads the mapped pages directly.
        self._staging = _StagingPool()
        self._stage = self.device.type == "cpu" and self.link_gbps > 0
        # "Streams" on CPU: one thread stages shards ahead (host-to-device), one returns
        # gradients (device-to-host), so both transfers overlap the compute thread.
        self._h2d = [0, 0.0]  # bytes, seconds of this step's weight copies
        self._d2h = [0, 0.0]  # bytes, seconds of this step's gradient returns
        self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-prefetch")
        self._returner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grad-return")
        # CUDA: real streams. Weights go host->device on their own stream, gradients device->host
        # on another, the model runs on the default stream; events order them. The store's mapped
        # segments are registered as pinned memory (in chunks), so both copies are asynchronous DMA
        # straight from/to shared memory, with no extra host copy of the model.
        self._cuda = self.device.type == "cuda"
        self._pinning = HostPinning()
        self._h2d_timing: list[tuple] = []  # (start, end) events of this step's weight copies
        # The last step's (start, _ShardFeed.log, end) on the perf_counter clock (benchmarks).
        self.last_timeline: tuple[float, list[tuple[float, float]], float] = (0.0, [], 0.0)
        if self._cuda:
            self._h2d_stream = torch.cuda.Stream(self.device)
            self._d2h_stream = torch.cuda.Stream(self.device)
            for seg in self.w_maps + self.g_maps:
                if not self._pinning.register(seg):
                    break  # copies from unpinned pages still work, only synchronously
        self._stash = _ActivationStash(self, rt.offload_activations)

    # -- weights ------------------------------------------------------------------------------
    def _fetch(self, shard: int, step: int) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        if self.transport == "shm":
            self.store.wait_version(shard, step)
            src = self.w_maps[shard]
            t_copy, moved = time.perf_counter(), 0
        else:
            t_copy = time.perf_counter()  # the transfer is the object fetch itself
            raw = self.store.get_weights(shard, step)
            src = torch.from_numpy(np.array(raw, copy=True)).view(self.dtype)
            moved = src.numel() * src.element_size()
        if self._stage:  # simulated link: a throttled copy into a reused buffer
            w, _ = self._staging.acquire(src.numel(), src.dtype)
            throttled_copy(w, src, self.link_gbps)
            moved = src.numel() * src.element_size()
        elif self._cuda:  # enqueue the H2D copy on its stream; the compute waits on its event
            return self._copy_to_device(src), time.perf_counter() - t0
        else:  # CPU: compute straight from the mapped pages (no copy)
            w = src
        if moved:  # only the prefetch thread writes these (one fetch at a time)
            self._h2d[0] += moved
            self._h2d[1] += time.perf_counter() - t_copy
        return w, time.perf_counter() - t0

    def _copy_to_device(self, src: torch.Tensor) -> torch.Tensor:
        """Asynchronous host->device copy of ``src`` on the H2D stream (DMA when ``src`` is pinned),
        counted in this step's H2D bytes. The result carries the event that marks the copy done
        (see ``_ready``)."""
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._h2d_stream):
            # A reused device buffer: the copy waits until the compute is done with its last use.
            w, fence = self._staging.acquire(src.numel(), src.dtype, self.device)
            if fence is not None:
                self._h2d_stream.wait_event(fence)
            start.record()
            w.copy_(src, non_blocking=True)
            done.record()
        w._megaslide_ready = done  # read and dropped by _ready on the compute thread
        self._h2d_timing.append((start, done))
        self._h2d[0] += src.numel() * src.element_size()
        return w

    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> "torch.cuda.Event":
        """Asynchronous device->host copy of ``src`` into ``dst`` (pinned) on the D2H stream, after
        the compute work queued so far; returns the event that marks it done."""
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h_stream):
            self._d2h_stream.wait_event(produced)
            dst.copy_(src, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        src.record_stream(self._d2h_stream)
        return copied

    def _ready(self, w: torch.Tensor) -> torch.Tensor:
        """Make the compute stream wait for ``w``'s copy, and keep the caching allocator from
        reusing its memory (allocated on the H2D stream) before the compute is done with it."""
        done = getattr(w, "_megaslide_ready", None)
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            w.record_stream(current)
            del w._megaslide_ready
        return w

    def _release(self, w: torch.Tensor) -> None:
        """The compute is done with the weights ``w``: their staging buffer can be reused."""
        if self._stage or self._cuda:
            self._recycle(w)

    def _recycle(self, buf: torch.Tensor) -> None:
        """Hand a staging buffer back. CUDA: with an event after the compute work queued so far,
        which the next copy into the buffer waits for."""
        fence = None
        if self._cuda:
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(self.device))
        self._staging.release(buf, fence)

    def _run(self, shard: int, flat: torch.Tensor, *args):
        params = self.infos[shard].layout.views(flat)
        return functional_call(self.modules[shard], params, args)

    def _push_grad(self, shard: int, step: int, flat: torch.Tensor, poison: bool = False) -> Future | None:
        """Hand shard ``shard``'s gradient to the store. ``poison``: report a NaN norm (the loss
        was not finite), so the store skips the step's update on every shard."""
        g = flat.grad if flat.grad is not None else torch.zeros_like(flat)
        sqnorm = float(g.float().pow(2).sum())  # host sync: the store needs the number
        if poison:
            sqnorm = float("nan")

        copied = None
        if self._cuda and self.transport == "shm":  # into the pinned segment, after the backward
            copied = self._copy_to_host(self.g_maps[shard], g)

        def send() -> None:
            t0 = time.perf_counter()
            if copied is not None:
                copied.synchronize()  # the gradient is in the store's segment
                self._d2h[1] += time.perf_counter() - t0
                self.store.report_grad(shard, step, sqnorm, None)
            elif self.transport == "shm":
                throttled_copy(self.g_maps[shard], g, self.link_gbps)
                self._d2h[1] += time.perf_counter() - t0
                self.store.report_grad(shard, step, sqnorm, None)
            else:
                host = g.cpu()
                self._d2h[1] += time.perf_counter() - t0
                self.store.report_grad(shard, step, sqnorm, host.view(torch.uint8).numpy())
            self._d2h[0] += g.numel() * g.element_size()  # only the return thread writes these

        if not self.overlap:
            send()
            return None
        return self._returner.submit(send)

    # -- one step -----------------------------------------------------------------------------
    def step_order(self) -> tuple[list[int], dict[int, int]]:
        """The shards a training step takes, in order (forward 0..L+1, backward L..0), and which
        positions reuse an earlier one's weights instead of fetching them: the last block's,
        the forward's last fetch before the head, are kept for its backward (the turn costs
        one fetch less). They take the slot the head's prefetch would use, so the device never
        holds more than prefetch_depth + 1 shards."""
        L = self.cfg.model.depth
        return list(range(self.n)) + list(range(L, -1, -1)), {self.n: L}

    def train_step(self, batch, step: int) -> StepResult:
        """One step. ``batch``: the decoder's dict, or ``[ObjectRef]`` of it (the pipeline wraps
        the ref in a list so Ray does not resolve it before the call: the wait is then measured)."""
        t_start = time.perf_counter()
        fault_point("compute.before_weights", step)
        if isinstance(batch, list):
            import ray

            batch = ray.get(batch[0])
        data_wait = time.perf_counter() - t_start
        self._h2d, self._d2h = [0, 0.0], [0, 0.0]  # no transfer is in flight between steps
        self._h2d_timing = []
        L = self.cfg.model.depth
        head = L + 1
        order, reuse = self.step_order()
        feed = _ShardFeed(self, order, step, reuse=reuse)
        take, done = feed.take, feed.done
        returns: list[Future | None] = []

        noise_step = 0 if self.cfg.training.overfit_one_batch else step
        fx = sample_flow_inputs(batch["video"], self.cfg.training.seed, noise_step, self.cfg.training.t_sampling)
        dev = self.device
        x_t, t, target = fx.x_t.to(dev), fx.t.to(dev), fx.target.to(dev)
        cap = torch.from_numpy(np.array(batch["caption"])).to(dev)
        cap_len = torch.from_numpy(np.array(batch["caption_len"])).to(dev)

        # -- forward: keep only block inputs (activation checkpointing at block boundaries)
        pos = 0
        with torch.no_grad():
            w = take(pos)
            fault_point("compute.after_weights", step)
            x, c = self._run(0, w, x_t, t, cap, cap_len)
            done(pos, w)
            pos += 1
            stash = self._stash
            stash.begin(L)
            for shard in range(1, L + 1):
                if shard == (L + 2) // 2:
                    fault_point("compute.mid_forward", step)
                stash.put(shard - 1, x)
                w = take(pos)
                x = self._run(shard, w, x, c)
                done(pos, w)
                pos += 1
        w_staged = take(pos)
        for i in range(L - 1, L - 1 - self.prefetch_depth, -1):  # the backward's first inputs
            stash.prefetch(i)
        w_head = w_staged.detach().requires_grad_(True)
        pos += 1
        x_last = x.detach().requires_grad_(True)
        c_leaf = c.detach().requires_grad_(True)
        t_fwd = time.perf_counter()
        pred = self._run(head, w_head, x_last, c_leaf)
        loss = flow_loss(pred, target)
        if fault_point("compute.loss", step) == "nan":
            loss = loss * float("nan")
        # A NaN/Inf loss with finite gradients must not slip through: poison the step's norm.
        bad_loss = not bool(torch.isfinite(loss.detach()))
        loss.backward()
        returns.append(self._push_grad(head, step, w_head, poison=bad_loss))
        done(pos - 1, w_staged)
        dx, dc = x_last.grad, c_leaf.grad.clone()
        del pred, w_head

        # -- backward: recompute each block from its input, newest first
        for shard in range(L, 0, -1):
            w_staged = take(pos)
            w = w_staged.detach().requires_grad_(True)
            pos += 1
            x_saved = stash.take(shard - 1)
            stash.prefetch(shard - 1 - self.prefetch_depth)
            x_in = x_saved.detach().requires_grad_(True)
            c_leaf = c.detach().requires_grad_(True)
            y = self._run(shard, w, x_in, c_leaf)
            torch.autograd.backward(y, dx)
            returns.append(self._push_grad(shard, step, w))
            done(pos - 1, w_staged)
            stash.give_back(x_saved)
            del x_saved
            if shard == (L + 1) // 2:
                fault_point("compute.mid_backward", step)
            dx = x_in.grad
            dc += c_leaf.grad
            del y, w
        w_staged = take(pos)
        w0 = w_staged.detach().requires_grad_(True)
        x0, c0 = self._run(0, w0, x_t, t, cap, cap_len)
        torch.autograd.backward([x0, c0], [dx, dc])
        returns.append(self._push_grad(0, step, w0))
        done(pos, w_staged)
        for r in returns:  # every gradient has reached the store (errors surface here)
            if r is not None:
                r.result()
        self.store.flush()
        if self._h2d_timing:  # CUDA: the copies' own duration on the H2D stream
            self._h2d_timing[-1][1].synchronize()
            self._h2d[1] = sum(a.elapsed_time(b) for a, b in self._h2d_timing) / 1e3
        t_end = time.perf_counter()
        self.last_timeline = (t_start, feed.log, t_end)
        B = x_t.shape[0]
        return StepResult(
            step=step, loss=float(loss.detach()), tokens=B * self.cfg.tokens_per_sample, seconds=t_end - t_start,
            forward_seconds=t_fwd - t_start, backward_seconds=t_end - t_fwd, weight_wait_seconds=feed.wait,
            data_position=int(batch.get("position", -1)), skipped_files=int(batch.get("skipped", 0)),
            device=str(dev), data_wait_seconds=data_wait, h2d_bytes=self._h2d[0], h2d_seconds=self._h2d[1],
            d2h_bytes=self._d2h[0], d2h_seconds=self._d2h[1], device_memory_peak_bytes=peak_memory(dev),
        )

    # -- forward only (sampling) -------------------------------------------------------------
    @torch.no_grad()
    def predict(self, x_t, t, caption, caption_len, step: int) -> torch.Tensor:
        """The model's velocity for ``x_t`` at times ``t``, with the weights of version ``step``.

        Forward only: shards 0..L+1 fetched as in training (prefetched while the current one
        computes), no activations kept, nothing sent back to the store.
        ``x_t: (B, F, H, W, C)`` in [-1, 1] scale, ``t: (B,)``, ``caption: (B, Lc)`` uint8 bytes,
        ``caption_len: (B,)``. Returns the prediction as float32 on the CPU, shaped like ``x_t``.
        """
        def as_tensor(a) -> torch.Tensor:
            # np.array copies: arrays from Ray are read-only views of the object store.
            return (a if isinstance(a, torch.Tensor) else torch.from_numpy(np.array(a))).to(self.device)

        x_t, t, cap, cap_len = (as_tensor(a) for a in (x_t, t, caption, caption_len))
        self._h2d_timing = []  # not reported for predictions
        feed = _ShardFeed(self, list(range(self.n)), step)
        x = c = None
        for shard in range(self.n):
            w = feed.take(shard)
            if shard == 0:
                x, c = self._run(0, w, x_t.float(), t.float(), cap, cap_len)
            else:
                x = self._run(shard, w, x, c)
            self._release(w)
            del w
        return x.float().cpu()  # host sync: the caller integrates on the CPU

    def transport_name(self) -> str:
        return self.transport

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"

    def close(self) -> None:
        self._prefetcher.shutdown(wait=True)
        self._returner.shutdown(wait=True)
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._stash.release_host()
        self._pinning.release()
        self.w_maps, self.g_maps = [], []


class LocalStoreClient:
    """In-process store client (unit tests and single-process tools)."""

    def __init__(self, store):
        self._store = store

    def wait_version(self, shard: int, step: int) -> int:
        return self._store.wait_version(shard, step)

    def get_weights(self, shard: int, step: int) -> np.ndarray:
        return self._store.get_weights(shard, step)

    def report_grad(self, shard: int, step: int, sqnorm: float, grad) -> None:
        self._store.report_grad(shard, step, sqnorm, grad)

    def flush(self) -> None:
        pass


class _ShardFeed:
    """The weights of ``order`` (shard indices) for one step, in that order: with overlap, the
    prefetch thread keeps ``prefetch_depth`` shards in flight after the one being taken;
    without, each is fetched when taken. ``wait`` = time the compute thread was blocked;
    ``log`` = (asked, got) clock readings of each take, for the overlap benchmark's schedule model."""

    def __init__(self, actor: "ComputeActor", order: list[int], step: int, reuse: dict[int, int] | None = None):
        self.actor, self.order, self.step = actor, order, step
        self.reuse = {src: dst for dst, src in (reuse or {}).items()}  # position kept -> position reusing it
        self.kept: dict[int, torch.Tensor] = {}
        self.futures: dict[int, Future] = {}
        self.wait = 0.0
        self.log: list[tuple[float, float]] = []
        if any(order[src] != order[dst] for src, dst in self.reuse.items()):
            raise ValueError(f"reuse {reuse} pairs positions of different shards in {order}")

    def take(self, pos: int) -> torch.Tensor:
        a = self.actor
        reused = set(self.reuse.values())
        for ahead in range(pos + 1, min(pos + a.prefetch_depth + 1, len(self.order))):
            if ahead not in self.futures and ahead not in reused:
                self.futures[ahead] = a._prefetcher.submit(a._fetch, self.order[ahead], self.step)
        t0 = time.perf_counter()
        if pos in reused:
            w = self.kept.pop(pos)
        elif pos in self.futures:
            w, _ = self.futures.pop(pos).result()
        else:  # the first shard, or no overlap: fetch now, in sequence
            w, _ = a._fetch(self.order[pos], self.step)
        t1 = time.perf_counter()
        self.wait += t1 - t0
        self.log.append((t0, t1))
        return a._ready(w)

    def done(self, pos: int, w: torch.Tensor) -> None:
        """The compute is done with position ``pos``'s weights ``w``: keep them for the position
        that reuses them, else hand the buffer back."""
        if pos in self.reuse:
            self.kept[self.reuse[pos]] = w
        else:
            self.actor._release(w)


class _ActivationStash:
    """The block-boundary inputs a step keeps for its backward (activation checkpointing).

    Default: a list on the compute device, which grows with model depth (L inputs of
    batch x tokens x width). With ``runtime.offload_activations`` each input goes to a host
    segment as soon as the next block has it (on the gradient-return thread: the device-to-host
    direction, idle during the forward) and comes back on the staging thread ahead of its
    block's backward, like the weights; at most ``prefetch_depth + 1`` inputs are then on the
    device whatever the depth. The host segment is one file-backed mapping, unlinked as soon as
    it is mapped (nothing is left behind by a crash), registered as pinned memory on CUDA.
    With ``link_gbps`` both copies cross the simulated link and count as link traffic.
    """

    def __init__(self, actor: "ComputeActor", offload: bool):
        self.actor, self.offload = actor, offload
        self.kept: list[torch.Tensor] = []
        self._host: torch.Tensor | None = None     # slots x slot numel, flat
        self._slot = 0
        self._shape: tuple = ()
        self._slots = 0
        self._put: dict[int, object] = {}            # Future (CPU), cuda.Event (CUDA) or None
        self._get: dict[int, Future] = {}
        self._pinning = HostPinning()

    def _ensure(self, slots: int, like: torch.Tensor) -> None:
        numel = like.numel()
        if self._host is not None and self._host.dtype == like.dtype and self._host.numel() >= slots * numel:
            return
        self.release_host()
        root = Path(self.actor.cfg.runtime.state_dir) if self.actor.cfg.runtime.state_dir else default_state_root()
        path = root / f"megaslide-activations-{os.getpid()}-{id(self):x}"
        try:
            root.mkdir(parents=True, exist_ok=True)  # (another node than the store's may lack it)
            self._host = map_segment(path, slots * numel, like.dtype, create=True)
        except OSError as e:
            raise RuntimeError(f"runtime.offload_activations: cannot make a {slots * numel * like.element_size()} "
                               f"byte host segment in {root} ({e}); free space there, set runtime.state_dir, "
                               f"or turn offload_activations off") from e
        finally:
            path.unlink(missing_ok=True)  # the mapping stays valid; no file outlives the process
        if self.actor._cuda:
            self._pinning.register(self._host)

    def begin(self, slots: int) -> None:
        self.kept, self._put, self._get, self._slots = [], {}, {}, slots

    def put(self, i: int, x: torch.Tensor) -> None:
        """Keep block input ``i`` (0-based block index) for the backward."""
        if not self.offload:
            self.kept.append(x)
            return
        a = self.actor
        if self._host is None or self._shape != tuple(x.shape):
            self._ensure(self._slots, x)
            self._shape, self._slot = tuple(x.shape), x.numel()
        dst = self._host[i * self._slot:(i + 1) * self._slot]
        if a._cuda:
            self._put[i] = a._copy_to_host(dst, x.reshape(-1))
            a._d2h[0] += x.numel() * x.element_size()
            return

        def out() -> None:
            t0 = time.perf_counter()
            throttled_copy(dst, x.reshape(-1), a.link_gbps)
            a._d2h[0] += x.numel() * x.element_size()
            a._d2h[1] += time.perf_counter() - t0

        if not a.overlap:
            out()
            self._put[i] = None
            return
        self._put[i] = a._returner.submit(out)
        # Bound what waits for the link: no more than prefetch_depth + 1 inputs on the device.
        waiting = [j for j, f in self._put.items() if isinstance(f, Future) and not f.done()]
        for j in waiting[:max(0, len(waiting) - (a.prefetch_depth + 1))]:
            self._put[j].result()

    def _load(self, i: int) -> torch.Tensor:
        a = self.actor
        src = self._host[i * self._slot:(i + 1) * self._slot]
        if a._cuda:
            a._h2d_stream.wait_event(self._put[i])  # the input has reached the host
            return a._copy_to_device(src)
        done = self._put[i]
        if isinstance(done, Future):
            done.result()
        t0 = time.perf_counter()
        buf, _ = a._staging.acquire(src.numel(), src.dtype)
        throttled_copy(buf, src, a.link_gbps)
        a._h2d[0] += src.numel() * src.element_size()
        a._h2d[1] += time.perf_counter() - t0
        return buf

    def prefetch(self, i: int) -> None:
        """Start bringing input ``i`` back (offload with overlap); a no-op otherwise."""
        if self.offload and self.actor.overlap and 0 <= i < self._slots and i not in self._get:
            self._get[i] = self.actor._prefetcher.submit(self._load, i)

    def take(self, i: int) -> torch.Tensor:
        """Block input ``i`` for its backward; inputs are taken newest first."""
        if not self.offload:
            return self.kept.pop()
        got = self._get.pop(i, None)
        buf = got.result() if isinstance(got, Future) else self._load(i)
        return self.actor._ready(buf).view(self._shape)

    def give_back(self, x: torch.Tensor) -> None:
        """``x`` (from ``take``) is no longer needed: its staging buffer is reused (CPU)."""
        if self.offload:
            self.actor._recycle(x.view(-1))

    def release_host(self) -> None:
        self._pinning.release()
        self._host, self._shape = None, ()


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class _StagingPool:
    """Reused staging buffers, by size and device: the working set stays at prefetch_depth + 1
    shards whatever the depth of the model (buffers are handed back after each shard's compute).
    On CUDA these are the device buffers the H2D stream copies into; each comes back with a
    ``fence`` event that the next copy into it must wait for."""

    def __init__(self):
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = {}
        self._lock = threading.Lock()
        self.allocated = 0

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple[torch.Tensor, object]:
        device = torch.device(device or "cpu")
        with self._lock:
            free = self._free.get((numel, dtype, device))
            if free:
                return free.pop()
            self.allocated += 1
        return torch.empty(numel, dtype=dtype, device=device), None

    def release(self, buf: torch.Tensor, fence: object = None) -> None:
        with self._lock:
            self._free.setdefault((buf.numel(), buf.dtype, buf.device), []).append((buf, fence))


PIN_CHUNK_BYTES = 256 << 20
"""Pinned registration works in pieces of at most this size (never one huge registration)."""


def pin_ranges(ptr: int, nbytes: int, chunk: int = PIN_CHUNK_BYTES, page: int = 4096) -> list[tuple[int, int]]:
    """Page-aligned ``(start, length)`` pieces of at most ``chunk`` bytes that cover
    ``[ptr, ptr + nbytes)``. A mapped file's pages are whole, so rounding out stays inside it."""
    if nbytes <= 0:
        return []
    if chunk < page or chunk % page:
        raise ValueError(f"chunk={chunk} must be a positive multiple of the page size {page}")
    start = ptr - ptr % page
    end = ptr + nbytes
    end += -end % page
    return [(s, min(chunk, end - s)) for s in range(start, end, chunk)]


class HostPinning:
    """Host memory registered as pinned (``cudaHostRegister``) in ``pin_ranges`` pieces, so
    copies from and to it are asynchronous DMA; ``release`` unregisters every piece."""

    def __init__(self):
        self.ranges: list[tuple[int, int]] = []

    def register(self, t: torch.Tensor) -> bool:
        """Register ``t``'s memory; False (with a warning, nothing left registered from ``t``)
        when the driver refuses, e.g. over the locked-memory limit."""
        cudart = torch.cuda.cudart()
        done = []
        for start, n in pin_ranges(t.data_ptr(), t.numel() * t.element_size()):
            err = int(cudart.cudaHostRegister(start, n, 0))
            if err != 0:
                for s, _ in done:
                    cudart.cudaHostUnregister(s)
                log.warning("could not register %d bytes of the store's segments as pinned memory (cudaError %d); "
                            "weight copies will be synchronous. Check `ulimit -l`.", t.numel() * t.element_size(), err)
                return False
            done.append((start, n))
        self.ranges.extend(done)
        return True

    def release(self) -> None:
        if not self.ranges:
            return
        cudart = torch.cuda.cudart()
        for start, _ in self.ranges:
            cudart.cudaHostUnregister(start)
        self.ranges = []


THROTTLE_CHUNK_BYTES = 4 << 20


def throttled_copy(dst: torch.Tensor, src: torch.Tensor, gbps: float) -> None:
    """``dst.copy_(src)`` at no more than ``gbps`` GB/s (0: unthrottled), in 4 MiB pieces with
    sleeps: a CPU stand-in for a PCIe link, so overlap can be tested without a GPU."""
    if gbps <= 0:
        dst.copy_(src)
        return
    d, s_ = dst.view(-1), src.view(-1)
    step = max(1, THROTTLE_CHUNK_BYTES // s_.element_size())
    t0 = time.perf_counter()
    done = 0
    for i in range(0, s_.numel(), step):
        piece = s_[i:i + step]
        d[i:i + step].copy_(piece)
        done += piece.numel() * piece.element_size()
        ahead = done / (gbps * 1e9) - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)
