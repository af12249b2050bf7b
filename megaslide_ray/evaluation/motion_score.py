"""A model-free motion-fidelity metric for a generated clip and the caption it was asked for.

The caption names the object, its direction and speed as the motion set writes them
(``megaslide_ray.motion``: "a red circle moving up-right fast on a black background, bouncing
off the edges"). Per frame, the object is found by its colour (every pixel within ``tol`` of the
caption's colour in each channel, and of those the largest 8-connected region), giving its area,
centroid, bounding box and mean colour.

* **detection_rate**: the fraction of frames where the object is found (a region of at least
  ``min_area`` pixels, by default 12 in a 64x64 frame and in proportion to other frame areas,
  at least 4; noise holding the colour in scattered pixels forms no such region).
* **Trajectory** against the caption, on the *visible* frames (found, with at least
  ``visible_fraction`` of the median area: a partly occluded object's centroid is biased, so
  those frames are left out). Between consecutive visible frames ``t`` and ``t + k`` the
  caption predicts the motion: from the centroid at ``t``, ``k`` steps of ``speed`` px/frame in
  the current direction, mirrored at the frame's edges (the object bounces when its bounding
  box reaches an edge, known to ``WALL_SLACK`` px; the current direction starts as the caption's
  and flips on an axis at each predicted bounce, so ground truth with bounces scores near zero).
  ``trajectory_error`` is the mean distance between observed and predicted position per frame
  step (px/frame), ``speed_error`` the absolute difference between the median observed speed
  and the caption's (px/frame), ``direction_error_deg`` the mean angle between the observed
  and the predicted displacement (steps that moved less than 0.5 px are counted as 90 deg).
  Captions state speeds in pixels of the motion set's 64-px-wide frames: a clip of another
  width is judged at speeds (and that 0.5 px) scaled by its width / 64.
* **Shape consistency** over the frames where the object is found: ``area_cv``, the robust
  coefficient of variation of the area (1.4826 x median absolute deviation / median: a few
  occluded frames do not move it), and ``colour_std``, the standard deviation of the object's
  mean colour over the visible frames (0..255, averaged over channels).
* **shape_match**: the fraction of visible frames where the caption's shape (circle, square,
  triangle) fits the object's mask best: each shape is drawn with the mask's area at its
  centroid and compared by intersection over union (``shape_ious``).
* **flicker**: VBench's temporal flicker without the score mapping: the mean absolute
  difference (0..255) of consecutive frames over the background only. Background = pixels that
  are within ``bg_tol`` of their frame's median colour in both frames, after dilating the
  foreground by 2 px (the object, an occluder and codec halos around them are excluded).

Lower is better for every number except ``detection_rate`` and ``shape_match``. The
ground-truth clips of the motion set score close to zero (and match their shape in every
frame; tests/test_motion.py); shuffled, frozen or jittered frames raise the trajectory numbers
well above it, and a caption naming another shape scores ``shape_match`` near zero.

    python -m megaslide_ray.motion_metric CLIP.mp4 [--caption TEXT] [--json]
    python -m megaslide_ray.motion_metric MANIFEST.parquet [--json]    # each row with its caption
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaslide_ray.data.demo import COLOURS, SHAPES, _shape_mask
from megaslide_ray.data.motion_set import DIRECTIONS, SPEEDS
from megaslide_ray.data.motion_set import WIDTH as MOTION_WIDTH

_CAPTION = re.compile(r"\b(" + "|".join(COLOURS) + r") (" + "|".join(SHAPES) + r") moving ("
                      + "|".join(sorted(DIRECTIONS, key=len, reverse=True)) + r") ("
                      + "|".join(sorted(SPEEDS, key=len, reverse=True)) + r")\b")


@dataclass(frozen=True)
class CaptionMotion:
    colour: str
    rgb: tuple[int, int, int]
    shape: str
    direction: str
    unit: tuple[float, float]   # (dx, dy), image coordinates (y down)
    speed_word: str
    speed: float                # px per frame


def parse_caption(caption: str) -> CaptionMotion:
    """The object, direction and speed a motion caption states; ``ValueError`` if it states none."""
    m = _CAPTION.search(caption.lower())
    if not m:
        raise ValueError(f"caption {caption!r} does not say '<colour> <shape> moving <direction> <speed>' "
                         f"(colours {list(COLOURS)}, directions {list(DIRECTIONS)}, speeds {list(SPEEDS)})")
    colour, shape, direction, speed = m.groups()
    return CaptionMotion(colour, COLOURS[colour], shape, direction, DIRECTIONS[direction], speed, SPEEDS[speed])


@dataclass(frozen=True)
class Track:
    area: np.ndarray        # (T,) the object's area in pixels (coverage-weighted); 0 where not found
    centroid: np.ndarray    # (T, 2) (x, y) in pixel-centre coordinates; NaN where not found
    lo: np.ndarray          # (T, 2) bounding box min (x, y), pixel edges; NaN where not found
    hi: np.ndarray          # (T, 2) bounding box max (x, y), pixel edges (exclusive)
    colour: np.ndarray      # (T, 3) mean colour of those pixels; NaN where not found
    mask: np.ndarray        # (T, H, W) bool, the hard mask (pixels within ``tol`` of the colour)


MIN_LUMA_CONTRAST = 30.0


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 8-connected region of a boolean ``(H, W)`` mask (ties: the first found in
    row-major order). Scattered pixels of the right colour, as in noise, form only tiny regions."""
    H, W = mask.shape
    label = np.zeros((H, W), dtype=np.int32)
    best, best_size, current = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask)):
        if label[y0, x0]:
            continue
        current += 1
        label[y0, x0] = current
        stack, size = [(int(y0), int(x0))], 0
        while stack:
            y, x = stack.pop()
            size += 1
            for ny in (y - 1, y, y + 1):
                for nx in (x - 1, x, x + 1):
                    if 0 <= ny < H and 0 <= nx < W and mask[ny, nx] and not label[ny, nx]:
                        label[ny, nx] = current
                        stack.append((ny, nx))
        if size > best_size:
            best, best_size = current, size
    return label == best if best else np.zeros_like(mask, dtype=bool)


