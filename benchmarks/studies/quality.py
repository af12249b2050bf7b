"""Does 3D-DSA learn motion? The attention kinds trained alike and compared on held-out motion.

    python -m benchmarks.studies.quality [--steps N] [--seeds 0 1 2] [--kinds dense swin neighborhood dsa]
                                         [--samples M] [--out DIR [--resume]] [--json]
    python -m benchmarks.studies.quality --preset tiny-motion --variant simple --steps 2000 --evals 4 \
                                         --samples 12 --out DIR        # where the model draws the objects

Every (kind, seed) trains the same small model (``--preset``, default ``tiny``: 16 frames of 64x64
in 2x4x4 patches, 2048 tokens, 4 blocks of width 128) for the same steps on the same batches of the
motion set's training split (``megaslide_ray.data.motion_set``: shapes moving 1-8 px per frame, so
the fast ones move 2.5-4 tokens per patch frame; ``--variant simple``: its simple variant, one
large shape over 8 frames, on which ``tiny-motion`` learns to draw its prompts within 2000
steps), with the same initial weights per seed; only ``attention.kind`` differs (``dense``;
``swin``, ``neighborhood`` and ``dsa`` with the same (3,3,3) window, K = 27 keys per query:
swin's windows are fixed tiles (shifted every other block), neighborhood's slide with the query,
dsa's slide and move by learned offsets). Training runs in process (``harness``: the model and
objective of the streamed trainer, which the tests hold equal to it), so the table compares the
attention operators, not the plumbing.

Per (kind, seed) it records:

* **validation loss** on the held-out split (combinations of colour, shape, direction and speed
  never seen in training), at fixed noise and t (``megaslide_ray.evaluation.validation``),
  at several steps, and per t-bucket at the end; and the same loss on as many clips of the
  training split (``train_split_loss``: the gap between the two is what a kind memorised);
* **motion fidelity** of samples (``megaslide_ray.evaluation.motion_score``): the first ``--samples``
  held-out captions, and as many training captions (``train_*`` columns: motion the model was
  shown, which a small model draws long before it generalises to unseen combinations), are
  sampled from fixed noise (Euler, ``training.sample_steps``) and each clip is scored against
  its caption: detection rate, trajectory error (px per frame; also over the ``fast`` captions
  alone, ``fast_trajectory_error``), direction error, shape match, area variation, background
  flicker, and the fraction of samples that show their prompt (colour, shape and direction:
  ``harness.shows_prompt``);
* **step time** (in-process, this machine);
* for ``dsa``, the **learned offsets** on the validation clips at t = 0.5: mean |offset| in
  tokens, and whether they point along the object's motion: the per-block motion estimate of
  ``megaslide_ray.evaluation.offsets_view`` (the slope of the mean spatial offset over the window's time
  slices) averaged over the object's tokens, against the true velocity from the set's
  ``motion.json``: cosine and length ratio, per block.

The table gives mean and spread (standard deviation over seeds) per kind; ``--out`` receives
``quality.json``, ``quality.md`` and two plots (val loss against steps, motion metrics per
kind), ``runs.jsonl``, one line per finished (kind, seed) as it finishes: ``--resume`` skips
the runs it already holds (same settings required), so a long comparison that was stopped goes
on where it was, and ``models/KIND_seedS.safetensors``, each run's final weights (``saved_model``
rebuilds one; ``region_loss`` reads them). Nothing is tuned per kind: the preset's optimizer
settings serve all four.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.studies.harness import (
    ModelPredictor,
    finished_runs,
    fresh_trainer,
    load_model,
    log,
    motion_manifests,
    nanmean,
    object_tokens,
    offset_heads,
    sample_and_score,
    save_weights,
    shows_prompt,
    study_config,
    training_decoder,
)
from megaslide_ray.data import motion_set as motion
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.offsets_view import motion_estimate
from megaslide_ray.evaluation.plotting import pyplot
from megaslide_ray.evaluation.validation import load_val_set, val_generator, validation_loss

KINDS = ("dense", "swin", "neighborhood", "dsa")
WINDOWED = ("swin", "neighborhood", "dsa")
DEFAULT_WINDOW = "3,3,3"
METRICS = ("detection_rate", "trajectory_error", "direction_error_deg", "shape_match", "area_cv", "flicker",
           "shown", "fast_trajectory_error")
SPLITS = ("", "train_")  # metric prefixes: samples of held-out captions, of training captions


def kind_config(kind: str, seed: int, steps: int, train_manifest: str, val_manifest: str, extra: dict,
                preset: str = "tiny"):
    over = {"attention.kind": kind, "training.seed": seed, "training.steps": steps,
            "data.manifest": train_manifest, "data.val_manifest": val_manifest, **extra}
    if kind in WINDOWED:  # one window for all three (``--window``), never the preset's per kind
        over["attention.window"] = extra.get("attention.window", DEFAULT_WINDOW)
    return study_config(preset, over)


def training_batches(cfg, steps: int) -> list[dict]:
    """The decoder's first ``steps`` batches for ``cfg.training.seed`` (the same for every kind)."""
    with training_decoder(cfg) as dec:
        return [dec.next_batch() for _ in range(steps)]


