"""A motion dataset: one shape moving at a stated speed and direction, for measuring motion.

Each clip (64x64, 16 frames at 8 fps, H.264 through ``demo_data.write_video``) shows one shape
(circle, square, triangle) of one colour on a dark background, moving in one of 8 compass
directions at one of four speeds, in pixels per frame:

==============  =====  =============================================================
caption word    px/f   with ``tiny``'s 2x4x4 patches (2 frames, 4 px per token)
==============  =====  =============================================================
``slowly``      1      0.5 token per patch frame
``at medium     2.5    1.25 tokens
speed``
``fast``        5      2.5 tokens: beyond a 3x3x3 window's reach of one token
``very fast``   8      4 tokens
==============  =====  =============================================================

The shape bounces off the frame's edges (a mirror reflection: the direction changes), and in
some clips a gray bar drifts across in front of it (an occlusion). Captions state all of it:
"a red circle moving up-right fast on a black background, bouncing off the edges, passing
behind a gray bar". ``motion_metric.parse_caption`` reads them back.

**The simple variant** (``variant="simple"``, ``<cache>/motion-simple-v1``, ``train --demo
motion-simple``) is the set a small model learns to draw within minutes on a CPU: one large shape
(half-size 14 px instead of 6) moving in one of the 8 directions ``slowly``, ``at medium speed``
or ``fast`` for 8 frames, never reaching an edge (no bounce) and never occluded, so every clip's
caption states all of its motion. Its captions read like the full set's without the extras.

The set is split by **held-out combinations**: a (colour, shape, direction, speed) combination
is either in the validation split or in the training split, never both (``is_held_out``), and
the two splits draw from different seeds. It is written to ``<cache>/motion-v1`` (``<cache>``
as for the demo set) with ``train.parquet`` and ``val.parquet`` (video manifests) and
``motion.json`` (per clip: the plan and the shape's centre in every frame), built in a
temporary directory and renamed into place (``data.folders``).

    python -m megaslide_ray.motion [--variant simple] [--out DIR] [--num-train N] [--num-val M]
    python -m megaslide_ray.train --demo motion      # trains on it, validates on the held-out split
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from megaslide_ray.data.demo import COLOURS, SHAPES, _shape_mask, write_video
from megaslide_ray.data.folders import build_folder_atomically, cache_root
from megaslide_ray.data.manifest import ManifestEntry, write_manifest

MOTION_VERSION = "motion-v1"
SIMPLE_VERSION = "motion-simple-v1"
MOTION_SEED = 20261130
NUM_FRAMES, HEIGHT, WIDTH, FPS = 16, 64, 64, 8
RADIUS = 6.0                      # the shape's half-size in pixels
DEFAULT_TRAIN, DEFAULT_VAL = 48, 12
TRAIN_MANIFEST, VAL_MANIFEST, GROUND_TRUTH = "train.parquet", "val.parquet", "motion.json"

DIRECTIONS: dict[str, tuple[float, float]] = {  # (dx, dy), image coordinates (y down)
    "right": (1.0, 0.0), "left": (-1.0, 0.0), "down": (0.0, 1.0), "up": (0.0, -1.0),
    "up-right": (math.sqrt(0.5), -math.sqrt(0.5)), "up-left": (-math.sqrt(0.5), -math.sqrt(0.5)),
    "down-right": (math.sqrt(0.5), math.sqrt(0.5)), "down-left": (-math.sqrt(0.5), math.sqrt(0.5)),
}
SPEEDS: dict[str, float] = {"slowly": 1.0, "at medium speed": 2.5, "fast": 5.0, "very fast": 8.0}
"""Caption phrase -> pixels per frame."""
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "black": (0, 0, 0), "dark blue": (15, 20, 70), "dark green": (15, 60, 25), "dark red": (70, 10, 10),
}
OCCLUDER_RGB = (128, 128, 128)
OCCLUDER_WIDTH = 8
CLEAR_STEPS = 3                   # no bounce in a clip's first steps: its start shows the caption's direction
BOUNCE_TEXT, OCCLUDER_TEXT = "bouncing off the edges", "passing behind a gray bar"
SIMPLE_RADIUS, SIMPLE_FRAMES = 14.0, 8  # the simple variant: a larger shape, 8 frames
SIMPLE_SPEEDS = ("slowly", "at medium speed", "fast")  # at 8 px/frame the shape reaches an edge within 8 frames


def is_held_out(colour: str, shape: str, direction: str, speed: str) -> bool:
    """Whether a combination belongs to the validation split (about one in five)."""
    c, s = list(COLOURS).index(colour), SHAPES.index(shape)
    d, v = list(DIRECTIONS).index(direction), list(SPEEDS).index(speed)
    return (3 * c + 5 * s + 7 * d + 11 * v) % 5 == 0


def reflect(p: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``p`` folded into ``[lo, hi]`` by mirror reflection, and the sign (+1/-1) the
    velocity has there (a triangle wave)."""
    span = hi - lo
    q = np.mod(p - lo, 2 * span)
    back = q > span
    return lo + np.where(back, 2 * span - q, q), np.where(back, -1.0, 1.0)


