"""Plots and a summary of a training run, from its ``metrics.jsonl``.

    python -m megaslide_ray.report RUN_DIR [RUN_DIR ...] [--out DIR]

Writes ``loss.png``, ``tokens_per_s.png`` and ``time_split.png`` into ``RUN_DIR/report/`` (or
``--out``) and prints a summary table. A run that evaluated (``training.eval_every``) also gets
``val_loss.png`` (the validation loss and its t-buckets), and its validation loss is drawn on
``loss.png`` too. A ``dsa`` run with a checkpoint gets ``offsets.png``: the learned offset field
of one clip, as arrows per head group (``megaslide_ray.evaluation.offsets_view``). Several runs (e.g. one
per attention kind) are each reported, and ``val_loss_by_run.png`` draws their validation
losses side by side. A run that sampled during training also gets its samples listed
(``read_samples``, ``format_samples``: by step and prompt, and what sampling held the steps up by).
How a step's wall time splits: ``step_seconds`` is the
driver's time between two steps; the compute actor's share is ``forward_seconds +
backward_seconds`` (= ``compute_seconds``), and the rest (``step_seconds - compute_seconds``)
is waiting for data and driver overhead. ``weight_wait_seconds`` (blocked on a shard version
or a weight transfer) lies inside forward and backward; ``optimizer_seconds`` (CPU AdamW in
the store) overlaps the next step's forward, so neither adds to the stack.

Rows may lack fields (older runs, other tools): a missing value is skipped, never guessed.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from megaslide_ray.config import load_toml
from megaslide_ray.evaluation.offsets_view import run_offsets_plot
from megaslide_ray.evaluation.plotting import pyplot

PLOTS = ("loss.png", "tokens_per_s.png", "time_split.png")
OFFSETS_PLOT = "offsets.png"          # dsa runs with a checkpoint
COMPARE_PLOT = "val_loss_by_run.png"  # several runs
VAL_PLOT = "val_loss.png"  # only for runs with validation rows


@dataclass(frozen=True)
class RunSummary:
    rows: int
    first_step: int
    last_step: int
    first_loss: float
    last_loss: float
    min_loss: float
    min_loss_step: int
    mean_step_seconds: float      # over the steps after the first (the first includes start-up), if any
    tokens_per_second: float      # tokens / wall seconds over the same steps
    split: dict                   # name -> fraction of step time (forward, backward, other, weight wait, optimizer)
    val_first: float = float("nan")   # validation loss at the first / last evaluation, and its minimum
    val_last: float = float("nan")
    val_min: float = float("nan")
    val_min_step: int = -1
    val_evals: int = 0


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``, sorted by step; a later row for the same step wins."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p} does not exist: point the report at a run directory written by "
                                f"`python -m megaslide_ray.train` (it holds metrics.jsonl)")
    by_step: dict[int, dict] = {}
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{p} line {n} is not JSON: {line[:80]!r}") from None
        if "step" in row:
            by_step[int(row["step"])] = row
    if not by_step:
        raise ValueError(f"{p} holds no metrics rows yet: run some training steps first")
    return [by_step[s] for s in sorted(by_step)]


def _values(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have a finite ``key``."""
    steps, values = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict]) -> RunSummary:
    steps, losses = _values(rows, "loss")
    steady = rows[1:] if len(rows) > 1 else rows
    _, step_s = _values(steady, "step_seconds")
    tokens = [r.get("tokens") for r in steady if isinstance(r.get("tokens"), (int, float))]
    if tokens and step_s and len(tokens) == len(step_s):
        tok_s = sum(tokens) / sum(step_s)
    else:
        tok_s = _mean(_values(steady, "tokens_per_s")[1])
    split: dict[str, float] = {}
    total = sum(step_s)
    if total > 0:
        for name, key in (("forward", "forward_seconds"), ("backward", "backward_seconds"),
                          ("weight wait", "weight_wait_seconds"), ("optimizer", "optimizer_seconds")):
            _, xs = _values(steady, key)
            if len(xs) == len(step_s):
                split[name] = sum(xs) / total
        other = [max(r["step_seconds"] - r["compute_seconds"], 0.0) for r in steady
                 if isinstance(r.get("step_seconds"), (int, float)) and isinstance(r.get("compute_seconds"), (int, float))]
        if len(other) == len(step_s):
            split["other (data, driver)"] = sum(other) / total
    i_min = min(range(len(losses)), key=losses.__getitem__) if losses else None
    nan = float("nan")
    val_steps, val = _values(rows, "val_loss")
    v_min = min(range(len(val)), key=val.__getitem__) if val else None
    val_fields = dict(val_first=val[0], val_last=val[-1], val_min=val[v_min], val_min_step=val_steps[v_min],
                      val_evals=len(val)) if val else {}
    return RunSummary(
        rows=len(rows), first_step=int(rows[0]["step"]), last_step=int(rows[-1]["step"]),
        first_loss=losses[0] if losses else nan, last_loss=losses[-1] if losses else nan,
        min_loss=losses[i_min] if i_min is not None else nan, min_loss_step=steps[i_min] if i_min is not None else -1,
        mean_step_seconds=_mean(step_s), tokens_per_second=tok_s, split=split, **val_fields,
    )