@torch.no_grad()
def offset_statistics(model, cfg, val, truth: dict, val_files: list[str]) -> dict:
    """Mean |offset| (tokens) and, per block, the motion estimate against the true velocity on
    the object's tokens (module docstring), over the validation clips at t = 0.5."""
    mods = offset_heads(model)
    got: dict[int, list] = {i: [] for i in range(len(mods))}
    hooks = [m.register_forward_hook(lambda mod, a, out, i=i: got[i].append(out[0].float()))
             for i, m in enumerate(mods)]
    window = tuple(cfg.attention.window)
    abs_mean, cos_by_block, ratio_by_block = [], {i: [] for i in got}, {i: [] for i in got}
    try:
        for c in range(len(val.rows)):
            for m in got.values():
                m.clear()
            noise = torch.randn(val.x0[c].shape, generator=val_generator(cfg.training.seed, c, 999))
            x_t = 0.5 * val.x0[c] + 0.5 * noise  # fixed noise, t = 0.5
            model(x_t[None], torch.full((1,), 0.5), torch.from_numpy(val.cond[c:c + 1]),
                  torch.from_numpy(val.cond_len[c:c + 1]))
            plan = truth[val_files[c]]
            for i, outs in got.items():
                off = outs[0]  # (T, H, W, nh, K, 3)
                abs_mean.append(float(off.abs().mean()))
                est = motion_estimate(off, window)  # (T, H, W, nh, 2): (vy, vx) tokens per patch frame
                for ti, near, v_tok in object_tokens(plan, cfg):
                    mean = est[ti][near].mean(dim=(0, 1))
                    if float(mean.norm()) < 1e-9:
                        cos_by_block[i].append(0.0)
                    else:
                        cos_by_block[i].append(float(mean @ v_tok) / float(mean.norm() * v_tok.norm()))
                    ratio_by_block[i].append(float(mean.norm() / v_tok.norm()))
    finally:
        for h in hooks:
            h.remove()
    return {"mean_abs_offset": statistics.fmean(abs_mean) if abs_mean else math.nan,
            "cosine_by_block": [statistics.fmean(v) if v else math.nan for v in cos_by_block.values()],
            "length_ratio_by_block": [statistics.fmean(v) if v else math.nan for v in ratio_by_block.values()]}


