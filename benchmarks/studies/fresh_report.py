"""The report of ``benchmarks.studies.fresh_adaptation``: paired intervals, tables and the curves' plot.

Every number compared is a per-seed difference (``paired.paired_interval``): the kind's run and
the reference's run of one seed share the teacher, the data order, the evaluation clips with their
noise and t, and the sampled prompts with their noise. Intervals are 95% Student-t intervals over
seeds; ``rel_*`` are the same for ``kind / reference - 1`` in percent.
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from benchmarks.studies.fresh_clips import EVAL_SETS
from benchmarks.studies.paired import paired_interval, verdict
from megaslide_ray.evaluation.plotting import pyplot

SAMPLE_METRICS = ("train_shown", "shown", "train_trajectory_error", "trajectory_error", "train_fast_trajectory_error",
                  "train_temporal_consistency", "temporal_consistency")
"""Sample scores compared (``train_``: prompts of trained combinations; else unseen ones)."""


def comparisons(kinds: list[str], arms: dict | None = None) -> list[tuple[str, str]]:
    """(kind, reference) pairs: every kind (and arm) against dense, dsa against neighborhood and
    swin, and each arm against its own kind (``arms``: ``{name: (kind, overrides)}``)."""
    out = [(k, "dense") for k in kinds if k != "dense" and "dense" in kinds]
    out += [("dsa", r) for r in ("neighborhood", "swin") if "dsa" in kinds and r in kinds]
    out += [(name, kind) for name, (kind, _) in (arms or {}).items() if name in kinds and kind in kinds]
    return list(dict.fromkeys(out))


def curve_mean(run: dict, split: str, key: str = "loss_ge25") -> float:
    """The mean of a run's curve on ``split`` over its points after step 0 (the curve's area per step)."""
    pts = [p[split][key] for p in run["curve"] if p["step"] > 0 and split in p]
    return statistics.fmean(pts) if pts else math.nan


def metrics_of(run: dict) -> dict[str, float]:
    """A run's scalar numbers compared across kinds: per set the final loss (t >= 0.25, all t, x0)
    and the curve's mean, then the sample scores."""
    out, last = {}, run["curve"][-1]
    for s in EVAL_SETS:
        if s in last:
            out.update({f"{s}_loss_ge25": last[s]["loss_ge25"], f"{s}_loss": last[s]["loss"], f"{s}_x0": last[s]["x0"],
                        f"{s}_curve_mean": curve_mean(run, s)})
    out.update({k: run[k] for k in SAMPLE_METRICS if k in run})
    return out


def intervals(runs: list[dict], kinds: list[str], arms: dict | None = None) -> dict:
    """Per ``"kind-reference"``: per metric (``metrics_of``) the paired interval over the seeds both
    ran, and ``curve_<set>``: one interval per curve point of the loss at t >= 0.25."""
    by = {(r["kind"], r["seed"]): r for r in runs}
    out = {}
    for kind, ref in comparisons(kinds, arms):
        seeds = sorted(s for (k, s) in by if k == kind and (ref, s) in by)
        if not seeds:
            continue
        mk, mr = [metrics_of(by[kind, s]) for s in seeds], [metrics_of(by[ref, s]) for s in seeds]
        entry = {"seeds": seeds, **{m: paired_interval([x[m] for x in mk], [x[m] for x in mr]) for m in mk[0]}}
        for split in EVAL_SETS:
            n = min(len(by[k, s]["curve"]) for s in seeds for k in (kind, ref))
            entry[f"curve_{split}"] = [
                {"step": by[kind, seeds[0]]["curve"][i]["step"],
                 **paired_interval([by[kind, s]["curve"][i][split]["loss_ge25"] for s in seeds],
                                   [by[ref, s]["curve"][i][split]["loss_ge25"] for s in seeds])}
                for i in range(n) if split in by[kind, seeds[0]]["curve"][i]]
        out[f"{kind}-{ref}"] = entry
    return out


def _ci(c: dict, fmt: str = ".4f", rel: bool = True) -> str:
    if math.isnan(c["mean"]):
        return "-"
    text = f"{c['mean']:+{fmt}} [{c['lo']:+{fmt}}, {c['hi']:+{fmt}}]"
    if rel and not math.isnan(c.get("rel_mean", math.nan)):
        text += f" ({c['rel_mean']:+.1f}% [{c['rel_lo']:+.1f}, {c['rel_hi']:+.1f}])"
    return text + f" {verdict(c)}"


def _mean(runs: list[dict], kind: str, get) -> str:
    xs = [get(r) for r in runs if r["kind"] == kind]
    xs = [x for x in xs if not math.isnan(x)]
    return f"{statistics.fmean(xs):.4f}" if xs else "-"


