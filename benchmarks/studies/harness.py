"""What the studies share: a model trained in process on the motion set, its weights saved and
loaded, and its samples scored against their captions and the set's ground truth.

Training runs in process (``megaslide_ray.training.baseline.InProcessTrainer``: the model and
objective of the streamed trainer, which the tests hold equal to it) on the batches the streamed
trainer's decoder would give, so a study compares models, not plumbing. Samples start from fixed
noise (seed 1000 + the caption's index, whichever study draws them) and are scored with the
motion-fidelity metric (``megaslide_ray.evaluation.motion_score``).

The motion set is found through the module (``motion.ensure_motion_dataset``), not a name
imported from it, so a test can stand a small set in for it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from actors.decoder import VideoDecoder
from megaslide_ray.config import Config, build_config
from megaslide_ray.data import motion_set as motion
from megaslide_ray.data.captions import caption_batch
from megaslide_ray.evaluation.motion_score import motion_fidelity
from megaslide_ray.evaluation.sampling import initial_noise, integrate, to_uint8_frames
from megaslide_ray.models.attention import OffsetPredictor
from megaslide_ray.models.registry import build_model
from megaslide_ray.training.baseline import InProcessTrainer

SAMPLE_SEED = 1000
"""The noise of the ``j``-th sampled caption is drawn from seed ``SAMPLE_SEED + j``."""
DETECTED, SHAPED, DIRECTION_DEG = 0.75, 0.5, 45.0
"""``shows_prompt``'s thresholds: colour found in >= 75% of the frames, the caption's shape the
best fit in >= half of the visible frames, mean direction error <= 45 degrees."""


def log(*parts) -> None:
    """A progress line on stderr (the studies print their tables on stdout)."""
    print(*parts, file=sys.stderr, flush=True)


def nanmean(xs) -> float:
    """The mean of the numbers in ``xs`` that are not NaN (anything else is skipped); NaN if none."""
    xs = [x for x in xs if isinstance(x, (int, float)) and not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


# ---------------------------------------------------------------------------------------------
# The motion set and a model on it
# ---------------------------------------------------------------------------------------------


def motion_manifests(variant: str = "motion") -> tuple[str, str]:
    """``(train manifest, val manifest)`` of the motion set (``"simple"``: its simple variant) in
    the cache, made on first use."""
    train, val = motion.ensure_motion_dataset(variant=variant)
    return str(train), str(val)


def study_config(preset: str, overrides: dict) -> Config:
    """``preset`` with ``overrides`` (``{"section.field": value}``, values of any type, read as a
    command line's)."""
    return build_config(preset, None, {k: str(v) for k, v in overrides.items()})


def fresh_trainer(cfg: Config, seed: int, threads: int) -> InProcessTrainer:
    """An in-process trainer of ``cfg`` whose initial weights are drawn from ``seed`` (torch's
    global generator), so that runs of one seed start alike whatever else differs."""
    torch.manual_seed(seed)
    return InProcessTrainer(cfg, threads=threads)


def training_decoder(cfg: Config) -> VideoDecoder:
    """The decoder of ``cfg``'s training data for ``training.seed``: the batches the streamed
    trainer would get, in its order (a context manager; ``next_batch()``)."""
    return VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes)


class ModelPredictor:
    """``predict(x_t, t, cond, cond_len, version)`` of an in-process model (the interface the
    compute actor offers to sampling and validation)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @torch.no_grad()
    def predict(self, x_t, t, cond, cond_len, version: int) -> torch.Tensor:
        as_t = lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a))  # noqa: E731
        return self.model(as_t(x_t).float(), as_t(t).float(), as_t(cond), as_t(cond_len)).float()


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """``model``'s state dict as one safetensors file (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(path))


def load_model(cfg: Config, path: Path) -> torch.nn.Module:
    """The model of ``cfg`` with the weights ``save_weights`` wrote to ``path``, in eval mode."""
    model = build_model(cfg)
    model.load_state_dict(load_file(str(path)))
    return model.eval()


# ---------------------------------------------------------------------------------------------
# Samples scored against their captions
# ---------------------------------------------------------------------------------------------


