"""Wiring: makes the three plain actor classes remote, names them, and runs the step schedule.

    decoder-i --batch ref--> compute --(shard, step, ||g||^2)--> param-store
                               ^-------- shard versions / weights -------'

The driver keeps the compute actor one step ahead: step k+1 is queued before step k's
update is collected, so the store's AdamW (shard order 0..L+1) overlaps step k+1's forward,
which waits shard by shard for ``version == k+1``. Before a checkpoint the driver does not
queue ahead, so the saved state is exactly the state after step k.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray

from actors.compute import ComputeActor, StepResult
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore, UpdateResult

log = logging.getLogger(__name__)

NAMESPACE = "megaslide"


class RayStoreClient:
    """The compute actor's view of a remote ParameterStore. Gradient reports are fire-and-
    forget (their refs are kept and checked once per step, so an error is never lost)."""

    def __init__(self, store_handle):
        self._store = store_handle
        self._inflight: list = []

    def wait_version(self, shard: int, step: int) -> int:
        return ray.get(self._store.wait_version.remote(shard, step))

    def get_weights(self, shard: int, step: int):
        return ray.get(self._store.get_weights.remote(shard, step))

    def report_grad(self, shard: int, step: int, sqnorm: float, grad) -> None:
        self._inflight.append(self._store.report_grad.remote(shard, step, sqnorm, grad))

    def flush(self) -> None:
        refs, self._inflight = self._inflight, []
        ray.get(refs)

    def __getstate__(self):
        return {"_store": self._store, "_inflight": []}


@dataclass(frozen=True)
class StepReport:
    compute: StepResult
    update: UpdateResult


class StreamingPipeline:
    """Owns the actors of one run. ``run_step(k)`` returns step k's compute and update results."""

    def __init__(self, cfg, run_dir: str, resume_checkpoint: str | None = None, start_position: int = 0):
        self.cfg = cfg
        use_gpu = cfg.runtime.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1
        if cfg.runtime.device == "cuda" and not use_gpu:
            raise RuntimeError("runtime.device='cuda' but the Ray cluster has no GPU; use 'auto' or 'cpu'")
        w_dtype = "bfloat16" if use_gpu else "float32"
        # The store serves many blocking calls (wait_version) at once: a threaded actor.
        store_cls = ray.remote(ParameterStore).options(
            name=f"{NAMESPACE}/param-store", num_cpus=0, max_concurrency=64)
        self.store = store_cls.remote(cfg, run_dir, w_dtype, resume_checkpoint)
        infos = ray.get(self.store.shard_infos.remote())
        store_node = ray.get(self.store.status.remote()).node_id

        # transport "auto": the compute actor compares its node with the store's once placed.
        self.compute = ray.remote(ComputeActor).options(
            name=f"{NAMESPACE}/compute", num_cpus=0 if use_gpu else 1, num_gpus=1 if use_gpu else 0,
        ).remote(cfg, infos, RayStoreClient(self.store), cfg.runtime.transport, store_node)
        transport = ray.get(self.compute.transport_name.remote())
        self.transport = transport

        self.decoders = [
            ray.remote(VideoDecoder).options(name=f"{NAMESPACE}/decoder-{i}", num_cpus=0).remote(
                cfg.data, cfg.training.seed, cfg.model.caption_max_bytes, start_position, i, cfg.data.num_decoders)
            for i in range(cfg.data.num_decoders)
        ]
        self._queued: dict[int, object] = {}
        self._first_batch = None
        log.info("pipeline up: %d shards, weights %s, transport %s, %s", len(infos), w_dtype, transport,
                 "GPU" if use_gpu else "CPU")

    def _submit(self, step: int) -> None:
        if step in self._queued:
            return
        if self.cfg.training.overfit_one_batch and self._first_batch is not None:
            batch_ref = self._first_batch
        else:
            batch_ref = self.decoders[step % len(self.decoders)].next_batch.remote()
            if self._first_batch is None:
                self._first_batch = batch_ref
        self._queued[step] = self.compute.train_step.remote(batch_ref, step)

    def run_step(self, step: int, queue_next: bool) -> StepReport:
        """Run step ``step``; with ``queue_next`` also queue step + 1 behind it."""
        self._submit(step)
        if queue_next:
            self._submit(step + 1)
        result = ray.get(self._queued.pop(step))
        update = ray.get(self.store.wait_step.remote(step))
        return StepReport(result, update)

    def save_checkpoint(self, run_dir: str, step: int, extra: dict) -> str:
        return ray.get(self.store.save_checkpoint.remote(run_dir, step, extra))

    def decoder_stats(self):
        return ray.get([d.stats.remote() for d in self.decoders])

    def close(self) -> None:
        for ref in self._queued.values():
            ray.cancel(ref, force=False)
        self._queued.clear()
        handles = [self.compute, *self.decoders]
        for h, method in [(self.compute, "close"), *[(d, "close") for d in self.decoders]]:
            try:
                ray.get(getattr(h, method).remote(), timeout=30)
            except Exception as e:  # noqa: BLE001 - closing best-effort, then killed below
                log.debug("closing actor failed: %r", e)
        try:
            ray.get(self.store.close.remote(), timeout=60)
        except Exception as e:  # noqa: BLE001
            log.warning("parameter store did not close cleanly: %r", e)
        for h in handles + [self.store]:
            ray.kill(h)