def markdown(report: dict) -> str:
    meta, runs = report["meta"], report["runs"]
    L = [f"`{meta['preset']}` ({meta['arch']}), {meta['clips']} clips rendered fresh every step, grid {meta['grid']} "
         f"({meta['tokens']} tokens, window {meta['window']}): dense teacher {meta['teacher_steps']} steps, then "
         f"{meta['steps']} adaptation steps per kind; seeds {meta['seeds']}; {meta['eval_clips']} clips per evaluation "
         f"set; {meta['samples']} prompts per seed and split; this invocation {meta['minutes']:.1f} min", "",
         "**Learning rate per kind** (sweep on the `val` split, seeds " f"{meta['sweep_seeds']}; final val loss "
         "t >= 0.25 per rate):", "", "| kind | " + " | ".join(f"{r:g}" for r in meta["rates"]) + " | picked |",
         "|---|" + "---|" * (len(meta["rates"]) + 1)]
    for kind in meta["kinds"]:
        rows = [x for x in report["sweep"] if x["kind"] == kind]
        cells = [_mean([{"kind": kind, "v": x["val_loss_ge25"]} for x in rows if x["lr"] == r], kind, lambda d: d["v"])
                 for r in meta["rates"]]
        fixed = " (fixed)" if kind in meta["fixed_lr"] else ""
        L.append(f"| {kind} | " + " | ".join(cells) + f" | {report['picked_lr'][kind]:g}{fixed} |")
    L += ["", "**Held-out loss at the end** (t >= 0.25, mean over seeds): val / seen (new clips of trained "
              "combinations) / unseen (combinations never trained on):", "", "| kind | val | seen | unseen |",
          "|---|---|---|---|"]
    for kind in meta["kinds"]:
        L.append(f"| {kind} | " + " | ".join(_mean(runs, kind, lambda r, s=s: r["curve"][-1][s]["loss_ge25"])
                                            for s in EVAL_SETS) + " |")
    L += ["", "**Paired differences** (kind - reference, per seed; mean [95% t-interval] (relative, %)):", "",
          "| comparison | seen, final | seen, curve mean | unseen, final | unseen, curve mean |",
          "|---|---|---|---|---|"]
    for name, e in report["intervals"].items():
        L.append(f"| {name} | " + " | ".join(_ci(e[m]) for m in ("seen_loss_ge25", "seen_curve_mean",
                                                                 "unseen_loss_ge25", "unseen_curve_mean")) + " |")
    L += ["", "**Samples** (paired differences; shown: share of prompts showing colour, shape and direction; "
              "consistency: `benchmarks.studies.consistency`):", "",
          "| comparison | " + " | ".join(SAMPLE_METRICS) + " |", "|---|" + "---|" * len(SAMPLE_METRICS)]
    for name, e in report["intervals"].items():
        L.append(f"| {name} | " + " | ".join(_ci(e[m], ".3f", rel=False) if m in e else "-" for m in SAMPLE_METRICS)
                 + " |")
    L += ["", "Time per run (mean, seconds): step / training / evaluations / samples:", ""]
    for kind in meta["kinds"]:
        L.append(f"- {kind}: " + " / ".join(_mean(runs, kind, lambda r, k=k: r.get(k, math.nan))
                                          for k in ("step_seconds", "train_seconds", "eval_seconds", "sample_seconds")))
    return "\n".join(L) + "\n"


def plot(report: dict, path) -> None:
    """Per evaluation set, each kind's curve (loss t >= 0.25): the mean over seeds, and each seed thin."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(EVAL_SETS), figsize=(5 * len(EVAL_SETS), 4))
    for i, kind in enumerate(report["meta"]["kinds"]):
        rs = [r for r in report["runs"] if r["kind"] == kind]
        if not rs:
            continue
        n = min(len(r["curve"]) for r in rs)
        steps = [p["step"] for p in rs[0]["curve"][:n]]
        for ax, s in zip(axes, EVAL_SETS):
            vals = np.array([[p[s]["loss_ge25"] for p in r["curve"][:n]] for r in rs])
            ax.plot(steps, vals.mean(0), color=f"C{i}", marker="o", label=f"{kind} (lr {report['picked_lr'][kind]:g})")
            for row in vals:
                ax.plot(steps, row, color=f"C{i}", alpha=0.25, linewidth=0.8)
    for ax, s in zip(axes, EVAL_SETS):
        ax.set_title(s)
        ax.set_xlabel("adaptation step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("loss, t >= 0.25")
    axes[0].legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
