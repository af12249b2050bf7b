"""What the Trainer delegates: each component says when it is due and does its work.

- ``Checkpointer``: a checkpoint every ``training.checkpoint_every`` steps, at the last step and
  when a stop is requested (``pipeline.save_checkpoint``: atomic; the previous one stays).
- ``Validator``: the held-out loss every ``training.eval_every`` steps, through the compute actor
  (forward only, ``evaluation.validation``).
- ``Sampler``: a sample of each prompt every ``training.sample_every`` steps, denoised through the
  compute actor, decoded and written by the sample writer actor (``actors.sample_writer``) into
  ``samples/step_{N:06d}_{i:02d}_{slug}.mp4``, its ``.png`` contact sheet and ``samples/samples.jsonl``.
- A validation or a sample that fails is logged (the traceback in ``RUN/error.log``) and counted
  (``val_failures``, ``sample_failures``); training goes on.
- ``MetricsLog``: one ``metrics.jsonl`` line per step, the run's Ray metrics and the same row to
  the experiment tracker (``training.tracker``, ``driver.trackers``), and to it the sample videos
  once they are written.
- ``BadStepGuard``: counts steps whose update was skipped (NaN/Inf) and stops the run after
  ``optim.max_bad_steps`` in a row.

A step that a checkpoint, validation or sample follows queues nothing ahead (the state read must
be exactly that step's): the Trainer asks ``due`` before it runs the step.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections import deque
from pathlib import Path

import numpy as np
import ray
import torch

from megaslide_ray.config import Config, sample_prompt_images, sample_prompts
from megaslide_ray.evaluation.sampling import euler_sample, image_spec, sample_path, wan_sample
from megaslide_ray.evaluation.validation import ValSet, validation_loss
from megaslide_ray.runtime.metrics import RunMetrics
from pipelines.errors import root_cause
from pipelines.sample_writer import start_sample_writer
from pipelines.streaming import StreamingPipeline

log = logging.getLogger(__name__)


def every(n: int, done: int) -> bool:
    """Due after step ``done`` (counted from 1) of a component that runs every ``n`` steps (0: never)."""
    return n > 0 and done % n == 0


class Checkpointer:
    """Writes ``RUN/checkpoints/step_N`` every ``training.checkpoint_every`` steps, after the last
    step and when the run stops early; remembers the last one written (or resumed from)."""

    def __init__(self, cfg: Config, run_dir: Path, pipeline: StreamingPipeline, last: str = "", step: int = 0):
        self.every, self.steps = cfg.training.checkpoint_every, cfg.training.steps
        self.run_dir, self.pipeline = run_dir, pipeline
        self.last = last
        self.step = step  # the step of ``last`` (0: none yet)

    def due(self, done: int) -> bool:
        return done == self.steps or every(self.every, done)

    def save(self, done: int, data_state: dict, skipped: bool = False) -> str:
        """Checkpoint the state after step ``done``; ``data_state``: where the data continues.
        ``skipped``: step ``done`` had a NaN/Inf loss or gradient (its update was skipped): no
        checkpoint is written; after the last step that stops the run (``BadStepsError`` naming
        the step and the last good checkpoint), before it a warning says so and training goes on."""
        if skipped:
            what = (f"step {done} had a NaN/Inf loss or gradient (its update was skipped): no checkpoint of it is "
                    f"written; the last good checkpoint is {self.last or 'none (no checkpoint yet)'}")
            if done >= self.steps:
                raise BadStepsError(f"{what}. The run's last step was not finite: lower optim.lr, raise "
                                    f"optim.warmup_steps or check the data, then --resume")
            log.warning("%s; training goes on", what)
            return self.last
        self.last = self.pipeline.save_checkpoint(str(self.run_dir), done, data_state)
        self.step = done
        return self.last

    def save_on_stop(self, done: int, start_step: int, data_state: dict, skipped: bool = False) -> None:
        """A stop after step ``done``: checkpoint it unless nothing ran, it is already saved or its
        update was skipped (``skipped``: a warning names the last good checkpoint instead)."""
        if done > start_step and not self.last.endswith(f"step_{done}"):
            if skipped:
                log.warning("stopping after step %d, whose loss or gradient was NaN/Inf: no checkpoint of it is "
                            "written; the last good checkpoint is %s", done, self.last or "none (no checkpoint yet)")
                return
            self.save(done, data_state)


def log_failure(what: str, done: int, error: Exception, run_dir: Path) -> None:
    """A validation or sample after step ``done`` failed: one warning with the root cause, the
    traceback appended to ``RUN/error.log``; training goes on."""
    cause = root_cause(error)
    try:
        with (run_dir / "error.log").open("a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what} after step {done} failed (training went on)\n"
                    f"{''.join(traceback.format_exception(error))}\n")
    except OSError as e:
        log.debug("could not write error.log: %r", e)
    log.warning("%s after step %d failed, training goes on: %s%s (traceback in %s)", what, done,
                cause.headline().splitlines()[0] if cause.headline() else cause.kind,
                f" (raised in {cause.where})" if cause.where else "", run_dir / "error.log")


class Validator:
    """The validation loss of the weights after step ``done`` (``val_loss``, ``val_loss_t{b}``,
    ``val_seconds``), every ``training.eval_every`` steps. One that fails is logged and counted
    (``val_failures``); training goes on."""

    def __init__(self, cfg: Config, pipeline: StreamingPipeline, val_set: ValSet | None, run_dir: Path):
        self.cfg, self.pipeline, self.val_set, self.run_dir = cfg, pipeline, val_set, run_dir
        self.failures = 0

    def due(self, done: int) -> bool:
        return every(self.cfg.training.eval_every, done)

    def run(self, version: int) -> dict:
        """The metrics.jsonl fields of the validation loss of ``version`` (and ``val_failures``);
        no loss when it failed or the store's versions were not all ``version`` around it."""
        try:
            return {**self._run(version), "val_failures": self.failures}
        except Exception as e:  # noqa: BLE001 - a validation never ends the run
            self.failures += 1
            log_failure("validation", version, e, self.run_dir)
            return {"val_failures": self.failures}

    def _run(self, version: int) -> dict:
        # ``version`` is k + 1 after step k: predict() waits until each shard's version is k + 1,
        # i.e. until the store has applied step k's update to it. Before that a shard's ``w``
        # segment may hold its gradient (between its backward and its update), never weights to
        # read. Nothing is queued past step k (see Trainer.train_step), so no shard can move on
        # while the evaluation reads it (on a CPU the weights are read in place); checked before
        # and after.
        before = self.pipeline.status().versions
        result = validation_loss(self.pipeline, self.cfg, self.val_set, version).as_row()
        after = self.pipeline.status().versions
        if any(v != version for v in (*before, *after)):
            log.warning("validation after step %d skipped: shard versions %s / %s, not all %d (a step was queued "
                        "past it)", version, before, after, version)
            return {}
        return result