def run_one(kind: str, seed: int, steps: int, eval_steps: list[int], data: dict, samples: int,
            extra: dict, log=print) -> dict:
    cfg = kind_config(kind, seed, steps, data["train"], data["val"], extra, data["preset"])
    trainer = fresh_trainer(cfg, seed, data["threads"])
    pred = ModelPredictor(trainer.model)
    batches = data["batches"][seed]
    curve, losses, times = [], [], []
    for step in range(steps):
        r = trainer.train_step(batches[step])
        losses.append(r.loss)
        times.append(r.seconds)
        if step + 1 in eval_steps:
            trainer.model.eval()
            v = validation_loss(pred, cfg, data["valset"], step + 1)
            # The same measurement on training clips: the gap to the held-out loss is what was
            # memorised rather than learned in general.
            tr = validation_loss(pred, cfg, data["trainset"], step + 1)
            trainer.model.train()
            curve.append({"step": step + 1, "val_loss": v.val_loss, "buckets": list(v.bucket_losses),
                          "train_split_loss": tr.val_loss})
            log(f"  {kind:<12} seed {seed} step {step + 1:>4}: train loss {statistics.fmean(losses[-20:]):.4f}, "
                f"val loss {v.val_loss:.4f}, train-split loss {tr.val_loss:.4f}")
    trainer.model.eval()
    out = {"kind": kind, "seed": seed, "steps": steps, "val_curve": curve, "val_loss": curve[-1]["val_loss"],
           "val_buckets": curve[-1]["buckets"], "train_split_loss": curve[-1]["train_split_loss"],
           "train_loss_last20": statistics.fmean(losses[-20:]),
           "step_seconds": statistics.median(times[1:] or times)}
    for prefix, key in zip(SPLITS, ("captions", "train_captions")):
        captions = data[key][:samples]
        _, metrics = sample_and_score(pred, cfg, captions, steps)
        fidelity = [{**m, "shown": float(shows_prompt(m)),
                     "fast_trajectory_error": m["trajectory_error"] if " fast" in caption else math.nan}
                    for m, caption in zip(metrics, captions)]
        out[prefix + "samples"] = [{"caption": c, **{k: f[k] for k in METRICS + ("steps",)}}
                                   for c, f in zip(captions, fidelity)]
        out.update({prefix + m: nanmean([f[m] for f in fidelity]) for m in METRICS})
    if data.get("models"):
        save_weights(trainer.model, data["models"] / f"{kind}_seed{seed}.safetensors")
    if kind == "dsa":
        out["offsets"] = offset_statistics(trainer.model, cfg, data["valset"], data["truth"], data["val_files"])
    return out


def _spread(xs) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict], kinds: list[str]) -> list[dict]:
    rows = []
    for kind in kinds:
        rs = [r for r in runs if r["kind"] == kind]
        if not rs:
            continue
        row = {"kind": kind, "seeds": len(rs)}
        for key in ("val_loss", "train_split_loss", "train_loss_last20", "step_seconds") + tuple(
                p + m for p in SPLITS for m in METRICS):
            row[key], row[key + "_sd"] = _spread([r.get(key, math.nan) for r in rs])  # older runs.jsonl: no split loss
        if kind == "dsa":
            row["mean_abs_offset"], row["mean_abs_offset_sd"] = _spread([r["offsets"]["mean_abs_offset"] for r in rs])
            per_block = list(zip(*[r["offsets"]["cosine_by_block"] for r in rs]))
            row["offset_cosine_by_block"] = [_spread(list(b))[0] for b in per_block]
            per_block = list(zip(*[r["offsets"]["length_ratio_by_block"] for r in rs]))
            row["offset_length_ratio_by_block"] = [_spread(list(b))[0] for b in per_block]
        rows.append(row)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"`{meta.get('preset', 'tiny')}` on the {meta.get('variant', 'motion')} set, "
             f"{meta['steps']} steps, seeds {meta['seeds']}, {meta['samples']} samples per run, "
             f"{meta['val_clips']} validation clips x {meta['buckets']} t-buckets; total {meta['minutes']:.1f} min",
             "",
             "| kind | val loss | train-split loss | shows prompt | trajectory err (px/f) | fast: trajectory err "
             "| direction err (deg) | detection | shape match | area CV | flicker | step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(r, k, spec=".4f"):
        return f"{r[k]:{spec}} ± {r[k + '_sd']:{spec}}"

    def metric_cells(r, p):
        return (f"{f(r, p + 'shown', '.2f')} | {f(r, p + 'trajectory_error', '.2f')} | "
                f"{f(r, p + 'fast_trajectory_error', '.2f')} | {f(r, p + 'direction_error_deg', '.1f')} | "
                f"{f(r, p + 'detection_rate', '.2f')} | {f(r, p + 'shape_match', '.2f')} | {f(r, p + 'area_cv', '.2f')} | "
                f"{f(r, p + 'flicker', '.2f')}")

    for r in rows:
        lines.append(f"| {r['kind']} | {f(r, 'val_loss')} | {f(r, 'train_split_loss')} | {metric_cells(r, '')} "
                     f"| {f(r, 'step_seconds', '.2f')} |")
    lines += ["", f"Samples of training captions (the first {meta['samples']}; motion the model was shown):", "",
              "| kind | shows prompt | trajectory err (px/f) | fast: trajectory err | direction err (deg) | detection "
              "| shape match | area CV | flicker |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {metric_cells(r, 'train_')} |")
    for r in rows:
        if r["kind"] == "dsa":
            cos = ", ".join(f"{c:+.2f}" for c in r["offset_cosine_by_block"])
            ratio = ", ".join(f"{c:.2f}" for c in r["offset_length_ratio_by_block"])
            lines += ["", f"dsa offsets: mean |offset| {r['mean_abs_offset']:.3f} ± {r['mean_abs_offset_sd']:.3f} "
                          f"tokens; motion estimate vs true velocity on the object's tokens, per block: cosine "
                          f"[{cos}], length ratio [{ratio}]"]
    return "\n".join(lines) + "\n"