def track_object(frames: np.ndarray, rgb: tuple[int, int, int], tol: int = 50, min_area: int = 12,
                 residual_tol: int = 80) -> Track:
    """Find the object of colour ``rgb`` in every frame of uint8 ``(T, H, W, 3)``.

    The object's pixels are the largest 8-connected region of the pixels within ``tol`` of
    ``rgb`` (the hard mask: bounding box, mean colour, ``min_area``; noise that happens to hold
    the colour in scattered pixels is not an object). Its area and centroid count, in the hard mask grown by one pixel, each
    pixel's coverage ``a`` by the object: the pixel read as ``bg + a (rgb - bg)`` with ``bg`` the
    frame's median colour (pixels off that line by more than ``residual_tol`` count 0), so an
    antialiased edge moves the centroid by fractions of a pixel. The coverage is read from the luma
(full resolution in H.264's yuv420p, where chroma is halved) when object and background differ in
luma by ``MIN_LUMA_CONTRAST``, else the hard mask alone is used."""
    f = np.asarray(frames)
    if f.ndim != 4 or f.shape[-1] != 3:
        raise ValueError(f"frames must be (T, H, W, 3), got {f.shape}")
    f = f.astype(np.float64) if f.dtype == np.uint8 else np.clip(np.round(f), 0, 255).astype(np.float64)
    T, H, W = f.shape[:3]
    obj = np.asarray(rgb, dtype=np.float64)
    masks = np.stack([largest_component(m) for m in np.abs(f - obj).max(axis=-1) <= tol])
    nan2 = np.full((T, 2), np.nan)
    area = np.zeros(T)
    centroid, lo, hi, colour = nan2.copy(), nan2.copy(), nan2.copy(), np.full((T, 3), np.nan)
    ys, xs = np.mgrid[0:H, 0:W].astype(np.float64) + 0.5
    for t in range(T):
        m = masks[t]
        if m.sum() < min_area:
            continue
        bg = np.median(f[t].reshape(-1, 3), axis=0)
        d = obj - bg
        region = m.copy()
        for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1), (1, 1), (1, -1), (-1, 1), (-1, -1)):
            region |= np.roll(np.roll(m, dy, axis=0), dx, axis=1)
        luma = np.array([0.299, 0.587, 0.114])
        if abs(float(d @ luma)) >= MIN_LUMA_CONTRAST:
            # Coverage from luma: video codecs keep luma at full resolution (chroma at half).
            p = f[t] - bg
            a = np.clip((p @ luma) / float(d @ luma), 0.0, 1.0)
            off = np.abs(p - a[..., None] * d).max(axis=-1) > residual_tol
            w = np.where(region & ~off, a, 0.0)
            w[m] = np.maximum(w[m], 1e-3)  # every hard-mask pixel counts
        else:  # too little contrast to read coverage: the hard mask is all there is
            w = m.astype(np.float64)
        area[t] = w.sum()
        centroid[t] = ((w * xs).sum() / area[t], (w * ys).sum() / area[t])
        yy, xx = np.nonzero(m)
        lo[t] = (xx.min(), yy.min())
        hi[t] = (xx.max() + 1, yy.max() + 1)
        colour[t] = f[t][m].mean(axis=0)
    return Track(area, centroid, lo, hi, colour, masks)