def shows_prompt(m: dict) -> bool:
    """Whether one sample's metric (``motion_fidelity``) says it shows its caption's colour, shape
    and direction (the thresholds above)."""
    d = m["direction_error_deg"]
    return (m["detection_rate"] >= DETECTED and not math.isnan(m["shape_match"]) and m["shape_match"] >= SHAPED
            and not math.isnan(d) and d <= DIRECTION_DEG)


def sample_and_score(predictor, cfg: Config, captions: list[str], version: int,
                     cfg_scale: float = 1.0, condition=None) -> tuple[list[np.ndarray], list[dict]]:
    """Each caption sampled from its fixed noise (Euler, ``training.sample_steps``, guided by
    ``cfg_scale`` against the empty caption; 1: unguided) and scored against it: the uint8 clips
    ``(T, H, W, 3)`` and their ``motion_fidelity`` dicts, in the captions' order. ``condition(caption)
    -> (cond, cond_len)``: what the model reads for a caption (default: its bytes, as ``videodit``
    reads them); the empty condition is zeros of that shape."""
    clips, metrics = [], []
    for j, caption in enumerate(captions):
        if condition is None:
            cap, cap_len = caption_batch(caption, cfg.model.caption_max_bytes, 1)
        else:
            cap, cap_len = condition(caption)
        x = integrate(predictor, cfg, initial_noise(cfg, SAMPLE_SEED + j), cap, cap_len, cfg.training.sample_steps,
                      version, cfg_scale, np.zeros_like(cap), np.zeros_like(cap_len))
        clips.append(to_uint8_frames(x))
        metrics.append(motion_fidelity(clips[-1], caption))
    return clips, metrics


# ---------------------------------------------------------------------------------------------
# dsa's offsets against the ground truth
# ---------------------------------------------------------------------------------------------


def offset_heads(model: torch.nn.Module) -> list[OffsetPredictor]:
    """The offset heads of a dsa model, block by block (none for the other kinds)."""
    return [m for m in model.modules() if isinstance(m, OffsetPredictor)]


def object_tokens(plan: dict, cfg: Config):
    """Per patch frame ``ti`` of a motion-set clip (its ``motion.json`` entry ``plan``): the
    tokens within 1.5 radii of the object's centre ``(H, W)`` bool, and its true velocity
    ``(vy, vx)`` in tokens per patch frame; frames where the object stands still or no token is
    near are left out."""
    pt, ph, pw = cfg.model.patch_size
    T, H, W = cfg.token_grid
    sy, sx = cfg.data.height / plan.get("height", cfg.data.height), cfg.data.width / plan.get("width", cfg.data.width)
    centres = np.asarray(plan["centres"], dtype=np.float64) * (sx, sy)  # (F, 2) x, y in pixels of the clip
    ys = (torch.arange(H, dtype=torch.float32) + 0.5) * ph
    xs = (torch.arange(W, dtype=torch.float32) + 0.5) * pw
    for ti in range(T - 1):
        f0, f1 = ti * pt, min((ti + 1) * pt, len(centres) - 1)
        v_px = centres[f1] - centres[f0]  # pixels per patch frame (x, y)
        v_tok = torch.tensor([v_px[1] / ph, v_px[0] / pw], dtype=torch.float32)
        cx, cy = centres[f0]
        near = ((ys[:, None] - cy) ** 2 + (xs[None, :] - cx) ** 2) <= (1.5 * plan["radius"] * sx) ** 2
        if bool(near.any()) and float(v_tok.norm()) >= 1e-6:
            yield ti, near, v_tok


def finished_runs(path: Path, settings: dict) -> dict[tuple[str, int], dict]:
    """The runs ``path`` (a study's ``--out``/runs.jsonl) holds, by (run name, seed); a line made
    with other settings is refused (a resumed comparison must be one comparison)."""
    done = {}
    if not path.is_file():
        return done
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec["settings"] != json.loads(json.dumps(settings)):
            raise SystemExit(f"{path}:{n} was made with other settings ({rec['settings']}) than this run "
                             f"({settings}); run without --resume, or with those settings")
        done[(rec["run"]["kind"], rec["run"]["seed"])] = rec["run"]
    return done
