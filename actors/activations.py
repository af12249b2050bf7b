"""ActivationStash: the block inputs a compute actor keeps for its backward.

Activation checkpointing at block boundaries keeps one tensor per block. They stay on the
device, or (``runtime.offload_activations``) go to host memory (``runtime.state_dir``; pinned
where CUDA can register it) after the first ``runtime.offload_keep`` counted from the end stay
on the device, and come back just before the backward needs them."""

from __future__ import annotations

import os
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from actors.pinned import HostPinning, throttled_copy
from actors.transfer import Transfers
from megaslide_ray.state.segments import default_state_root, map_segment


class ActivationStash:
    """The block-boundary inputs a step keeps for its backward (activation checkpointing).

    Default: a list on the compute device, which grows with model depth (L inputs of
    batch x tokens x width). With ``offload`` (``runtime.offload_activations``) each input goes
    to a host segment as soon as the next block has it (on the gradient-return thread: the
    device-to-host direction, idle during the forward) and comes back on the staging thread
    ahead of its block's backward, like the weights; at most ``prefetch_depth + 1`` inputs are
    then on the device whatever the depth. The host segment is one file-backed mapping in
    ``state_dir``, unlinked as soon as it is mapped (nothing is left behind by a crash),
    registered as pinned memory on CUDA. With ``link_gbps`` both copies cross the simulated
    link and count as link traffic.

    ``keep`` (``runtime.offload_keep``, with ``offload``): the inputs of the last ``keep`` blocks
    (``i >= L - keep``) stay on the device. They are the first the backward takes, so they need
    no round trip; the host segment has ``L - keep`` slots, and only the offloaded inputs count
    as traffic. The device then holds at most ``prefetch_depth + 1 + keep`` inputs
    (``peak_device_inputs`` records the most this step held: those kept, those still on their
    way out, those brought back or on their way in, those taken and not given back).
    """

    def __init__(self, link: Transfers, offload: bool, state_dir: str = "", keep: int = 0):
        if keep < 0:
            raise ValueError(f"keep={keep} must be >= 0")
        self.link, self.offload, self.state_dir, self.keep = link, offload, state_dir, keep
        self.kept: list[torch.Tensor] = []             # without offload: every input, on the device
        self._device: dict[int, torch.Tensor] = {}     # with offload: the last ``keep``, on the device
        self._first_kept = 0                           # inputs i >= this stay on the device
        self._host: torch.Tensor | None = None     # host slots x slot numel, flat
        self._slot = 0
        self._shape: tuple = ()
        self._slots = 0
        self._put: dict[int, object] = {}            # Future (CPU), cuda.Event (CUDA) or None
        self._get: dict[int, Future] = {}
        self._out: set[int] = set()                  # taken and not given back
        self._pinning = HostPinning()
        self.peak_device_inputs = 0

    def _ensure(self, slots: int, like: torch.Tensor) -> None:
        numel = like.numel()
        if self._host is not None and self._host.dtype == like.dtype and self._host.numel() >= slots * numel:
            return
        self.release_host()
        root = Path(self.state_dir) if self.state_dir else default_state_root()
        path = root / f"megaslide-activations-{os.getpid()}-{id(self):x}"
        try:
            root.mkdir(parents=True, exist_ok=True)  # (another node than the store's may lack it)
            self._host = map_segment(path, slots * numel, like.dtype, create=True)
        except OSError as e:
            raise RuntimeError(f"runtime.offload_activations: cannot make a {slots * numel * like.element_size()} "
                               f"byte host segment in {root} ({e}); free space there, set runtime.state_dir, "
                               f"raise runtime.offload_keep, or turn offload_activations off") from e
        finally:
            path.unlink(missing_ok=True)  # the mapping stays valid; no file outlives the process
        if self.link.cuda:
            self._pinning.register(self._host)

    def begin(self, slots: int, group: int = 1) -> None:
        """A new step of ``slots`` block inputs (the model's depth, times ``group`` micro-batches:
        input ``i`` is block ``i // group``'s; ``keep`` counts blocks, so ``keep x group`` stay)."""
        self.kept, self._device, self._put, self._get, self._out = [], {}, {}, {}, set()
        self._slots, self._first_kept = slots, max(0, slots - self.keep * group)
        self.peak_device_inputs = 0

    def offloaded(self, i: int) -> bool:
        """Whether block input ``i`` goes to the host segment (else it stays on the device)."""
        return self.offload and 0 <= i < self._first_kept

    def _outgoing(self) -> list[int]:
        """Offloaded inputs whose copy to the host has not finished (oldest first)."""
        if self.link.cuda:
            return [j for j, e in self._put.items() if e is not None and not e.query()]
        return [j for j, f in self._put.items() if isinstance(f, Future) and not f.done()]

    def _note_peak(self) -> None:
        if self.offload:
            held = set(self._device) | set(self._outgoing()) | set(self._get) | self._out
            self.peak_device_inputs = max(self.peak_device_inputs, len(held))
        else:
            self.peak_device_inputs = max(self.peak_device_inputs, len(self.kept))

    def put(self, i: int, x: torch.Tensor) -> None:
        """Keep block input ``i`` (0-based block index) for the backward."""
        if not self.offload:
            self.kept.append(x)
            self._note_peak()
            return
        if not self.offloaded(i):  # one of the last ``keep``: stays where it is
            self._device[i] = x
            self._note_peak()
            return
        link = self.link
        if self._host is None or self._shape != tuple(x.shape):
            self._ensure(self._first_kept, x)
            self._shape, self._slot = tuple(x.shape), x.numel()
        dst = self._host[i * self._slot:(i + 1) * self._slot]
        if link.cuda:
            self._put[i] = link.to_host(dst, x.reshape(-1))
            link.count("d2h", x.numel() * x.element_size())
            self._bound_outgoing()
            return

        def out() -> None:
            t0 = time.perf_counter()
            throttled_copy(dst, x.reshape(-1), link.link_gbps)
            link.count("d2h", x.numel() * x.element_size(), time.perf_counter() - t0)

        if not link.overlap:
            out()
            self._put[i] = None
            self._note_peak()
            return
        self._put[i] = link.returner.submit(out)
        self._bound_outgoing()

    def _bound_outgoing(self) -> None:
        """Bound what waits for the link: no more than prefetch_depth + 1 inputs on their way out
        (each holds its device tensor until its copy is done). CUDA: the host waits for the
        oldest copies' events, so the compute cannot queue ahead of the D2H stream without bound."""
        waiting = self._outgoing()
        for j in waiting[:max(0, len(waiting) - (self.link.prefetch_depth + 1))]:
            if self.link.cuda:
                self._put[j].synchronize()
            else:
                self._put[j].result()
        self._note_peak()

    def _load(self, i: int) -> torch.Tensor:
        link = self.link
        src = self._host[i * self._slot:(i + 1) * self._slot]
        if link.cuda:
            link.h2d_stream.wait_event(self._put[i])  # the input has reached the host
            return link.to_device(src)
        done = self._put[i]
        if isinstance(done, Future):
            done.result()
        t0 = time.perf_counter()
        buf, _ = link.staging.acquire(src.numel(), src.dtype)
        throttled_copy(buf, src, link.link_gbps)
        link.count("h2d", src.numel() * src.element_size(), time.perf_counter() - t0)
        return buf

    def prefetch(self, i: int) -> None:
        """Start bringing offloaded input ``i`` back (with overlap); a no-op for an input kept on
        the device, out of range, already on its way, or without offload or overlap."""
        if self.offloaded(i) and self.link.overlap and i not in self._get:
            self._get[i] = self.link.prefetcher.submit(self._load, i)
            self._note_peak()

    def take(self, i: int) -> torch.Tensor:
        """Block input ``i`` for its backward; inputs are taken newest first. Hand it back with
        ``give_back(i, x)`` once the backward is done with it."""
        if not self.offload:
            return self.kept.pop()
        self._out.add(i)
        if not self.offloaded(i):
            return self._device.pop(i)
        got = self._get.pop(i, None)
        buf = got.result() if isinstance(got, Future) else self._load(i)
        self._note_peak()
        return self.link.ready(buf).view(self._shape)

    def give_back(self, i: int, x: torch.Tensor) -> None:
        """Input ``i`` (``x``, from ``take``) is no longer needed: an offloaded one's staging
        buffer is reused; one kept on the device is simply dropped (it is no staging buffer)."""
        if not self.offload:
            return
        self._out.discard(i)
        if self.offloaded(i):
            self.link.recycle(x.view(-1))

    def release_host(self) -> None:
        self._pinning.release()
        self._host, self._shape = None, ()
