"""A temporal-consistency score of a generated clip, in the spirit of VBench's, without a model.

VBench's *subject consistency* is the mean, over frames ``t >= 1``, of the cosine similarity of
DINO features of frame ``t`` with frame ``t - 1`` and with frame 0; its *background consistency*
the same with CLIP features of the whole frame. No feature network is available offline, and the
motion set's clips are one flat-coloured shape on a flat background, so the features are read
directly:

* **subject** of a frame: the largest 8-connected region of pixels that differ from the frame's
  median colour (its background) by more than ``tol`` in some channel, if it holds at least
  ``min_area`` pixels (as the motion metric's, in proportion to the frame's area). Whatever the
  model drew counts, prompted or not, as VBench's features do not ask what the subject is.
* **subject similarity** of frames ``a`` and ``b``: the IoU of their subjects' masks with the
  centroids brought together (shape and size kept; position is the trajectory's business), times
  ``1 - mean |colour_a - colour_b| / 255`` (appearance kept). A frame without a subject scores 0
  against any frame: an object that vanishes, or a clip that never draws one, is not consistent.
* **background similarity** of frames ``a`` and ``b``: ``1 - mean |a - b| / 255`` over the pixels
  that are background in both (outside either frame's foreground grown by one pixel).

``subject_consistency`` and ``background_consistency`` average ``(s(t, t-1) + s(t, 0)) / 2`` over
``t = 1 .. T-1`` as VBench does; ``temporal_consistency`` is their mean. 1 is a clip whose object
keeps its shape and colour and whose background holds still; the motion set's own clips score
close to it (tests/test_adaptation.py). Like VBench's, the score rewards a frozen clip: read it
beside the trajectory error.
"""

from __future__ import annotations

import math

import numpy as np

from megaslide_ray.evaluation.motion_score import as_uint8, largest_component

TOL = 40
"""A pixel is foreground when some channel differs from the frame's median colour by more than this."""


def subjects(frames: np.ndarray, tol: int = TOL, min_area: int | None = None) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per frame of uint8 ``(T, H, W, 3)``: ``(mask (H, W) bool, mean colour (3,))`` of its subject,
    or None where it has none (module docstring)."""
    f = as_uint8(frames).astype(np.float64)
    T, H, W = f.shape[:3]
    if min_area is None:  # the motion metric's: 12 px at 64x64, in proportion to the frame's area
        min_area = max(4, round(12 * H * W / 64 ** 2))
    out = []
    for t in range(T):
        med = np.median(f[t].reshape(-1, 3), axis=0)
        mask = largest_component(np.abs(f[t] - med).max(axis=-1) > tol)
        out.append((mask, f[t][mask].mean(axis=0)) if mask.sum() >= min_area else None)
    return out


def _centred_iou(a: np.ndarray, b: np.ndarray) -> float:
    """IoU of masks ``a`` and ``b`` after ``b`` is moved (by whole pixels) so its centroid meets ``a``'s."""
    ya, xa = np.nonzero(a)
    yb, xb = np.nonzero(b)
    dy, dx = round(ya.mean() - yb.mean()), round(xa.mean() - xb.mean())
    H, W = a.shape
    moved = np.zeros_like(b)
    ys, xs = yb + dy, xb + dx
    keep = (ys >= 0) & (ys < H) & (xs >= 0) & (xs < W)
    moved[ys[keep], xs[keep]] = True
    return float((a & moved).sum()) / float((a | moved).sum())


def _subject_similarity(a, b) -> float:
    if a is None or b is None:
        return 0.0
    return _centred_iou(a[0], b[0]) * max(0.0, 1.0 - float(np.abs(a[1] - b[1]).mean()) / 255.0)


def _grown(mask: np.ndarray) -> np.ndarray:
    out = mask.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            out |= np.roll(np.roll(mask, dy, axis=0), dx, axis=1)
    return out


def temporal_consistency(frames: np.ndarray, tol: int = TOL) -> dict:
    """``subject_consistency``, ``background_consistency`` and ``temporal_consistency`` (their
    mean) of one clip ``(T, H, W, 3)`` (uint8, or floats as ``motion_metric.as_uint8`` reads them);
    NaN for a clip of one frame (and the background's where no pixel is background in both frames)."""
    f = as_uint8(frames)
    T = f.shape[0]
    nan = {"subject_consistency": math.nan, "background_consistency": math.nan, "temporal_consistency": math.nan}
    if T < 2:
        return nan
    subj = subjects(f, tol)
    ff = f.astype(np.float64)
    fg = []
    for t in range(T):
        med = np.median(ff[t].reshape(-1, 3), axis=0)
        fg.append(_grown(np.abs(ff[t] - med).max(axis=-1) > tol))

    def background(a: int, b: int) -> float:
        bg = ~(fg[a] | fg[b])
        return 1.0 - float(np.abs(ff[a] - ff[b])[bg].mean()) / 255.0 if bg.any() else math.nan

    s = [(_subject_similarity(subj[t], subj[t - 1]) + _subject_similarity(subj[t], subj[0])) / 2 for t in range(1, T)]
    bgs = [(background(t, t - 1) + background(t, 0)) / 2 for t in range(1, T)]
    bgs = [b for b in bgs if not math.isnan(b)]
    subject = float(np.mean(s))
    back = float(np.mean(bgs)) if bgs else math.nan
    both = [v for v in (subject, back) if not math.isnan(v)]
    return {"subject_consistency": subject, "background_consistency": back,
            "temporal_consistency": float(np.mean(both))}
