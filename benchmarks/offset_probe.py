"""Do a trained dsa model's offsets help or hurt when it samples? One model, its offsets scaled.

    python -m benchmarks.offset_probe --quality DIR [--seed 0] [--scales 1 0.5 0] [--samples 12]
                                      [--threads 0] [--json]

``DIR`` is the ``--out`` folder of a ``benchmarks.quality`` run that trained ``dsa`` (its
``quality.json`` names the preset, the motion set and the overrides; ``models/dsa_seedS.safetensors``
holds the weights). The probe rebuilds that model and, for each ``--scales`` value ``s``, multiplies
every offset head's output by ``s`` (``s = 0``: the same weights attend like ``neighborhood``,
the sliding window without offsets; ``static``: each position gets the offsets averaged over all
positions of the call, the learned window shape without its content-dependent part), then reports:

* the fixed-noise loss on the held-out clips and on as many training clips (as ``quality`` does);
* samples of the first ``--samples`` training captions and as many held-out captions, from the
  same noise as ``quality`` (so ``s = 1`` repeats its sample scores): how many show their prompt,
  the detection rate, trajectory and direction error (``megaslide_ray.motion_metric``);
* the mean |offset| (tokens, before scaling) the heads produce on real noised clips against what
  they produce along the sampler's own trajectory, per flow-time bin: offsets that grow on the
  sampler's inputs, which are never exactly the noised clips of training, are the suspect;
* the offsets' **static share**: how much of them is one pattern every position shares (a learned
  window shape) rather than a function of the content (motion following).

Issue 16's question: dsa has the lowest held-out loss of the four kinds, yet its samples show their
prompt least often. If samples improve as ``s`` goes to 0 while the loss rises, the offsets help
denoise a real noised clip but mislead the sampler.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.quality import ModelPredictor, _nanmean, quality_folder, saved_model

T_BINS = (0.0, 0.25, 0.5, 0.75, 1.01)


class OffsetTap:
    """Forward hooks on every offset head: scale their output by ``scale`` and record the mean
    |offset| they produced (before scaling) with the flow time ``t`` the caller set."""

    def __init__(self, model):
        from megaslide_ray.models.attention import OffsetPredictor

        self.scale: float | str = 1.0  # or "static": every position gets the call's mean offsets
        self.t: float | None = None
        self.records: list[tuple[float, float, float]] = []
        self.hooks = [m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, OffsetPredictor)]
        if not self.hooks:
            raise SystemExit("the model has no offset heads: --quality must hold a dsa model")

    def _hook(self, module, args, out):
        if self.t is not None:  # out: (B, T, H, W, heads, K, 3)
            mean_abs = float(out.abs().mean())
            fixed = float(out.mean(dim=(0, 1, 2, 3)).abs().mean())  # the part every position shares
            self.records.append((self.t, mean_abs, fixed / mean_abs if mean_abs > 0 else math.nan))
        if self.scale == "static":
            return out.mean(dim=(0, 1, 2, 3), keepdim=True).expand_as(out).contiguous()
        return out * self.scale if self.scale != 1.0 else out

    def by_bin(self, field: int = 1) -> list[float]:
        """Per flow-time bin, the mean of record field ``field`` (1: mean |offset|, 2: static share)."""
        out = []
        for lo, hi in zip(T_BINS, T_BINS[1:]):
            vals = [r[field] for r in self.records if lo <= r[0] < hi]
            out.append(statistics.fmean(vals) if vals else math.nan)
        return out

    def close(self):
        for h in self.hooks:
            h.remove()


class TimedPredictor:
    """The quality benchmark's predictor, telling the tap the flow time of each call."""

    def __init__(self, model, tap: OffsetTap):
        self.inner, self.tap = ModelPredictor(model), tap

    def predict(self, x_t, t, cond, cond_len, version):
        self.tap.t = float(np.asarray(t).reshape(-1)[0])
        return self.inner.predict(x_t, t, cond, cond_len, version)


def load_quality_run(folder: Path, seed: int):
    """(cfg, model, meta) of the dsa run of ``seed`` in a ``benchmarks.quality --out`` folder."""
    got = saved_model(folder, "dsa", seed)
    if got is None:
        raise SystemExit(f"{folder / 'models'} holds no dsa model of seed {seed}: run benchmarks.quality with "
                         f"--kinds dsa --seeds {seed} --out {folder}")
    return got


