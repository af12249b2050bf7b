"""The Trainer: ``__init__`` builds everything, ``train_step`` runs one step, ``train`` loops,
``close`` cleans up. Ray must already be initialised (``driver.launch`` does that).

A step is the pipeline's (``pipelines.streaming``: the compute actor's forward and backward, the
store's AdamW overlapping the next step's forward); what follows a step is the components'
(``driver.components``: checkpoint, validation, sample, metrics, the NaN guard), each asked
whether it is due."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from megaslide_ray.config import Config, to_toml
from megaslide_ray.data.checks import check_data
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver.components import (
    BadStepGuard,
    Checkpointer,
    MetricsLog,
    Sampler,
    Validator,
)
from megaslide_ray.driver.trackers import open_tracker
from megaslide_ray.evaluation.sampling import sample_model_dir
from megaslide_ray.evaluation.validation import load_val_set
from megaslide_ray.runtime.faults import fault_point
from megaslide_ray.state.checkpoint import (
    CheckpointDamagedError,
    describe_damaged,
    latest_checkpoint,
    newest_complete_checkpoint,
    read_checkpoint_state,
)
from megaslide_ray.state.kept import KeptState, check_kept_state, find_kept_state
from megaslide_ray.state.preflight import w_dtype_bytes
from megaslide_ray.state.pretrained_io import check_pretrained
from megaslide_ray.training.flow import EXPERT_NAMES
from pipelines.decoder_pool import DataCursor
from pipelines.store_client import StoreLostError
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
    stopped_by: str = ""    # why the run stopped before training.steps (a signal), else ""
    bad_steps: int = 0      # steps whose update was skipped (NaN/Inf loss or gradients)
    restarts: int = 0       # actor failures recovered from
    rollbacks: int = 0      # times the latest checkpoint was restored (the store's state was lost)


def seconds_per_step(rows: list[dict]) -> float:
    """The run's s/step, the one figure the step line, the progress bar and the summary show: the
    mean ``step_seconds`` (the driver's wall time per step, docs/metrics.md) of the steps this
    process ran so far, the first one left out (it includes warm-up) once there are two."""
    timed = rows[1:] or rows
    return sum(r["step_seconds"] for r in timed) / len(timed) if timed else 0.0


def default_run_dir() -> str:
    return str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))


def checkpoint_data_state(ckpt: Path, num_decoders: int) -> tuple[int, DataCursor]:
    """(steps done, where each decoder continues) recorded in checkpoint ``ckpt``. A checkpoint
    of a different ``data.num_decoders`` is refused (ValueError)."""
    state = read_checkpoint_state(ckpt)
    return int(state["step"]), DataCursor.from_state(state, num_decoders, f"checkpoint {ckpt}")


@dataclass(frozen=True)
class ResumePoint:
    """Where ``--resume`` continues: the newest complete checkpoint, or the shared-memory state a
    failed run kept when that is newer (``megaslide_ray.state.kept``)."""
    step: int                    # steps done
    cursor: DataCursor           # where each decoder continues
    checkpoint: Path | None      # the newest complete checkpoint (None: there is none)
    kept: KeptState | None = None  # continue from this kept state instead of the checkpoint
    notes: tuple[str, ...] = ()  # what was passed over: damaged checkpoints, a kept state that does not fit


def resume_point(cfg: Config, run_dir: str | Path, known_damaged: dict[Path, str] | None = None) -> ResumePoint:
    """Where ``--resume`` continues ``run_dir`` (checked before Ray starts; nothing is written):
    the newest checkpoint whose files are all there and of the size they were written with
    (newer damaged ones are named in ``notes`` and in a warning), or a kept state newer than it
    that fits this run. FileNotFoundError when neither exists; ValueError when the data order
    cannot continue (another ``data.num_decoders``). ``known_damaged``: checkpoints whose
    tensors did not match their checksums when the store read them (passed over; no kept state
    is considered then: the store already refused the newest checkpoint)."""
    ckpt, damaged = newest_complete_checkpoint(run_dir, known_damaged)
    notes = []
    if damaged:
        notes.append(f"{describe_damaged(damaged)}; " + (f"falling back to {ckpt}" if ckpt else "none is complete"))
    ckpt_step = int(read_checkpoint_state(ckpt)["step"]) if ckpt else 0
    kept = None if known_damaged else find_kept_state(cfg, run_dir)
    if kept is not None:
        problems = (["it is not newer than that checkpoint"] if ckpt and kept.step <= ckpt_step
                    else check_kept_state(kept, cfg, "bfloat16" if w_dtype_bytes(cfg) == 2 else "float32"))
        if problems:
            notes.append(f"the shared-memory state a failed run kept, {kept.describe()}, is not used and will be "
                         f"replaced: {'; '.join(problems)}")
            kept = None
    for note in notes:
        log.warning("--resume: %s", note)
    if kept is not None:
        cursor = DataCursor.from_state(kept.doc, cfg.data.num_decoders, f"the kept state {kept.path}")
        return ResumePoint(kept.step, cursor, ckpt, kept, tuple(notes))
    if ckpt is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint under {Path(run_dir) / 'checkpoints'}"
                                + (f" ({describe_damaged(damaged)})" if damaged else "")
                                + "; start without --resume or point --run-dir at an earlier run")
    step, cursor = checkpoint_data_state(ckpt, cfg.data.num_decoders)
    return ResumePoint(step, cursor, ckpt, None, tuple(notes))


def resolve_data(cfg: Config) -> Config:
    """An empty manifest means the demo set: make it here, once, before any actor starts. The
    data is checked against the model first (``check_data``)."""
    check_data(cfg)
    if cfg.data.manifest:
        return cfg

    cfg.data = replace(cfg.data, manifest=str(ensure_demo_dataset(cfg.data.cache_dir or None)))
    return cfg


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | None = None, resume: bool = False, progress: bool = True,
                 init_from: str | None = None, val_set=None, tracker=None):
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.training.run_dir or default_run_dir())
        self.progress = progress
        self.start_step, position, ckpt, kept = 0, 0, None, None
        self.done = 0  # steps completed: the state's version once the last one is applied
        # What a checkpoint (or a kept state) after the last step records of the data (where the
        # next batch starts), and that step.
        self.data_state: dict = {}
        if resume:
            point = resume if isinstance(resume, ResumePoint) else resume_point(cfg, self.run_dir)
            ckpt, position, kept, init_from = self._resume_from(point, init_from)
        if init_from and ckpt is not None:
            log.warning("--init-from %s ignored: resuming from %s, which holds the trained weights", init_from, ckpt)
            init_from = None
        if init_from:
            check_pretrained(cfg, init_from)  # every mismatch in one error, before any actor starts
            if not resume:  # config.toml records where the weights came from
                cfg.training = replace(cfg.training, init_from=str(Path(init_from).resolve()))
        resolve_data(cfg)
        # A latent model's samples need its model folder: refused (ConfigError) before any actor starts.
        sample_dir = sample_model_dir(cfg, init_from) if cfg.training.sample_every else None
        # The validation clips (``evaluation.validation.ValSet``; the CLI decodes them before Ray
        # starts and hands them over), decoded once, here, before any actor starts.
        if cfg.training.eval_every and val_set is None:
            val_set = load_val_set(cfg)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # The only pipeline of the run: a rollback rebuilds its actors in place. A checkpoint whose
        # tensors fail their checksums when the store reads them is passed over for an older one.
        damaged: dict[Path, str] = {}
        while True:
            try:
                self.pipeline = StreamingPipeline(cfg, str(self.run_dir), str(ckpt) if ckpt else None, position,
                                                  init_from=str(Path(init_from).resolve()) if init_from else None,
                                                  kept_doc=kept.doc if kept else None)
                break
            except CheckpointDamagedError as e:
                if not resume or ckpt is None or kept is not None:
                    raise
                damaged[Path(ckpt)] = str(e).split(" is damaged: ", 1)[-1].split(". Use an older", 1)[0]
                ckpt, position, kept, init_from = self._resume_from(resume_point(cfg, self.run_dir, damaged), None)
        # Written once the store holds the state (a refused resume leaves the old config.toml).
        (self.run_dir / "config.toml").write_text(to_toml(cfg))
        self.checkpointer = Checkpointer(cfg, self.run_dir, self.pipeline, str(ckpt) if ckpt else "",
                                         int(read_checkpoint_state(ckpt)["step"]) if ckpt else 0)
        self.validator = Validator(cfg, self.pipeline, val_set, self.run_dir)
        try:  # the sample writer (a latent model's prompts encoded now, once)
            self.sampler = Sampler(cfg, self.pipeline, self.run_dir, sample_dir)
        except BaseException:
            self.pipeline.close()
            raise
        # The experiment tracker (``training.tracker``): the CLI opens it before Ray starts and
        # hands it over; from here on the metrics log owns it and closes it.
        self.metrics = MetricsLog(cfg, self.run_dir, self.pipeline,
                                  tracker if tracker is not None else open_tracker(cfg, self.run_dir))
        self.guard = BadStepGuard(cfg)
        self.stop_reason = ""   # set by request_stop (a signal handler): stop after the current step
        self._last_time = time.perf_counter()

    def _resume_from(self, point: ResumePoint, init_from: str | None):
        """Take ``point`` as where the run continues; returns (checkpoint, data cursor, kept
        state, init_from)."""
        self.start_step, kept = point.step, point.kept
        if kept is not None:
            log.warning("--resume: continuing from the shared-memory state a failed run kept: %s (newer than %s)",
                        kept.describe(), point.checkpoint or "any checkpoint")
            self.data_state = {k: v for k, v in kept.doc.items() if k not in ("step", "init_from")}
            init_from = kept.doc.get("init_from") or None
        if self.start_step >= self.cfg.training.steps:
            log.warning("%s is at step %d and training.steps=%d: nothing to do; raise --steps",
                        "the kept state" if kept else "checkpoint", self.start_step, self.cfg.training.steps)
        self.done = self.start_step  # steps completed: the state's version once the last one is applied
        return point.checkpoint, point.cursor, kept, init_from

    @property
    def last_checkpoint(self) -> str:
        return self.checkpointer.last

    @property
    def bad_steps(self) -> int:
        return self.guard.count

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
        self.guard.reset_streak()
        self._last_time = time.perf_counter()
        return step

    def train_step(self, step: int) -> dict:
        done = step + 1
        checkpoint, validate, sample = (c.due(done) for c in (self.checkpointer, self.validator, self.sampler))
        # Before a checkpoint, a sample, a validation or a requested stop nothing is queued
        # ahead: the state must be step k's.
        quiet = not (checkpoint or validate or sample or self.stop_reason)
        report = self.pipeline.run_step(step, queue_next=quiet and done < self.cfg.training.steps)
        # The store holds step ``done`` now: what a checkpoint or a kept state records of the data.
        self.data_state = {**self.pipeline.data_cursor(done).to_state(), "data_position": report.compute.data_position,
                           "seed": self.cfg.training.seed, "skipped_files": report.skipped_files}
        self.done = done
        now = time.perf_counter()
        wall, self._last_time = now - self._last_time, now
        row = self._row(done, report, wall)
        self.guard.check(row, self.last_checkpoint)
        row["bad_steps"] = self.guard.count
        row["restarts"] = self.pipeline.restarts
        if validate or sample:
            row.update(self._evaluate_and_sample(done, validate, sample))
        written = self.sampler.collect()  # videos the writer finished meanwhile (never waits)
        if written and not sample:
            row["sample_failures"] = self.sampler.failures
        self.metrics.record(row, first=step == self.start_step)
        self.metrics.record_samples(written)
        if checkpoint:
            self.checkpointer.save(done, self.data_state, skipped=row["update_skipped"])
        if not quiet:  # the next step's time excludes saving, sampling, validating
            self._last_time = time.perf_counter()
        return row

    def _evaluate_and_sample(self, done: int, validate: bool, sample: bool) -> dict:
        """The validation loss and the samples after step ``done``, with the moving average of the
        weights where the run keeps one and ``training.ema_eval`` asks for it (the store serves it
        through ``w`` meanwhile, and the trained weights again before the next step)."""
        t = self.cfg.training
        average = bool(t.ema_decay and t.ema_eval)
        row = {}
        if average:
            try:
                self.pipeline.use_weights("ema")
            except Exception as e:  # noqa: BLE001 - like a failed validation or sample: logged, training goes on
                log.warning("step %d: the moving average of the weights could not be served (%r): no validation loss "
                            "or samples this time", done, e)
                return {}
        try:
            if validate:
                row.update(self.validator.run(done))
            if sample:
                row.update(self.sampler.run(done))
        finally:
            if average:  # (a store that fails here serves the trained weights again when it comes back)
                self.pipeline.use_weights("master")
        return row

    def _row(self, done: int, report, wall: float) -> dict:
        """Step ``done``'s ``metrics.jsonl`` fields (docs/metrics.md)."""
        c, u = report.compute, report.update
        return {
            "step": done, "loss": c.loss, "lr": u.lr, "grad_norm": u.grad_norm, "clip_coef": u.clip_coef,
            "update_skipped": u.skipped, "tokens": c.tokens, "tokens_per_s": c.tokens / wall, "step_seconds": wall,
            "compute_seconds": c.seconds, "forward_seconds": c.forward_seconds,
            "backward_seconds": c.backward_seconds, "weight_wait_seconds": c.weight_wait_seconds,
            # data wait: the compute actor's own, plus time lost to a decoder that hung or died
            "optimizer_seconds": u.optimizer_seconds,
            "data_wait_seconds": c.data_wait_seconds + report.data_lost_seconds,
            "h2d_bytes": c.h2d_bytes, "h2d_gbps": c.h2d_bytes / c.h2d_seconds / 1e9 if c.h2d_seconds else 0.0,
            "d2h_bytes": c.d2h_bytes, "d2h_gbps": c.d2h_bytes / c.d2h_seconds / 1e9 if c.d2h_seconds else 0.0,
            "device_memory_peak_bytes": c.device_memory_peak_bytes, "reduce_seconds": u.reduce_seconds,
            "network_bytes": u.network_bytes,
            "grad_slot_wait_seconds": c.grad_slot_wait_seconds,
            "data_position": c.data_position, "data_rows": list(report.batch.rows) if report.batch else None,
            "skipped_files": report.skipped_files, "decoders_replaced": self.pipeline.decoders_replaced,
            "device": c.device, "time": time.time(),
            # the flow time of each clip of the step's global batch; a two-expert model: the expert trained
            "t": list(c.t), "expert": EXPERT_NAMES[c.expert] if c.expert >= 0 else None,
            # training.distill_weight > 0: the distillation term (before its weight; ``loss`` is the task's)
            **({"distill_loss": c.distill_loss, "teacher_seconds": c.teacher_seconds}
               if self.cfg.training.distill_weight > 0 else {}),
            # several compute actors: each one's own times (the fields above are the slowest's)
            **({"compute_actors": [{"rank": r.rank, "loss": r.loss, "compute_seconds": r.seconds,
                                    "weight_wait_seconds": r.weight_wait_seconds,
                                    "data_wait_seconds": r.data_wait_seconds,
                                    "grad_slot_wait_seconds": r.grad_slot_wait_seconds} for r in report.computes]}
               if report.computes else {}),
        }

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

    def train(self) -> TrainSummary:
        steps = self.cfg.training.steps
        rows = []
        # No rate of tqdm's own: the bar shows the run's one s/step figure (seconds_per_step).
        bar = tqdm(total=steps, initial=self.start_step, disable=not self.progress, unit="step", dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
        self._last_time = time.perf_counter()
        step = self.start_step
        try:
            while step < steps:
                if self.stop_reason:
                    step = self._finish_queued(step, rows, bar)
                    self.checkpointer.save_on_stop(step, self.start_step, self.data_state,
                                                   skipped=bool(rows) and rows[-1]["update_skipped"])
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
                per_step = seconds_per_step(rows)
                bar.set_postfix(loss=f"{row['loss']:.4f}", s_step=f"{per_step:.2f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                data_wait=f"{100 * row['data_wait_seconds'] / row['step_seconds']:.0f}%")
                if row["step"] % self.cfg.training.log_every == 0 or row["step"] == steps:
                    msg = (f"step {row['step']}/{steps} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
                           f"grad {row['grad_norm']:.3f} | {row['tokens_per_s']:.0f} tok/s | "
                           f"{per_step:.2f} s/step | skipped files {row['skipped_files']}"
                           + (f" | expert {row['expert']}" if row.get("expert") else "")
                           + (f" | distill {row['distill_loss']:.4f}" if "distill_loss" in row else ""))
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
        mean_s = seconds_per_step(rows)
        return TrainSummary(
            run_dir=str(self.run_dir), first_step=self.start_step, last_step=rows[-1]["step"],
            first_loss=rows[0]["loss"], last_loss=rows[-1]["loss"], mean_step_seconds=mean_s,
            tokens_per_second=sum(r["tokens"] for r in timed) / sum(r["step_seconds"] for r in timed),
            checkpoint=self.last_checkpoint, **extra,
        )

    def close(self) -> None:
        self.pipeline.close()
        try:  # the videos still being written: waited for, then logged
            self.metrics.record_samples(self.sampler.close())
        finally:
            self.metrics.close()

    def close_after_error(self) -> tuple[str, int] | None:
        """The run failed: stop every actor; keep the shared-memory state when it holds steps newer
        than the latest checkpoint (returns its path and size; ``--resume`` continues from it),
        else release it (returns None)."""
        doc = {**self.data_state, "init_from": self.pipeline.init_from or ""}
        try:
            return self.pipeline.close_after_error(self.done, self.checkpointer.step, doc)
        finally:
            self.sampler.abort()
            self.metrics.close()

    def abort(self) -> None:
        """Quit at once (a second Ctrl-C): kill the actors without waiting for them, drop the
        shared-memory state. Checkpoints are written atomically, so the latest complete one stays."""
        self.pipeline.abort()
        self.sampler.abort()
        self.metrics.close()
