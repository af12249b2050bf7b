"""The adaptation study on clips that cannot be memorised (issue 46, item 1).

    python -m benchmarks.studies.fresh_adaptation [--arch videodit|wan] [--clips simple|long] [--grid 2k]
        [--teacher-steps 2400] [--steps 600] [--evals 12] [--seeds 0 1 2 3 4] [--kinds dense swin neighborhood dsa]
        [--rates 1e-5 1e-4 1e-3] [--sweep-seeds 0] [--lr KIND RATE] [--eval-clips 96] [--samples 48]
        [--set FIELD VALUE] [--arm NAME KIND FIELD=VALUE ...] [--threads N] [--out DIR [--resume]] [--json]

``benchmarks.studies.adaptation`` trained its teacher and every adaptation on the motion set's 48
clips, read one held-out point on 12 clips, used one learning rate for every kind and 3 seeds.
This study keeps its shape (per seed a dense **teacher**, then each kind **adapted** from it, dense
continued as the reference; ``adaptation.load_teacher`` converts the weights, so dsa starts
exactly as neighborhood) and changes what made it unreadable:

* **fresh clips**: every training batch is rendered for its ``(seed, step)`` from the motion set's
  generators (``fresh_clips``), never the same clip twice, of trained combinations only;
* **held-out sets** of ``--eval-clips`` clips each (default 96), at fixed noise and one t per clip
  spread over the 4 t-buckets: ``seen`` (new clips of trained combinations) and ``unseen``
  (combinations never trained on), and a ``val`` split for the sweep (``fresh_clips``);
* a **grid** of ``--grid`` (``2k``: 8 frames of 64x64 in 1x4x4 patches, 2048 tokens, window 3x7x7);
* the **learning rate per kind** from a sweep over ``--rates`` on the ``val`` split (the
  ``--sweep-seeds``' final ``val`` loss at t >= 0.25, lowest wins; ``--lr KIND RATE`` fixes one and
  skips its sweep), then every seed adapted at its kind's rate and reported on ``seen``/``unseen``;
* **paired 95% intervals** over seeds of each kind minus dense (and dsa minus neighborhood and
  minus swin) for the final loss, the curve's mean and every curve point (``paired``);
* **full curves**: every set's loss at ``--evals`` points (and step 0) per kind and seed, plotted;
* ``--samples`` prompts per seed (default 48) of trained and of unseen combinations, sampled and
  scored with the motion metric (``harness.shows_prompt``) and temporal consistency
  (``consistency``).

**Arms** (``--arm NAME KIND FIELD=VALUE ...``) measure a lever: a run named ``NAME`` of attention
kind ``KIND`` with config overrides of its own (e.g. ``--arm dsa-dense-t dsa
attention.dense_above_t=0.75``). An arm is swept, seeded, sampled and reported like a kind, and
compared with dense and with its own kind (``NAME-dsa``), paired per seed.

``--clips long`` is the paper's **long-clip row**: clips of ``fresh_clips.LONG_FRAMES`` frames of
fast motion bouncing off the edges (grid ``long``: 16x16x16 tokens, a 3x7x7 window reaching one
patch frame either side), where the temporal consistency of dsa, neighborhood and swin is compared.

``--out`` receives ``runs.jsonl`` (one line per finished run; ``--resume`` keeps those made with
the same settings), ``teachers/``, ``fresh_adaptation.json`` (settings, the sweep, picked rates,
every run with its curves, the intervals), ``fresh_adaptation.md`` and the curves' plot.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from benchmarks.studies import fresh_clips as F
from benchmarks.studies import fresh_report as R
from benchmarks.studies.adaptation import SAMPLE_KEYS, load_teacher, score_samples
from benchmarks.studies.harness import fresh_trainer, log, nanmean, save_weights, study_config
from benchmarks.studies.wan_motion import WAN_OVERRIDES, caption_condition, wan_batch

KINDS = ("dense", "swin", "neighborhood", "dsa")
DEFAULT_RATES = (1e-5, 1e-4, 1e-3)
"""The sweep's rates: the Wan presets' fine-tuning rate, the from-scratch 1e-3, and between."""
SETTING_KEYS = ("arch", "preset", "clips", "grid", "teacher_steps", "steps", "eval_steps", "overrides",
                "eval_clips", "samples", "arms")


# ---------------------------------------------------------------------------------------------
# Configs, data, the teacher
# ---------------------------------------------------------------------------------------------


def run_config(setup: dict, kind: str, seed: int, steps: int, lr: float | None = None):
    """The config of one run: the preset, the grid, ``--arch``'s overrides, ``--set``, the kind (or
    an ``--arm``'s kind and its overrides), the seed, the steps and (adaptation) the learning rate."""
    base, arm_over = setup.get("arms", {}).get(kind, (kind, {}))
    over = {**F.grid_overrides(setup["grid"]), "attention.kind": base, "training.seed": seed,
            "training.steps": steps}
    if setup["arch"] == "wan":
        over.update(WAN_OVERRIDES)
    over.update(setup["overrides"])
    over.update(arm_over)
    if lr is not None:
        over["optim.lr"] = lr
        # an adaptation starts from the seed's teacher (loaded by hand: ``load_teacher``), which is also
        # the dense teacher a distilling arm (training.distill_weight) distils from at its first step
        over.setdefault("training.init_from", f"the study's dense teacher of seed {seed}")
    return study_config(setup["preset"], over)


