"""Launch a training run: every check that can refuse it before Ray starts, then Ray, the
Trainer, signals and exit codes.

``python -m megaslide_ray.train`` parses its arguments into a config and calls ``launch``. Exit
codes: 0 (done, or stopped by a signal after a checkpoint), 1 (the run failed after Ray started:
too many bad steps, restarts over the limit, a checkpoint that cannot be written, unusable data,
any other error), 2 (refused before Ray started: data, ``--init-from``, ``--resume``, fault spec,
state dir or ``training.tracker``; nothing is written to the run directory but what a tracker
that failed to start wrote), 130 (interrupted twice: quit at once;
the latest complete checkpoint stays intact).

A run that fails after Ray started ends the same way whatever failed (``report_failure``): the
root cause first (unwrapped from Ray's exceptions, ``pipelines.errors``) with the actor call that
raised it, the whole traceback in ``RUN/error.log``, every actor stopped and Ray shut down, and
the shared-memory state released, or kept when it holds steps newer than the latest checkpoint
(``megaslide_ray.state.kept``; its path, size, the command that frees it and the ``--resume``
that continues from it are printed).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import ray

from megaslide_ray.config import Config, ConfigError
from megaslide_ray.data.checks import check_data
from megaslide_ray.driver.loop import ResumePoint, Trainer, default_run_dir, resume_point
from megaslide_ray.driver.preflight import (
    check_devices,
    check_resume_config,
    check_run_dir,
    clear_run_dir,
    local_devices,
)
from megaslide_ray.driver.raystart import (
    RayStartInterrupted,
    RayUnreachable,
    guarded_init,
    join_hint,
    probe_address,
    use_token_if_at_hand,
)
from megaslide_ray.driver.trackers import check_tracker, open_tracker
from megaslide_ray.evaluation.sampling import sample_model_dir
from megaslide_ray.evaluation.validation import load_val_set
from megaslide_ray.models.registry import distills
from megaslide_ray.runtime import faults
from megaslide_ray.state.kept import (
    dir_bytes,
    human_bytes,
    is_kept,
    keep_state,
    release_state,
    state_path,
)
from megaslide_ray.state.preflight import StateSpaceError, plan_state_space
from megaslide_ray.state.pretrained_io import PretrainedMismatchError, check_pretrained, describe_init
from megaslide_ray.state.teacher_io import check_teacher
from pipelines.errors import root_cause

log = logging.getLogger(__name__)

MESSAGE_LINES = 12
"""A failure's message is printed up to this many lines (all of it goes to RUN/error.log)."""


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


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


