"""How many steps before a preset's samples show the prompted shape, colour and direction?

    python -m benchmarks.studies.learning [--preset tiny] [--variant motion] [--steps 1200] [--every 100]
                                          [--prompts 8] [--kind dsa] [--cfg-scale S] [--set FIELD VALUE ...]
                                          [--out DIR] [--json]
    python -m benchmarks.studies.learning --preset tiny-motion --variant simple --steps 2400 --every 600
    python -m benchmarks.studies.learning --checkpoint RUN --variant simple [--prompts 16] [--cfg-scale S]

Trains ``--preset`` (default ``tiny``) on the training split of the motion set or of its simple
variant (``--variant simple``: what ``python -m megaslide_ray.train --demo motion`` and ``--demo
motion-simple`` train on) in process (``harness``: the model and objective of the streamed
trainer, which the tests hold equal to it), and every ``--every`` steps samples ``--prompts``
captions from fixed noise (Euler, ``training.sample_steps``, guided by ``--cfg-scale`` against
the empty caption) and scores each sample against its caption with the motion-fidelity metric
(``megaslide_ray.evaluation.motion_score``).

A sample **shows its prompt** (``harness.shows_prompt``) when the caption's colour is found in at
least 75% of its frames (``detection_rate``), the object's mask fits the caption's shape best in
at least half of the visible frames (``shape_match``), and it moves in the caption's direction:
mean direction error at most 45 degrees. The table gives, per checkpoint, the fraction of samples that show their
prompt and the metric means; the answer is the first checkpoint where at least half do.

With ``--checkpoint RUN`` it trains nothing: it samples each prompt from that run (or checkpoint)
with ``megaslide_ray.sample`` (``--sample-steps``, default 20, and ``--upscale``, default 4), reads
the mp4 back and scores it, as a user checking a streamed run would.

The prompts are the first ``--prompts`` captions of the training split (``--split val``: of the
held-out split, combinations never trained on). ``--out`` receives ``learning.json``,
``learning.md`` and a contact sheet of the samples at each checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.studies.harness import (
    SAMPLE_SEED,
    ModelPredictor,
    fresh_trainer,
    log,
    motion_manifests,
    nanmean,
    sample_and_score,
    shows_prompt,
    study_config,
    training_decoder,
)
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.motion_score import KEYS, motion_fidelity, read_video
from megaslide_ray.evaluation.sampling import contact_sheet, sample_video, write_png
from megaslide_ray.state.checkpoint import read_checkpoint_state, resolve_checkpoint


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.learning", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1200, help="training steps (default 1200)")
    p.add_argument("--every", type=int, default=100, help="sample and score every this many steps (default 100)")
    p.add_argument("--prompts", type=int, default=8, help="captions sampled at each checkpoint (default 8)")
    p.add_argument("--split", choices=["train", "val"], default="train", help="where the prompts come from")
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="classifier-free guidance of the samples (1 = off; needs training.caption_dropout > 0)")
    p.add_argument("--preset", default="tiny",
                   help="config preset (default tiny; tiny-motion is sized for --variant simple)")
    p.add_argument("--variant", default="motion", choices=["motion", "simple"],
                   help="the motion set (default) or its simple variant (a large shape, 8 frames, no bounces or "
                        "occluders)")
    p.add_argument("--kind", default=None, choices=["dense", "swin", "neighborhood", "dsa"],
                   help="attention kind (default: the preset's)")
    p.add_argument("--checkpoint", default=None, metavar="RUN",
                   help="score a trained run instead of training one: sample each prompt from this checkpoint (or run "
                        "directory's latest) with megaslide_ray.sample, as a user would, and score the written mp4s")
    p.add_argument("--sample-steps", type=int, default=20, help="--checkpoint: Euler steps per sample (default 20, "
                                                                "as megaslide_ray.sample)")
    p.add_argument("--upscale", type=int, default=4, help="--checkpoint: megaslide_ray.sample --upscale (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override (e.g. --set optim.lr 1e-3); recorded")
    p.add_argument("--out", type=Path, default=None, help="folder for learning.json/.md and contact sheets")
    p.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    a = p.parse_args(argv)
    for name in ("steps", "every", "prompts", "sample_steps", "upscale"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if a.checkpoint:
        return score_checkpoint(a)

    t0 = time.perf_counter()
    train, _ = motion_manifests(a.variant)
    over = {**({"attention.kind": a.kind} if a.kind else {}), "training.seed": a.seed, "training.steps": a.steps,
            "data.manifest": train, **dict(a.set)}
    cfg = study_config(a.preset, over)
    captions = prompts_of(a.variant, a.split, a.prompts)
    trainer = fresh_trainer(cfg, a.seed, a.threads)
    pred = ModelPredictor(trainer.model)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    points, losses, train_s = [], [], 0.0
    with training_decoder(cfg) as dec:
        for step in range(a.steps):
            r = trainer.train_step(dec.next_batch())
            losses.append(r.loss)
            train_s += r.seconds
            if (step + 1) % a.every and step + 1 != a.steps:
                continue
            trainer.model.eval()
            clips, metrics = sample_and_score(pred, cfg, captions, step + 1, a.cfg_scale)
            trainer.model.train()
            shown = [shows_prompt(m) for m in metrics]
            point = {"step": step + 1, "train_loss": statistics.fmean(losses[-a.every:]),
                     "shown": sum(shown) / len(shown), "train_seconds": train_s,
                     **{k: nanmean([m[k] for m in metrics]) for k in KEYS},
                     "samples": [{"caption": c, "shows": s, **{k: m[k] for k in KEYS}}
                                 for c, s, m in zip(captions, shown, metrics)]}
            points.append(point)
            log(f"step {step + 1:>5}: loss {point['train_loss']:.4f}, shown {point['shown']:.2f}, "
                f"detection {point['detection_rate']:.2f}, shape {point['shape_match']:.2f}, "
                f"direction err {point['direction_error_deg']:.0f} deg, train {train_s:.0f} s")
            if a.out:
                rows = [contact_sheet(c, max_frames=8, columns=8) for c in clips]
                write_png(a.out / f"learning_step_{step + 1}.png", np.concatenate(rows, axis=0))
            if a.json:
                print(json.dumps({k: v for k, v in point.items() if k != "samples"}), flush=True)
    first = next((pt["step"] for pt in points if pt["shown"] >= 0.5), None)
    meta = {"preset": a.preset, "variant": a.variant, "kind": cfg.attention.kind, "seed": a.seed,
            "cfg_scale": a.cfg_scale, "steps": a.steps, "every": a.every, "prompts": a.prompts,
            "split": a.split, "overrides": dict(a.set), "first_step_half_shown": first,
            "step_seconds": train_s / max(a.steps, 1), "minutes": (time.perf_counter() - t0) / 60,
            "threads": a.threads or os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    md = markdown(points, meta)
    if a.out:
        (a.out / "learning.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
        (a.out / "learning.md").write_text(md)
    if not a.json:
        print(md, end="")
    return 0


def prompts_of(variant: str, split: str, n: int) -> list[str]:
    """The first ``n`` captions of a split of the motion set (or its simple variant)."""
    train, val = motion_manifests(variant)
    return [e.caption for e in read_manifest(train if split == "train" else val)][:n]


def score_checkpoint(a) -> int:
    """``--checkpoint``: each prompt sampled by ``megaslide_ray.sample`` (noise seed 1000 + its
    index, as in training mode) into ``--out`` (or a temporary folder), read back from the mp4
    and scored with the motion metric."""
    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(a.checkpoint)
    state = read_checkpoint_state(ckpt)
    captions = prompts_of(a.variant, a.split, a.prompts)
    out = a.out or Path(tempfile.mkdtemp(prefix="learning-"))
    out.mkdir(parents=True, exist_ok=True)
    metrics, rows = [], []
    for j, caption in enumerate(captions):
        r = sample_video(ckpt, caption, out / f"sample_{j:02d}.mp4", steps=a.sample_steps, seed=SAMPLE_SEED + j,
                         cfg_scale=a.cfg_scale, upscale=a.upscale)
        frames = read_video(r.video_path)  # what a user's motion_metric run reads
        metrics.append(motion_fidelity(frames, caption))
        rows.append(contact_sheet(frames, max_frames=8, columns=8))
    write_png(out / f"learning_step_{state['step']}.png", np.concatenate(rows, axis=0))
    shown = [shows_prompt(m) for m in metrics]
    point = {"step": int(state["step"]), "train_loss": math.nan, "shown": sum(shown) / len(shown),
             "train_seconds": math.nan, **{k: nanmean([m[k] for m in metrics]) for k in KEYS},
             "samples": [{"caption": c, "shows": s, **{k: m[k] for k in KEYS}}
                         for c, s, m in zip(captions, shown, metrics)]}
    cfg = state["config"]
    meta = {"preset": cfg.get("preset", "?"), "variant": a.variant, "kind": cfg["attention"]["kind"],
            "cfg_scale": a.cfg_scale, "steps": int(state["step"]), "every": 0, "prompts": len(captions),
            "split": a.split, "overrides": {}, "checkpoint": str(ckpt), "sample_steps": a.sample_steps,
            "upscale": a.upscale,
            "first_step_half_shown": point["step"] if point["shown"] >= 0.5 else None, "step_seconds": math.nan,
            "minutes": (time.perf_counter() - t0) / 60, "threads": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    md = markdown([point], meta)
    (out / "learning.json").write_text(json.dumps({"meta": meta, "points": [point]}, indent=1))
    (out / "learning.md").write_text(md)
    if a.json:
        print(json.dumps({k: v for k, v in point.items() if k != "samples"}))
    else:
        print(md, end="")
    return 0


def markdown(points: list[dict], meta: dict) -> str:
    first = meta["first_step_half_shown"]
    how = (f"sampled from {meta['checkpoint']} by megaslide_ray.sample ({meta['sample_steps']} Euler steps, "
           f"--upscale {meta['upscale']}, scored on the mp4s)" if meta.get("checkpoint") else
           f"seed {meta['seed']}, overrides {meta['overrides'] or 'none'}; "
           f"{meta['step_seconds']:.2f} s/step in process")
    lines = [f"`{meta['preset']}` on the {meta['variant']} set, attention {meta['kind']}, "
             f"{meta['prompts']} {meta['split']} prompts, guidance {meta['cfg_scale']:g}, {how}; "
             f"total {meta['minutes']:.1f} min",
             "",
             "| step | train loss | shows prompt | detection | shape match | direction err (deg) | "
             "trajectory err (px/f) | area CV |",
             "|---|---|---|---|---|---|---|---|"]
    for pt in points:
        lines.append(f"| {pt['step']} | {pt['train_loss']:.4f} | {pt['shown']:.2f} | {pt['detection_rate']:.2f} | "
                     f"{pt['shape_match']:.2f} | {pt['direction_error_deg']:.1f} | {pt['trajectory_error']:.2f} | "
                     f"{pt['area_cv']:.2f} |")
    lines += ["", f"first checkpoint where at least half the samples show their prompt: "
                  f"{first if first is not None else 'none within ' + str(meta['steps']) + ' steps'}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
