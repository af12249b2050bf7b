"""The Trainer: ``__init__`` builds everything, ``train_step`` runs one step, ``train`` loops,
``close`` cleans up. Ray must already be initialised (the CLI in ``train.py`` does that)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_state
from megaslide_ray.config import Config, to_toml
from megaslide_ray.runtime.faults import fault_point
from megaslide_ray.runtime.metrics import RunMetrics
from pipelines.decoder_pool import DataCursor
from pipelines.streaming import StoreLostError, StreamingPipeline
from megaslide_ray.data.checks import check_data

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
    stopped_by: str = ""    # why the run stopped before training.steps (a signal), else ""
    bad_steps: int = 0      # steps whose update was skipped (NaN/Inf loss or gradients)
    restarts: int = 0       # actor failures recovered from
    rollbacks: int = 0      # times the latest checkpoint was restored (the store's state was lost)


class BadStepsError(RuntimeError):
    """``optim.max_bad_steps`` steps in a row had NaN/Inf loss or gradients."""


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def checkpoint_data_state(ckpt: Path, num_decoders: int) -> tuple[int, DataCursor]:
    """(steps done, where each decoder continues) recorded in checkpoint ``ckpt``. A checkpoint
    of a different ``data.num_decoders`` is refused (ValueError)."""
    state = read_checkpoint_state(ckpt)
    return int(state["step"]), DataCursor.from_state(state, num_decoders, f"checkpoint {ckpt}")


def resume_point(run_dir: str | Path, num_decoders: int) -> tuple[Path, int, DataCursor]:
    """The latest complete checkpoint of ``run_dir`` with its step and data state, for
    ``--resume``: FileNotFoundError when there is none, ValueError (see above) when it cannot
    continue this run's data order."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {Path(run_dir) / 'checkpoints'}; "
                                f"start without --resume or point --run-dir at an earlier run")
    return (ckpt, *checkpoint_data_state(ckpt, num_decoders))


