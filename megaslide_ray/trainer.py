"""The Trainer: ``__init__`` builds everything, ``train_step`` runs one step, ``train`` loops,
``close`` cleans up. Ray must already be initialised (the CLI in ``train.py`` does that)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import ray
from tqdm import tqdm

from actors.param_store import latest_checkpoint, read_checkpoint_state
from megaslide_ray.config import Config, to_toml
from megaslide_ray.metrics import RunMetrics
from pipelines.streaming import StreamingPipeline

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSummary:
    run_dir: str
    first_step: int
    last_step: int          # steps completed in total
    first_loss: float
    last_loss: float
    mean_step_seconds: float
    tokens_per_second: float
    checkpoint: str


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def resolve_data(cfg: Config) -> Config:
    """An empty manifest means the demo set: make it here, once, before any actor starts."""
    if cfg.data.manifest:
        return cfg
    from megaslide_ray.demo_data import ensure_demo_dataset

    cfg.data = replace(cfg.data, manifest=str(ensure_demo_dataset()))
    return cfg


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | None = None, resume: bool = False, progress: bool = True,
                 init_from: str | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.training.run_dir or default_run_dir())
        self.progress = progress
        self.start_step, position, ckpt = 0, 0, None
        self._skipped_before = 0  # files skipped before a resume (a new decoder counts from 0)
        if resume:
            ckpt = latest_checkpoint(self.run_dir)
            if ckpt is None:
                raise FileNotFoundError(f"--resume: no complete checkpoint under {self.run_dir / 'checkpoints'}; "
                                        f"start without --resume or point --run-dir at an earlier run")
            state = read_checkpoint_state(ckpt)
            self.start_step, position = int(state["step"]), int(state.get("data_position", 0))
            self._skipped_before = int(state.get("skipped_files", 0))
            if self.start_step >= cfg.training.steps:
                log.warning("checkpoint is at step %d and training.steps=%d: nothing to do; raise --steps",
                            self.start_step, cfg.training.steps)
        if init_from and ckpt is not None:
            log.warning("--init-from %s ignored: resuming from %s, which holds the trained weights", init_from, ckpt)
            init_from = None
        if init_from:
            from megaslide_ray.pretrained import check_pretrained

            check_pretrained(cfg, init_from)  # every mismatch in one error, before any actor starts
        resolve_data(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))
        self.pipeline = StreamingPipeline(cfg, str(self.run_dir), str(ckpt) if ckpt else None, position,
                                          init_from=str(Path(init_from).resolve()) if init_from else None)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._metrics = self.metrics_path.open("a")
        # Ray dashboard / Prometheus: the same numbers, tagged by run name.
        self.ray_metrics = RunMetrics(self.run_dir.name, ray.get(self.pipeline.store.status.remote()).state_bytes)
        self._last_time = time.perf_counter()
        self.last_checkpoint = str(ckpt) if ckpt else ""

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.training.checkpoint_every
        done = step + 1
        return done == self.cfg.training.steps or (every > 0 and done % every == 0)

    def _sample_due(self, step: int) -> bool:
        every = self.cfg.training.sample_every
        return every > 0 and (step + 1) % every == 0

    def sample(self, version: int) -> Path:
        """Sample the fixed prompt with the weights of ``version`` through the compute actor
        (forward only) into ``samples/step_N.mp4`` and its ``.png`` contact sheet."""
        from megaslide_ray.demo_data import write_video
        from megaslide_ray.sample import contact_sheet, euler_sample, to_uint8_frames, write_png

        compute = self.pipeline.compute

        class RemotePredict:  # euler_sample's view of the remote actor
            @staticmethod
            def predict(*args):
                return ray.get(compute.predict.remote(*args))

        t = self.cfg.training
        x = euler_sample(RemotePredict, self.cfg, t.sample_prompt, t.sample_steps, t.seed, version)
        frames = to_uint8_frames(x)
        out = self.run_dir / "samples" / f"step_{version}.mp4"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_video(out, frames)
        write_png(out.with_suffix(".png"), contact_sheet(frames))
        return out

    def train_step(self, step: int) -> dict:
        due = self._checkpoint_due(step)
        sample_due = self._sample_due(step)
        # Before a checkpoint or a sample nothing is queued ahead: the state must be step k's.
        report = self.pipeline.run_step(step, queue_next=not (due or sample_due)
                                        and step + 1 < self.cfg.training.steps)
        now = time.perf_counter()
        wall, self._last_time = now - self._last_time, now
        c, u = report.compute, report.update
        row = {
            "step": step + 1, "loss": c.loss, "lr": u.lr, "grad_norm": u.grad_norm, "clip_coef": u.clip_coef,
            "update_skipped": u.skipped, "tokens": c.tokens, "tokens_per_s": c.tokens / wall, "step_seconds": wall,
            "compute_seconds": c.seconds, "forward_seconds": c.forward_seconds,
            "backward_seconds": c.backward_seconds, "weight_wait_seconds": c.weight_wait_seconds,
            "optimizer_seconds": u.optimizer_seconds, "data_wait_seconds": c.data_wait_seconds,
            "h2d_bytes": c.h2d_bytes, "h2d_gbps": c.h2d_bytes / c.h2d_seconds / 1e9 if c.h2d_seconds else 0.0,
            "d2h_bytes": c.d2h_bytes, "d2h_gbps": c.d2h_bytes / c.d2h_seconds / 1e9 if c.d2h_seconds else 0.0,
            "device_memory_peak_bytes": c.device_memory_peak_bytes,
            "data_position": c.data_position,
            "skipped_files": self._skipped_before + c.skipped_files, "device": c.device, "time": time.time(),
        }
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if (step + 1) % self.cfg.training.log_every == 0 or step == self.start_step:
            stats = self.pipeline.decoder_stats()
            seconds = sum(st.decode_seconds for st in stats)
            self.ray_metrics.record_decoders(sum(st.frames_decoded for st in stats) / seconds if seconds else 0.0)
        self.ray_metrics.record(row)
        if sample_due:
            row["sample"] = str(self.sample(step + 1))
        if due:
            self.last_checkpoint = self.pipeline.save_checkpoint(
                str(self.run_dir), step + 1, {"data_position": c.data_position, "seed": self.cfg.training.seed,
                                              "skipped_files": row["skipped_files"]})
        if due or sample_due:  # the next step's time should not include saving or sampling
            self._last_time = time.perf_counter()
        return row

    def train(self) -> TrainSummary:
        steps = self.cfg.training.steps
        rows = []
        bar = tqdm(total=steps, initial=self.start_step, disable=not self.progress, unit="step", dynamic_ncols=True)
        self._last_time = time.perf_counter()
        try:
            for step in range(self.start_step, steps):
                row = self.train_step(step)
                rows.append(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                data_wait=f"{100 * row['data_wait_seconds'] / row['step_seconds']:.0f}%")
                if row["step"] % self.cfg.training.log_every == 0 or row["step"] == steps:
                    msg = (f"step {row['step']}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
                           f"grad {row['grad_norm']:.3f} | {row['tokens_per_s']:.0f} tok/s | "
                           f"{row['step_seconds']:.2f} s/step | skipped files {row['skipped_files']}")
                    if self.progress:  # the bar owns the terminal: print above it
                        bar.write(msg)
                    else:
                        log.info(msg)
        finally:
            bar.close()
        if not rows:
            return TrainSummary(str(self.run_dir), self.start_step, self.start_step, float("nan"), float("nan"),
                                0.0, 0.0, self.last_checkpoint)
        timed = rows[1:] or rows  # the first step includes warm-up
        mean_s = sum(r["step_seconds"] for r in timed) / len(timed)
        return TrainSummary(
            run_dir=str(self.run_dir), first_step=self.start_step, last_step=rows[-1]["step"],
            first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"], mean_step_seconds=mean_s,
            tokens_per_second=sum(r["tokens"] for r in timed) / sum(r["step_seconds"] for r in timed),
            checkpoint=self.last_checkpoint,
        )

    def close(self) -> None:
        self.pipeline.close()
        self._metrics.close()