def conditioner(arch: str):
    """What ``fresh_clips.eval_set`` turns captions into: ``None`` (caption bytes) for videodit,
    the stand-in text embeddings for wan."""
    if arch != "wan":
        return None

    def wan_condition(captions: list[str]):
        texts, lens = zip(*(caption_condition(c) for c in captions))
        return np.concatenate(texts), np.concatenate(lens)

    return wan_condition


def train_batch(setup: dict, seed: int, step: int) -> dict:
    batch = setup["source"].batch(seed, step)
    return wan_batch(batch) if setup["arch"] == "wan" else batch


def teacher_weights(setup: dict, seed: int, folder: Path | None) -> tuple[dict, float]:
    """The seed's dense teacher, trained on fresh batches ``0 .. teacher_steps - 1`` (read from
    ``folder/teachers`` when a run with the same settings saved it), and its training seconds."""
    settings = {k: setup[k] for k in ("arch", "preset", "clips", "grid", "teacher_steps", "overrides")}
    path = folder / "teachers" / f"{setup['arch']}_{setup['clips']}_seed{seed}.safetensors" if folder else None
    if path is not None and path.is_file():
        if json.loads(path.with_suffix(".json").read_text()) == json.loads(json.dumps(settings)):
            log(f"teacher seed {seed}: from {path}")
            return load_file(str(path)), 0.0
        raise SystemExit(f"{path} was trained with other settings; use another --out")
    trainer = fresh_trainer(run_config(setup, "dense", seed, setup["teacher_steps"]), seed, setup["threads"])
    t0, losses = time.perf_counter(), []
    for step in range(setup["teacher_steps"]):
        losses.append(trainer.train_step(train_batch(setup, seed, step)).loss)
        if (step + 1) % 200 == 0:
            log(f"  teacher seed {seed} step {step + 1}: train loss {statistics.fmean(losses[-50:]):.4f}")
    seconds = time.perf_counter() - t0
    if path is not None:
        save_weights(trainer.model, path)
        path.with_suffix(".json").write_text(json.dumps(settings))
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, seconds


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, es: F.EvalSet, batch_size: int) -> dict:
    """The fixed-input loss of ``model`` on an evaluation set: ``loss`` (velocity, all clips),
    ``buckets`` (per t-bucket), ``loss_ge25`` (the mean of the buckets from t = 0.25) and ``x0``
    (the clean clip's loss the velocity implies: ``t^2`` times the velocity loss)."""
    model.eval()
    v_err = []
    for s in range(0, len(es.captions), batch_size):
        sl = slice(s, s + batch_size)
        pred = model(es.x_t[sl], es.t[sl], torch.from_numpy(es.cond[sl]), torch.from_numpy(es.cond_len[sl]))
        v_err += (pred.double() - es.target[sl].double()).pow(2).flatten(1).mean(1).tolist()
    model.train()
    t2 = (es.t.double() ** 2).tolist()
    buckets = [statistics.fmean(v for v, b in zip(v_err, es.buckets) if b == k) for k in range(F.BUCKETS)]
    return {"loss": statistics.fmean(v_err), "buckets": buckets, "loss_ge25": statistics.fmean(buckets[1:]),
            "x0": statistics.fmean(v * t for v, t in zip(v_err, t2))}


def samples(model, cfg, setup: dict, seed: int) -> dict:
    """``--samples`` prompts per seed of trained (``train_*``) and unseen combinations, sampled
    from fixed noise and scored (``adaptation.score_samples``); per sample and their means."""
    out, t0 = {}, time.perf_counter()
    for prefix, unseen in (("train_", False), ("", True)):
        captions = F.sample_captions(seed, setup["samples"], unseen, setup["clips"])
        _, scored = score_samples(model, cfg, setup, captions, setup["steps"])
        out[prefix + "samples"] = scored
        out.update({prefix + k: nanmean([s[k] for s in scored]) for k in SAMPLE_KEYS})
    out["sample_seconds"] = time.perf_counter() - t0
    return out


