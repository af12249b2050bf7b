"""Where does each attention kind's loss come from: the moving object, or the background?

    python -m benchmarks.studies.region_loss --quality DIR [--seed 0] [--clips 12] [--threads 0] [--json]

``DIR`` is the ``--out`` folder of a ``benchmarks.studies.quality`` run (its
``models/KIND_seedS.safetensors`` and ``quality.json``). For every kind saved there, the
fixed-noise loss of ``quality`` (the same noise and t per clip and t-bucket:
``megaslide_ray.evaluation.validation.val_inputs``) is split by pixel with
the motion set's ground truth (``motion.json``: the object's centre per frame and its radius):

* **object**: pixels within one radius of the object's centre in that frame;
* **background**: pixels farther than 1.5 radii (the band between, where squares' corners and
  triangles' tips lie, counts for neither);

on the first ``--clips`` held-out clips and as many training clips, per t-bucket and overall. A
kind whose lower total loss comes from the background while its object loss is higher would
explain lower loss with samples that show the prompted object less often (issue 16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

from benchmarks.studies.harness import ModelPredictor, log
from benchmarks.studies.quality import KINDS, quality_folder, saved_model
from megaslide_ray.data import motion_set as motion
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.validation import load_val_set, val_inputs

OBJECT_RADII = 1.0
BACKGROUND_RADII = 1.5


def region_masks(plan: dict, frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(object, background)`` bool masks ``(frames, height, width)`` of one motion-set clip at the
    training resolution, from its ``motion.json`` entry ``plan``."""
    sy, sx = height / plan.get("height", height), width / plan.get("width", width)
    centres = torch.tensor(plan["centres"][:frames], dtype=torch.float64)
    if len(centres) < frames:
        raise ValueError(f"the plan has {len(centres)} frames, the clip {frames}")
    ys = (torch.arange(height, dtype=torch.float64) + 0.5) / sy  # pixel centres in the plan's pixels
    xs = (torch.arange(width, dtype=torch.float64) + 0.5) / sx
    d = ((ys[None, :, None] - centres[:, 1, None, None]) ** 2
         + (xs[None, None, :] - centres[:, 0, None, None]) ** 2).sqrt()
    r = float(plan["radius"])
    return d <= OBJECT_RADII * r, d > BACKGROUND_RADII * r


@torch.no_grad()
def region_losses(predictor, cfg, val, truth: dict, files: list[str]) -> dict:
    """Per t-bucket and overall, the squared error of the predicted velocity averaged over object
    pixels and over background pixels of every clip of ``val`` (clip ``c`` is ``files[c]``)."""
    nb = int(cfg.training.val_t_buckets)
    sums = {k: [0.0] * nb for k in ("object", "background")}
    counts = {k: [0] * nb for k in sums}
    for c in range(len(val.rows)):
        x0 = val.x0[c]
        obj, bg = region_masks(truth[files[c]], *x0.shape[:3])
        for b in range(nb):
            x_t, t, target = val_inputs(x0, cfg.training.seed, c, b, nb)
            pred = predictor.predict(x_t[None], torch.tensor([t], dtype=torch.float32), val.cond[c:c + 1],
                                     val.cond_len[c:c + 1], cfg.training.steps)[0]
            err = (pred.double() - target.double()).pow(2).mean(dim=-1)  # (F, H, W)
            for key, m in (("object", obj), ("background", bg)):
                sums[key][b] += float(err[m].sum())
                counts[key][b] += int(m.sum())
    out = {}
    for key in sums:
        out[key] = math.fsum(sums[key]) / max(1, sum(counts[key]))
        out[key + "_buckets"] = [s / n if n else math.nan for s, n in zip(sums[key], counts[key])]
    out["object_pixels"] = sum(counts["object"]) / max(1, sum(counts["object"]) + sum(counts["background"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.region_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--quality", type=quality_folder, required=True,
                   help="a benchmarks.studies.quality --out folder (with models/)")
    p.add_argument("--seed", type=int, default=0, help="which seed's models (default 0)")
    p.add_argument("--clips", type=int, default=12, help="held-out clips, and as many training clips (default 12)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--json", action="store_true", help="one JSON object per kind")
    a = p.parse_args(argv)
    if a.clips < 1:
        p.error(f"--clips {a.clips} must be >= 1")
    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    models = {k: got for k in KINDS if (got := saved_model(a.quality, k, a.seed)) is not None}
    if not models:
        raise SystemExit(f"no models/KIND_seed{a.seed}.safetensors in {a.quality}")
    # The kinds differ only in attention: one decoding of the clips serves them all.
    cfg0, _, meta = next(iter(models.values()))
    truth = motion.load_ground_truth(cfg0.data.val_manifest)
    splits = {}
    for split, manifest in (("held_out", cfg0.data.val_manifest), ("train", cfg0.data.manifest)):
        vs = load_val_set(cfg0, manifest=manifest, clips=a.clips)
        entries = read_manifest(manifest)
        splits[split] = (vs, [Path(entries[r].path).name for r in vs.rows])
    rows = []
    for kind, (cfg, model, _) in models.items():
        pred = ModelPredictor(model)
        row = {"kind": kind, **{split: region_losses(pred, cfg, vs, truth, files)
                                for split, (vs, files) in splits.items()}}
        rows.append(row)
        log(f"{kind}: held-out object {row['held_out']['object']:.4f} background {row['held_out']['background']:.4f}; "
            f"train object {row['train']['object']:.4f} background {row['train']['background']:.4f}")
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"`{meta.get('preset')}` on the {meta.get('variant')} set, {meta['steps']} steps, seed {a.seed}; "
          f"{a.clips} clips per split x {len(rows[0]['held_out']['object_buckets'])} t-buckets; object pixels "
          f"{rows[0]['held_out']['object_pixels']:.1%} of those counted\n")
    print("| kind | held-out: object | held-out: background | train: object | train: background "
          "| held-out object per t-bucket | train object per t-bucket | train background per t-bucket |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        h, t = r["held_out"], r["train"]
        per = [" / ".join(f"{v:.3f}" for v in d[k]) for d, k in
               ((h, "object_buckets"), (t, "object_buckets"), (t, "background_buckets"))]
        print(f"| {r['kind']} | {h['object']:.4f} | {h['background']:.4f} | {t['object']:.4f} | {t['background']:.4f} "
              f"| {per[0]} | {per[1]} | {per[2]} |")
    print("\nt-bucket b covers flow times [b/n, (b+1)/n): the last one is the noisiest, where a sample "
          "settles where its object is.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