def resolve_data(cfg: Config) -> Config:
    """An empty manifest means the demo set: make it here, once, before any actor starts. The
    data is checked against the model first (``check_data``)."""
    check_data(cfg)
    if cfg.data.manifest:
        return cfg
    from megaslide_ray.data.demo import ensure_demo_dataset

    cfg.data = replace(cfg.data, manifest=str(ensure_demo_dataset()))
    return cfg


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | None = None, resume: bool = False, progress: bool = True,
                 init_from: str | None = None, val_set=None):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.training.run_dir or default_run_dir())
        self.progress = progress
        self.start_step, position, ckpt = 0, 0, None
        if resume:
            ckpt, self.start_step, position = resume_point(self.run_dir, cfg.data.num_decoders)
            if self.start_step >= cfg.training.steps:
                log.warning("checkpoint is at step %d and training.steps=%d: nothing to do; raise --steps",
                            self.start_step, cfg.training.steps)
        if init_from and ckpt is not None:
            log.warning("--init-from %s ignored: resuming from %s, which holds the trained weights", init_from, ckpt)
            init_from = None
        if init_from:
            from megaslide_ray.state.pretrained import check_pretrained

            check_pretrained(cfg, init_from)  # every mismatch in one error, before any actor starts
        resolve_data(cfg)
        # The validation clips (``evaluate.ValSet``; the CLI decodes them before Ray starts and
        # hands them over), decoded once, here, before any actor starts.
        self.val_set = val_set
        if cfg.training.eval_every and val_set is None:
            from megaslide_ray.evaluation.validation import load_val_set

            self.val_set = load_val_set(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(to_toml(cfg))
        # The only pipeline of the run: a rollback rebuilds its actors in place.
        self.pipeline = StreamingPipeline(cfg, str(self.run_dir), str(ckpt) if ckpt else None, position,
                                          init_from=str(Path(init_from).resolve()) if init_from else None)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self._metrics = self.metrics_path.open("a")
        # Ray dashboard / Prometheus: the same numbers, tagged by run name.
        self.ray_metrics = RunMetrics(self.run_dir.name, self.pipeline.status().state_bytes)
        self._last_time = time.perf_counter()
        self.last_checkpoint = str(ckpt) if ckpt else ""
        self.stop_reason = ""   # set by request_stop (a signal handler): stop after the current step
        self.bad_steps = 0      # updates skipped for NaN/Inf in this run
        self._bad_streak = 0    # ... of them in a row, up to the last step

    def request_stop(self, reason: str) -> None:
        """Ask the loop to stop after the step in progress, checkpoint and return (safe to call
        from a signal handler: it only sets a flag)."""
        self.stop_reason = reason

    def _restore_latest(self, error: StoreLostError) -> int:
        """The store's state is lost: roll the pipeline back to the latest checkpoint (or to the
        initial weights when there is none yet) and return the step to go on from. The steps
        after the checkpoint are redone (same batches, same noise)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is not None:
            step, position = checkpoint_data_state(ckpt, self.cfg.data.num_decoders)
        else:
            step, position = 0, 0
        log.warning("%s\nRestoring %s and redoing the steps after it.", error,
                    f"checkpoint {ckpt} (step {step})" if ckpt else "the initial weights (no checkpoint yet)")
        self.pipeline.rollback_to(str(ckpt) if ckpt else None, position)
        self._bad_streak = 0
        self._last_time = time.perf_counter()
        return step

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.training.checkpoint_every
        done = step + 1
        return done == self.cfg.training.steps or (every > 0 and done % every == 0)

    def _sample_due(self, step: int) -> bool:
        every = self.cfg.training.sample_every
        return every > 0 and (step + 1) % every == 0

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.training.eval_every
        return every > 0 and (step + 1) % every == 0

    def evaluate(self, version: int) -> dict:
        """The validation loss of the weights of ``version`` (forward only, through the compute
        actor): the metrics.jsonl fields ``val_loss``, ``val_loss_t{b}`` and ``val_seconds``
        (none when the store's versions were not all ``version`` around it: see below)."""
        from megaslide_ray.evaluation.validation import validation_loss

        # ``version`` is k + 1 after step k: predict() waits until each shard's version is k + 1,
        # i.e. until the store has applied step k's update to it. Before that a shard's ``w``
        # segment may hold its gradient (between its backward and its update), never weights to
        # read. Nothing is queued past step k (see train_step), so no shard can move on while the
        # evaluation reads it (on a CPU the weights are read in place); checked before and after.
        before = self.pipeline.status().versions
        result = validation_loss(self.pipeline, self.cfg, self.val_set, version).as_row()
        after = self.pipeline.status().versions
        if any(v != version for v in (*before, *after)):
            log.warning("validation after step %d skipped: shard versions %s / %s, not all %d (a step was queued "
                        "past it)", version, before, after, version)
            return {}
        return result

    def sample(self, version: int) -> Path:
        """Sample the fixed prompt with the weights of ``version`` through the compute actor
        (forward only) into ``samples/step_N.mp4`` and its ``.png`` contact sheet."""
        from megaslide_ray.data.demo import write_video
        from megaslide_ray.evaluation.sampling import contact_sheet, euler_sample, to_uint8_frames, write_png

        t = self.cfg.training
        x = euler_sample(self.pipeline, self.cfg, t.sample_prompt, t.sample_steps, t.seed, version)
        frames = to_uint8_frames(x)
        out = self.run_dir / "samples" / f"step_{version}.mp4"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_video(out, frames)
        write_png(out.with_suffix(".png"), contact_sheet(frames))
        return out

    def train_step(self, step: int) -> dict:
        due = self._checkpoint_due(step)
        sample_due = self._sample_due(step)
        eval_due = self._eval_due(step)
        # Before a checkpoint, a sample, an evaluation or a requested stop nothing is queued
        # ahead: the state must be step k's.
        report = self.pipeline.run_step(step, queue_next=not (due or sample_due or eval_due or self.stop_reason)
                                        and step + 1 < self.cfg.training.steps)
        now = time.perf_counter()
        wall, self._last_time = now - self._last_time, now
        c, u = report.compute, report.update
        row = {
            "step": step + 1, "loss": c.loss, "lr": u.lr, "grad_norm": u.grad_norm, "clip_coef": u.clip_coef,
            "update_skipped": u.skipped, "tokens": c.tokens, "tokens_per_s": c.tokens / wall, "step_seconds": wall,
            "compute_seconds": c.seconds, "forward_seconds": c.forward_seconds,
            "backward_seconds": c.backward_seconds, "weight_wait_seconds": c.weight_wait_seconds,
            # data wait: the compute actor's own, plus time lost to a decoder that hung or died
            "optimizer_seconds": u.optimizer_seconds,
            "data_wait_seconds": c.data_wait_seconds + report.data_lost_seconds,
            "h2d_bytes": c.h2d_bytes, "h2d_gbps": c.h2d_bytes / c.h2d_seconds / 1e9 if c.h2d_seconds else 0.0,
            "d2h_bytes": c.d2h_bytes, "d2h_gbps": c.d2h_bytes / c.d2h_seconds / 1e9 if c.d2h_seconds else 0.0,
            "device_memory_peak_bytes": c.device_memory_peak_bytes,
            "data_position": c.data_position, "data_rows": list(report.batch.rows) if report.batch else None,
            "skipped_files": report.skipped_files, "decoders_replaced": self.pipeline.decoders_replaced,
            "device": c.device, "time": time.time(),
        }
        self._count_bad_step(row)
        row["bad_steps"] = self.bad_steps
        row["restarts"] = self.pipeline.restarts
        if eval_due:
            row.update(self.evaluate(step + 1))
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if (step + 1) % self.cfg.training.log_every == 0 or step == self.start_step:
            stats = self.pipeline.decoder_stats()
            seconds = sum(st.decode_seconds for st in stats)
            self.ray_metrics.record_decoders(sum(st.frames_decoded for st in stats) / seconds if seconds else 0.0)
        self.ray_metrics.record(row)
        if sample_due:
            row["sample"] = str(self.sample(step + 1))
        # What a checkpoint after this step must record of the data (where the next batch starts).
        self._data_extra = {**self.pipeline.data_cursor(step + 1).to_state(), "data_position": c.data_position,
                            "seed": self.cfg.training.seed, "skipped_files": row["skipped_files"]}
        if due:
            self.last_checkpoint = self.pipeline.save_checkpoint(
                str(self.run_dir), step + 1, self._data_extra)
        if due or sample_due or eval_due:  # the next step's time excludes saving, sampling, evaluating
            self._last_time = time.perf_counter()
        return row

    def _count_bad_step(self, row: dict) -> None:
        """NaN/Inf in the loss or gradients: the store skipped the update on every shard. Count
        it; ``optim.max_bad_steps`` in a row stop the run."""
        if not row["update_skipped"]:
            self._bad_streak = 0
            return
        self.bad_steps += 1
        self._bad_streak += 1
        limit = self.cfg.optim.max_bad_steps
        log.warning("step %d: loss %s, gradient norm %s: not finite; the update was skipped on every shard "
                    "(%d bad step(s) in a row; the run stops at optim.max_bad_steps=%d)", row["step"], row["loss"],
                    row["grad_norm"], self._bad_streak, limit)
        if limit and self._bad_streak >= limit:
            raise BadStepsError(
                f"{self._bad_streak} steps in a row (up to step {row['step']}) had NaN/Inf loss or gradients "
                f"(optim.max_bad_steps={limit}); stopping. The weights are those before the first bad step (no "
                f"update was applied); the latest checkpoint is {self.last_checkpoint or 'none'}. Lower optim.lr, "
                f"raise optim.warmup_steps or check the data, then --resume")

    def _say(self, msg: str, bar) -> None:
        if self.progress:  # the bar owns the terminal: print above it
            bar.write(msg)
        else:
            log.info(msg)

    def _finish_queued(self, step: int, rows: list, bar) -> int:
        """A stop was requested: run ``step`` if it is already queued on the compute actor (its
        gradients may be partly reported), so the state is a whole step; return the next step."""
        if step < self.cfg.training.steps and self.pipeline.is_queued(step):
            rows.append(self.train_step(step))
            bar.update(1)
            step += 1
        return step

    def _checkpoint_on_stop(self, step: int) -> None:
        if step > self.start_step and not self.last_checkpoint.endswith(f"step_{step}"):
            self.last_checkpoint = self.pipeline.save_checkpoint(
                str(self.run_dir), step, self._data_extra)

    def train(self) -> TrainSummary:
        steps = self.cfg.training.steps
        rows = []
        bar = tqdm(total=steps, initial=self.start_step, disable=not self.progress, unit="step", dynamic_ncols=True)
        self._last_time = time.perf_counter()
        step = self.start_step
        try:
            while step < steps:
                if self.stop_reason:
                    step = self._finish_queued(step, rows, bar)
                    self._checkpoint_on_stop(step)
                    break
                try:
                    row = self.train_step(step)
                except StoreLostError as e:
                    step = self._restore_latest(e)
                    bar.reset(total=steps)
                    bar.update(step)
                    continue
                fault_point("driver.after_step", step)
                step += 1
                rows.append(row)
                bar.update(1)
                bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                data_wait=f"{100 * row['data_wait_seconds'] / row['step_seconds']:.0f}%")
                if row["step"] % self.cfg.training.log_every == 0 or row["step"] == steps:
                    msg = (f"step {row['step']}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
                           f"grad {row['grad_norm']:.3f} | {row['tokens_per_s']:.0f} tok/s | "
                           f"{row['step_seconds']:.2f} s/step | skipped files {row['skipped_files']}")
                    self._say(msg, bar)
                if "val_loss" in row:
                    buckets = sorted((k for k in row if k.startswith("val_loss_t")), key=lambda k: int(k[10:]))
                    self._say(f"step {row['step']}/{steps} | val_loss {row['val_loss']:.4f} | by t-bucket "
                              + " ".join(f"{row[k]:.4f}" for k in buckets), bar)
        finally:
            bar.close()
        extra = {"stopped_by": self.stop_reason if step < steps else "", "bad_steps": self.bad_steps,
                 "restarts": self.pipeline.restarts, "rollbacks": self.pipeline.rollbacks}
        if not rows:
            return TrainSummary(str(self.run_dir), self.start_step, self.start_step, float("nan"), float("nan"),
                                0.0, 0.0, self.last_checkpoint, **extra)
        timed = rows[1:] or rows  # the first step includes warm-up
        mean_s = sum(r["step_seconds"] for r in timed) / len(timed)
        return TrainSummary(
            run_dir=str(self.run_dir), first_step=self.start_step, last_step=rows[-1]["step"],
            first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"], mean_step_seconds=mean_s,
            tokens_per_second=sum(r["tokens"] for r in timed) / sum(r["step_seconds"] for r in timed),
            checkpoint=self.last_checkpoint, **extra,
        )

    def close(self) -> None:
        self.pipeline.close()
        self._metrics.close()

    def abort(self) -> None:
        """Quit at once (a second Ctrl-C): kill the actors without waiting for them, drop the
        shared-memory state. Checkpoints are written atomically, so the latest complete one stays."""
        self.pipeline.abort()
        self._metrics.close()