@contextlib.contextmanager
def measured_weights(trainer):
    """The weights a run is measured with (curves and samples): its moving average where it keeps
    one and ``training.ema_eval`` says so (as the trainer's validation and samples do), else its
    trained weights; the trained weights are back afterwards."""
    if trainer.ema is None or not trainer.cfg.training.ema_eval:
        yield
        return
    params = [p.detach() for p in trainer.model.parameters()]
    trained = [p.clone() for p in params]
    torch._foreach_copy_(params, trainer.ema)
    try:
        yield
    finally:
        torch._foreach_copy_(params, trained)


def adapt(setup: dict, kind: str, seed: int, lr: float, teacher: dict, sets: tuple[str, ...],
          with_samples: bool) -> dict:
    """One adaptation of ``kind`` from the seed's teacher at ``lr`` on fresh batches
    ``teacher_steps ..``: its curve on ``sets`` (step 0 and every eval step), times, samples."""
    steps, first = setup["steps"], setup["teacher_steps"]
    cfg = run_config(setup, kind, seed, steps, lr)
    trainer = fresh_trainer(cfg, seed, setup["threads"])
    fresh = load_teacher(trainer.model, teacher)
    curve, wall, losses, eval_seconds = [], [], [], 0.0

    def point(step: int) -> None:
        nonlocal eval_seconds
        t0 = time.perf_counter()
        with measured_weights(trainer):
            curve.append({"step": step, **{s: evaluate(trainer.model, setup["sets"][s], setup["eval_batch"])
                                           for s in sets}})
        eval_seconds += time.perf_counter() - t0
        log(f"  {kind:<12} seed {seed} lr {lr:g} step {step:>4}: " + ", ".join(
            f"{s} {curve[-1][s]['loss_ge25']:.4f}" for s in sets))

    point(0)
    for step in range(steps):
        r = trainer.train_step(train_batch(setup, seed, first + step), noise_step=first + step)
        wall.append(r.seconds)
        losses.append(r.loss)
        if step + 1 in setup["eval_steps"]:
            point(step + 1)
    out = {"kind": kind, "seed": seed, "lr": lr, "fresh_parameters": len(fresh), "curve": curve,
           "train_loss_last20": statistics.fmean(losses[-20:]), "step_seconds": statistics.median(wall[1:] or wall),
           "train_seconds": math.fsum(wall), "eval_seconds": eval_seconds}
    if with_samples:
        with measured_weights(trainer):
            out.update(samples(trainer.model, cfg, setup, seed))
    return out


# ---------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------


class Runs:
    """Finished runs by id (``phase:kind:seed:lr``), appended to ``runs.jsonl`` as they end; with
    ``resume`` the file's runs of the same settings are kept (others refused)."""

    def __init__(self, folder: Path | None, settings: dict, resume: bool):
        self.path, self.settings, self.done = (folder / "runs.jsonl" if folder else None), settings, {}
        if self.path and resume and self.path.is_file():
            for n, line in enumerate(self.path.read_text().splitlines(), 1):
                rec = json.loads(line)
                if rec["settings"] != json.loads(json.dumps(settings)):
                    raise SystemExit(f"{self.path}:{n} was made with other settings; run without --resume")
                self.done[rec["id"]] = rec["run"]
        elif self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)

    def get(self, run_id: str, make) -> dict:
        if run_id not in self.done:
            self.done[run_id] = make()
            if self.path:
                with self.path.open("a") as f:
                    f.write(json.dumps({"settings": self.settings, "id": run_id, "run": self.done[run_id]}) + "\n")
        return self.done[run_id]


def sweep(setup: dict, runs: Runs, teachers) -> tuple[dict, list[dict]]:
    """Each kind's rate: the fixed one (``--lr``), else the sweep's pick (module docstring);
    and the sweep's rows (kind, rate, seed, final ``val`` loss at t >= 0.25, its curve)."""
    picked, rows = dict(setup["fixed_lr"]), []
    for kind in setup["kinds"]:
        if kind in picked:
            continue
        if len(setup["rates"]) == 1:  # nothing to choose
            picked[kind] = setup["rates"][0]
            continue
        score = {}
        for lr in setup["rates"]:
            finals = []
            for seed in setup["sweep_seeds"]:
                run = runs.get(f"sweep:{kind}:{seed}:{lr:g}",
                               lambda: adapt(setup, kind, seed, lr, teachers(seed), ("val",), False))
                finals.append(run["curve"][-1]["val"]["loss_ge25"])
                rows.append({"kind": kind, "lr": lr, "seed": seed, "val_loss_ge25": finals[-1],
                             "curve": [[p["step"], p["val"]["loss_ge25"]] for p in run["curve"]]})
            score[lr] = statistics.fmean(finals)
        picked[kind] = min(score, key=lambda r: (math.isnan(score[r]), score[r]))
        log(f"sweep {kind}: " + ", ".join(f"{r:g} -> {s:.4f}" for r, s in score.items()) + f"; picked {picked[kind]:g}")
    return picked, rows