WALL_SLACK = 1.5
"""Pixels by which the metric lets a bounce happen early or late (the edge the centroid bounces
at is estimated from the object's bounding box, to about a pixel)."""


def _predict_axis(p: float, v: float, k: int, lo: float, hi: float) -> tuple[float, float]:
    """``k`` steps of velocity ``v`` from ``p`` on one axis, mirrored at ``lo``/``hi``:
    (position, velocity)."""
    for _ in range(k):
        p += v
        if lo < hi and p < lo:
            p, v = 2 * lo - p, -v
        elif lo < hi and p > hi:
            p, v = 2 * hi - p, -v
    return p, v


def _predict(p: np.ndarray, v: np.ndarray, k: int, lo: np.ndarray, hi: np.ndarray, obs: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """The caption's prediction ``k`` steps from ``p`` with velocity ``v`` (per axis, the edges
    moved by up to ``WALL_SLACK`` px to the choice nearest the observed position ``obs``):
    (position, velocity)."""
    pos, vel = np.empty(2), np.empty(2)
    for a in range(2):
        best = None
        for slack in np.linspace(-WALL_SLACK, WALL_SLACK, 13):
            q, w = _predict_axis(float(p[a]), float(v[a]), k, lo[a] - slack, hi[a] + slack)
            if best is None or abs(q - obs[a]) < abs(best[0] - obs[a]):
                best = (q, w)
        pos[a], vel[a] = best
    return pos, vel


_SHAPE_AREA = {"circle": math.pi, "square": 4.0, "triangle": 2.0}
"""Area of each shape of ``demo_data._shape_mask`` in units of its half-size squared."""


def shape_ious(mask: np.ndarray) -> dict[str, float]:
    """IoU of a hard object mask ``(H, W)`` with each shape of the same area drawn at the mask's
    centroid (a triangle's centroid lies a third of its half-size below its centre)."""
    H, W = mask.shape
    n = float(mask.sum())
    if n <= 0:
        return {s: 0.0 for s in SHAPES}
    ys, xs = np.nonzero(mask)
    cx, cy = float(xs.mean()) + 0.5, float(ys.mean()) + 0.5
    out = {}
    for s in SHAPES:
        r = math.sqrt(n / _SHAPE_AREA[s])
        ideal = _shape_mask(s, cx, cy - (r / 3.0 if s == "triangle" else 0.0), r, H, W)
        out[s] = float((ideal & mask).sum()) / float((ideal | mask).sum())
    return out


def flicker(frames: np.ndarray, bg_tol: int = 24, dilate: int = 2) -> float:
    """Mean absolute difference of consecutive frames over background pixels (0..255)."""
    f = np.asarray(frames).astype(np.float32)
    T = f.shape[0]
    if T < 2:
        return float("nan")
    med = np.median(f.reshape(T, -1, 3), axis=1)[:, None, None, :]
    fg = np.abs(f - med).max(axis=-1) > bg_tol
    grown = fg.copy()
    for dy in range(-dilate, dilate + 1):
        for dx in range(-dilate, dilate + 1):
            grown |= np.roll(np.roll(fg, dy, axis=1), dx, axis=2)
    diffs = []
    for t in range(T - 1):
        bg = ~(grown[t] | grown[t + 1])
        if bg.any():
            diffs.append(float(np.abs(f[t + 1] - f[t])[bg].mean()))
    return float(np.mean(diffs)) if diffs else float("nan")


def as_uint8(frames) -> np.ndarray:
    """A clip as uint8 ``(T, H, W, 3)``: uint8 as it is; floats in [-1, 1] (the model's scale,
    when any value is negative), in [0, 1] (when none exceeds 1), else in [0, 255]."""
    f = np.asarray(frames)
    if f.dtype == np.uint8:
        return f
    f = f.astype(np.float64)
    if f.size and f.min() < 0:
        f = (f + 1) * 127.5
    elif f.size and f.max() <= 1:
        f = f * 255
    return np.clip(np.round(f), 0, 255).astype(np.uint8)


def motion_fidelity(frames: np.ndarray, caption: str | CaptionMotion, tol: int = 50, min_area: int | None = None,
                    visible_fraction: float = 0.8) -> dict:
    """The metric of one clip (``(T, H, W, 3)``, uint8 or float: ``as_uint8``) against its caption: a dict with
    ``detection_rate``, ``trajectory_error``, ``speed_error``, ``direction_error_deg``,
    ``area_cv``, ``colour_std``, ``shape_match``, ``flicker``, ``steps`` (frame pairs judged) and the caption's
    ``colour``, ``direction`` and ``speed``. NaN where a number cannot be measured (e.g. fewer
    than two visible frames)."""
    want = parse_caption(caption) if isinstance(caption, str) else caption
    f = as_uint8(frames)
    T, H, W = f.shape[:3]
    if min_area is None:  # 12 px at the motion set's 64x64, in proportion to the frame's area
        min_area = max(4, round(12 * H * W / MOTION_WIDTH ** 2))
    tr = track_object(f, want.rgb, tol, min_area)
    found = tr.area > 0
    speed = want.speed * W / MOTION_WIDTH  # captions state px/frame of the motion set's frames
    out = {"colour": want.colour, "direction": want.direction, "speed": speed,
           "detection_rate": float(found.mean()) if T else float("nan")}
    nan = float("nan")
    if found.any():
        visible = found & (tr.area >= visible_fraction * np.median(tr.area[found]))
    else:
        visible = found
    idx = np.nonzero(visible)[0]
    traj, speeds, angles = [], [], []
    if len(idx) >= 2:
        # The centroid's walls: it bounces when the bounding box reaches an edge.
        below = np.median(tr.centroid[idx] - tr.lo[idx], axis=0)
        above = np.median(tr.hi[idx] - tr.centroid[idx], axis=0)
        lo, hi = below, np.array([W, H], dtype=np.float64) - above
        v = np.asarray(want.unit) * speed
        for a, b in zip(idx[:-1], idx[1:]):
            k = int(b - a)
            p = tr.centroid[a]
            pred, v_next = _predict(p, v, k, lo, hi, tr.centroid[b])
            obs = tr.centroid[b] - p
            traj.append(float(np.linalg.norm(tr.centroid[b] - pred)) / k)
            speeds.append(float(np.linalg.norm(obs)) / k)
            exp = pred - p
            if np.linalg.norm(obs) < 0.5 * k * W / MOTION_WIDTH or np.linalg.norm(exp) < 1e-9:
                angles.append(90.0 if np.linalg.norm(exp) >= 1e-9 else 0.0)
            else:
                cos = float(np.dot(obs, exp) / (np.linalg.norm(obs) * np.linalg.norm(exp)))
                angles.append(math.degrees(math.acos(max(-1.0, min(1.0, cos)))))
            v = v_next
    out["trajectory_error"] = float(np.mean(traj)) if traj else nan
    out["speed_error"] = abs(float(np.median(speeds)) - speed) if speeds else nan
    out["direction_error_deg"] = float(np.mean(angles)) if angles else nan
    out["steps"] = len(traj)
    seen = np.nonzero(found)[0]
    if len(seen) >= 2:
        areas = tr.area[seen]
        med = float(np.median(areas))
        out["area_cv"] = 1.4826 * float(np.median(np.abs(areas - med))) / med
        # the colour over the visible frames: a partly hidden object's edge pixels are mixed
        out["colour_std"] = float(tr.colour[idx].std(axis=0).mean()) if len(idx) >= 2 else nan
    else:
        out["area_cv"] = out["colour_std"] = nan
    # the shape, on the visible frames: which of the shapes, drawn with the object's area at its
    # centroid, overlaps its mask best
    best = [max(ious, key=ious.get) for ious in (shape_ious(tr.mask[t]) for t in idx)]
    out["shape_match"] = float(np.mean([b == want.shape for b in best])) if best else nan
    out["flicker"] = flicker(f)
    return out


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def read_video(path: str | Path) -> np.ndarray:
    """Every frame of a video file as uint8 RGB ``(T, H, W, 3)`` (PyAV)."""
    import av

    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} does not exist")
    with av.open(str(path)) as container:
        frames = [fr.to_ndarray(format="rgb24") for fr in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path} holds no video frames")
    return np.stack(frames)


KEYS = ("detection_rate", "trajectory_error", "speed_error", "direction_error_deg", "area_cv", "colour_std",
        "shape_match", "flicker")
