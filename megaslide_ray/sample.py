"""``python -m megaslide_ray.sample --checkpoint RUN --prompt TEXT --out video.mp4``

The command line of ``megaslide_ray.evaluation.sampling``: sample a video from a checkpoint. It
parses the arguments and calls the library; every flag is in docs/cli.md."""

from __future__ import annotations

import argparse
import logging
import sys

from megaslide_ray.config import ConfigError
from megaslide_ray.evaluation.sampling import sample_video


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megaslide_ray.sample",
                                description="Sample a video from a checkpoint (Euler, rectified flow, streamed).")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (its latest)")
    p.add_argument("--prompt", default="", help="caption text")
    p.add_argument("--frames", type=int, default=None, help="frames (default: the training clip's)")
    p.add_argument("--height", type=int, default=None, help="height in pixels (default: the training clip's)")
    p.add_argument("--width", type=int, default=None, help="width in pixels (default: the training clip's)")
    p.add_argument("--steps", type=int, default=20, help="Euler steps")
    p.add_argument("--seed", type=int, default=0, help="noise seed")
    p.add_argument("--cfg-scale", type=float, default=1.0,
                   help="classifier-free guidance scale (1 = off; Wan models are usually sampled at 5)")
    p.add_argument("--model-dir", default=None,
                   help="wan checkpoints: the local diffusers Wan folder (text_encoder/, tokenizer/, vae/); a videodit on "
                        "latents (dit-* presets): the folder whose vae/ decodes its latents")
    p.add_argument("--negative-prompt", default="", help="wan: the prompt of guidance's unconditional half")
    p.add_argument("--image", default=None,
                   help="image-to-video checkpoint: the first frame (resized to cover the clip, center-cropped)")
    p.add_argument("--last-image", default=None, help="FLF2V checkpoint: the last frame")
    p.add_argument("--fps", type=int, default=8)
    p.add_argument("--upscale", type=int, default=1,
                   help="write each pixel K x K times (nearest neighbour), e.g. 4 for tiny-motion's 16x16 "
                        "clips")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--weights", choices=["auto", "trained", "ema"], default="auto",
                   help="the trained weights or their moving average (training.ema_decay); auto: the average where "
                        "the run kept one and evaluated with it (training.ema_eval), else the trained weights")
    p.add_argument("--out", default="sample.mp4", help="output mp4; the contact sheet goes beside it as .png")
    p.add_argument("--log-level", default="WARNING")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        r = sample_video(a.checkpoint, a.prompt, a.out, a.frames, a.steps, a.seed, a.height, a.width,
                         a.cfg_scale, a.fps, a.device, a.model_dir, a.negative_prompt, a.upscale, a.image,
                         a.last_image, a.weights)
    except (ConfigError, FileNotFoundError, ValueError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    f, h, w, _ = r.frames.shape
    print(f"checkpoint {r.checkpoint} (step {r.checkpoint_step}): {f} frames {w}x{h}, {a.steps} steps, "
          f"seed {a.seed}, {r.seconds:.1f} s")
    print(f"video: {r.video_path}")
    print(f"contact sheet: {r.sheet_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
