"""``python -m megaslide_ray.train``: the main job.

With no arguments: a local Ray cluster, the demo dataset (made on first use), the ``tiny``
preset on whatever this machine has. Every config field can be overridden with a dotted flag
(``--model.depth 8``); ``--help-config`` lists them all.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from megaslide_ray.config import SECTIONS, Config, ConfigError, build_config, describe_fields

log = logging.getLogger("megaslide_ray")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megaslide_ray.train",
        description="Fine-tune a video DiT with streamed weights, a host-RAM parameter store and 3D-DSA.",
        epilog="Any config field: --SECTION.FIELD VALUE (e.g. --model.depth 8 --attention.kind dense). "
               "See --help-config.")
    p.add_argument("--preset", default=None, help="tiny (default), tiny-motion, dit-105b, dit-33b, dit-28b, "
                                                  "wan2.1-t2v-1.3b, wan2.1-t2v-14b or wan2.2-ti2v-5b")
    p.add_argument("--config", default=None, help="TOML file with [section] tables (e.g. a run's config.toml)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (training.steps)")
    p.add_argument("--run-dir", default=None, help="output directory (default runs/<timestamp>)")
    p.add_argument("--data", default=None, help="Parquet manifest of your videos (data.manifest)")
    p.add_argument("--demo", choices=["shapes", "motion", "motion-simple"], default=None,
                   help="without --data: the demo set to train on: shapes (default), motion (megaslide_ray.motion: "
                        "shapes at stated speeds and directions; its held-out split becomes data.val_manifest, "
                        "evaluated every 10 steps unless training.eval_every says otherwise) or motion-simple (its "
                        "simple variant: one large shape, 8 frames, no bounces or occluders, validated every 600 "
                        "steps; what the tiny-motion preset learns in minutes)")
    p.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    p.add_argument("--init-from", default=None, metavar="FILE_OR_DIR",
                   help="start from pretrained weights: a checkpoint dir (RUN/checkpoints/step_N), a .safetensors "
                        "file or a directory of them with the model's state-dict names, or a diffusers Wan model "
                        "directory (its config.json sets the model); moments start at zero, step at 0")
    p.add_argument("--seed", type=int, default=None, help="training.seed")
    p.add_argument("--sample-every", type=int, default=None, metavar="N",
                   help="sample training.sample_prompt into RUN_DIR/samples every N steps (training.sample_every)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--help-config", action="store_true", help="list every config field with its meaning and exit")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    # Hidden: fault injection for drills and tests (megaslide_ray/faults.py).
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return p


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


def parse_overrides(extra: list[str]) -> dict[str, str]:
    """``--section.field value`` / ``--section.field=value`` pairs -> {"section.field": "value"}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or "." not in tok:
            raise ConfigError(f"unrecognised argument {tok!r}; config fields are given as --SECTION.FIELD VALUE "
                              f"with SECTION in {list(SECTIONS)} (see --help-config)")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(extra):
                raise ConfigError(f"{tok} needs a value")
            i += 1
            value = extra[i]
        out[key] = value
        i += 1
    return out


