"""How long sampling during training holds a step up, on the tests' tiny random Wan folder.

    python -m benchmarks.sampling [--steps 16] [--sample-every 4] [--sample-steps 10] [--prompts 2]
        [--repeats 2] [--tracker tensorboard] [--keep DIR] [--json]

Runs of the main job (Ray actors, ``--init-from`` the folder, latents precomputed from the demo
videos), ``--repeats`` of each, taking turns (baseline, sampling, baseline, ...), the figures the
medians over all their steps:

    baseline   no sampling
    sampling   ``training.sample_every``: every N steps each prompt is denoised through the compute
               actor (the driver waits: ``sample_seconds``), then VAE-decoded and written by the
               sample writer actor on the CPU while training goes on (``decode_seconds``)

Reported: s/step of the steps that did not sample in each run (the sampling run's include the
decode beside them and the tracker's GIFs), the driver's wait per sampling, the writer's seconds
per video, the ratio of the wait to a step, and what the wait would be with the decode on the
training path (the wait plus the writer's seconds). ``--keep DIR`` keeps the run directories
(the sampling runs' ``samples/`` and ``tensorboard/``). The folder is ``tests/wan_models.py``'s (9
frames of 32x32, a VAE of base width 8): the figures are the overheads' shape, not a real
Wan's times.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import ray
import torch

TESTS = Path(__file__).resolve().parent.parent / "tests"

PROMPTS = ("a red circle moving right", "blue square on dark background", "a white triangle moving up",
           "green circle moving left")


def make_folder(root: Path) -> Path:
    """The tests' tiny random Wan folder (``tests/wan_models.py``) with its transformer."""
    sys.path.insert(0, str(TESTS))
    from diffusers import WanTransformer3DModel
    from wan_models import TRANSFORMER, make_wan_dir

    folder = make_wan_dir(root / "wan-tiny")
    torch.manual_seed(3)
    WanTransformer3DModel(**TRANSFORMER).save_pretrained(folder / "transformer")
    return folder


def make_latents(folder: Path, root: Path) -> Path:
    from wan_models import FRAMES, SIZE

    from megaslide_ray.data.demo import ensure_demo_dataset
    from pipelines.latent_precompute import precompute

    videos = ensure_demo_dataset(root / "videos", num_videos=4)
    precompute(folder, videos, root / "latents", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32", num_encoders=0,
               progress=False)
    return root / "latents" / "manifest.parquet"


def train(folder: Path, manifest: Path, run_dir: Path, steps: int, sample: dict) -> list[dict]:
    from wan_models import FRAMES, SIZE

    from megaslide_ray.driver import Trainer
    from megaslide_ray.state.pretrained_io import config_for_diffusers_dir

    cfg = config_for_diffusers_dir(folder, None, None, {
        "data.manifest": str(manifest), "data.num_frames": FRAMES, "data.height": SIZE, "data.width": SIZE,
        "data.batch_size": 1, "attention.kind": "dsa", "attention.window": "3,1,1", "training.steps": steps,
        "training.flow_shift": 3.0, "training.log_every": 1000, "optim.lr": 1e-4,
        "runtime.state_dir": str(run_dir.parent / f"{run_dir.name}-state"), **sample})
    trainer = Trainer(cfg, run_dir=str(run_dir), progress=False, init_from=str(folder))
    try:
        trainer.train()
    finally:
        trainer.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plain_step_seconds(rows: list[dict]) -> list[float]:
    """s/step of the steps that did not sample, the first (warm-up) left out."""
    return [r["step_seconds"] for r in rows[1:] if "sample" not in r]


def run(a, root: Path) -> list[dict]:
    folder = make_folder(root)
    manifest = make_latents(folder, root)
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:a.prompts]) + "\n")
    base, sampled, held, index = [], [], [], []
    for r in range(a.repeats):
        base += plain_step_seconds(train(folder, manifest, root / f"baseline-{r}", a.steps, {}))
        rows = train(folder, manifest, root / f"sampling-{r}", a.steps, {
            "training.sample_every": a.sample_every, "training.sample_steps": a.sample_steps,
            "training.sample_prompts_file": str(prompts), "training.tracker": a.tracker})
        sampled += plain_step_seconds(rows)
        held += [row["sample_seconds"] for row in rows if "sample_seconds" in row]
        lines = (root / f"sampling-{r}" / "samples" / "samples.jsonl").read_text().splitlines()
        index += [json.loads(line) for line in lines]
    step_base, step_sampling, held_s = statistics.median(base), statistics.median(sampled), statistics.median(held)
    written = statistics.median(e["decode_seconds"] + e["write_seconds"] for e in index)
    return [
        {"run": "baseline", "step_s": step_base, "steps": len(base), "samplings": 0},
        {"run": "sampling", "step_s": step_sampling, "steps": len(sampled), "samplings": len(held),
         "videos": len(index), "prompts": a.prompts, "sample_steps": a.sample_steps,
         "held_s": held_s, "held_per_prompt_s": held_s / a.prompts,
         "decode_s": statistics.median(e["decode_seconds"] for e in index),
         "write_s": statistics.median(e["write_seconds"] for e in index),
         "held_if_decoded_on_path_s": held_s + a.prompts * written,
         "held_over_step": held_s / step_base, "step_ratio": step_sampling / step_base},
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sampling", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--sample-every", type=int, default=4)
    p.add_argument("--sample-steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=2, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, taking turns")
    p.add_argument("--tracker", default="tensorboard", choices=("none", "tensorboard"))
    p.add_argument("--keep", default=None, help="keep the runs (and the folder) in this directory")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        if a.keep:
            Path(a.keep).mkdir(parents=True, exist_ok=True)
            rows = run(a, Path(a.keep))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rows = run(a, Path(tmp))
    finally:
        ray.shutdown()
    if a.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    base, s = rows
    print(f"tiny Wan folder, {a.steps} steps, sampling every {a.sample_every}: {s['prompts']} prompts x "
          f"{s['sample_steps']} Euler steps, decode on the CPU (sample writer actor)")
    w = 56
    print(f"{'s/step without sampling (baseline runs)':<{w}} {base['step_s']:.3f}  ({base['steps']} steps)")
    print(f"{'s/step of the sampling runs, steps that did not sample':<{w}} {s['step_s']:.3f}  "
          f"(x{s['step_ratio']:.2f}; the decode runs beside some of them)")
    print(f"{'step held up per sampling (denoising; the driver waits)':<{w}} {s['held_s']:.3f}  "
          f"({s['held_per_prompt_s']:.3f} per prompt; {s['held_over_step']:.2f} steps)")
    print(f"{'VAE decode per video (sample writer, off the step)':<{w}} {s['decode_s']:.3f}")
    print(f"{'mp4 + contact sheet per video (sample writer)':<{w}} {s['write_s']:.3f}")
    print(f"{'held up per sampling, were the decode on the step':<{w}} {s['held_if_decoded_on_path_s']:.3f}")
    print(f"videos written: {s['videos']} ({s['samplings']} samplings); medians over the runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
