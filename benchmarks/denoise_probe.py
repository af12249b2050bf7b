"""Where does sampling break? A trained ``tiny`` model's clean-clip estimate at each flow time.

    python -m benchmarks.denoise_probe [--steps 1000] [--kind swin] [--clips 8] [--seed 0]
                                       [--threads 1] [--set FIELD VALUE ...] [--json]

Trains ``tiny`` on the motion set's training split in process (as ``benchmarks.learning`` does),
then takes the next ``--clips`` training clips with their captions and fixed noise and reports:

* per flow time t (x_t = (1 - t) x0 + t noise): the velocity loss, and the model's estimate of
  the clean clip, ``x0_hat = x_t - t v``: its RMS error, the error of its background colour (the
  per-channel median of the clip, mean absolute difference), and its roughness (mean absolute
  difference of horizontally adjacent pixels; the real clips' value is given beside it);
* denoising from t0 to 0 in 10 Euler steps, for t0 = 1 (sampling) and partly noised clips;
* the **caption effect**: at t = 1, how far the estimate moves between the clip's caption and
  the empty caption (mean absolute difference), beside how far the clips differ from their mean;
* two estimates that use no model: the dataset's **mean clip** (RMS error) and the **mean
  background colour** (background error). At t = 1 the input is pure noise, so the best
  estimate is the mean clip *given the caption*: a model that reads its caption beats both.

All values are in the model's [-1, 1] pixel scale.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch

T_GRID = (0.05, 0.25, 0.5, 0.75, 0.9, 0.98, 1.0)  # ends at 1: the caption effect is measured there
DENOISE_FROM = (1.0, 0.8, 0.6, 0.4)


def background(x: torch.Tensor) -> torch.Tensor:
    """Per clip, the per-channel median over every pixel of every frame: (B, C)."""
    return x.flatten(1, 3).median(1).values


def roughness(x: torch.Tensor) -> float:
    return float((x[:, :, :, 1:] - x[:, :, :, :-1]).abs().mean())


def probe(model, x0: torch.Tensor, cap: torch.Tensor, cap_len: torch.Tensor, seed: int) -> dict:
    """The measurements above for a model (velocity out) on clips ``x0`` (B, F, H, W, C)."""
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    bg = background(x0)
    rows, denoised = [], []
    with torch.no_grad():
        for t in T_GRID:
            x_t = (1 - t) * x0 + t * noise
            v = model(x_t, torch.full((x0.shape[0],), t), cap, cap_len).float()
            x0_hat = x_t - t * v
            rows.append({"t": t, "v_loss": float(((v - (noise - x0)) ** 2).mean()),
                         "x0_rms": float(((x0_hat - x0) ** 2).mean().sqrt()),
                         "background_err": float((background(x0_hat) - bg).abs().mean()),
                         "roughness": roughness(x0_hat)})
            if t == 1.0:  # from pure noise: how far the caption moves the estimate (its own against none)
                blank = x_t - model(x_t, torch.full((x0.shape[0],), t), torch.zeros_like(cap),
                                    torch.zeros_like(cap_len)).float()
                caption_effect = float((x0_hat - blank).abs().mean())
        for t0 in DENOISE_FROM:
            x = (1 - t0) * x0 + t0 * noise
            ts = torch.linspace(t0, 0.0, 11)
            for i in range(10):
                t, dt = float(ts[i]), float(ts[i] - ts[i + 1])
                x = x - dt * model(x, torch.full((x0.shape[0],), t), cap, cap_len).float()
            denoised.append({"from_t": t0, "x0_rms": float(((x - x0) ** 2).mean().sqrt()),
                             "background_err": float((background(x) - bg).abs().mean()), "roughness": roughness(x)})
    spread = x0 - x0.mean(0, keepdim=True)
    return {"per_t": rows, "denoise": denoised, "caption_effect": caption_effect,
            "true_clip_spread": float(spread.abs().mean()), "mean_clip_rms": float(spread.pow(2).mean().sqrt()),
            "mean_background_err": float((bg - bg.mean(0)).abs().mean()), "true_roughness": roughness(x0)}


def markdown(result: dict, meta: dict) -> str:
    lines = [f"`tiny`, attention {meta['kind']}, seed {meta['seed']}, {meta['steps']} steps "
             f"(train loss of the last 50: {meta['train_loss']:.4f}), {meta['clips']} training clips, "
             f"overrides {meta['overrides'] or 'none'}; total {meta['minutes']:.1f} min", "",
             "| t | v loss | x0_hat RMS err | background err | roughness |", "|---|---|---|---|---|"]
    for r in result["per_t"]:
        lines.append(f"| {r['t']:.2f} | {r['v_loss']:.4f} | {r['x0_rms']:.3f} | {r['background_err']:.3f} | "
                     f"{r['roughness']:.3f} |")
    lines += ["", "| denoised from t0 (10 Euler steps) | RMS err | background err | roughness |",
              "|---|---|---|---|"]
    for r in result["denoise"]:
        lines.append(f"| {r['from_t']:.1f} | {r['x0_rms']:.3f} | {r['background_err']:.3f} | {r['roughness']:.3f} |")
    lines += ["", f"no model: mean clip RMS err {result['mean_clip_rms']:.3f}, mean background err "
                  f"{result['mean_background_err']:.3f}; the real clips' roughness {result['true_roughness']:.3f}",
              "", f"caption effect at t = 1 (mean |x0_hat with the caption - x0_hat with the empty caption|): "
                  f"{result['caption_effect']:.3f}; the clips' own mean |x0 - mean clip|: {result['true_clip_spread']:.3f}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.denoise_probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1000, help="training steps (default 1000)")
    p.add_argument("--kind", default="swin", choices=["dense", "swin", "neighborhood", "dsa"])
    p.add_argument("--clips", type=int, default=8, help="training clips probed (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: all cores)")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("FIELD", "VALUE"),
                   help="a config override (e.g. --set data.height 32); recorded")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the tables")
    a = p.parse_args(argv)
    for name in ("steps", "clips"):
        if getattr(a, name) < 1:
            p.error(f"--{name} {getattr(a, name)} must be >= 1")

    from actors.decoder import VideoDecoder
    from megaslide_ray.training.baseline import InProcessTrainer
    from megaslide_ray.config import build_config
    from megaslide_ray.training.flow import video_to_unit
    from megaslide_ray.data.motion import ensure_motion_dataset

    t0 = time.perf_counter()
    train, _ = (str(x) for x in ensure_motion_dataset())
    cfg = build_config("tiny", None, {"attention.kind": a.kind, "training.seed": str(a.seed),
                                      "training.steps": str(a.steps), "data.manifest": train, **dict(a.set)})
    torch.manual_seed(a.seed)
    trainer = InProcessTrainer(cfg, threads=a.threads)
    losses, batches = [], []
    with VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes) as dec:
        for _ in range(a.steps):
            losses.append(trainer.train_step(dec.next_batch()).loss)
        while sum(len(b["caption_len"]) for b in batches) < a.clips:
            batches.append(dec.next_batch())
    x0 = torch.cat([video_to_unit(b["video"]) for b in batches])[: a.clips]
    cap = torch.cat([torch.from_numpy(np.array(b["caption"])) for b in batches])[: a.clips]
    cap_len = torch.cat([torch.from_numpy(np.array(b["caption_len"])) for b in batches])[: a.clips]
    trainer.model.eval()
    result = probe(trainer.model, x0, cap, cap_len, seed=1000 + a.seed)
    meta = {"kind": a.kind, "seed": a.seed, "steps": a.steps, "clips": a.clips, "overrides": dict(a.set),
            "train_loss": float(np.mean(losses[-50:])), "minutes": (time.perf_counter() - t0) / 60,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if a.json:
        print(json.dumps({"meta": meta, **result}))
    else:
        print(markdown(result, meta), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
