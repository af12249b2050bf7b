"""Can dsa's offsets learn motion from their gradient? The descent direction of the offsets
against the true motion, for slow and fast objects.

    python -m benchmarks.studies.offset_signal [--seeds 0 1] [--steps 25 150] [--clips 12] [--t 0.5]
                                               [--window 3,3,3] [--set FIELD VALUE ...] [--json]

Learned offsets can only move where their gradient pushes them. Trilinear sampling gives each
sample point a gradient from its 8 surrounding tokens only, so a sample whose target (the moving
object's position in a neighbouring frame) is more than a token away gets no signal that points
at it. This study measures that signal. For each seed it builds the ``tiny`` dsa model (in
process, ``harness``), trains it on the motion set's training split, and at each step in
``--steps`` does three things on the clips of ``--split`` (fixed noise, flow time ``--t``):

1. takes the gradient of the flow-matching loss with respect to every block's offsets;
2. turns the descent direction (minus the gradient) into a motion estimate per token, exactly as
   the offsets themselves are read (``offsets_view.motion_estimate``: the slope of the mean
   spatial offset over the window's time slices);
3. compares it, on the object's tokens, with the object's true velocity (from ``motion.json``).

(Not at step 0: a fresh model's attention output gates are zero, as in DiT's adaLN-Zero, so
no gradient reaches its offsets; its offset head is zero too, i.e. it starts as neighborhood
attention.) A positive cosine means the gradient pulls the offsets along the motion; about 0, no
useful signal. The same comparison for the learned offsets themselves says whether they follow.
Results are split by speed: ``slow`` clips move at most one token per patch frame (``slowly``,
0.5 token with ``tiny``'s 2x4x4 patches), ``fast`` clips 2.5-4 tokens (``fast``, ``very fast``),
beyond a 3x3x3 window's reach. (``at medium speed``, 1.25 tokens, is its own group.)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.studies.harness import (
    fresh_trainer,
    log,
    motion_manifests,
    object_tokens,
    offset_heads,
    study_config,
    training_decoder,
)
from megaslide_ray.data import motion_set as motion
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.offsets_view import motion_estimate
from megaslide_ray.evaluation.validation import load_val_set, val_generator
from megaslide_ray.training.flow import flow_loss

GROUPS = {"slowly": "slow", "at medium speed": "medium", "fast": "fast", "very fast": "fast"}


def gradient_alignment(model, cfg, val, truth: dict, val_files: list[str], t: float, seed: int) -> dict:
    """``{group: {"cosine_by_block": [...], "offset_cosine_by_block": [...], "clips": n}}``: per
    speed group and block, the mean cosine between the true velocity and the motion estimate of
    the offsets' descent direction (``cosine_by_block``) and of the offsets themselves."""
    mods = offset_heads(model)
    grads: dict[int, torch.Tensor] = {}
    offsets: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(mod, args, out):
            offsets[i] = out.detach().float()
            out.register_hook(lambda g: grads.__setitem__(i, g.detach().float()))
        return hook

    handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(mods)]
    window = tuple(cfg.attention.window)
    cos: dict[str, list[list[float]]] = {}
    try:
        for c in range(len(val.rows)):
            plan = truth[val_files[c]]
            group = GROUPS[plan["speed"]]
            noise = torch.randn(val.x0[c].shape, generator=val_generator(seed, c, 998))
            x0 = val.x0[c][None]
            x_t = (1 - t) * x0 + t * noise[None]
            model.zero_grad(set_to_none=True)
            pred = model(x_t, torch.full((1,), t), torch.from_numpy(val.cond[c:c + 1]),
                         torch.from_numpy(val.cond_len[c:c + 1]))
            flow_loss(pred, noise[None] - x0).backward()
            for name, field in (("gradient", {i: -grads[i][0] for i in grads}),
                                ("offsets", {i: offsets[i][0] for i in offsets})):
                per_block = []
                for i in range(len(mods)):
                    est = motion_estimate(field[i], window)  # (T, H, W, nh, 2)
                    vals = []
                    for ti, near, v_tok in object_tokens(plan, cfg):
                        m = est[ti][near].mean(dim=(0, 1))
                        n = float(m.norm())
                        vals.append(float(m @ v_tok) / (n * float(v_tok.norm())) if n > 0 else 0.0)
                    per_block.append(statistics.fmean(vals) if vals else math.nan)
                cos.setdefault((group, name), []).append(per_block)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    out: dict[str, dict] = {}
    for (g, name), rows in sorted(cos.items()):
        key = "cosine_by_block" if name == "gradient" else "offset_cosine_by_block"
        out.setdefault(g, {"clips": len(rows)})[key] = [float(np.nanmean(b)) for b in zip(*rows)]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.offset_signal", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--steps", type=int, nargs="+", default=[25, 150],
                   help="measure after these training steps (the fresh model has zero attention gates: no "
                        "gradient reaches the offsets at step 0)")
    p.add_argument("--split", choices=["train", "val"], default="train",
                   help="clips to measure on: the training split (default; 48 clips, all four speeds) or the "
                        "held-out one (12 clips, 10 of them fast)")
    p.add_argument("--clips", type=int, default=48, help="clips of the split (default 48; fewer if it has fewer)")
    p.add_argument("--t", type=float, default=0.5, help="flow time of the measurement (default 0.5)")
    p.add_argument("--window", default="3,3,3", help="dsa's window kt,kh,kw (default 3,3,3)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override (e.g. --set model.depth 2); recorded")
    p.add_argument("--json", action="store_true", help="one JSON object per (seed, step)")
    a = p.parse_args(argv)
    if sorted(a.steps) != a.steps or a.steps[0] < 0:
        p.error(f"--steps {a.steps} must be ascending and >= 0")
    if not 0 < a.t < 1:
        p.error(f"--t {a.t} must be in (0, 1)")

    t0 = time.perf_counter()
    train, val = motion_manifests()
    measured = train if a.split == "train" else val
    truth = motion.load_ground_truth(measured)
    entries = read_manifest(measured)
    results = []
    for seed in a.seeds:
        over = {"attention.kind": "dsa", "attention.window": a.window, "training.seed": seed,
                "training.steps": max(a.steps) or 1, "data.manifest": train, "data.val_manifest": val,
                "training.val_clips": min(a.clips, len(entries)), **dict(a.set)}
        cfg = study_config("tiny", over)
        valset = load_val_set(cfg, measured)
        files = [Path(entries[r].path).name for r in valset.rows]
        trainer = fresh_trainer(cfg, seed, a.threads)
        with training_decoder(cfg) as dec:
            done = 0
            for target in a.steps:
                while done < target:
                    trainer.train_step(dec.next_batch())
                    done += 1
                r = {"seed": seed, "step": target,
                     "groups": gradient_alignment(trainer.model, cfg, valset, truth, files, a.t, seed)}
                results.append(r)
                log(f"seed {seed} step {target}: " + "; ".join(
                    f"{g} ({v['clips']} clips) gradient " + ", ".join(f"{x:+.2f}" for x in v["cosine_by_block"])
                    + " offsets " + ", ".join(f"{x:+.2f}" for x in v["offset_cosine_by_block"])
                    for g, v in r["groups"].items()))
                if a.json:
                    print(json.dumps(r), flush=True)
    if not a.json:
        print(markdown(results, a, (time.perf_counter() - t0) / 60), end="")
    return 0


def markdown(results: list[dict], a, minutes: float) -> str:
    lines = [f"dsa, window {a.window}, t = {a.t}, seeds {a.seeds}, {a.split} split, "
             f"overrides {dict(a.set) or 'none'}; "
             f"total {minutes:.1f} min", "",
             "| step | speed | clips | cosine(descent direction, true motion) per block | "
             "cosine(learned offsets, true motion) per block |",
             "|---|---|---|---|---|"]

    def cell(rs, g, key):
        blocks = list(zip(*[r["groups"][g][key] for r in rs if g in r["groups"]]))
        return ", ".join(f"{statistics.fmean(b):+.2f} ± {statistics.stdev(b) if len(b) > 1 else 0.0:.2f}"
                         for b in blocks)

    for step in a.steps:
        rs = [r for r in results if r["step"] == step]
        for g in sorted({g for r in rs for g in r["groups"]}):
            clips = sum(r["groups"][g]["clips"] for r in rs if g in r["groups"])
            lines.append(f"| {step} | {g} | {clips} | {cell(rs, g, 'cosine_by_block')} | "
                         f"{cell(rs, g, 'offset_cosine_by_block')} |")
    lines += ["", "mean ± sd over seeds of the per-seed means over clips"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