def run_study(setup: dict, folder: Path | None, resume: bool) -> dict:
    """The sweep, then every (kind, seed) at its kind's rate; the report's dict."""
    t_start = time.perf_counter()
    settings = {k: setup[k] for k in SETTING_KEYS}
    runs = Runs(folder, settings, resume)
    cache: dict[int, dict] = {}
    teacher_seconds: dict[int, float] = {}

    def teachers(seed: int) -> dict:
        if seed not in cache:
            cache[seed], teacher_seconds[seed] = teacher_weights(setup, seed, folder)
        return cache[seed]

    picked, sweep_rows = sweep(setup, runs, teachers)
    final = []
    for seed in setup["seeds"]:
        for kind in setup["kinds"]:
            lr = picked[kind]
            final.append(runs.get(f"final:{kind}:{seed}:{lr:g}", lambda: adapt(
                setup, kind, seed, lr, teachers(seed), F.EVAL_SETS, setup["samples"] > 0)))
            log(f"{kind} seed {seed} at lr {lr:g}: seen {final[-1]['curve'][-1]['seen']['loss_ge25']:.4f}, "
                f"unseen {final[-1]['curve'][-1]['unseen']['loss_ge25']:.4f}")
    meta = {**settings, "seeds": setup["seeds"], "kinds": setup["kinds"], "rates": setup["rates"],
            "sweep_seeds": setup["sweep_seeds"], "fixed_lr": setup["fixed_lr"], "tokens": F.grid_tokens(setup["grid"]),
            "window": F.GRIDS[setup["grid"]][4], "threads": setup["threads"] or os.cpu_count(),
            "teacher_seconds": teacher_seconds, "minutes": (time.perf_counter() - t_start) / 60,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    return {"meta": meta, "picked_lr": picked, "sweep": sweep_rows, "runs": final,
            "intervals": R.intervals(final, setup["kinds"], setup["arms"])}


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.fresh_adaptation",
                                description=__doc__.split("\n\n")[1].strip())
    p.add_argument("--arch", choices=("videodit", "wan"), default="videodit")
    p.add_argument("--preset", default="tiny-motion", help="the model and its training settings (default tiny-motion)")
    p.add_argument("--clips", choices=("simple", "long"), default="simple",
                   help="simple (default) or long: the long-clip row (32 frames of fast motion)")
    p.add_argument("--grid", default=None, choices=sorted(F.GRIDS),
                   help="token grid (default 2k; with --clips long: long)")
    p.add_argument("--teacher-steps", type=int, default=2400, help="dense teacher steps (default 2400)")
    p.add_argument("--steps", type=int, default=600, help="adaptation steps per run (default 600)")
    p.add_argument("--evals", type=int, default=12, help="curve points after step 0, evenly spaced (default 12)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--rates", type=float, nargs="+", default=list(DEFAULT_RATES), help="the sweep's learning rates")
    p.add_argument("--sweep-seeds", type=int, nargs="+", default=[0], help="seeds the sweep runs (default 0)")
    p.add_argument("--lr", nargs=2, action="append", default=[], metavar=("KIND", "RATE"),
                   help="fix KIND's rate (no sweep for it), e.g. a rate another study picked")
    p.add_argument("--eval-clips", type=int, default=96, help="clips in each of val, seen and unseen (default 96)")
    p.add_argument("--samples", type=int, default=48, help="prompts sampled per seed and split (default 48; 0: none)")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override for every run")
    p.add_argument("--arm", nargs="+", action="append", default=[], metavar="NAME KIND FIELD=VALUE",
                   help="a lever's arm: runs named NAME of attention kind KIND with these overrides, "
                        "reported like a kind and compared with dense and with KIND")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", type=Path, default=None, help="folder for runs.jsonl, teachers, JSON, tables, plot")
    p.add_argument("--resume", action="store_true", help="with --out: keep DIR/runs.jsonl's runs of these settings")
    p.add_argument("--json", action="store_true", help="print the JSON's intervals and picked rates, not the tables")
    return p


