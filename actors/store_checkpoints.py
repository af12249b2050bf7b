"""The parameter store's checkpoints: written from its shared-memory state shard by shard, and
read into a fresh state (``ParameterStore(..., resume_checkpoint=...)``). The format and the
crash-safe write (temporary directory, fsync, rename, then ``latest``) are
``megaslide_ray/state/checkpoint.py``'s; a run on several nodes has node 0's store write every
shard, the other owners' optimizer state fetched through Ray (``NodeSyncMethods.checkpoint_state``)."""

from __future__ import annotations

import logging

from megaslide_ray.runtime.faults import fault_point
from megaslide_ray.state.checkpoint import CHECKPOINT_KINDS, CheckpointReader, write_checkpoint

log = logging.getLogger(__name__)


class CheckpointMethods:
    """The ``ParameterStore`` methods that write and read checkpoints."""

    def save_checkpoint(self, run_dir: str, step: int, extra: dict) -> str:
        """Write ``run_dir/checkpoints/step_N`` shard by shard (``megaslide_ray.state.checkpoint``:
        temporary directory, fsync, rename, then ``latest``; a crash leaves the previous one intact).

        The state must be exactly step ``step``'s: this waits for that update, holds back any
        later one while writing, and refuses if a later update was already applied. A write
        that fails (full disk, unwritable directory) raises ``CheckpointWriteError`` naming
        the directory and the reason; the previous checkpoint and ``latest`` stay as they were."""
        for i in range(self.n):
            self.wait_version(i, step)
        with self._lock:
            self._saving += 1
            while self._applying:  # an update that started before we got here finishes first
                self._lock.wait(1.0)
        try:
            versions = self.versions.tolist()
            if any(v != step for v in versions):
                raise RuntimeError(f"checkpoint of step {step} asked for, but the parameter store already holds "
                                   f"versions {versions}: a later step was applied (queue no step ahead of a "
                                   f"checkpoint)")
            return self._write_checkpoint(run_dir, step, extra)
        finally:
            with self._lock:
                self._saving -= 1
                self._lock.notify_all()

    def _write_checkpoint(self, run_dir: str, step: int, extra: dict) -> str:
        def shards():  # one shard at a time; the fault point fires halfway, as a kill mid-write would
            for i, lay in enumerate(self.layouts):
                if i == self.n // 2:
                    fault_point("store.mid_checkpoint", step - 1)
                yield lay, self.checkpoint_state(i, step)

        doc = {"w_dtype": self.w_dtype, "config": self.cfg.to_dict(), **extra}
        return write_checkpoint(run_dir, step, shards(), doc)

    def _load_checkpoint(self, path: str) -> None:
        with CheckpointReader(path, self.n) as ckpt:
            for i, lay in enumerate(self.layouts):
                if not self.owns(i):  # another node owns its optimizer state (several nodes)
                    self.seg[i]["w"].copy_(ckpt.tensor(i, "master", lay.numel))
                    continue
                for kind in CHECKPOINT_KINDS:
                    self.seg[i][kind].copy_(ckpt.tensor(i, kind, lay.numel))
                self.seg[i]["w"].copy_(self.seg[i]["master"])  # w is master cast: not stored
                self._load_average(ckpt, i, lay.numel)
            self.versions.fill_(ckpt.step)

    def _load_average(self, ckpt: CheckpointReader, i: int, numel: int) -> None:
        """Shard ``i``'s moving average (``training.ema_decay``) from the checkpoint, exactly; one
        written without it starts the average at the checkpoint's weights."""
        if "ema" not in self.seg[i]:
            return
        if ckpt.has(i, "ema"):
            self.seg[i]["ema"].copy_(ckpt.tensor(i, "ema", numel))
            return
        if i == 0:
            log.warning("checkpoint %s holds no moving average of the weights (its run had no training.ema_decay): "
                        "the average starts at its weights", ckpt.path)
        self.seg[i]["ema"].copy_(self.seg[i]["master"])