def trajectory(start: tuple[float, float], direction: str, speed: float, frames: int = NUM_FRAMES,
               radius: float = RADIUS, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """The centre ``(frames, 2)`` (x, y) of a shape of half-size ``radius`` starting at ``start``
    and moving ``speed`` px/frame towards ``direction``, bouncing off the edges."""
    dx, dy = DIRECTIONS[direction]
    t = np.arange(frames, dtype=np.float64)
    x, _ = reflect(start[0] + dx * speed * t, radius, width - radius)
    y, _ = reflect(start[1] + dy * speed * t, radius, height - radius)
    return np.stack([x, y], axis=1)


def _draw_combination(rng: np.random.Generator, held_out: bool, speeds) -> tuple[str, str, str, str]:
    """A (colour, shape, direction, speed) combination of the split ``held_out`` says."""
    while True:
        colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
        direction, speed = str(rng.choice(list(DIRECTIONS))), str(rng.choice(list(speeds)))
        if is_held_out(colour, shape, direction, speed) == held_out:
            return colour, shape, direction, speed


def plan_clip(rng: np.random.Generator, held_out: bool) -> dict:
    """A random clip description whose combination is held out (``held_out``) or not."""
    colour, shape, direction, speed = _draw_combination(rng, held_out, SPEEDS)
    background = str(rng.choice(list(BACKGROUNDS)))
    want = np.asarray(DIRECTIONS[direction]) * SPEEDS[speed]
    while True:  # the caption's direction holds for the first CLEAR_STEPS steps at least
        start = (float(rng.uniform(RADIUS, WIDTH - RADIUS)), float(rng.uniform(RADIUS, HEIGHT - RADIUS)))
        centres = trajectory(start, direction, SPEEDS[speed])
        changed = np.any(np.abs(np.diff(centres, axis=0) - want) > 1e-6, axis=1)
        if not changed[:CLEAR_STEPS].any():
            break
    bounces = bool(changed.any())
    occluder = None
    if rng.random() < 0.35:  # a bar drifting across, in front of the shape
        x0 = float(rng.uniform(0, WIDTH - OCCLUDER_WIDTH))
        occluder = {"x0": x0, "speed": float(rng.choice([-1.0, -0.5, 0.5, 1.0])), "width": OCCLUDER_WIDTH}
    caption = f"a {colour} {shape} moving {direction} {speed} on a {background} background"
    extras = ([BOUNCE_TEXT] if bounces else []) + ([OCCLUDER_TEXT] if occluder else [])
    if extras:
        caption += ", " + ", ".join(extras)
    return dict(colour=colour, shape=shape, direction=direction, speed=speed, speed_px=SPEEDS[speed],
                background=background, start=start, radius=RADIUS, centres=centres.tolist(), bounces=bounces,
                occluder=occluder, caption=caption, num_frames=NUM_FRAMES, height=HEIGHT, width=WIDTH)


def plan_simple_clip(rng: np.random.Generator, held_out: bool) -> dict:
    """A clip of the simple variant: one shape of half-size ``SIMPLE_RADIUS`` that stays clear of
    the edges for all ``SIMPLE_FRAMES`` frames (its start is drawn from the positions that allow
    it), no occluder, a caption without extras."""
    colour, shape, direction, speed = _draw_combination(rng, held_out, SIMPLE_SPEEDS)
    background = str(rng.choice(list(BACKGROUNDS)))
    r, travel = SIMPLE_RADIUS, SPEEDS[speed] * (SIMPLE_FRAMES - 1)
    dx, dy = DIRECTIONS[direction]
    # the start range on each axis that keeps the whole path inside [r, size - r]
    lo_x, hi_x = r + max(0.0, -dx * travel), WIDTH - r - max(0.0, dx * travel)
    lo_y, hi_y = r + max(0.0, -dy * travel), HEIGHT - r - max(0.0, dy * travel)
    start = (float(rng.uniform(lo_x, hi_x)), float(rng.uniform(lo_y, hi_y)))
    centres = trajectory(start, direction, SPEEDS[speed], frames=SIMPLE_FRAMES, radius=r)
    caption = f"a {colour} {shape} moving {direction} {speed} on a {background} background"
    return dict(colour=colour, shape=shape, direction=direction, speed=speed, speed_px=SPEEDS[speed],
                background=background, start=start, radius=r, centres=centres.tolist(), bounces=False,
                occluder=None, caption=caption, num_frames=SIMPLE_FRAMES, height=HEIGHT, width=WIDTH)


VARIANTS = {"motion": (MOTION_VERSION, plan_clip), "simple": (SIMPLE_VERSION, plan_simple_clip)}
"""``variant`` -> (folder name, clip planner) of ``ensure_motion_dataset``."""


def occluder_span(occluder: dict, t: int) -> tuple[int, int]:
    """Columns ``[a, b)`` the bar covers in frame ``t`` (it bounces off the edges too)."""
    w = occluder["width"]
    x, _ = reflect(np.array([occluder["x0"] + occluder["speed"] * t]), 0.0, WIDTH - w)
    a = int(round(float(x[0])))
    return a, a + w


SUPERSAMPLE = 4  # shapes are drawn antialiased: coverage of 4x4 samples per pixel


def coverage(shape: str, cx: float, cy: float, r: float, height: int, width: int, k: int = SUPERSAMPLE) -> np.ndarray:
    """Float (H, W) fraction of each pixel the shape covers (``k`` x ``k`` samples), so the
    centre moves smoothly by fractions of a pixel."""
    fine = _shape_mask(shape, cx * k, cy * k, r * k, height * k, width * k)
    return fine.reshape(height, k, width, k).mean(axis=(1, 3))


def render_clip(plan: dict) -> np.ndarray:
    """uint8 ``(F, H, W, 3)`` frames of a planned clip."""
    f, h, w = plan["num_frames"], plan["height"], plan["width"]
    bg = np.asarray(BACKGROUNDS[plan["background"]], dtype=np.float64)
    fg = np.asarray(COLOURS[plan["colour"]], dtype=np.float64)
    frames = np.empty((f, h, w, 3), dtype=np.uint8)
    for t, (cx, cy) in enumerate(plan["centres"]):
        a = coverage(plan["shape"], cx, cy, plan["radius"], h, w)[..., None]
        frames[t] = np.round(bg + a * (fg - bg)).astype(np.uint8)
        if plan["occluder"]:
            x0, x1 = occluder_span(plan["occluder"], t)
            frames[t, :, x0:x1] = OCCLUDER_RGB
    return frames


def _build(target: Path, num_train: int, num_val: int, planner=plan_clip) -> None:
    truth = {}
    for split, n, manifest_name, seed in (("train", num_train, TRAIN_MANIFEST, MOTION_SEED),
                                          ("val", num_val, VAL_MANIFEST, MOTION_SEED + 1)):
        rng = np.random.default_rng(seed)
        rows = []
        for i in range(n):
            plan = planner(rng, held_out=split == "val")
            name = f"{split}_{i:04d}.mp4"
            write_video(target / name, render_clip(plan), FPS)
            rows.append(ManifestEntry(path=name, caption=plan["caption"], num_frames=plan["num_frames"],
                                      fps=float(FPS), width=WIDTH, height=HEIGHT))
            truth[name] = plan
        write_manifest(rows, target / manifest_name)
    (target / GROUND_TRUTH).write_text(json.dumps(truth, indent=1))


def ensure_motion_dataset(cache_dir: str | Path | None = None, num_train: int = DEFAULT_TRAIN,
                          num_val: int = DEFAULT_VAL, variant: str = "motion") -> tuple[Path, Path]:
    """``(train manifest, val manifest)`` of the motion set (``variant="simple"``: its simple
    variant), generating it on first use in ``<cache_dir>/motion-v1`` (``motion-simple-v1``;
    ``...-n<train>-<val>`` for other sizes)."""
    if num_train < 1 or num_val < 1:
        raise ValueError(f"num_train={num_train}, num_val={num_val}: both must be >= 1")
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {sorted(VARIANTS)}")
    version, planner = VARIANTS[variant]
    name = version if (num_train, num_val) == (DEFAULT_TRAIN, DEFAULT_VAL) else f"{version}-n{num_train}-{num_val}"
    final = cache_root(cache_dir) / name
    build_folder_atomically(final, GROUND_TRUTH, lambda folder: _build(folder, num_train, num_val, planner),
                            f"the motion dataset ({num_train} + {num_val} clips)")
    return final / TRAIN_MANIFEST, final / VAL_MANIFEST


def load_ground_truth(manifest: str | Path) -> dict:
    """The ``motion.json`` beside a motion manifest: video file name -> plan (with ``centres``)."""
    return json.loads((Path(manifest).parent / GROUND_TRUTH).read_text())
