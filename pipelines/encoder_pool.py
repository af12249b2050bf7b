"""The encoder pool of ``precompute``: ``Encoder`` (``megaslide_ray.data.encoders``) made a Ray
actor, one per GPU or several on CPU, with a watchdog that replaces an actor that hangs or dies;
or one ``Encoder`` in this process, without Ray (``--num-encoders 0``).

The pool takes chunks of tasks (``CLIPS_PER_CALL`` clips, ``CAPTIONS_PER_CALL`` captions) and
keeps two calls in flight per actor: one encodes while the other's clips decode on the actor's
thread, so an actor never waits for the driver. On CPU each of the ``N`` actors gets ``CPUs / N``
torch threads (several actors with a few threads each, rather than one with all of them); before
the captions, ``shrink_to_one`` keeps one actor with every thread (a UMT5-XXL copy is 22 GB in
float32, and the captions are few).

Ray is imported where it is used: importing this module (the ``precompute`` command line does)
and an in-process pool cost no Ray import."""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Callable

import torch

from megaslide_ray.config import DataConfig
from megaslide_ray.data.encoders import Encoder

log = logging.getLogger(__name__)

HANG_TIMEOUT_S = 1800.0
"""An encoder actor with calls in flight and no call finished for this long is taken for hung
(``precompute --hang-timeout``): a call holds two clips, and a Wan VAE on a CPU takes minutes
for one long clip."""

CLIPS_PER_CALL = 2
"""Clips per actor call. Each actor runs two calls at once: one encodes while the other's clips
decode, and the actor never waits for the driver."""

CAPTIONS_PER_CALL = 16
"""Captions per text-encoder batch."""


def start_ray() -> bool:
    """A local Ray for the encoder actors unless this process already runs one; True when it was
    started here (whoever started it shuts it down: ``stop_ray``)."""
    import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
    if ray.is_initialized():
        return False
    ray.init(address="local", include_dashboard=False, namespace="megaslide", logging_level="ERROR")
    return True


def stop_ray() -> None:
    """Shut down the Ray ``start_ray`` started."""
    import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
    ray.shutdown()


def pick_device(device: str, use_ray: bool) -> str:
    """``auto`` made ``cuda`` or ``cpu``: by the Ray cluster's GPUs for actors, by this process's
    for an in-process encoder; ``cpu`` and ``cuda`` stay."""
    if device != "auto":
        return device
    if use_ray:
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_size(device: str) -> int:
    """Encoder actors when none are asked for: one per GPU of the cluster, or ``min(CPUs, 4)``."""
    import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
    res = ray.cluster_resources()
    return max(1, int(res.get("GPU", 0))) if device == "cuda" else max(1, min(int(res.get("CPU", 1)), 4))