MAX_PENDING = 2
"""Sampling rounds whose videos may still be decoding when the next one is due; past that the
next round waits for the oldest (``sample_seconds`` counts the wait)."""


class Sampler:
    """Samples each prompt (``training.sample_prompt`` or ``sample_prompts_file``) with the weights
    after step ``done`` every ``training.sample_every`` steps: the compute actor denoises it (forward
    only, prompt i's noise from seed ``sample_seed + i``), the sample writer actor
    (``actors.sample_writer``, started here; for a latent model it encodes the prompts once, now,
    and VAE-decodes each sample) writes the mp4, its contact sheet and ``samples/samples.jsonl``.
    The step waits for the denoising; on ``sample_device = cpu`` the decode overlaps the next
    steps (``collect`` picks up the videos written), on ``cuda`` it runs before the next step.
    A sample that fails is logged and counted (``sample_failures``); training goes on."""

    def __init__(self, cfg: Config, pipeline: StreamingPipeline, run_dir: Path, model_dir: Path | None = None):
        self.cfg, self.pipeline, self.run_dir = cfg, pipeline, run_dir
        self.failures = 0
        self.pending: deque = deque()  # (step, [object refs of WrittenSample]) in step order
        self.writer, self.prompts, self.texts = None, [], None
        if not cfg.training.sample_every:
            return
        t = cfg.training
        self.prompts = sample_prompts(cfg)
        self.writer = start_sample_writer(cfg, run_dir, model_dir)
        self.conditions = [None] * len(self.prompts)
        if cfg.model.arch == "wan":  # once: the text encoder is freed before the first decode
            texts = ray.get(self.writer.encode_prompts.remote([*self.prompts, t.sample_negative_prompt]))
            self.texts = [torch.from_numpy(np.array(x)) for x in texts]  # copies: Ray hands over read-only arrays
            spec = image_spec(cfg)
            if spec.kind or spec.clean_first_frame:  # an image-to-video model: each prompt's image, encoded once
                made = ray.get(self.writer.encode_images.remote(spec, sample_prompt_images(cfg)))
                self.conditions = [{k: None if v is None else torch.from_numpy(np.array(v)) for k, v in c.items()}
                                   for c in made]

    def due(self, done: int) -> bool:
        return every(self.cfg.training.sample_every, done)

    def run(self, version: int) -> dict:
        """The metrics.jsonl fields: ``sample`` (the mp4s being written), ``sample_seconds`` (what
        the step was held up by: denoising, and a wait for the writer) and ``sample_failures``."""
        t0 = time.perf_counter()
        try:
            paths = [str(p) for p in self._run(version)]
            return {"sample": paths, "sample_seconds": time.perf_counter() - t0, "sample_failures": self.failures}
        except Exception as e:  # noqa: BLE001 - a sample never ends the run
            self.failures += 1
            log_failure("sampling", version, e, self.run_dir)
            return {"sample_seconds": time.perf_counter() - t0, "sample_failures": self.failures}

    def _run(self, version: int) -> list[Path]:
        t = self.cfg.training
        behind = len(self.pending) - MAX_PENDING + 1  # the writer is behind: wait for its oldest rounds
        for _, refs in list(self.pending)[:max(0, behind)]:
            self._wait(refs, timeout=None)  # (``collect`` after the step takes them off ``pending``)
        refs, paths = [], []
        for i, prompt in enumerate(self.prompts):
            seed = t.sample_seed + i
            if self.texts is not None:
                x = wan_sample(self.pipeline, self.cfg, self.texts[i], self.texts[-1], t.sample_steps, seed, version,
                               t.sample_cfg_scale, self.conditions[i])
            else:
                x = euler_sample(self.pipeline, self.cfg, prompt, t.sample_steps, seed, version, t.sample_cfg_scale)
            path = sample_path(self.run_dir, version, i, prompt)
            refs.append(self.writer.write.remote(x.numpy(), version, i, prompt, seed, str(path)))
            paths.append(path)
        self.pending.append((version, refs))
        if t.sample_device == "cuda":  # the decode runs on the training GPU: before the next step
            self._wait(refs, timeout=None)
        return paths

    def _wait(self, refs: list, timeout: float | None) -> None:
        ray.wait(refs, num_returns=len(refs), timeout=timeout)

    def collect(self, wait_s: float = 0.0) -> list:
        """The ``WrittenSample`` of every video written since the last call, in step order (never
        waits unless ``wait_s``: then up to that long for every round in flight). A decode that
        failed is logged and counted."""
        if self.pending and wait_s:
            self._wait([r for _, refs in self.pending for r in refs], timeout=wait_s)
        out = []
        while self.pending:
            step, refs = self.pending[0]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            if len(ready) < len(refs):
                break
            self.pending.popleft()
            for ref in refs:
                try:
                    out.append(ray.get(ref))
                except Exception as e:  # noqa: BLE001 - a sample never ends the run
                    self.failures += 1
                    log_failure("writing a sample", step, e, self.run_dir)
        return out

    def close(self, wait_s: float = 600.0) -> list:
        """Wait up to ``wait_s`` for the videos still being written, stop the writer and return
        what was written since the last ``collect``."""
        if self.writer is None:
            return []
        out = self.collect(wait_s)
        if self.pending:
            log.warning("samples of steps %s were still being written after %.0f s and are left out",
                        [step for step, _ in self.pending], wait_s)
        self.abort()
        return out

    def abort(self) -> None:
        """Stop the writer now (a video being written is left incomplete)."""
        if self.writer is not None:
            ray.kill(self.writer, no_restart=True)
            self.writer = None
            self.pending.clear()