def probe(cfg, model, scales, samples: int, log=print) -> list[dict]:
    from benchmarks.learning import shows_prompt
    from megaslide_ray.data.captions import caption_batch
    from megaslide_ray.evaluation.validation import load_val_set, validation_loss
    from megaslide_ray.data.manifest import read_manifest
    from megaslide_ray.evaluation.motion_metric import motion_fidelity
    from megaslide_ray.evaluation.sampling import initial_noise, integrate, to_uint8_frames

    valset = load_val_set(cfg)
    trainset = load_val_set(cfg, manifest=cfg.data.manifest)
    captions = {"train": [e.caption for e in read_manifest(cfg.data.manifest)][:samples],
                "held_out": [e.caption for e in read_manifest(cfg.data.val_manifest)][:samples]}
    tap = OffsetTap(model)
    pred = TimedPredictor(model, tap)
    rows = []
    try:
        for s in scales:
            tap.scale = s
            t0 = time.perf_counter()
            row = {"scale": s}
            tap.records, tap.t = [], None
            # one item per call, so each call has one t and the tap files its offsets under it
            row["val_loss"] = validation_loss(pred, cfg, valset, cfg.training.steps, batch_size=1).val_loss
            row["offsets_real"] = tap.by_bin()
            row["static_share_real"] = tap.by_bin(2)
            row["train_split_loss"] = validation_loss(pred, cfg, trainset, cfg.training.steps).val_loss
            tap.records = []
            for split, caps in captions.items():
                ms = []
                for j, caption in enumerate(caps):
                    cap, cap_len = caption_batch(caption, cfg.model.caption_max_bytes, 1)
                    x = integrate(pred, cfg, initial_noise(cfg, 1000 + j), cap, cap_len, cfg.training.sample_steps,
                                  cfg.training.steps)
                    ms.append(motion_fidelity(to_uint8_frames(x), caption))
                row[split] = {"shown": sum(shows_prompt(m) for m in ms), "of": len(ms),
                              "detection_rate": statistics.fmean(m["detection_rate"] for m in ms),
                              "trajectory_error": _nanmean([m["trajectory_error"] for m in ms]),
                              "direction_error_deg": _nanmean([m["direction_error_deg"] for m in ms])}
            row["offsets_sampling"] = tap.by_bin()
            row["static_share_sampling"] = tap.by_bin(2)
            row["seconds"] = time.perf_counter() - t0
            log(f"scale {s}: val {row['val_loss']:.4f}, train-split {row['train_split_loss']:.4f}, training captions "
                f"shown {row['train']['shown']}/{row['train']['of']}, held out {row['held_out']['shown']}/"
                f"{row['held_out']['of']} ({row['seconds']:.0f} s)")
            rows.append(row)
    finally:
        tap.close()
    return rows


def markdown(rows: list[dict], meta: dict, seed: int) -> str:
    bins = ", ".join(f"[{lo:g}, {min(hi, 1):g}{']' if hi > 1 else ')'}" for lo, hi in zip(T_BINS, T_BINS[1:]))
    lines = [f"dsa model of `benchmarks.quality` ({meta.get('preset')}, {meta.get('variant')} set, {meta['steps']} "
             f"steps, seed {seed}); offsets scaled by s", "",
             "| s | held-out loss | train-split loss | training captions shown | detection | trajectory err "
             "| direction err | held-out captions shown | mean abs offset, real x_t | mean abs offset, sampler's x_t "
             "| static share, real x_t | static share, sampler's x_t |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tr, ho = r["train"], r["held_out"]
        real = " / ".join(f"{v:.2f}" for v in r["offsets_real"])
        samp = " / ".join(f"{v:.2f}" for v in r["offsets_sampling"])
        static = [" / ".join(f"{v:.2f}" for v in r[k]) for k in ("static_share_real", "static_share_sampling")]
        scale = r["scale"] if isinstance(r["scale"], str) else format(r["scale"], "g")
        lines.append(f"| {scale} | {r['val_loss']:.4f} | {r['train_split_loss']:.4f} | {tr['shown']}/{tr['of']} "
                     f"| {tr['detection_rate']:.2f} | {tr['trajectory_error']:.2f} | {tr['direction_error_deg']:.1f} "
                     f"| {ho['shown']}/{ho['of']} | {real} | {samp} | {static[0]} | {static[1]} |")
    lines += ["", f"Offsets per flow-time bin t in {bins} (tokens, before scaling). Static share: |the offset "
                  f"averaged over every position of a call| / mean |offset|, per head, window slot and axis: 1 when "
                  f"the heads give every token the same offsets (a learned window shape), near 0 when the offsets "
                  f"follow the content."]
    return "\n".join(lines) + "\n"


def _scale(text: str) -> float | str:
    if text == "static":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number nor 'static'") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.offset_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--quality", type=quality_folder, required=True,
                   help="a benchmarks.quality --out folder with a dsa model")
    p.add_argument("--seed", type=int, default=0, help="which seed's dsa model (default 0)")
    p.add_argument("--scales", type=_scale, nargs="+", default=[1.0, "static", 0.5, 0.0],
                   help="offset scales to try, or 'static' (each position gets the offsets averaged over "
                        "all positions: the learned window shape without its content-dependent part); "
                        "default 1 static 0.5 0")
    p.add_argument("--samples", type=int, default=12, help="captions sampled per split (default 12)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--json", action="store_true", help="one JSON object per scale")
    a = p.parse_args(argv)
    if a.samples < 1:
        p.error(f"--samples {a.samples} must be >= 1")
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    cfg, model, meta = load_quality_run(a.quality, a.seed)
    rows = probe(cfg, model, a.scales, a.samples, log=lambda *x: print(*x, file=sys.stderr, flush=True))
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(markdown(rows, meta, a.seed), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
