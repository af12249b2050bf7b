"""Launch a training run: every check that can refuse it before Ray starts, then Ray, the
Trainer, signals and exit codes.

``python -m megaslide_ray.train`` parses its arguments into a config and calls ``launch``. Exit
codes: 0 (done, or stopped by a signal after a checkpoint), 1 (the run failed: too many bad
steps, restarts over the limit, a checkpoint that cannot be written, no room for the state), 2
(refused before Ray started: data, ``--init-from``, ``--resume``, fault spec or state dir), 130
(interrupted twice: quit at once; the latest complete checkpoint stays intact).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile

import ray

from megaslide_ray.config import Config, ConfigError
from megaslide_ray.data.checks import check_data
from megaslide_ray.evaluation.validation import load_val_set
from megaslide_ray.runtime import faults
from megaslide_ray.state.checkpoint import CheckpointWriteError
from megaslide_ray.state.preflight import StateSpaceError, plan_state_space
from megaslide_ray.state.pretrained import PretrainedMismatchError, check_pretrained
from megaslide_ray.trainer.components import BadStepsError
from megaslide_ray.trainer.loop import Trainer, resume_point
from pipelines.streaming import RestartLimitError

log = logging.getLogger(__name__)


class StopOnSignal:
    """SIGINT/SIGTERM: the first asks the trainer to stop after the current step, checkpoint and
    exit 0; a second one (or one before training started) raises KeyboardInterrupt at once."""

    def __init__(self):
        self.trainer = None
        self.count = 0
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.count += 1
        name = signal.Signals(signum).name
        if self.trainer is None or self.count > 1:
            raise KeyboardInterrupt(name)
        print(f"\n{name}: stopping after the current step and writing a checkpoint (press Ctrl-C again to "
              f"quit at once; the latest complete checkpoint stays intact)", file=sys.stderr, flush=True)
        self.trainer.request_stop(name)


def check_resume(cfg: Config) -> str:
    """Why ``--resume`` cannot continue this run ("" when it can): no complete checkpoint, or
    one written with another number of decoders."""
    if not cfg.training.run_dir:
        return "--resume needs --run-dir (the run to continue)"
    try:
        resume_point(cfg.training.run_dir, cfg.data.num_decoders)
    except (FileNotFoundError, ValueError) as e:
        return str(e)
    return ""


def start_ray(cfg: Config, space=None):
    """Join ``ray.address`` or start a local cluster; ``space`` (``preflight.SpacePlan``) sizes a
    local cluster's object store so that it and the parameter store's state fit in /dev/shm."""
    if cfg.ray.address:
        return ray.init(address=cfg.ray.address, namespace="megaslide", log_to_driver=True)
    extra = {"_metrics_export_port": cfg.ray.metrics_export_port} if cfg.ray.metrics_export_port else {}
    if space is not None and space.object_store_bytes:
        extra["object_store_memory"] = space.object_store_bytes
        if space.plasma_dir:
            extra["_plasma_directory"] = space.plasma_dir
        log.warning("Ray's object store: %.2f GB%s, so that it and the parameter store's %.2f GB of state fit in %s",
                    space.object_store_bytes / 1e9, f" in {space.plasma_dir}" if space.plasma_dir else "",
                    space.need_bytes / 1e9, space.root)
    return ray.init(address="local", num_cpus=cfg.ray.num_cpus or None, include_dashboard=True,
                    dashboard_host=cfg.ray.dashboard_host, namespace="megaslide",
                    logging_level=logging.WARNING, log_to_driver=True, **extra)


def launch(cfg: Config, resume: bool = False, init_from: str | None = None, progress: bool = True,
           inject_fault: str | None = None) -> int:
    """Train ``cfg`` (``resume``: continue ``training.run_dir`` from its latest checkpoint;
    ``init_from``: start from pretrained weights; ``inject_fault``: a fault spec for drills,
    ``runtime.faults``). Returns the exit code (see the module docstring)."""
    try:
        check_data(cfg)  # the data must be what the model reads (video, or latents for wan)
        val_set = None
        if cfg.training.eval_every:  # the validation clips must decode: found out before Ray starts
            val_set = load_val_set(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2

    if init_from and not resume:
        try:
            check_pretrained(cfg, init_from)  # every mismatch in one message, before Ray starts
        except (PretrainedMismatchError, FileNotFoundError) as e:
            print(f"init-from error: {e}", file=sys.stderr)
            return 2

    if resume:
        problem = check_resume(cfg)  # before Ray starts, like every other refusal
        if problem:
            print(f"resume error: {problem}", file=sys.stderr)
            return 2

    if inject_fault:
        try:
            faults.parse_faults(inject_fault)
        except ValueError as e:
            print(f"--inject-fault error: {e}", file=sys.stderr)
            return 2
        os.environ[faults.ENV_SPEC] = inject_fault  # the actors inherit it (pipelines/streaming.py)
        os.environ.setdefault(faults.ENV_DIR, tempfile.mkdtemp(prefix="megaslide-faults-"))
        log.warning("fault injection on: %s", inject_fault)

    space = None
    if not cfg.ray.address:  # a local cluster: the store's state goes to this machine's state dir
        try:
            space = plan_state_space(cfg, cfg.training.run_dir or None)
        except StateSpaceError as e:
            print(f"state dir error: {e}", file=sys.stderr)
            return 2

    ctx = start_ray(cfg, space)
    url = getattr(ctx, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}  (Ray token auth is on: `ray get-auth-token` prints the token "
              f"to paste into the dashboard's login)", flush=True)
    trainer = None
    with StopOnSignal() as stopper:  # installed until Ray is down: a Ctrl-C while closing aborts
        rc = 0
        try:
            trainer = Trainer(cfg, run_dir=cfg.training.run_dir or None, resume=resume, progress=progress,
                              init_from=init_from, val_set=val_set)
            stopper.trainer = trainer
            print(f"run dir: {trainer.run_dir}", flush=True)
            report_summary(trainer.train(), trainer, cfg)
        except KeyboardInterrupt:
            rc = 130
        except (BadStepsError, RestartLimitError, CheckpointWriteError, StateSpaceError) as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
        try:
            if trainer is not None:
                trainer.abort() if rc == 130 else trainer.close()
        except KeyboardInterrupt:
            rc = 130
            trainer.abort()
        finally:
            try:
                ray.shutdown()
            except KeyboardInterrupt:
                rc = 130
            if rc == 130:
                print("interrupted: quitting at once; the latest complete checkpoint is intact"
                      + (f" (resume with: python -m megaslide_ray.train --run-dir {trainer.run_dir} --resume)"
                         if trainer is not None else ""), file=sys.stderr, flush=True)
    return rc


def report_summary(summary, trainer, cfg: Config) -> None:
    resume = f"python -m megaslide_ray.train --run-dir {trainer.run_dir} --resume"
    if summary.stopped_by:
        print(f"stopped by {summary.stopped_by} after step {summary.last_step} of {cfg.training.steps}; "
              f"checkpoint {summary.checkpoint or '(none: no step had finished)'}", flush=True)
        print(f"resume with: {resume}", flush=True)
        return
    print(f"done: steps {summary.first_step}->{summary.last_step}, loss {summary.first_loss:.4f} -> "
          f"{summary.last_loss:.4f}, {summary.mean_step_seconds:.2f} s/step, "
          f"{summary.tokens_per_second:.0f} tokens/s, checkpoint {summary.checkpoint}"
          + (f"; {summary.bad_steps} bad step(s) skipped" if summary.bad_steps else "")
          + (f"; recovered from {summary.restarts} actor failure(s)" if summary.restarts else ""), flush=True)
    print(f"resume with: {resume} --steps N", flush=True)