class MetricsLog:
    """``metrics.jsonl`` (one JSON line per step, appended: a resumed run continues the file), the
    same numbers as Ray metrics tagged by run name (with the decoders' frame rate every
    ``training.log_every`` steps) and the same row, once written, to ``tracker`` (an open
    ``driver.trackers`` tracker or None), which ``close`` closes."""

    def __init__(self, cfg: Config, run_dir: Path, pipeline: StreamingPipeline, tracker=None):
        self.log_every, self.pipeline, self.tracker = cfg.training.log_every, pipeline, tracker
        self.last_step = 0  # the step of the last row recorded
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        self.ray_metrics = RunMetrics(run_dir.name, pipeline.status().state_bytes)

    def record(self, row: dict, first: bool) -> None:
        """Write step ``row`` (``first``: the run's first step here, which also records the decoders)."""
        line = json.dumps(row)
        self._file.write(line + "\n")
        self._file.flush()
        self.last_step = row["step"]
        if self.tracker is not None:  # the row as written: the tracker and the file cannot differ
            self.tracker.log(json.loads(line))
        if row["step"] % self.log_every == 0 or first:
            stats = self.pipeline.decoder_stats()
            seconds = sum(st.decode_seconds for st in stats)
            self.ray_metrics.record_decoders(sum(st.frames_decoded for st in stats) / seconds if seconds else 0.0)
        self.ray_metrics.record(row)

    def record_samples(self, samples: list) -> None:
        """The sample videos written since the last call (``Sampler.collect``) to the tracker
        (samples.jsonl, which the writer keeps, lists them all)."""
        if self.tracker is not None and samples:
            self.tracker.log_samples(samples, self.last_step)

    def close(self) -> None:
        self._file.close()
        if self.tracker is not None:
            self.tracker.close()


