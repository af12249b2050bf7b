"""Adapting a pretrained dense model to each attention kind: the paper's experiment as it ran it.

    python -m benchmarks.studies.adaptation [--arch videodit|wan] [--teacher-steps 1200] [--steps 600]
        [--seeds 0 1 2] [--kinds dense swin neighborhood dsa] [--samples 12] [--val-clips 12] [--evals 3]
        [--window 3,3,3] [--set FIELD VALUE] [--adapt-set FIELD VALUE] [--dsa NAME FIELD=VALUE[,...]]
        [--out DIR [--resume]] [--json]

Per seed ``s``, a **teacher**: the ``--preset`` model (default ``tiny-motion``: width 128, 4 blocks,
8 frames of 16x16 in 2x2x2 patches, 256 tokens) with dense attention, trained from the initial
weights of seed ``s`` for ``--teacher-steps`` on the training split of the motion set's simple
variant (``--variant``), in process (``harness``). Then each kind is **adapted** from it for
``--steps``: the model of that kind (``swin``, ``neighborhood`` and ``dsa`` all with ``--window``,
K = 27 keys per query by default), every weight the teacher has loaded from it (``dsa``'s offset
heads are the only new part, their last layer zero, so ``dsa`` starts exactly as
``neighborhood``: tests/test_adaptation.py holds the two bit-identical), a fresh AdamW with the
preset's schedule (``--adapt-set`` changes it), on the batches that follow the teacher's in the
same data order with their own noise. ``dense`` continued for the same steps is the reference.
``--arch wan`` runs the same on a small Wan model (``wan_motion``: RoPE on q and k before 3D-DSA
in the self-attention, dense cross-attention to the text).

Per (kind, seed) it records, at step 0 (the teacher converted, before any adaptation) and at
``--evals`` points to the end:

* **held-out loss** on ``--val-clips`` clips of the held-out split (combinations of colour, shape,
  direction and speed never trained on) at fixed noise and t, one t in each of the 4 t-buckets
  (``megaslide_ray.evaluation.validation.val_inputs``), per bucket and in three forms: ``loss``,
  the velocity loss over all buckets (what training minimises and the product's validation
  reports); ``loss_ge25``, its mean over the buckets ``t >= 0.25``; and ``x0``, the loss of the
  clean clip the velocity implies (``x_t - t v``: ``t^2`` times the velocity loss), which does not
  depend on ``model.prediction`` (for an x-predicting model the velocity loss near t = 0 carries
  a ``1/t`` factor, and bucket 0 swamps the mean). The goals are judged on ``loss_ge25``;
* the **distance from the teacher**: the x0-space mean squared difference between the adapted
  model's prediction and the teacher's on the same held-out inputs;
* the same loss on as many **training** clips (``train_split``);
* at the end, **samples** of the first ``--samples`` held-out captions and as many training
  captions from fixed noise (Euler, ``training.sample_steps``), scored with the motion metric
  (``harness.shows_prompt``: colour, shape and direction; trajectory error overall and on the
  ``fast`` captions; direction error) and the temporal-consistency score (``consistency``: the
  object's shape and colour and the background stable across frames, VBench's form);
* for ``dsa``, the mean |offset| (tokens) per t-bucket on the held-out inputs, and the offsets'
  extent per offset-head call (its largest |offset|: the one bound the GPU kernels take per call;
  ``offset_extent_summary``; ``offset_extent`` recomputes it from an earlier study's models);
* step time (wall and process CPU seconds, median) and the time of each phase.

The teacher itself is scored alike (its row ``teacher``). ``--dsa NAME FIELD=VALUE,...`` adds a
``dsa+NAME`` run with those config overrides (``attention.*`` fields; ``study.offset_freeze=N``
keeps the offset heads' weights still for the first N adaptation steps). ``--out`` receives
``runs.jsonl`` (one line per finished run; ``--resume`` keeps those and runs the rest, so a variant
can be added to a finished study), ``teachers/`` (each seed's teacher, reused on resume),
``adaptation.json``, ``adaptation.md``, plots and contact sheets of seed 0's training samples.
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
from safetensors.torch import load_file

from benchmarks.studies.consistency import temporal_consistency
from benchmarks.studies.harness import (
    ModelPredictor,
    finished_runs,
    fresh_trainer,
    log,
    motion_manifests,
    nanmean,
    offset_heads,
    sample_and_score,
    save_weights,
    shows_prompt,
    study_config,
    training_decoder,
)
from benchmarks.studies.wan_motion import WAN_OVERRIDES, caption_condition, wan_batch, wan_val_set
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.plotting import pyplot
from megaslide_ray.evaluation.sampling import write_png
from megaslide_ray.evaluation.validation import load_val_set, val_inputs
from megaslide_ray.state.pretrained_io import is_fresh_part

KINDS = ("dense", "swin", "neighborhood", "dsa")
DEFAULT_WINDOW = "3,3,3"
SAMPLE_KEYS = ("shown", "trajectory_error", "fast_trajectory_error", "direction_error_deg", "detection_rate",
               "shape_match", "area_cv", "flicker", "subject_consistency", "background_consistency",
               "temporal_consistency")
SPLITS = ("", "train_")  # sample metric prefixes: held-out captions, training captions
RUNS_FILE = "runs.jsonl"
STUDY_OPTIONS = ("study.offset_freeze",)
"""Variant options that are not config fields (``--dsa NAME study.offset_freeze=100``)."""


# ---------------------------------------------------------------------------------------------
# Configs, data, the teacher
# ---------------------------------------------------------------------------------------------


def base_kind(name: str) -> str:
    """``dsa+tcond`` -> ``dsa``: the attention kind of a run name."""
    return name.split("+", 1)[0]


def run_config(setup: dict, kind: str, seed: int, steps: int, extra: dict | None = None):
    """The config of one run: the preset, ``model.arch``'s overrides, the study's window for every
    kind, ``--set``, then ``extra`` (the adaptation's and a variant's overrides)."""
    over = {"attention.kind": base_kind(kind), "attention.window": setup["window"], "training.seed": seed,
            "training.steps": steps, "data.manifest": setup["train"], "data.val_manifest": setup["val"],
            "training.val_clips": setup["val_clips"]}
    if setup["arch"] == "wan":
        over.update(WAN_OVERRIDES)
    over.update(setup["overrides"])
    over.update({k: v for k, v in (extra or {}).items() if k not in STUDY_OPTIONS})
    return study_config(setup["preset"], over)


def decoded_batches(setup: dict, seed: int, count: int) -> list[dict]:
    """The decoder's first ``count`` batches for ``seed`` (pixel clips and caption bytes; for
    ``wan`` turned into its inputs): the teacher takes the first ``--teacher-steps``, every
    adaptation the ones after."""
    with training_decoder(run_config(setup, "dense", seed, count)) as dec:
        batches = [dec.next_batch() for _ in range(count)]
    return [wan_batch(b) for b in batches] if setup["arch"] == "wan" else batches


def load_teacher(model: torch.nn.Module, teacher: dict[str, torch.Tensor]) -> list[str]:
    """Every weight of ``teacher`` (a dense model's state dict) into ``model``; returns the names
    that start fresh, which must all be DSA offset heads (``state.pretrained.is_fresh_part``, as
    ``--init-from`` does)."""
    missing, unexpected = model.load_state_dict(teacher, strict=False)
    if unexpected or not all(is_fresh_part(n) for n in missing):
        raise ValueError(f"the teacher does not fit this model: unexpected {unexpected}, missing "
                         f"{[n for n in missing if not is_fresh_part(n)]}")
    return list(missing)


def teacher_weights(setup: dict, seed: int, batches: list[dict], folder: Path | None) -> tuple[dict, float]:
    """The seed's teacher (its state dict) and the seconds its training took: read from
    ``folder/teachers`` when a run with the same settings saved it, else trained and saved there."""
    settings = {k: setup[k] for k in ("arch", "preset", "variant", "teacher_steps", "window", "overrides")}
    path = folder / "teachers" / f"{setup['arch']}_seed{seed}.safetensors" if folder else None
    if path is not None and path.is_file():
        saved = json.loads(path.with_suffix(".json").read_text())
        if saved == json.loads(json.dumps(settings)):
            log(f"teacher seed {seed}: from {path}")
            return load_file(str(path)), 0.0
        raise SystemExit(f"{path} was trained with other settings ({saved}); use another --out")
    cfg = run_config(setup, "dense", seed, setup["teacher_steps"])
    trainer = fresh_trainer(cfg, seed, setup["threads"])
    t0 = time.perf_counter()
    losses = []
    for step in range(setup["teacher_steps"]):
        losses.append(trainer.train_step(batches[step]).loss)
        if (step + 1) % 200 == 0:
            log(f"  teacher seed {seed} step {step + 1}: train loss {statistics.fmean(losses[-50:]):.4f}")
    seconds = time.perf_counter() - t0
    trainer.model.eval()
    if path is not None:
        save_weights(trainer.model, path)
        path.with_suffix(".json").write_text(json.dumps(settings))
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, seconds


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, cfg, val, teacher_pred: torch.Tensor | None = None, keep: bool = False) -> dict:
    """The fixed-noise loss of ``model`` on the clips of ``val``, one t per bucket (module
    docstring): ``loss``, ``loss_ge25``, ``x0`` and their ``*_buckets``; with ``teacher_pred``
    (the teacher's predictions on the same inputs, ``keep=True`` of the teacher's evaluation)
    ``teacher_dist`` and its buckets; for a dsa model ``offset_buckets`` (mean |offset|, tokens)
    and ``offset_extent`` (``offset_extent_summary``: the largest |offset| of each offset head's
    call, which is what the GPU kernels' choice follows); with ``keep`` the predictions (``pred``)."""
    model.eval()
    nb, seed, bs = int(cfg.training.val_t_buckets), int(cfg.training.seed), int(cfg.data.batch_size)
    items = [(c, b) for c in range(len(val.rows)) for b in range(nb)]
    heads = offset_heads(model)
    seen: list[torch.Tensor] = []
    calls: list[float] = []  # each head call's largest |offset|
    quantiles: list[torch.Tensor] = []
    pairs: list[torch.Tensor] = []  # each call's share of (query, head) pairs past each of PAIR_MARKS

    def hook(module, args, out):
        mag = out.detach().abs()
        seen.append(mag.flatten(1).mean(1))
        calls.append(float(mag.max()))
        quantiles.append(torch.quantile(mag.flatten().float()[:1 << 24], torch.tensor([0.99, 0.999])))
        reach = mag.amax(dim=(-2, -1)).float()  # (..., heads): each (query, head)'s largest |offset|
        pairs.append(torch.stack([(reach > m).float().mean() for m in PAIR_MARKS]))

    hooks = [h.register_forward_hook(hook) for h in heads]
    v_err, x0_err, dist, offs, preds = [], [], [], [], []
    try:
        for start in range(0, len(items), bs):
            chunk = items[start:start + bs]
            xs, ts, targets = zip(*(val_inputs(val.x0[c], seed, c, b, nb) for c, b in chunk))
            idx = [c for c, _ in chunk]
            t = torch.tensor(ts, dtype=torch.float32)
            seen.clear()
            pred = model(torch.stack(xs), t, torch.from_numpy(val.cond[idx]), torch.from_numpy(val.cond_len[idx]))
            pred = pred.float()
            t2 = torch.tensor(ts, dtype=torch.float64) ** 2
            v = (pred.double() - torch.stack(targets).double()).pow(2).flatten(1).mean(1)
            v_err += v.tolist()
            x0_err += (v * t2).tolist()
            if teacher_pred is not None:
                other = teacher_pred[start:start + len(chunk)].double()
                dist += ((pred.double() - other).pow(2).flatten(1).mean(1) * t2).tolist()
            if seen:
                offs += torch.stack(seen).mean(0).tolist()
            if keep:
                preds.append(pred)
    finally:
        for h in hooks:
            h.remove()

    def by_bucket(values: list[float]) -> list[float]:
        return [statistics.fmean(v for v, (_, b) in zip(values, items) if b == bucket) for bucket in range(nb)]

    buckets = by_bucket(v_err)
    out = {"loss": statistics.fmean(v_err), "buckets": buckets,
           "loss_ge25": statistics.fmean(buckets[b] for b in range(nb) if b / nb >= 0.25),
           "x0": statistics.fmean(x0_err), "x0_buckets": by_bucket(x0_err)}
    if dist:
        out["teacher_dist"], out["teacher_dist_buckets"] = statistics.fmean(dist), by_bucket(dist)
    if offs:
        out["offset_buckets"] = by_bucket(offs)
        out["offset_extent"] = offset_extent_summary(calls, torch.stack(quantiles), torch.stack(pairs))
    if keep:
        out["pred"] = torch.cat(preds)
    return out


EXTENT_MARKS = (1.5, 2.0, 3.0)
"""Offsets' extents that change the GPU kernels: the halo kernels at Wan's 480p shape run up to 1.5
at 3x5x5 and 2 at 3x7x7, the backward's key-side pass (no atomics) up to 3 (kernels/dsa_cost.py)."""
PAIR_MARKS = (1.0, 1.5, 2.0, 2.5, 3.0)
"""The bounds the backward's split mode may run its key-side pass at (``kernels.dsa_triton_split``):
the (query, head) pairs with an offset past the one it picks take atomics."""


def offset_extent_summary(calls: list[float], quantiles: torch.Tensor, pairs: torch.Tensor) -> dict:
    """The extents of a model's offset-head calls (``calls``: each call's largest |offset|, in
    tokens), each call's 99th and 99.9th percentile |offset| (``quantiles``, ``(calls, 2)``) and
    share of (query, head) pairs with an offset past each of ``PAIR_MARKS`` (``pairs``, ``(calls,
    marks)``): ``median`` and ``max`` extent, ``over``: the share of calls past each of
    ``EXTENT_MARKS``, ``p99``/``p999``: the percentiles' median over calls, ``pairs_over`` and
    ``pairs_over_max``: the pairs' share past each mark, mean and largest over calls, ``per_call``:
    each call's ``[extent, share past each mark]`` (what ``offset_extent --predict`` prices). The
    kernels take one bound per call, so a few large offsets set it for every sample of the call;
    past 3 the backward's split mode takes atomics for the pairs past the bound it picks."""
    return {"calls": len(calls), "median": statistics.median(calls), "max": max(calls),
            "over": {f"{m:g}": sum(c > m for c in calls) / len(calls) for m in EXTENT_MARKS},
            "p99": float(quantiles[:, 0].median()), "p999": float(quantiles[:, 1].median()),
            "pairs_over": {f"{m:g}": float(x) for m, x in zip(PAIR_MARKS, pairs.mean(0))},
            "pairs_over_max": {f"{m:g}": float(x) for m, x in zip(PAIR_MARKS, pairs.amax(0))},
            "per_call": [[round(c, 5), *(round(float(x), 5) for x in row)] for c, row in zip(calls, pairs)]}


def extent_line(extents: list[dict]) -> str:
    """One line on runs' ``offset_extent`` summaries (one per seed)."""

    def seeds(get) -> str:
        return "/".join(f"{get(e):.2f}" for e in extents)

    over = ", ".join(f"{m} {seeds(lambda e, m=m: e['over'][m])}" for m in extents[0]["over"])
    line = (f"offsets' extent per head call (the bound the GPU kernels take), seeds {seeds(lambda e: e['median'])} "
            f"median, {seeds(lambda e: e['max'])} max; share of calls past {over}; |offset| p99 "
            f"{seeds(lambda e: e['p99'])}, p99.9 {seeds(lambda e: e['p999'])}")
    if all("pairs_over" in e for e in extents):  # studies recorded before the split mode lack it
        pairs = ", ".join(f"{m} {seeds(lambda e, m=m: e['pairs_over'][m])} (max "
                          f"{seeds(lambda e, m=m: e['pairs_over_max'][m])})" for m in extents[0]["pairs_over"])
        line += f"; share of (query, head) pairs past {pairs}"
    return line


def score_samples(model, cfg, setup: dict, captions: list[str], version: int) -> tuple[list[np.ndarray], list[dict]]:
    """Each caption sampled from its fixed noise and scored: the clips and, per clip, the motion
    metric, ``shown``, ``fast_trajectory_error`` and the temporal-consistency score."""
    condition = caption_condition if setup["arch"] == "wan" else None
    clips, metrics = sample_and_score(ModelPredictor(model.eval()), cfg, captions, version, condition=condition)
    scored = []
    for clip, m, caption in zip(clips, metrics, captions):
        scored.append({"caption": caption, **{k: m[k] for k in ("trajectory_error", "direction_error_deg",
                                                                "detection_rate", "shape_match", "area_cv", "flicker")},
                       "shown": float(shows_prompt(m)),
                       "fast_trajectory_error": m["trajectory_error"] if " fast" in caption else math.nan,
                       **temporal_consistency(clip)})
    return clips, scored


def finish_run(out: dict, model, cfg, setup: dict, version: int) -> list[np.ndarray]:
    """Samples of held-out and training captions into ``out`` (per sample and their means); returns
    the training captions' clips."""
    t0 = time.perf_counter()
    clips = []
    for prefix, key in zip(SPLITS, ("captions", "train_captions")):
        clips, scored = score_samples(model, cfg, setup, setup[key][:setup["samples"]], version)
        out[prefix + "samples"] = scored
        out.update({prefix + k: nanmean([s[k] for s in scored]) for k in SAMPLE_KEYS})
    out["sample_seconds"] = time.perf_counter() - t0
    return clips


def run_teacher(setup: dict, seed: int, teacher: dict, seconds: float, folder: Path | None) -> tuple[dict, torch.Tensor]:
    """The teacher's own row (its losses and samples) and its predictions on the held-out inputs."""
    cfg = run_config(setup, "dense", seed, setup["teacher_steps"])
    model = fresh_trainer(cfg, seed, setup["threads"]).model
    model.load_state_dict(teacher)
    t0 = time.perf_counter()
    ev = evaluate(model, cfg, setup["valset"], keep=True)
    pred = ev.pop("pred")
    tr = evaluate(model, cfg, setup["trainset"])
    out = {"kind": "teacher", "seed": seed, "steps": setup["teacher_steps"], "train_seconds": seconds,
           **{k: ev[k] for k in ("loss", "buckets", "loss_ge25", "x0", "x0_buckets")},
           "train_split_loss": tr["loss"], "train_split_x0": tr["x0"], "eval_seconds": time.perf_counter() - t0}
    clips = finish_run(out, model, cfg, setup, setup["teacher_steps"])
    if folder and seed == setup["seeds"][0]:
        sheet(clips, folder / f"samples_{setup['arch']}_teacher_seed{seed}.png")
    return out, pred


def adapt(setup: dict, kind: str, seed: int, teacher: dict, teacher_pred: torch.Tensor, batches: list[dict],
          spec: dict, folder: Path | None) -> dict:
    """One adaptation run (module docstring): its curve, final numbers, samples and times."""
    steps, first = setup["steps"], setup["teacher_steps"]
    cfg = run_config(setup, kind, seed, steps, {**setup["adapt_overrides"], **spec})
    trainer = fresh_trainer(cfg, seed, setup["threads"])
    fresh = load_teacher(trainer.model, teacher)
    freeze = int(spec.get("study.offset_freeze", 0))
    frozen = [p for h in offset_heads(trainer.model) for p in h.parameters()] if freeze else []
    hooks = [p.register_hook(lambda g: torch.zeros_like(g)) for p in frozen]  # no gradient: AdamW leaves them
    curve, losses, wall, cpu = [], [], [], []
    eval_seconds = 0.0

    def point(step: int) -> None:
        nonlocal eval_seconds
        t0 = time.perf_counter()
        ev = evaluate(trainer.model, cfg, setup["valset"], teacher_pred)
        tr = evaluate(trainer.model, cfg, setup["trainset"])
        trainer.model.train()
        curve.append({"step": step, **ev, "train_split_loss": tr["loss"], "train_split_x0": tr["x0"]})
        eval_seconds += time.perf_counter() - t0
        log(f"  {kind:<14} seed {seed} step {step:>4}: held-out loss {ev['loss']:.4f} (t >= 0.25: "
            f"{ev['loss_ge25']:.4f}, x0 {ev['x0']:.4f}), from teacher {ev['teacher_dist']:.5f}, "
            f"train-split {tr['loss']:.4f}" + (f", train loss {statistics.fmean(losses[-20:]):.4f}" if losses else ""))

    point(0)
    for step in range(steps):
        if frozen and step == freeze:
            for h in hooks:
                h.remove()
        c0 = time.process_time()
        r = trainer.train_step(batches[first + step], noise_step=first + step)
        cpu.append(time.process_time() - c0)
        losses.append(r.loss)
        wall.append(r.seconds)
        if step + 1 in setup["eval_steps"]:
            point(step + 1)
    final = curve[-1]
    out = {"kind": kind, "seed": seed, "steps": steps, "spec": spec, "fresh_parameters": len(fresh),
           "curve": curve, **{k: final[k] for k in final if k != "step"},
           "train_loss_last20": statistics.fmean(losses[-20:]),
           "step_seconds": statistics.median(wall[1:] or wall), "step_cpu_seconds": statistics.median(cpu[1:] or cpu),
           "train_seconds": math.fsum(wall), "eval_seconds": eval_seconds}
    clips = finish_run(out, trainer.model, cfg, setup, steps)
    if folder:
        save_weights(trainer.model, folder / "models" / f"{setup['arch']}_{kind}_seed{seed}.safetensors")
        if seed == setup["seeds"][0]:
            sheet(clips, folder / f"samples_{setup['arch']}_{kind}_seed{seed}.png")
    return out


# ---------------------------------------------------------------------------------------------
# Tables, goals, plots
# ---------------------------------------------------------------------------------------------


def spread(xs) -> tuple[float, float]:
    """Mean and standard deviation over seeds of the numbers that are not NaN."""
    xs = [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def kinds_in(runs: list[dict]) -> list[str]:
    """The run names in table order: the teacher, the four kinds, then variants."""
    names = list(dict.fromkeys(r["kind"] for r in runs))
    order = ["teacher", *KINDS]
    return sorted(names, key=lambda n: (order.index(n) if n in order else len(order), n))


def by_kind(runs: list[dict], kind: str) -> dict[int, dict]:
    return {r["seed"]: r for r in runs if r["kind"] == kind}


def goals(runs: list[dict], dsa: str = "dsa") -> list[dict]:
    """The issue's goals for the run ``dsa`` (the baseline or a variant), each met or not, with
    the numbers: per seed where the goal is per seed, else means over seeds."""
    d, nb, sw, de = (by_kind(runs, k) for k in (dsa, "neighborhood", "swin", "dense"))
    seeds = sorted(set(d) & set(nb) & set(sw) & set(de))
    if not seeds:
        return []
    out = []

    def per_seed(text, ok, fmt):
        out.append({"goal": text, "met": all(ok(s) for s in seeds), "numbers": "; ".join(fmt(s) for s in seeds)})

    loss = lambda k, s: k[s]["loss_ge25"]  # noqa: E731
    per_seed("held-out loss (t >= 0.25): dsa <= neighborhood in every seed", lambda s: loss(d, s) <= loss(nb, s),
             lambda s: f"seed {s}: {loss(d, s):.4f} vs {loss(nb, s):.4f}")
    per_seed("held-out loss (t >= 0.25): dsa < swin in every seed", lambda s: loss(d, s) < loss(sw, s),
             lambda s: f"seed {s}: {loss(d, s):.4f} vs {loss(sw, s):.4f}")
    per_seed("held-out loss (t >= 0.25): dsa within 3% of dense continued, every seed",
             lambda s: loss(d, s) <= 1.03 * loss(de, s),
             lambda s: f"seed {s}: {100 * (loss(d, s) / loss(de, s) - 1):+.1f}%")
    shown = {k: sum(round(r["train_shown"] * len(r["train_samples"])) for s, r in v.items() if s in seeds)
             for k, v in (("dsa", d), ("neighborhood", nb), ("swin", sw))}
    total = sum(len(d[s]["train_samples"]) for s in seeds)
    out.append({"goal": "training prompts shown: dsa >= neighborhood and >= swin (all seeds together)",
                "met": shown["dsa"] >= shown["neighborhood"] and shown["dsa"] >= shown["swin"],
                "numbers": f"dsa {shown['dsa']}, neighborhood {shown['neighborhood']}, swin {shown['swin']} of {total}"})
    for key, better, label in (("train_fast_trajectory_error", min, "fast-motion trajectory error (training prompts, px/frame)"),
                               ("train_temporal_consistency", max, "temporal consistency (training prompts)")):
        m = {k: spread([v[s][key] for s in seeds])[0] for k, v in (("dsa", d), ("neighborhood", nb), ("swin", sw))}
        ok = all(not math.isnan(m[k]) for k in m) and better(m.values()) == m["dsa"] and \
            m["dsa"] not in (m["neighborhood"], m["swin"])
        out.append({"goal": f"{label}: dsa better than swin and neighborhood (mean over seeds)", "met": ok,
                    "numbers": ", ".join(f"{k} {v:.3f}" for k, v in m.items())})
    return out


def markdown(runs: list[dict], meta: dict) -> str:
    kinds = kinds_in(runs)
    seeds = sorted({r["seed"] for r in runs})
    L = [f"`{meta['preset']}` ({meta['arch']}) on the {meta['variant']} motion set: dense teacher "
         f"{meta['teacher_steps']} steps, then {meta['steps']} adaptation steps per kind; seeds {seeds}; "
         f"window {meta['window']}; {meta['val_clips']} held-out clips x 4 t-buckets; {meta['samples']} samples per "
         f"split; this invocation {meta['minutes']:.1f} min", ""]

    def cell(kind, key, spec=".4f"):
        m, sd = spread([r.get(key, math.nan) for r in by_kind(runs, kind).values()])
        return f"{m:{spec}} ± {sd:{spec}}"

    L += ["**Held-out loss after adaptation** (mean ± sd over seeds; `t >= 0.25`: the velocity loss averaged over "
          "the t-buckets from 0.25, the goals' form; `x0`: the loss of the clean clip the prediction implies, "
          "comparable across `model.prediction`; teacher distance in x0 space):", "",
          "| run | t >= 0.25 | x0 | velocity, all t | train-split | from teacher | step s (wall / CPU) |",
          "|---|---|---|---|---|---|---|"]
    for k in kinds:
        L.append(f"| {k} | {cell(k, 'loss_ge25')} | {cell(k, 'x0', '.5f')} | {cell(k, 'loss')} | "
                 f"{cell(k, 'train_split_loss')} | {cell(k, 'teacher_dist', '.5f') if k != 'teacher' else '-'} | "
                 f"{cell(k, 'step_seconds', '.3f') if k != 'teacher' else '-'} / "
                 f"{cell(k, 'step_cpu_seconds', '.3f') if k != 'teacher' else '-'} |")
    L += ["", "Per seed, held-out loss (t >= 0.25) / x0 loss:", "",
          "| run | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for k in kinds:
        rs = by_kind(runs, k)
        L.append(f"| {k} | " + " | ".join(f"{rs[s]['loss_ge25']:.4f} / {rs[s]['x0']:.5f}" if s in rs else "-"
                                          for s in seeds) + " |")
    nbk = len(runs[0]["buckets"])
    L += ["", "Per t-bucket (mean over seeds; bucket b covers t in [b/4, (b+1)/4); the last is the noisiest): "
              "velocity loss / x0 loss:", "",
          "| run | " + " | ".join(f"t{b}" for b in range(nbk)) + " |", "|---|" + "---|" * nbk]
    for k in kinds:
        rs = list(by_kind(runs, k).values())
        L.append(f"| {k} | " + " | ".join(
            f"{spread([r['buckets'][b] for r in rs])[0]:.4f} / {spread([r['x0_buckets'][b] for r in rs])[0]:.5f}"
            for b in range(nbk)) + " |")
    adapted = [k for k in kinds if k != "teacher"]
    if adapted:
        steps = [p["step"] for p in by_kind(runs, adapted[0])[seeds[0]]["curve"]] if seeds[0] in by_kind(
            runs, adapted[0]) else []
        L += ["", "Curve: held-out loss (t >= 0.25) at adaptation steps (mean over seeds); from teacher (x0) at the end "
                  "of each column's step:", "",
              "| run | " + " | ".join(f"step {s}" for s in steps) + " |", "|---|" + "---|" * len(steps)]
        for k in adapted:
            rs = list(by_kind(runs, k).values())
            L.append(f"| {k} | " + " | ".join(
                f"{spread([r['curve'][i]['loss_ge25'] for r in rs if len(r['curve']) > i])[0]:.4f} "
                f"({spread([r['curve'][i]['teacher_dist'] for r in rs if len(r['curve']) > i])[0]:.5f})"
                for i in range(len(steps))) + " |")
    for prefix, what in (("train_", "training captions (motion the model was shown)"),
                         ("", "held-out captions (combinations never trained on)")):
        L += ["", f"**Samples of {what}**, the first {meta['samples']} per seed: prompts shown per seed; means over "
                  "seeds of the per-sample means. Trajectory error in px/frame of the 16-px frames; consistency: "
                  "`benchmarks.studies.consistency` (1 = object shape, colour and background kept):", "",
              "| run | shown per seed | trajectory err | fast: trajectory err | direction err (deg) | detection "
              "| shape match | temporal consistency (subject / background) | flicker |",
              "|---|---|---|---|---|---|---|---|---|"]
        for k in kinds:
            rs = by_kind(runs, k)
            counts = " / ".join(str(round(rs[s][prefix + "shown"] * len(rs[s][prefix + "samples"]))) if s in rs else "-"
                                for s in seeds)
            L.append(f"| {k} | {counts} | {cell(k, prefix + 'trajectory_error', '.2f')} | "
                     f"{cell(k, prefix + 'fast_trajectory_error', '.2f')} | {cell(k, prefix + 'direction_error_deg', '.1f')} | "
                     f"{cell(k, prefix + 'detection_rate', '.2f')} | {cell(k, prefix + 'shape_match', '.2f')} | "
                     f"{cell(k, prefix + 'temporal_consistency', '.3f')} ({cell(k, prefix + 'subject_consistency', '.3f')} / "
                     f"{cell(k, prefix + 'background_consistency', '.3f')}) | {cell(k, prefix + 'flicker', '.2f')} |")
    for k in kinds:
        rs = [r for r in by_kind(runs, k).values() if "offset_buckets" in r]
        if rs:
            per = " / ".join(f"{spread([r['offset_buckets'][b] for r in rs])[0]:.3f}" for b in range(nbk))
            L.append(f"\n{k}: mean |offset| per t-bucket t0..t{nbk - 1} (tokens, held-out inputs): {per}")
            ex = [r["offset_extent"] for r in rs if "offset_extent" in r]
            if ex:
                L.append(f"{k}: " + extent_line(ex))
    for k in kinds:
        if base_kind(k) == "dsa":
            g = goals(runs, k)
            if g:
                L += ["", f"Goals for `{k}`:", "", "| goal | met | numbers |", "|---|---|---|"]
                L += [f"| {x['goal']} | {'yes' if x['met'] else '**no**'} | {x['numbers']} |" for x in g]
    L += ["", "Time per run (mean over seeds, seconds): training / evaluations / sampling:", "",
          "| run | train | eval | samples |", "|---|---|---|---|"]
    for k in kinds:
        L.append(f"| {k} | {cell(k, 'train_seconds', '.0f')} | {cell(k, 'eval_seconds', '.0f')} | "
                 f"{cell(k, 'sample_seconds', '.0f')} |")
    return "\n".join(L) + "\n"


def plots(runs: list[dict], folder: Path, arch: str) -> list[Path]:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in kinds_in(runs):
        rs = list(by_kind(runs, k).values())
        if k == "teacher" or not rs:
            continue
        n = min(len(r["curve"]) for r in rs)
        steps = [p["step"] for p in rs[0]["curve"][:n]]
        for ax, key in zip(axes, ("loss_ge25", "teacher_dist")):
            vals = np.array([[p[key] for p in r["curve"][:n]] for r in rs])
            mean, sd = vals.mean(axis=0), vals.std(axis=0)
            ax.plot(steps, mean, marker="o", label=k)
            ax.fill_between(steps, mean - sd, mean + sd, alpha=0.15)
    axes[0].set_ylabel("held-out loss, t >= 0.25 (mean ± sd over seeds)")
    axes[1].set_ylabel("distance from the teacher (x0 space)")
    for ax in axes:
        ax.set_xlabel("adaptation step")
        ax.grid(alpha=0.3)
    axes[0].legend()
    path = folder / f"adaptation_{arch}_curves.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]


def sheet(clips: list[np.ndarray], path: Path, rows: int = 8, upscale: int = 4) -> None:
    """One row per clip (its frames side by side), upscaled, as a PNG."""
    rows_img = [np.concatenate(list(c), axis=1) for c in clips[:rows]]
    img = np.concatenate(rows_img, axis=0).repeat(upscale, axis=0).repeat(upscale, axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_png(path, img)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


def parse_variant(p: argparse.ArgumentParser, name: str, spec: str) -> tuple[str, dict]:
    over = {}
    for item in filter(None, spec.split(",")):
        if "=" not in item:
            p.error(f"--dsa {name} {spec}: {item!r} is not FIELD=VALUE")
        k, v = item.split("=", 1)
        over[k.strip()] = v.strip()
    if not over:
        p.error(f"--dsa {name}: no FIELD=VALUE given")
    return f"dsa+{name}", over


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.adaptation", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=("videodit", "wan"), default="videodit",
                   help="videodit (default) or a small Wan model (benchmarks.studies.wan_motion)")
    p.add_argument("--preset", default="tiny-motion", help="the model and its training settings (default tiny-motion)")
    p.add_argument("--variant", choices=("motion", "simple"), default="simple", help="the motion set (default simple)")
    p.add_argument("--teacher-steps", type=int, default=1200, help="dense teacher training steps (default 1200)")
    p.add_argument("--steps", type=int, default=600, help="adaptation steps per kind (default 600)")
    p.add_argument("--evals", type=int, default=3, help="evaluation points after step 0, evenly spaced (default 3)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS, help="kinds adapted (default all four)")
    p.add_argument("--dsa", nargs=2, action="append", default=[], metavar=("NAME", "FIELD=VALUE[,...]"),
                   help="also adapt a dsa variant, run 'dsa+NAME', with these overrides (study.offset_freeze=N: the "
                        "offset heads still for the first N steps)")
    p.add_argument("--samples", type=int, default=12, help="captions sampled per split and run (default 12)")
    p.add_argument("--val-clips", type=int, default=12, help="held-out clips, and as many training clips (default 12)")
    p.add_argument("--window", default=DEFAULT_WINDOW, help="kt,kh,kw of swin, neighborhood and dsa (default 3,3,3)")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override for every run, the teacher's too")
    p.add_argument("--adapt-set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override for the adaptation runs only (e.g. optim.lr)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--out", type=Path, default=None, help="folder for runs.jsonl, teachers, tables and plots")
    p.add_argument("--resume", action="store_true", help="with --out: keep the runs already in DIR/runs.jsonl")
    p.add_argument("--json", action="store_true", help="print adaptation.json's summary instead of the tables")
    a = p.parse_args(argv)
    for name in ("teacher_steps", "steps", "evals", "samples", "val_clips"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)} must be >= 1")
    if a.evals > a.steps:
        p.error(f"--evals {a.evals} exceeds --steps {a.steps}")
    if a.resume and not a.out:
        p.error("--resume needs --out DIR")
    variants = dict(parse_variant(p, n, s) for n, s in a.dsa)
    t_start = time.perf_counter()
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    train, val = motion_manifests(a.variant)
    setup = {"arch": a.arch, "preset": a.preset, "variant": a.variant, "teacher_steps": a.teacher_steps,
             "steps": a.steps, "window": a.window, "overrides": dict(a.set), "adapt_overrides": dict(a.adapt_set),
             "val_clips": a.val_clips, "samples": a.samples, "threads": a.threads, "train": train, "val": val,
             "seeds": a.seeds, "eval_steps": sorted({round(a.steps * (k + 1) / a.evals) for k in range(a.evals)})}
    cfg0 = run_config(setup, "dense", a.seeds[0], a.steps)  # the clips are decoded alike for either arch
    valset, trainset = load_val_set(cfg0), load_val_set(cfg0, manifest=train)
    if a.arch == "wan":
        valset, trainset = wan_val_set(valset), wan_val_set(trainset)
    setup.update(valset=valset, trainset=trainset, captions=[e.caption for e in read_manifest(val)],
                 train_captions=[e.caption for e in read_manifest(train)])
    settings = {k: setup[k] for k in ("arch", "preset", "variant", "teacher_steps", "steps", "window", "overrides",
                                      "adapt_overrides", "val_clips", "samples", "eval_steps")}
    folder = a.out
    done = finished_runs(folder / RUNS_FILE, settings) if a.resume else {}
    if folder:
        folder.mkdir(parents=True, exist_ok=True)
        if not a.resume:
            (folder / RUNS_FILE).unlink(missing_ok=True)
    names = {**{k: {} for k in a.kinds}, **variants}
    for (name, seed), run in done.items():
        if name in names and run.get("spec", {}) != json.loads(json.dumps(names[name])):
            raise SystemExit(f"{name} seed {seed} in {folder / RUNS_FILE} was run with {run.get('spec')}, not "
                             f"{names[name]}: give the variant another name")
    runs = dict(done)

    def record(run: dict) -> None:
        runs[(run["kind"], run["seed"])] = run
        if folder:
            with (folder / RUNS_FILE).open("a") as f:
                f.write(json.dumps({"settings": settings, "run": run}) + "\n")

    for seed in a.seeds:
        todo = [n for n in ["teacher", *names] if (n, seed) not in done]
        if not todo:
            continue
        t0 = time.perf_counter()
        batches = decoded_batches(setup, seed, a.teacher_steps + a.steps)
        log(f"seed {seed}: {len(batches)} batches decoded in {time.perf_counter() - t0:.0f} s")
        teacher, seconds = teacher_weights(setup, seed, batches, folder)
        if ("teacher", seed) in done:
            cfg = run_config(setup, "dense", seed, a.teacher_steps)
            model = fresh_trainer(cfg, seed, a.threads).model
            model.load_state_dict(teacher)
            pred = evaluate(model, cfg, valset, keep=True)["pred"]
        else:
            row, pred = run_teacher(setup, seed, teacher, seconds, folder)
            record(row)
            log(f"teacher seed {seed}: held-out loss (t >= 0.25) {row['loss_ge25']:.4f}, training prompts shown "
                f"{row['train_shown']:.2f}")
        for name in todo:
            if name == "teacher":
                continue
            t1 = time.perf_counter()
            run = adapt(setup, name, seed, teacher, pred, batches, names[name], folder)
            record(run)
            log(f"{name} seed {seed}: {time.perf_counter() - t1:.0f} s; held-out loss (t >= 0.25) "
                f"{run['loss_ge25']:.4f}, training prompts shown {run['train_shown']:.2f}")
    all_runs = list(runs.values())
    meta = {**{k: setup[k] for k in ("arch", "preset", "variant", "teacher_steps", "steps", "window", "overrides",
                                     "adapt_overrides", "val_clips", "samples", "eval_steps")},
            "seeds": sorted({r["seed"] for r in all_runs}), "resumed_runs": len(done),
            "minutes": (time.perf_counter() - t_start) / 60, "threads": a.threads or os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    summary = {k: {key: spread([r.get(key, math.nan) for r in by_kind(all_runs, k).values()])
                   for key in ("loss_ge25", "x0", "loss", "teacher_dist", "train_shown", "train_fast_trajectory_error",
                               "train_temporal_consistency", "step_seconds", "step_cpu_seconds")}
               for k in kinds_in(all_runs)}
    text = markdown(all_runs, meta)
    if folder:
        (folder / "adaptation.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": all_runs,
                                                            "goals": {k: goals(all_runs, k) for k in kinds_in(all_runs)
                                                                      if base_kind(k) == "dsa"}}, indent=1))
        (folder / "adaptation.md").write_text(text)
        plots(all_runs, folder, a.arch)
    if a.json:
        print(json.dumps({"meta": meta, "summary": summary}))
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
