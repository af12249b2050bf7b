"""``megaslide COMMAND [ARGS]`` (or ``python -m megaslide_ray COMMAND [ARGS]``): one entry point
for every command line of the project. ``megaslide train --steps 10`` is ``python -m
megaslide_ray.train --steps 10``; ``megaslide COMMAND --help`` shows the command's flags."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("megaslide_ray.train", "train (presets, --config, --SECTION.FIELD VALUE, --resume, --init-from)"),
    "sample": ("megaslide_ray.sample", "sample a video from a checkpoint"),
    "evaluate": ("megaslide_ray.evaluate", "the held-out validation loss of a checkpoint"),
    "plan": ("megaslide_ray.plan", "will a preset fit, and what bounds its step"),
    "index": ("megaslide_ray.index", "a manifest of a folder of videos"),
    "precompute": ("megaslide_ray.precompute", "VAE latents and text embeddings of a video manifest"),
    "export": ("megaslide_ray.pretrained", "a checkpoint's weights under standard names (safetensors, diffusers)"),
    "report": ("megaslide_ray.report", "plots and a summary of runs"),
    "demo-data": ("megaslide_ray.demo_data", "generate (or find) the demo dataset"),
    "motion": ("megaslide_ray.motion", "generate (or find) the motion set"),
    "motion-metric": ("megaslide_ray.motion_metric", "the motion fidelity of a generated clip"),
    "config": ("megaslide_ray.config.__main__", "the configuration reference (docs/configuration.md)"),
}
"""Command -> (the module whose ``main(argv)`` runs it, what it does)."""


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = ["usage: megaslide COMMAND [ARGS]   (megaslide COMMAND --help: its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"megaslide: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # Only the chosen command's module is imported: `megaslide plan` does not start Ray or load torch's
    # model code it does not use.
    module = importlib.import_module(COMMANDS[name][0])
    return module.main(rest)


if __name__ == "__main__":
    sys.exit(main())