def plots(runs: list[dict], rows: list[dict], out: Path) -> list[Path]:
    plt = pyplot()
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for kind in dict.fromkeys(r["kind"] for r in runs):
        rs = [r for r in runs if r["kind"] == kind]
        steps = [p["step"] for p in rs[0]["val_curve"]]
        vals = np.array([[p["val_loss"] for p in r["val_curve"]] for r in rs])
        mean, sd = vals.mean(axis=0), vals.std(axis=0)
        line, = ax.plot(steps, mean, marker="o", label=kind)
        ax.fill_between(steps, mean - sd, mean + sd, alpha=0.2)
        split = np.array([[p.get("train_split_loss", math.nan) for p in r["val_curve"]] for r in rs])
        if not np.isnan(split).all():
            ax.plot(steps, split.mean(axis=0), linestyle="--", color=line.get_color(), alpha=0.7)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss, mean ± sd over seeds\n(solid: held out; dashed: training clips)")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(out / "quality_val_loss.png")
    fig.savefig(written[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, key, label in zip(axes, ("trajectory_error", "direction_error_deg", "detection_rate"),
                              ("trajectory error (px/frame)", "direction error (deg)", "detection rate")):
        ax.bar([r["kind"] for r in rows], [r[key] for r in rows], yerr=[r[key + "_sd"] for r in rows], capsize=4)
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    written.append(out / "quality_motion.png")
    fig.savefig(written[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return written


RUNS_FILE = "runs.jsonl"


def quality_folder(text: str) -> Path:
    """argparse type of a ``--quality DIR`` (``region_loss``'s): a folder this study's ``--out`` made."""
    folder = Path(text)
    if not (folder / "quality.json").is_file():
        raise argparse.ArgumentTypeError(f"{text}: no quality.json there (the --out folder of "
                                         f"benchmarks.studies.quality)")
    return folder


def saved_model(folder: Path, kind: str, seed: int):
    """``(cfg, model in eval mode, meta)`` of the ``(kind, seed)`` run whose weights the ``--out``
    folder ``folder`` holds (``models/KIND_seedS.safetensors``), rebuilt with that comparison's
    preset, motion set and overrides; ``None`` when it holds no such weights."""
    weights = folder / "models" / f"{kind}_seed{seed}.safetensors"
    if not weights.is_file():
        return None
    meta = json.loads((folder / "quality.json").read_text())["meta"]
    train, val = motion_manifests(meta.get("variant", "motion"))
    cfg = kind_config(kind, seed, meta["steps"], train, val, meta["overrides"], meta.get("preset", "tiny"))
    return cfg, load_model(cfg, weights), meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="the model and its training settings (default tiny)")
    p.add_argument("--variant", choices=("motion", "simple"), default="motion",
                   help="the motion set (default) or its simple variant (one large shape, 8 frames)")
    p.add_argument("--steps", type=int, default=150, help="training steps per run (default 150)")
    p.add_argument("--evals", type=int, default=3, help="validation points, evenly spaced, the last at --steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--samples", type=int, default=4, help="held-out captions sampled per run (default 4)")
    p.add_argument("--val-clips", type=int, default=6, help="validation clips (default 6)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", type=Path, default=None, help="folder for quality.json/.md and the plots")
    p.add_argument("--json", action="store_true", help="one JSON object per kind")
    p.add_argument("--resume", action="store_true",
                   help="with --out: skip the (kind, seed) runs already in DIR/runs.jsonl (same settings)")
    p.add_argument("--window", default=DEFAULT_WINDOW, help="kt,kh,kw of swin, neighborhood and dsa (default 3,3,3)")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override for every run (e.g. --set attention.max_offset 4); recorded")
    a = p.parse_args(argv)
    for name in ("steps", "evals", "samples", "val_clips"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if a.evals > a.steps:
        p.error(f"--evals {a.evals} exceeds --steps {a.steps}")
    extra = dict(a.set)
    extra["training.val_clips"] = a.val_clips
    extra["attention.window"] = a.window

    if a.resume and not a.out:
        p.error("--resume needs --out DIR (the runs.jsonl to continue)")
    t0 = time.perf_counter()
    train, val = motion_manifests(a.variant)
    cfg0 = kind_config("dense", a.seeds[0], a.steps, train, val, extra, a.preset)
    valset = load_val_set(cfg0)
    trainset = load_val_set(cfg0, manifest=train)  # as many training clips, measured alike
    entries = read_manifest(val)
    data = {"train": train, "val": val, "valset": valset, "trainset": trainset, "threads": a.threads, "preset": a.preset,
            "captions": [e.caption for e in entries], "truth": motion.load_ground_truth(val),
            "train_captions": [e.caption for e in read_manifest(train)],
            "models": a.out / "models" if a.out else None,
            "val_files": [Path(entries[r].path).name for r in valset.rows],
            "batches": {s: training_batches(kind_config("dense", s, a.steps, train, val, extra, a.preset), a.steps)
                        for s in a.seeds}}
    eval_steps = sorted({round(a.steps * (k + 1) / a.evals) for k in range(a.evals)})
    settings = {"preset": a.preset, "variant": a.variant, "steps": a.steps, "evals": eval_steps,
                "samples": a.samples, "overrides": extra}
    done = finished_runs(a.out / RUNS_FILE, settings) if a.resume else {}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        if not a.resume:
            (a.out / RUNS_FILE).unlink(missing_ok=True)
    runs = []
    for seed in a.seeds:
        for kind in a.kinds:
            if (kind, seed) in done:
                runs.append(done[(kind, seed)])
                log(f"{kind} seed {seed}: from {a.out / RUNS_FILE}")
                continue
            t1 = time.perf_counter()
            runs.append(run_one(kind, seed, a.steps, eval_steps, data, a.samples, extra, log))
            log(f"{kind} seed {seed}: {time.perf_counter() - t1:.0f} s")
            if a.out:  # one line per finished run: a stopped comparison resumes from here
                with (a.out / RUNS_FILE).open("a") as f:
                    f.write(json.dumps({"settings": settings, "run": runs[-1]}) + "\n")
    rows = summarize(runs, a.kinds)
    meta = {"preset": a.preset, "variant": a.variant, "steps": a.steps, "seeds": a.seeds, "samples": a.samples,
            "val_clips": a.val_clips, "resumed_runs": len(done),
            "buckets": cfg0.training.val_t_buckets, "minutes": (time.perf_counter() - t0) / 60, "overrides": extra,
            "threads": a.threads or os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quality.json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": runs}, indent=1))
        (a.out / "quality.md").write_text(markdown(rows, meta))
        plots(runs, rows, a.out)
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(markdown(rows, meta), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