def config_from_args(args: argparse.Namespace, extra: list[str]) -> Config:
    overrides = parse_overrides(extra)
    for flag, key in (("steps", "training.steps"), ("seed", "training.seed"), ("data", "data.manifest"),
                      ("run_dir", "training.run_dir"), ("ray_address", "ray.address"),
                      ("sample_every", "training.sample_every")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.demo in ("motion", "motion-simple") and args.data is None and "data.manifest" not in overrides:
        from megaslide_ray.data.motion import ensure_motion_dataset

        train, val = ensure_motion_dataset(variant="simple" if args.demo == "motion-simple" else "motion")
        overrides["data.manifest"] = str(train)
        overrides.setdefault("data.val_manifest", str(val))
        overrides.setdefault("training.eval_every", 10 if args.demo == "motion" else 600)
    config_file, saved_run = args.config, False
    if args.resume and config_file is None and args.preset is None and args.run_dir:
        saved = Path(args.run_dir) / "config.toml"
        if saved.is_file():  # a resumed run keeps its own config unless told otherwise
            config_file, saved_run = str(saved), True
    if args.init_from and not args.resume:
        from megaslide_ray.state.pretrained import config_for_diffusers_dir, is_diffusers_dir

        if is_diffusers_dir(args.init_from):  # the model's shape comes from the directory's config.json
            return config_for_diffusers_dir(args.init_from, args.preset, config_file, overrides)
    return build_config(args.preset, config_file, overrides, saved_run=saved_run)


def help_config() -> str:
    import dataclasses

    cfg = Config()
    lines = []
    for section in SECTIONS:
        sec = getattr(cfg, section)
        docs = describe_fields(type(sec))
        lines.append(f"[{section}]")
        for f in dataclasses.fields(sec):
            lines.append(f"  --{section}.{f.name} (default {getattr(sec, f.name)!r}): {docs.get(f.name, '')}")
    return "\n".join(lines)


def check_resume(cfg: Config) -> str:
    """Why ``--resume`` cannot continue this run ("" when it can): no complete checkpoint, or
    one written with another number of decoders."""
    from megaslide_ray.trainer.loop import resume_point  # the Trainer's own check, run before Ray starts

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
    import ray

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.help_config:
        print(help_config())
        return 0
    try:
        cfg = config_from_args(args, extra)  # refused here, before Ray starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from megaslide_ray.config import to_toml

        print(to_toml(cfg), end="")
        return 0
    try:
        from megaslide_ray.data.checks import check_data

        check_data(cfg)  # the data must be what the model reads (video, or latents for wan)
        val_set = None
        if cfg.training.eval_every:  # the validation clips must decode: found out before Ray starts
            from megaslide_ray.evaluation.validation import load_val_set

            val_set = load_val_set(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"data error: {e}", file=sys.stderr)
        return 2

    if args.init_from and not args.resume:
        from megaslide_ray.state.pretrained import PretrainedMismatchError, check_pretrained

        try:
            check_pretrained(cfg, args.init_from)  # every mismatch in one message, before Ray starts
        except (PretrainedMismatchError, FileNotFoundError) as e:
            print(f"init-from error: {e}", file=sys.stderr)
            return 2

    if args.resume:
        problem = check_resume(cfg)  # before Ray starts, like every other refusal
        if problem:
            print(f"resume error: {problem}", file=sys.stderr)
            return 2

    if args.inject_fault:
        from megaslide_ray.runtime import faults

        try:
            faults.parse_faults(args.inject_fault)
        except ValueError as e:
            print(f"--inject-fault error: {e}", file=sys.stderr)
            return 2
        os.environ[faults.ENV_SPEC] = args.inject_fault  # the actors inherit it (pipelines/streaming.py)
        os.environ.setdefault(faults.ENV_DIR, tempfile.mkdtemp(prefix="megaslide-faults-"))
        log.warning("fault injection on: %s", args.inject_fault)

    space = None
    if not cfg.ray.address:  # a local cluster: the store's state goes to this machine's state dir
        from megaslide_ray.state.preflight import StateSpaceError, plan_state_space

        try:
            space = plan_state_space(cfg, cfg.training.run_dir or None)
        except StateSpaceError as e:
            print(f"state dir error: {e}", file=sys.stderr)
            return 2

    import ray

    from megaslide_ray.state.checkpoint import CheckpointWriteError
    from megaslide_ray.state.preflight import StateSpaceError
    from megaslide_ray.trainer.loop import BadStepsError, Trainer
    from pipelines.streaming import RestartLimitError

    ctx = start_ray(cfg, space)
    url = getattr(ctx, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}  (Ray token auth is on: `ray get-auth-token` prints the token "
              f"to paste into the dashboard's login)", flush=True)
    trainer = None
    with StopOnSignal() as stopper:  # installed until Ray is down: a Ctrl-C while closing aborts
        rc = 0
        try:
            trainer = Trainer(cfg, run_dir=cfg.training.run_dir or None, resume=args.resume,
                              progress=not args.no_progress, init_from=args.init_from, val_set=val_set)
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


if __name__ == "__main__":
    sys.exit(main())
