"""``python -m megaslide_ray.train``: the main job.

With no arguments: a local Ray cluster, the demo dataset (made on first use), the ``tiny``
preset on whatever this machine has. Every config field can be overridden with a dotted flag
(``--model.depth 8``); ``--help-config`` lists them all.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from megaslide_ray import early_interrupt  # first: a Ctrl-C while the imports below load is one line
from megaslide_ray.config import SECTIONS, Config, ConfigError, build_config, describe_fields, parse_overrides, to_toml
from megaslide_ray.data.motion_set import ensure_motion_dataset
from megaslide_ray.driver.launch import launch
from megaslide_ray.state.pretrained_io import config_for_diffusers_dir, is_diffusers_dir

log = logging.getLogger("megaslide_ray")

DEMO_EVAL_EVERY = {"motion": 10, "motion-simple": 600}
"""``training.eval_every`` of a run on the motion demo set (``--demo``) unless the config sets it."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megaslide_ray.train",
        description="Fine-tune a video DiT with streamed weights, a host-RAM parameter store and 3D-DSA.",
        epilog="Any config field: --SECTION.FIELD VALUE (e.g. --model.depth 8 --attention.kind dense). "
               "See --help-config.")
    p.add_argument("--preset", default=None, help="tiny (default), tiny-motion, dit-105b, dit-33b, dit-28b, "
                                                  "wan2.1-t2v-1.3b, wan2.1-t2v-14b, wan2.2-ti2v-5b, "
                                                  "wan2.2-t2v-a14b, wan2.1-i2v-14b-480p, wan2.1-i2v-14b-720p, "
                                                  "wan2.1-flf2v-14b-720p or wan2.2-i2v-a14b")
    p.add_argument("--config", default=None, help="TOML file with [section] tables (e.g. a run's config.toml)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (training.steps)")
    p.add_argument("--run-dir", default=None, help="output directory (default runs/<timestamp>)")
    p.add_argument("--data", default=None, help="Parquet manifest of your videos (data.manifest)")
    p.add_argument("--demo", choices=["shapes", "motion", "motion-simple"], default=None,
                   help="without --data: the demo set to train on: shapes (default), motion (megaslide_ray.motion: "
                        "shapes at stated speeds and directions; its held-out split becomes data.val_manifest, "
                        f"evaluated every {DEMO_EVAL_EVERY['motion']} steps unless training.eval_every says "
                        f"otherwise) or motion-simple (its simple variant: one large shape, 8 frames, no bounces or "
                        f"occluders, validated every {DEMO_EVAL_EVERY['motion-simple']} steps; what the tiny-motion "
                        f"preset learns in minutes)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the run dir's newest complete checkpoint (or the state a failed run kept)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the earlier run a non-empty --run-dir holds (its checkpoints, metrics.jsonl, "
                        "config.toml, samples and kept state); without it a new run there is refused")
    p.add_argument("--init-from", default=None, metavar="FILE_OR_DIR",
                   help="start from pretrained weights: a checkpoint dir (RUN/checkpoints/step_N), a .safetensors "
                        "file or a directory of them with the model's state-dict names, or a diffusers Wan model "
                        "directory (its config.json sets the model); moments start at zero, step at 0")
    p.add_argument("--seed", type=int, default=None, help="training.seed")
    p.add_argument("--sample-every", type=int, default=None, metavar="N",
                   help="every N steps sample each prompt (training.sample_prompt, or the lines of "
                        "training.sample_prompts_file) into RUN_DIR/samples (training.sample_every)")
    p.add_argument("--tracker", choices=["none", "tensorboard", "wandb"], default=None,
                   help="log metrics.jsonl's rows, the config and the samples to TensorBoard (RUN_DIR/tensorboard) or "
                        "Weights & Biases (RUN_DIR/wandb, offline unless WANDB_MODE says otherwise) "
                        "(training.tracker; needs pip install tensorboard or wandb)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--help-config", action="store_true", help="list every config field with its meaning and exit")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    # Hidden: fault injection for drills and tests (megaslide_ray/runtime/faults.py).
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(args: argparse.Namespace, extra: list[str]) -> Config:
    overrides = parse_overrides(extra)
    for flag, key in (("steps", "training.steps"), ("seed", "training.seed"), ("data", "data.manifest"),
                      ("run_dir", "training.run_dir"), ("ray_address", "ray.address"),
                      ("sample_every", "training.sample_every"), ("tracker", "training.tracker")):
        if getattr(args, flag) is not None:
            overrides[key] = getattr(args, flag)
    if args.demo in ("motion", "motion-simple") and args.data is None and "data.manifest" not in overrides:

        train, val = ensure_motion_dataset(overrides.get("data.cache_dir") or None,
                                           variant="simple" if args.demo == "motion-simple" else "motion")
        overrides["data.manifest"] = str(train)
        overrides.setdefault("data.val_manifest", str(val))
        overrides.setdefault("training.eval_every", DEMO_EVAL_EVERY[args.demo])
    config_file, saved_run = args.config, False
    if args.resume and config_file is None and args.preset is None and args.run_dir:
        saved = Path(args.run_dir) / "config.toml"
        if saved.is_file():  # a resumed run keeps its own config unless told otherwise
            config_file, saved_run = str(saved), True
    if args.init_from and not args.resume:
        overrides["training.init_from"] = str(Path(args.init_from).expanduser().resolve())  # recorded in config.toml
        if is_diffusers_dir(args.init_from):  # the model's shape comes from the directory's config.json
            return config_for_diffusers_dir(args.init_from, args.preset, config_file, overrides)
    return build_config(args.preset, config_file, overrides, saved_run=saved_run)


def help_config() -> str:
    cfg = Config()
    lines = []
    for section in SECTIONS:
        sec = getattr(cfg, section)
        docs = describe_fields(type(sec))
        lines.append(f"[{section}]")
        for f in dataclasses.fields(sec):
            lines.append(f"  --{section}.{f.name} (default {getattr(sec, f.name)!r}): {docs.get(f.name, '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    early_interrupt.restore()
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before Ray started (after it, launch answers a signal itself)
        print("interrupted: nothing was started or written", file=sys.stderr, flush=True)
        return 130


def _main(argv: list[str] | None) -> int:
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

        print(to_toml(cfg), end="")
        return 0
    return launch(cfg, resume=args.resume, init_from=args.init_from, progress=not args.no_progress,
                  inject_fault=args.inject_fault, overwrite=args.overwrite)


if __name__ == "__main__":
    sys.exit(main())