def checked_setup(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    """The study's settings from the command line, refused with the value at fault before any work."""
    for name in ("teacher_steps", "steps", "evals"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if a.evals > a.steps:
        p.error(f"--evals {a.evals} exceeds --steps {a.steps}")
    if a.eval_clips < F.BUCKETS:
        p.error(f"--eval-clips {a.eval_clips} must be >= {F.BUCKETS} (one clip per t-bucket at least)")
    if a.samples < 0 or any(r <= 0 for r in a.rates):
        p.error(f"--samples {a.samples} must be >= 0 and --rates {a.rates} all > 0")
    if a.resume and not a.out:
        p.error("--resume needs --out DIR")
    arms = checked_arms(p, a.arm)
    fixed = {}
    for kind, rate in a.lr:
        if kind not in KINDS and kind not in arms:
            p.error(f"--lr {kind} {rate}: the kind must be one of {KINDS} or an --arm's name")
        try:
            fixed[kind] = float(rate)
        except ValueError:
            p.error(f"--lr {kind} {rate!r}: the rate must be a number")
    grid = a.grid or ("long" if a.clips == "long" else "2k")
    if a.clips == "long" and F.GRIDS[grid][0] > F.LONG_FRAMES or a.clips == "simple" and F.GRIDS[grid][0] > 8:
        p.error(f"--grid {grid}: {F.GRIDS[grid][0]} frames is more than --clips {a.clips} clips have")
    return {"arch": a.arch, "preset": a.preset, "clips": a.clips, "grid": grid, "teacher_steps": a.teacher_steps,
            "steps": a.steps, "eval_steps": sorted({round(a.steps * (k + 1) / a.evals) for k in range(a.evals)}),
            "overrides": dict(a.set), "eval_clips": a.eval_clips, "samples": a.samples, "seeds": a.seeds,
            "kinds": [*a.kinds, *arms], "arms": arms, "rates": a.rates, "sweep_seeds": a.sweep_seeds, "fixed_lr": fixed,
            "threads": a.threads}


def checked_arms(p: argparse.ArgumentParser, given: list[list[str]]) -> dict:
    """``--arm NAME KIND FIELD=VALUE ...`` as ``{NAME: (KIND, {FIELD: VALUE})}``, refused with the
    value at fault (a name that is a kind or repeats, an unknown kind, an override without ``=``);
    each arm's config is checked by the config's own validation before any work."""
    arms: dict[str, tuple[str, dict]] = {}
    for arm in given:
        if len(arm) < 3:
            p.error(f"--arm {' '.join(arm)}: give NAME KIND FIELD=VALUE [FIELD=VALUE ...]")
        name, kind, sets = arm[0], arm[1], arm[2:]
        if name in KINDS or name in arms:
            p.error(f"--arm {name}: the name is a kind or another arm's; choose another")
        if kind not in KINDS:
            p.error(f"--arm {name} {kind}: the kind must be one of {KINDS}")
        bad = [x for x in sets if "=" not in x or not x.split("=", 1)[0]]
        if bad:
            p.error(f"--arm {name}: {bad[0]!r} is not FIELD=VALUE (e.g. attention.dense_above_t=0.75)")
        arms[name] = (kind, dict(x.split("=", 1) for x in sets))
    return arms


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    setup = checked_setup(p, a)
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    cfg0 = run_config(setup, "dense", setup["seeds"][0], setup["steps"])
    for name in setup["arms"]:  # a bad override is refused here, before any clip is rendered
        try:
            run_config(setup, name, setup["seeds"][0], setup["steps"], lr=1e-4)
        except (ValueError, KeyError, TypeError) as e:
            p.error(f"--arm {name}: {e}")
    source = F.ClipSource.of(cfg0, setup["clips"])
    t0 = time.perf_counter()
    setup.update(source=source, eval_batch=source.batch_size, sets={
        name: F.eval_set(source, name, setup["eval_clips"], conditioner(setup["arch"])) for name in F.EVAL_SETS})
    log(f"{len(F.EVAL_SETS)} evaluation sets of {setup['eval_clips']} clips rendered in "
        f"{time.perf_counter() - t0:.1f} s; grid {setup['grid']}: {F.grid_tokens(setup['grid'])} tokens")
    report = run_study(setup, a.out, a.resume)
    text = R.markdown(report)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "fresh_adaptation.json").write_text(json.dumps(report, indent=1))
        (a.out / "fresh_adaptation.md").write_text(text)
        R.plot(report, a.out / f"fresh_adaptation_{setup['arch']}_{setup['clips']}_curves.png")
    if a.json:
        print(json.dumps({"meta": report["meta"], "picked_lr": report["picked_lr"], "intervals": report["intervals"]}))
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