class BadStepsError(RuntimeError):
    """``optim.max_bad_steps`` steps in a row had NaN/Inf loss or gradients."""


class BadStepGuard:
    """NaN/Inf in the loss or gradients: the store skipped the update on every shard. Counts such
    steps; ``optim.max_bad_steps`` in a row stop the run (``BadStepsError``)."""

    def __init__(self, cfg: Config):
        self.limit = cfg.optim.max_bad_steps
        self.count = 0    # updates skipped for NaN/Inf in this run
        self.streak = 0   # ... of them in a row, up to the last step

    def reset_streak(self) -> None:
        self.streak = 0

    def check(self, row: dict, last_checkpoint: str) -> None:
        if not row["update_skipped"]:
            self.streak = 0
            return
        self.count += 1
        self.streak += 1
        log.warning("step %d: loss %s, gradient norm %s: not finite; the update was skipped on every shard "
                    "(%d bad step(s) in a row; the run stops at optim.max_bad_steps=%d)", row["step"], row["loss"],
                    row["grad_norm"], self.streak, self.limit)
        if self.limit and self.streak >= self.limit:
            raise BadStepsError(
                f"{self.streak} steps in a row (up to step {row['step']}) had NaN/Inf loss or gradients "
                f"(optim.max_bad_steps={self.limit}); stopping. The weights are those before the first bad step (no "
                f"update was applied); the latest checkpoint is {last_checkpoint or 'none'}. Lower optim.lr, "
                f"raise optim.warmup_steps or check the data, then --resume")