class EncoderPool:
    """The encoder actors, or one ``Encoder`` in this process (``n == 0``), and the dispatch of
    chunks of tasks to them, two calls in flight per actor. An actor that dies (a codec crash, an
    out-of-memory kill) or hangs (calls in flight, none finished for ``hang_timeout_s``: the
    watchdog kills it) is replaced and the tasks of its calls are retried one at a time, each
    alone on an actor; a task whose actor dies or hangs again while it runs alone is reported as
    failed ("died on it twice", "hung on it twice") and the run goes on.

    ``open`` starts one (and Ray, when none runs); ``run`` hands out chunks; ``close`` ends the
    actors (and the Ray ``open`` started)."""

    encoder_cls = Encoder
    """The class made remote (tests put a failing subclass here)."""

    def __init__(self, n: int, model_dir: str, data: DataConfig, device: str, dtype: str, condition: str = "",
                 hang_timeout_s: float = HANG_TIMEOUT_S):
        self.n, self.device = n, device
        self.args = (model_dir, data, device, dtype)
        self.kwargs = {"condition": condition} if condition else {}
        self.hang_timeout_s = hang_timeout_s
        self.size = n  # actors started (``n`` drops to 1 for the text phase on CPU)
        self.replacements = 0
        self.threads = self.cpus = 0
        self.started_ray = False
        if n == 0:
            self.local = self.encoder_cls(*self.args, **self.kwargs)
            self.actors = []
            return
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        self.cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        self.threads = 0 if device == "cuda" else max(1, self.cpus // n)
        self.actors = [self._start(i) for i in range(n)]
        self._wait_ready(self.actors)

    @classmethod
    def open(cls, model_dir: str, data: DataConfig, dtype: str, condition: str = "", *, num_encoders: int | None,
             device: str, hang_timeout_s: float = HANG_TIMEOUT_S) -> EncoderPool:
        """A pool of ``num_encoders`` actors (None: ``default_size``; 0: in this process) on
        ``device`` (``auto``: ``pick_device``), each an ``Encoder(model_dir, data, device, dtype,
        condition=condition)``. With actors, Ray is joined or started locally."""
        started = num_encoders != 0 and start_ray()
        try:
            dev = pick_device(device, num_encoders != 0)
            n = default_size(dev) if num_encoders is None else num_encoders
            pool = cls(n, model_dir, data, dev, dtype, condition, hang_timeout_s)
        except BaseException:
            if started:
                stop_ray()
            raise
        pool.started_ray = started
        return pool

    def _start(self, i: int):
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        opts = {"num_gpus": 1} if self.device == "cuda" else {}
        actor = ray.remote(self.encoder_cls).options(num_cpus=0, max_concurrency=2, **opts)
        return actor.remote(*self.args, self.threads, **self.kwargs)

    @staticmethod
    def _wait_ready(actors: list, timeout: float = 600.0) -> None:
        """Until the actors' processes are up (imports done): their start does not count against
        the hang watchdog. One that failed to start says so on its first call."""
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        ray.wait([a.__ray_ready__.remote() for a in actors], num_returns=len(actors), timeout=timeout)

    def run(self, method: str, chunks: list[list[dict]], on_result: Callable[[list[dict]], None]) -> None:
        """Call ``Encoder.<method>`` on every chunk and give each call's results to ``on_result``
        (in the order they arrive)."""
        if self.n == 0:
            for chunk in chunks:
                on_result(getattr(self.local, method)(chunk))
            return
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        from ray.exceptions import RayActorError  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        queue = deque((c, 0) for c in chunks)  # (chunk, attempt); attempt 1: a retry, run alone
        running: dict = {}  # ref -> (actor index, actor, chunk, attempt)
        busy = [0] * self.n  # calls in flight on the current actor i
        alone = [False] * self.n  # a retry runs on it: nothing else goes there meanwhile
        progress = [time.monotonic()] * self.n  # when actor i last finished a call (or got one, idle)
        hung: set = set()  # id() of the actors the watchdog killed

        def fill(i: int) -> None:
            while queue and busy[i] < 2 and not alone[i]:
                chunk, attempt = queue[0]
                if attempt and busy[i]:  # a retry waits for an idle actor: only it can be blamed
                    return
                queue.popleft()
                if not busy[i]:
                    progress[i] = time.monotonic()
                running[getattr(self.actors[i], method).remote(chunk)] = (i, self.actors[i], chunk, attempt)
                busy[i] += 1
                alone[i] = attempt > 0

        for i in range(self.n):
            fill(i)
        while running:
            done, _ = ray.wait(list(running), num_returns=1, timeout=self._wait_timeout(busy, progress))
            if not done:
                self._kill_hung(busy, progress, hung)
                continue
            i, actor, chunk, attempt = running.pop(done[0])
            current = self.actors[i] is actor
            if current:
                progress[i] = time.monotonic()
                busy[i] -= 1
                alone[i] = False
            try:
                results = ray.get(done[0])
            except RayActorError as e:
                if "creation task" in str(e):
                    raise RuntimeError(f"an encoder actor could not start: {e}") from e
                if current:  # not replaced yet (its other call fails too, and lands here as not current)
                    self._died(i, e)
                    busy[i], alone[i] = 0, False
                if attempt == 0:  # maybe innocent (another call ran beside it): each task again, alone
                    queue.extendleft(([t], 1) for t in reversed(chunk))
                else:
                    how = (f"hung on it twice (no answer in {self.hang_timeout_s:.0f} s)" if id(actor) in hung
                           else f"died on it twice ({type(e).__name__})")
                    on_result([{"key": chunk[0]["key"], "ok": False, "reason": f"the encoder process {how}"}])
            else:
                on_result(results)
            for j in range(self.n):
                fill(j)

    def _wait_timeout(self, busy: list[int], progress: list[float]) -> float | None:
        """How long to wait for the next result before the watchdog looks (None: forever)."""
        if self.hang_timeout_s <= 0:
            return None
        if not any(busy):
            return self.hang_timeout_s
        oldest = min(progress[i] for i in range(self.n) if busy[i])
        return max(0.1, oldest + self.hang_timeout_s - time.monotonic())

    def _kill_hung(self, busy: list[int], progress: list[float], hung: set) -> None:
        """The watchdog: kill each actor with calls in flight and no progress for ``hang_timeout_s``
        (its calls then fail as a death's do, and land in ``run``)."""
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        for i in range(self.n):
            if busy[i] and time.monotonic() - progress[i] >= self.hang_timeout_s:
                log.warning("encoder %d finished no call in %.0f s (precompute --hang-timeout); killing it as hung",
                            i, self.hang_timeout_s)
                hung.add(id(self.actors[i]))
                ray.kill(self.actors[i], no_restart=True)
                progress[i] = time.monotonic()

    def _died(self, i: int, error: BaseException) -> None:
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        self.replacements += 1
        if self.replacements > 2 * self.n + 4:
            raise RuntimeError(f"encoder actors died {self.replacements} times (last: {error}); check memory and the "
                               f"worker logs") from error
        log.warning("encoder %d died (%s); replacing it and retrying its clips one at a time", i, type(error).__name__)
        ray.kill(self.actors[i], no_restart=True)
        self.actors[i] = self._start(i)
        self._wait_ready([self.actors[i]])

    def shrink_to_one(self) -> None:
        """Keep one actor, with every CPU (on CPU, before the text phase: each UMT5-XXL copy
        takes 22 GB in float32, and the captions are few)."""
        if self.n <= 1:
            return
        import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
        for a in self.actors[1:]:
            ray.kill(a)
        self.actors, self.n = self.actors[:1], 1
        ray.get(self.actors[0].set_threads.remote(self.cpus))

    def close(self) -> None:
        """End the actors (or the in-process encoder), and Ray when ``open`` started it."""
        if self.n == 0:
            self.local.close()
        else:
            import ray  # lazy: Ray costs seconds; --num-encoders 0 runs without it
            for a in self.actors:
                ray.kill(a)
        if self.started_ray:
            stop_ray()