def format_summary(s: RunSummary) -> str:
    lines = [
        f"{'steps':<24} {s.first_step}..{s.last_step} ({s.rows} rows)",
        f"{'loss first / last':<24} {s.first_loss:.4f} / {s.last_loss:.4f}",
        f"{'loss min':<24} {s.min_loss:.4f} (step {s.min_loss_step})",
        f"{'mean s/step':<24} {s.mean_step_seconds:.3f}" + ("  (first step excluded)" if s.rows > 1 else ""),
        f"{'tokens/s':<24} {s.tokens_per_second:.0f}",
    ]
    if s.val_evals:
        lines.append(f"{'val loss first / last':<24} {s.val_first:.4f} / {s.val_last:.4f} ({s.val_evals} evaluations)")
        lines.append(f"{'val loss min':<24} {s.val_min:.4f} (step {s.val_min_step})")
    if s.split:
        lines.append("time split (% of step time):")
        notes = {"weight wait": "  (inside forward/backward)", "optimizer": "  (overlaps the next forward)"}
        for name in ("forward", "backward", "other (data, driver)", "weight wait", "optimizer"):
            if name in s.split:
                lines.append(f"  {name:<22} {100 * s.split[name]:5.1f}%{notes.get(name, '')}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Samples taken during training
# ---------------------------------------------------------------------------------------------


SAMPLES_INDEX = Path("samples") / "samples.jsonl"
"""The sample writer's list of the videos it wrote (``actors.sample_writer``), one JSON line each."""


def read_samples(run_dir: str | Path) -> list[dict]:
    """The samples a run wrote (``training.sample_every``), by step then prompt; [] when none.
    A line that is not JSON (a run stopped while writing it) is skipped."""
    path = Path(run_dir) / SAMPLES_INDEX
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and {"step", "index", "prompt", "video"} <= entry.keys():
            out.append(entry)
    return sorted(out, key=lambda e: (e["step"], e["index"]))


def format_samples(samples: list[dict], rows: list[dict], run_dir: str | Path) -> str:
    """The report's sample section: how long sampling held the steps up (``sample_seconds`` of the
    rows, against the mean ``step_seconds``) and each video, by step and prompt, its path relative
    to ``run_dir``; empty when the run took no sample."""
    held = [r["sample_seconds"] for r in rows if isinstance(r.get("sample_seconds"), (int, float))]
    if not samples and not held:
        return ""
    steps = [r["step_seconds"] for r in rows if "sample" not in r and isinstance(r.get("step_seconds"), (int, float))]
    lines = [f"samples: {len(samples)} videos of {len({e['prompt'] for e in samples})} prompts"]
    if held:
        line = f"  sampling held its step up by {_mean(held):.3f} s on average ({len(held)} times)"
        lines.append(line + (f", a step without it took {_mean(steps):.3f} s" if steps else ""))
    decode = [e["decode_seconds"] for e in samples if isinstance(e.get("decode_seconds"), (int, float))]
    if decode:
        lines.append(f"  decoding a sample took {_mean(decode):.3f} s on average (the sample writer, off the step)")
    root = Path(run_dir)
    for e in samples:
        video = Path(e["video"])
        shown = video.relative_to(root) if video.is_relative_to(root) else video
        lines.append(f"  step {e['step']:>6} [{e['index']:02d}] {e['prompt']!r}: {shown}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------


def plot_run(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Write the three PNGs (and ``val_loss.png`` when rows have ``val_loss``) into ``out_dir``;
    returns their paths."""
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, loss = _values(rows, "loss")
    ax.plot(steps, loss, marker="." if len(steps) < 50 else None, label="loss")
    if len(loss) >= 10:  # a running mean makes the trend readable through per-batch noise
        k = max(len(loss) // 10, 2)
        smooth = [_mean(loss[max(0, i - k + 1): i + 1]) for i in range(len(loss))]
        ax.plot(steps, smooth, label=f"mean of last {k}")
    val_steps, val = _values(rows, "val_loss")
    if val:
        ax.plot(val_steps, val, marker="o", label="validation loss")
    ax.set(xlabel="step", ylabel="flow-matching loss (MSE)", title="loss")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, out / "loss.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, tps = _values(rows, "tokens_per_s")
    ax.plot(steps, tps, marker="." if len(steps) < 50 else None)
    ax.set(xlabel="step", ylabel="tokens / s", title="throughput")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out / "tokens_per_s.png", plt))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    have = [r for r in rows if all(isinstance(r.get(k), (int, float))
                                   for k in ("step_seconds", "forward_seconds", "backward_seconds", "compute_seconds"))]
    if have:
        s = [int(r["step"]) for r in have]
        fwd = [r["forward_seconds"] for r in have]
        bwd = [r["backward_seconds"] for r in have]
        other = [max(r["step_seconds"] - r["compute_seconds"], 0.0) for r in have]
        top.bar(s, fwd, label="forward", color="tab:blue")
        top.bar(s, bwd, bottom=fwd, label="backward", color="tab:orange")
        top.bar(s, other, bottom=[a + b for a, b in zip(fwd, bwd)], label="other (data wait, driver)",
                color="tab:gray")
        top.legend(fontsize=8)
    else:
        top.text(0.5, 0.5, "no timing fields in metrics.jsonl", ha="center", transform=top.transAxes)
    top.set(ylabel="seconds", title="time per step")
    top.grid(alpha=0.3, axis="y")
    for key, label in (("weight_wait_seconds", "weight wait (inside forward/backward)"),
                       ("optimizer_seconds", "optimizer (overlaps the next forward)")):
        xs, ys = _values(rows, key)
        if xs:
            bottom.plot(xs, ys, marker="." if len(xs) < 50 else None, label=label)
    bottom.set(xlabel="step", ylabel="seconds")
    bottom.grid(alpha=0.3)
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=8)
    written.append(_save(fig, out / "time_split.png", plt))

    if val:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(val_steps, val, marker="o", color="black", label="val_loss (all buckets)")
        buckets = sorted({k for r in rows for k in r if k.startswith("val_loss_t") and k[10:].isdigit()},
                         key=lambda k: int(k[10:]))
        for k in buckets:
            b, n = int(k[10:]), len(buckets)
            xs, ys = _values(rows, k)
            ax.plot(xs, ys, marker=".", label=f"t in [{b / n:.2f}, {(b + 1) / n:.2f})")
        ax.set(xlabel="step", ylabel="flow-matching loss (MSE)", title="validation loss by t-bucket")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        written.append(_save(fig, out / VAL_PLOT, plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[RunSummary, list[Path]]:
    """The run's plots; for a ``dsa`` run with a checkpoint also ``offsets.png`` (the learned
    offset field of one clip, ``megaslide_ray.evaluation.offsets_view``)."""
    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    summary = summarize(rows)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    plots = plot_run(rows, out)
    try:

        drawn, _ = run_offsets_plot(run_dir, out / OFFSETS_PLOT)
    except (OSError, ValueError, RuntimeError, KeyError) as e:  # a plot that cannot be drawn is not fatal
        print(f"warning: no {OFFSETS_PLOT}: {e}", file=sys.stderr)
        drawn = None
    if drawn is not None:
        plots.append(drawn)
    return summary, plots


def run_label(run_dir: str | Path) -> str:
    """``name (attention kind)`` of a run, from its config.toml when it has one."""
    name = Path(run_dir).name
    try:

        kind = load_toml(Path(run_dir) / "config.toml").get("attention.kind")
    except Exception:  # noqa: BLE001 - a label without the kind is fine
        kind = None
    return f"{name} ({kind})" if kind else name


def compare_runs(run_dirs: list[str | Path], out: str | Path) -> Path:
    """``val_loss_by_run.png``: the validation loss of several runs side by side (e.g. one per
    attention kind), each labelled with its name and attention kind."""
    plt = pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = 0
    for run in run_dirs:
        xs, ys = _values(read_metrics(Path(run) / "metrics.jsonl"), "val_loss")
        if xs:
            ax.plot(xs, ys, marker="o", label=run_label(run))
            drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError("none of these runs logged a val_loss: train with data.val_manifest and training.eval_every")
    ax.set(xlabel="step", ylabel="validation loss (MSE)", title="validation loss by run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / COMPARE_PLOT, plt)