def check_resume(cfg: Config, run_dir: str) -> ResumePoint:
    """Where ``--resume`` continues (``resume_point``), checked before Ray starts: ConfigError
    when it cannot (no run dir, no complete checkpoint or kept state, another number of decoders,
    another model than the checkpoint's)."""
    if not cfg.training.run_dir:
        raise ConfigError("--resume needs --run-dir (the run to continue)")
    try:
        point = resume_point(cfg, run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if point.checkpoint is not None:
        check_resume_config(cfg, point.checkpoint)
    return point


def start_ray(cfg: Config, space=None):
    """Join ``ray.address`` or start a local cluster; ``space`` (``preflight.SpacePlan``) sizes a
    local cluster's object store so that it and the parameter store's state fit in /dev/shm.
    A signal while Ray starts raises ``RayStartInterrupted`` (Ray shut down), an address where
    no cluster answers ``RayUnreachable`` or ends the process with one line (``raystart``)."""
    if cfg.ray.address:
        probe_address(cfg.ray.address)  # nothing listening: refused in a moment, naming the address
        use_token_if_at_hand()
        return guarded_init(lambda: ray.init(address=cfg.ray.address, namespace="megaslide", log_to_driver=True),
                            ray.shutdown, address=cfg.ray.address, timeout_s=cfg.ray.connect_timeout_s)
    extra = {"_metrics_export_port": cfg.ray.metrics_export_port} if cfg.ray.metrics_export_port else {}
    if space is not None and space.object_store_bytes:
        extra["object_store_memory"] = space.object_store_bytes
        if space.plasma_dir:
            extra["_plasma_directory"] = space.plasma_dir
        log.warning("Ray's object store: %.2f GB%s, so that it and the parameter store's %.2f GB of state fit in %s",
                    space.object_store_bytes / 1e9, f" in {space.plasma_dir}" if space.plasma_dir else "",
                    space.need_bytes / 1e9, space.root)
    return guarded_init(lambda: ray.init(address="local", num_cpus=cfg.ray.num_cpus or None, include_dashboard=True,
                                         dashboard_host=cfg.ray.dashboard_host, namespace="megaslide",
                                         logging_level=logging.WARNING, log_to_driver=True, **extra),
                        ray.shutdown)


def cluster_devices(cfg: Config) -> tuple[float, float]:
    """(GPUs, CPUs) per node of the joined cluster for ``check_devices``: those of the
    ``runtime.nodes``-th best node (a run places its stores and compute actors on that many)."""
    alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    gpus = sorted((r.get("GPU", 0.0) for r in alive), reverse=True)
    cpus = sorted((r.get("CPU", 0.0) for r in alive), reverse=True)
    k = min(cfg.runtime.nodes, len(alive)) - 1
    return (gpus[k], cpus[k]) if k >= 0 else (0.0, 0.0)


def launch(cfg: Config, resume: bool = False, init_from: str | None = None, progress: bool = True,
           inject_fault: str | None = None, overwrite: bool = False) -> int:
    """Train ``cfg`` (``resume``: continue ``training.run_dir`` from its latest checkpoint;
    ``init_from``: start from pretrained weights; ``inject_fault``: a fault spec for drills
    (``--inject-fault``, else ``runtime.inject_fault``; ``megaslide_ray/runtime/faults.py``);
    ``overwrite``: replace the run a non-empty run directory holds). Returns the exit code (see
    the module docstring)."""
    run_dir = cfg.training.run_dir or default_run_dir()
    val_set, refused = _preflight(cfg, run_dir, resume, overwrite)
    if refused:
        print(refused, file=sys.stderr)
        return 2

    if resume and init_from:
        log.warning("--init-from %s ignored: --resume continues from the run's own weights", init_from)
    init_from = None if resume else (init_from or cfg.training.init_from or None)
    if not check_sources(cfg, init_from):
        return 2

    nodes = cfg.runtime.nodes
    if nodes > 1 and not cfg.ray.address:
        print(f"config error: runtime.nodes={nodes} trains on {nodes} nodes of a Ray cluster: start one (`ray start "
              f"--head` here, `ray start --address=HEAD:6379` on the others) and pass --ray.address HEAD:6379, or use "
              f"--runtime.nodes 1", file=sys.stderr)
        return 2

    point = None
    if resume:
        try:
            point = check_resume(cfg, run_dir)  # before Ray starts, like every other refusal
        except ConfigError as e:
            print(f"resume error: {e}", file=sys.stderr)
            return 2
        if point.step >= cfg.training.steps:  # nothing to train: no Ray, nothing written
            print(f"nothing to do: {'the kept state' if point.kept else point.checkpoint} is at step {point.step} "
                  f"and training.steps={cfg.training.steps}; raise --steps to train further", flush=True)
            return 0

    flag = "--inject-fault" if inject_fault else "runtime.inject_fault"
    inject_fault = inject_fault or cfg.runtime.inject_fault or None
    cfg.runtime.inject_fault = ""  # handed to the actors through the environment; never in config.toml
    if inject_fault:
        try:
            faults.parse_faults(inject_fault)
        except ValueError as e:
            print(f"{flag} error: {e}", file=sys.stderr)
            return 2
    created_marker_dir = _inject(inject_fault) if inject_fault else None
    if overwrite and not resume:  # every check passed: the earlier run goes now, before Ray starts
        removed = clear_run_dir(cfg, run_dir)
        if removed:
            log.warning("--overwrite: removed the earlier run's %s", ", ".join(removed))
    try:
        return _run(cfg, run_dir, point, init_from, val_set, progress)
    finally:
        if created_marker_dir:
            shutil.rmtree(created_marker_dir, ignore_errors=True)
            os.environ.pop(faults.ENV_DIR, None)


def _preflight(cfg: Config, run_dir: str, resume: bool, overwrite: bool) -> tuple[object, str | None]:
    """The first checks, none of which needs Ray, in order: the run directory (first: a refused run
    changes nothing anywhere), this machine's devices, the tracker's package, the data and the
    validation clips. (the validation set or None, None), or (None, the message of the refusal)."""
    try:
        check_run_dir(cfg, run_dir, resume, overwrite)
    except ConfigError as e:
        return None, f"run dir error: {e}"
    if not cfg.ray.address:  # a local cluster: this machine's devices (a cluster's: once joined)
        try:
            check_devices(cfg, *local_devices(cfg), "this machine")
        except ConfigError as e:
            return None, f"config error: {e}"
    try:
        check_tracker(cfg.training.tracker)  # the tracker's package: before any work
    except ConfigError as e:
        return None, f"config error: {e}"
    try:
        check_data(cfg)  # the data must be what the model reads (video, or latents for wan)
        # the validation clips must decode: found out before Ray starts
        return (load_val_set(cfg) if cfg.training.eval_every else None), None
    except (ConfigError, ValueError, FileNotFoundError) as e:
        return None, f"data error: {e}"


def check_sources(cfg: Config, init_from: str | None) -> bool:
    """The pretrained weights (``init_from``) fit the model, ``training.init_from`` holds the dense
    teacher of a run that distils (``training.distill_weight``), and a latent model that samples during
    training has its model folder (``vae/``, a wan's text encoder); said before Ray starts, and what
    ``init_from`` loads is printed. False (the error printed) when either is refused."""
    if init_from:
        try:
            source = check_pretrained(cfg, init_from)  # every mismatch in one message, before Ray starts
        except (PretrainedMismatchError, FileNotFoundError) as e:
            print(f"init-from error: {e}", file=sys.stderr)
            return False
        print(describe_init(cfg, init_from, source), flush=True)
    if distills(cfg):  # the dense teacher: read from training.init_from by every fresh store, a resumed run's too
        try:
            check_teacher(cfg, cfg.training.init_from)
        except PretrainedMismatchError as e:
            print(f"distillation error: {e}", file=sys.stderr)
            return False
    if cfg.training.sample_every:
        try:
            sample_model_dir(cfg, init_from)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return False
    return True


def _inject(inject_fault: str) -> str | None:
    """Fault injection on for this run's actors; the marker dir it made (removed when the run ends)."""
    os.environ[faults.ENV_SPEC] = inject_fault  # the actors inherit it (pipelines/streaming.py)
    created = None
    if faults.ENV_DIR not in os.environ:  # this run's markers: removed when it ends
        os.environ[faults.ENV_DIR] = created = tempfile.mkdtemp(prefix="megaslide-faults-")
    log.warning("fault injection on: %s", inject_fault)
    return created


def _start(cfg: Config, space) -> tuple[object, int | None]:
    """``start_ray``, then a joined cluster's devices: (Ray's context, None), or (None, the exit
    code) after one line saying why not (Ray is down again then)."""
    try:
        ctx = start_ray(cfg, space)
    except RayStartInterrupted as e:
        print(f"{e}: interrupted while Ray was starting; nothing was started or written", file=sys.stderr, flush=True)
        return None, 130
    except RayUnreachable as e:
        print(f"ray error: {e}", file=sys.stderr, flush=True)
        return None, 2
    except Exception as e:  # noqa: BLE001 - Ray's own failure to start or join: one line, not its traceback
        if cfg.ray.address:
            print(f"ray error: could not join the Ray cluster at --ray-address {cfg.ray.address} "
                  f"({type(e).__name__}: {first_line(e)[:200]}); {join_hint()}", file=sys.stderr, flush=True)
        else:
            print(f"ray error: could not start a local Ray cluster: {type(e).__name__}: {first_line(e)}",
                  file=sys.stderr, flush=True)
        return None, 2
    if cfg.ray.address:  # the cluster's devices, now that they can be seen: before any actor starts
        try:
            check_devices(cfg, *cluster_devices(cfg), f"the Ray cluster at {cfg.ray.address} (per node)")
        except ConfigError as e:
            ray.shutdown()
            print(f"config error: {e}", file=sys.stderr, flush=True)
            return None, 2
    return ctx, None


def _run(cfg: Config, run_dir: str, point: ResumePoint | None, init_from: str | None, val_set,
         progress: bool) -> int:
    """``launch`` once its checks passed: plan the state space, start Ray, train, settle."""
    space = None
    if not cfg.ray.address:  # a local cluster: the store's state goes to this machine's state dir
        try:
            space = plan_state_space(cfg, run_dir)
        except StateSpaceError as e:
            print(f"state dir error: {e}", file=sys.stderr)
            return 2

    try:  # the tracker opens before Ray: one that cannot (W&B online without a login) costs no actor
        tracker = open_tracker(cfg, run_dir)
    except Exception as e:  # noqa: BLE001 - any tracker failure is a refusal: nothing started yet
        print(f"tracker error: training.tracker={cfg.training.tracker} could not start: {e!r}", file=sys.stderr)
        return 2
    try:
        return _train(cfg, run_dir, point, init_from, val_set, progress, space, tracker)
    finally:
        if tracker is not None:  # the trainer's metrics log closed it unless the trainer never started
            tracker.close()


def _train(cfg: Config, run_dir: str, point: ResumePoint | None, init_from: str | None, val_set, progress: bool,
           space, tracker) -> int:
    """``_run`` once the tracker is open: start Ray, train, settle."""
    ctx, rc = _start(cfg, space)
    if rc is not None:
        return rc
    url = getattr(ctx, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}  (Ray token auth is on: `ray get-auth-token` prints the token "
              f"to paste into the dashboard's login)", flush=True)
    trainer, failure, kept = None, None, None
    with StopOnSignal() as stopper:  # installed until Ray is down: a Ctrl-C while closing aborts
        rc = 0
        try:
            trainer = Trainer(cfg, run_dir=run_dir, resume=point or False, progress=progress,
                              init_from=init_from, val_set=val_set, tracker=tracker)
            stopper.trainer = trainer
            print(f"run dir: {trainer.run_dir}", flush=True)
            report_summary(trainer.train(), trainer, cfg)
        except KeyboardInterrupt:
            rc = 130
        except Exception as e:  # noqa: BLE001 - every failure ends the same way: see report_failure
            rc, failure = 1, e
        try:
            if trainer is not None:
                if rc == 130:
                    trainer.abort()
                elif failure is not None:
                    kept = trainer.close_after_error()
                else:
                    trainer.close()
        except KeyboardInterrupt:
            rc = 130
            trainer.abort()
        except Exception as e:  # noqa: BLE001 - closing failed: the state is dealt with below
            log.warning("closing the run failed: %r", e)
        finally:
            try:
                ray.shutdown()
            except KeyboardInterrupt:
                rc = 130
            if rc == 130:
                print("interrupted: quitting at once; the latest complete checkpoint is intact"
                      + (f" (resume with: python -m megaslide_ray.train --run-dir {run_dir} --resume)"
                         if trainer is not None else ""), file=sys.stderr, flush=True)
    if failure is not None and rc != 130:
        if kept is None:
            kept = settle_state(cfg, run_dir, point)
        report_failure(failure, run_dir, kept, trainer.checkpointer.last if trainer else
                       (str(point.checkpoint) if point and point.checkpoint else ""))
    return rc


def settle_state(cfg: Config, run_dir: str, point: ResumePoint | None) -> tuple[str, int] | None:
    """After Ray is down, the run's state dir on this machine, if any is left: a kept state the run
    was continuing from is kept again (returned), anything else this run made is released."""
    path = state_path(cfg, run_dir)
    if not path.is_dir():
        return None
    if point is not None and point.kept is not None:
        keep_state(path, point.kept.doc)
        return str(path), dir_bytes(path)
    if not is_kept(path):
        release_state(path)
    return None


def report_failure(error: BaseException, run_dir: str, kept: tuple[str, int] | None, checkpoint: str) -> None:
    """The root cause first, in a few lines; the whole traceback in RUN/error.log; what became of
    the shared-memory state and how to go on."""
    cause = root_cause(error)
    log_file = Path(run_dir) / "error.log"
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with log_file.open("a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}\n{''.join(traceback.format_exception(error))}\n")
    except OSError as e:
        log_file = None
        log.warning("could not write the traceback to the run directory: %s", e)
    lines = cause.headline().splitlines() or [cause.kind]
    shown = lines[:MESSAGE_LINES] + ([f"  ... ({len(lines) - MESSAGE_LINES} more lines in {log_file})"]
                                     if len(lines) > MESSAGE_LINES else [])
    out = [f"error: {shown[0]}", *shown[1:]]
    if cause.where:
        out.append(f"  (raised in {cause.where})")
    if log_file is not None:
        out.append(f"full traceback: {log_file}")
    resume = f"python -m megaslide_ray.train --run-dir {run_dir} --resume"
    if kept is not None:
        path, size = kept
        out += [f"state kept: {path} ({human_bytes(size)}) holds steps newer than the latest checkpoint "
                f"({checkpoint or 'none'})",
                f"  continue from it: {resume}",
                f"  free it:          rm -rf {path}"]
    else:
        out.append("state released: nothing was left in shared memory; "
                   + (f"continue from the latest checkpoint ({checkpoint}) with: {resume}" if checkpoint else
                      "no checkpoint was written; start the run again once the cause is fixed"))
    print("\n".join(out), file=sys.stderr, flush=True)


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


