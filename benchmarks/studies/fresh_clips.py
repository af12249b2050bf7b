"""Clips rendered fresh for the unmemorisable adaptation study (``benchmarks.studies.fresh_adaptation``).

The motion set on disk holds 48 training clips; a study that trains on them for thousands of
steps measures memorisation. Here every training clip is **rendered when it is needed** from the
motion set's own generators (``megaslide_ray.data.motion_set``: its planners, trajectories and
antialiased renderer), deterministic per ``(seed, step, sample)`` and never the same clip twice
(each clip draws its start position from a continuous range; the tests check a long stream holds
no two equal clips at the motion set's 64x64; at 16x16 two starts a tenth of a pixel apart can round
to the same pixels). Nothing is written to disk and no codec runs: the pixels are the renderer's.

The combinations of (colour, shape, direction, speed) follow the motion set's split
(``motion.is_held_out``): training clips are only of **trained** combinations. The held-out
combinations are split again (``unseen_group``) into a half the learning-rate sweep may look at
and a half only the final report reads. Four sets of clips, each from its own random stream:

* ``train``: a stream per (seed, step), trained combinations;
* ``val``: the sweep's validation split, half new clips of trained combinations and half clips of
  the validation half of the unseen combinations;
* ``seen``: held out, new clips of trained combinations (never a training clip);
* ``unseen``: held out, clips of the other half of the unseen combinations (never trained on,
  never looked at by the sweep).

Each evaluation clip ``i`` carries a fixed noise and one t in t-bucket ``i % 4``
(``eval_inputs``), the same for every kind and seed, so differences between runs are paired.

``CLIPS`` names the clip kinds: ``simple`` (the simple variant: a large shape, no bounce) and
``long`` (the long-clip row: ``LONG_FRAMES`` frames of fast motion that bounces off the edges,
several times longer than a 3-frame window reaches). ``GRIDS`` names the token grids.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib

import numpy as np
import torch

from megaslide_ray.data import motion_set as M
from megaslide_ray.data.captions import empty_captions, set_caption
from megaslide_ray.data.demo import COLOURS, SHAPES

STREAMS = {"train": 1, "val": 2, "seen": 3, "unseen": 4, "samples": 5}
"""Each set's random stream (the first word of its ``np.random.default_rng`` key)."""
EVAL_SETS = ("val", "seen", "unseen")
EVAL_NOISE_SEED = 4646
"""The fixed noise and t of the evaluation clips are drawn from this seed, whatever the run's."""
BUCKETS = 4
LONG_FRAMES, LONG_RADIUS = 32, 9.0
LONG_SPEEDS = ("fast", "very fast")

GRIDS = {
    # name: (frames, height, width, patch, window); tokens = frames/pt * height/ph * width/pw
    "small": (8, 16, 16, "2,2,2", "3,3,3"),       # 4x8x8 = 256 tokens: tiny-motion's grid, for tests and pilots
    "2k": (8, 64, 64, "1,4,4", "3,7,7"),          # 8x16x16 = 2048 tokens at the motion set's 64x64
    "8k": (8, 64, 64, "1,2,2", "3,7,7"),          # 8x32x32 = 8192 tokens
    "long": (LONG_FRAMES, 64, 64, "2,4,4", "3,7,7"),  # 16x16x16 = 4096 tokens, 32 frames
    "long-small": (16, 16, 16, "2,2,2", "3,3,3"),  # 8x8x8 = 512 tokens: the long row's pilot
}


def grid_overrides(name: str) -> dict:
    """The config overrides of grid ``name`` (``GRIDS``)."""
    if name not in GRIDS:
        raise ValueError(f"grid {name!r} is not one of {sorted(GRIDS)}")
    frames, height, width, patch, window = GRIDS[name]
    return {"data.num_frames": frames, "data.height": height, "data.width": width, "model.patch_size": patch,
            "attention.window": window}


def grid_tokens(name: str) -> int:
    frames, height, width, patch, _ = GRIDS[name]
    pt, ph, pw = (int(x) for x in patch.split(","))
    return (frames // pt) * (height // ph) * (width // pw)


# ---------------------------------------------------------------------------------------------
# Combinations and plans
# ---------------------------------------------------------------------------------------------


def unseen_group(colour: str, shape: str, direction: str, speed: str) -> str:
    """``"val"`` or ``"unseen"``: which half of the held-out combinations one belongs to (a
    fixed hash of the combination, about half each)."""
    return "val" if zlib.crc32(f"{colour}|{shape}|{direction}|{speed}".encode()) % 2 == 0 else "unseen"


def combination_kind(combo: tuple[str, str, str, str]) -> str:
    """``"trained"``, ``"val"`` or ``"unseen"`` for a (colour, shape, direction, speed)."""
    return unseen_group(*combo) if M.is_held_out(*combo) else "trained"


@functools.lru_cache(maxsize=16)
def combinations(kind: str, speeds: tuple[str, ...]) -> tuple[tuple[str, str, str, str], ...]:
    """Every combination of ``kind`` (``combination_kind``) at the given speeds, in a fixed order."""
    out = [(c, s, d, v) for c in COLOURS for s in SHAPES for d in M.DIRECTIONS for v in speeds]
    return tuple(x for x in out if combination_kind(x) == kind)


CELL_CLASSES = {"train": (0, 1), "seen": (2,), "val": (3,), "unseen": (0, 1, 2, 3), "samples": (0, 1, 2, 3)}
"""Which start cells (class ``(jx + jy) % 4`` of cell ``(jx, jy)``) each stream draws from: a
training clip and a held-out clip of one combination never share a start cell."""


def start_range(combo, clips: str, size: int = M.WIDTH) -> tuple[float, float, float, float, float]:
    """``(lo_x, hi_x, lo_y, hi_y, radius)``: where a clip of ``combo`` may start (the simple variant:
    its whole path clear of the edges; long clips bounce: anywhere the shape fits)."""
    _, _, direction, speed = combo
    if clips == "long":
        r = LONG_RADIUS
        return r, size - r, r, size - r, r
    r, travel, (dx, dy) = M.SIMPLE_RADIUS, M.SPEEDS[speed] * (M.SIMPLE_FRAMES - 1), M.DIRECTIONS[direction]
    return (r + max(0.0, -dx * travel), size - r - max(0.0, dx * travel),
            r + max(0.0, -dy * travel), size - r - max(0.0, dy * travel), r)


@functools.lru_cache(maxsize=4096)
def start_cells(combo, clips: str, spacing: float, classes: tuple[int, ...]) -> tuple[tuple[float, float], ...]:
    """The start positions of ``combo`` on a lattice of ``spacing`` (one sample of the renderer's
    supersampling at the rendered size) in the given cell classes (``CELL_CLASSES``). Two clips of
    one combination at different cells are shifted by a whole sample: their pixels differ."""
    lo_x, hi_x, lo_y, hi_y, _ = start_range(combo, clips)
    off = 0.37 * spacing  # no edge of a shape at a lattice start sits exactly on a sample
    xs = [lo_x + off + j * spacing for j in range(int((hi_x - lo_x - off) // spacing) + 1)]
    ys = [lo_y + off + j * spacing for j in range(int((hi_y - lo_y - off) // spacing) + 1)]
    return tuple((x, y) for jy, y in enumerate(ys) for jx, x in enumerate(xs) if (jx + jy) % 4 in classes)


def nth_clip_start(pool: list, order: np.ndarray, n: int, clips: str, spacing: float, stream: str):
    """The ``n``-th clip of a stream that walks ``pool`` (the combinations, in ``order``) round
    after round: round ``r = n // len(pool)`` takes the ``r``-th cell of a fixed permutation of
    the combination's cells, so no two clips of the stream share a (combination, start)."""
    combo = pool[int(order[n % len(pool)])]
    cells = start_cells(combo, clips, spacing, CELL_CLASSES[stream])
    r = n // len(pool)
    if r >= len(cells):
        raise ValueError(f"{stream} clip {n}: the {len(cells)} starts of {combo} are used up at this size; "
                         f"render larger frames or use fewer clips")
    step = next(a for a in (7919, 104729, 1299709) if math.gcd(a, len(cells)) == 1)
    return combo, cells[(step * r + 3) % len(cells)]


def _plan(rng: np.random.Generator, combo, clips: str, size: int, start=None) -> dict:
    colour, shape, direction, speed = combo
    background = str(rng.choice(list(M.BACKGROUNDS)))
    lo_x, hi_x, lo_y, hi_y, r = start_range(combo, clips, size)
    frames = LONG_FRAMES if clips == "long" else M.SIMPLE_FRAMES
    if start is None:
        start = (float(rng.uniform(lo_x, hi_x)), float(rng.uniform(lo_y, hi_y)))
    centres = M.trajectory(start, direction, M.SPEEDS[speed], frames=frames, radius=r, height=size, width=size)
    bounces = bool(np.any(np.abs(np.diff(centres, axis=0) - np.asarray(M.DIRECTIONS[direction]) * M.SPEEDS[speed])
                          > 1e-6))
    caption = f"a {colour} {shape} moving {direction} {speed} on a {background} background"
    if bounces:
        caption += f", {M.BOUNCE_TEXT}"
    return dict(colour=colour, shape=shape, direction=direction, speed=speed, speed_px=M.SPEEDS[speed],
                background=background, start=start, radius=r, centres=centres.tolist(), bounces=bounces,
                occluder=None, caption=caption, num_frames=frames, height=size, width=size)


def speeds_of(clips: str) -> tuple[str, ...]:
    if clips not in ("simple", "long"):
        raise ValueError(f"clips {clips!r} is not 'simple' or 'long'")
    return LONG_SPEEDS if clips == "long" else M.SIMPLE_SPEEDS


@functools.lru_cache(maxsize=64)
def _order(stream: str, kind: str, clips: str, seed: int) -> np.ndarray:
    pool = combinations(kind, speeds_of(clips))
    return np.random.default_rng([STREAMS[stream], 99, seed]).permutation(len(pool))


def plan(stream: str, key: tuple[int, ...], clips: str = "simple", width: int = M.WIDTH) -> dict:
    """The plan of clip ``key`` of set ``stream`` (``STREAMS``): ``(seed, n)`` for ``train`` (the
    seed's ``n``-th clip), ``(n,)`` for the evaluation sets (``val`` alternates trained and
    validation-unseen combinations). The combination and start come from ``nth_clip_start`` on
    the lattice of the rendered ``width``, the background from the clip's own generator."""
    seed, n = (key[0], key[1]) if stream == "train" else (0, key[0])
    if stream == "val":
        kind, n = ("trained" if n % 2 == 0 else "val"), n // 2
    else:
        kind = "trained" if stream in ("train", "seen") else "unseen"
    pool = combinations(kind, speeds_of(clips))
    spacing = M.WIDTH / (width * M.SUPERSAMPLE)
    combo, start = nth_clip_start(pool, _order(stream, kind, clips, seed), n, clips, spacing, stream)
    return _plan(np.random.default_rng([STREAMS[stream], *key]), combo, clips, M.WIDTH, start)


def render(p: dict, frames: int, height: int, width: int) -> np.ndarray:
    """uint8 ``(frames, height, width, 3)`` of a plan drawn at ``(height, width)`` (its
    coordinates scaled from the plan's frame; ``frames`` must not exceed the plan's)."""
    if frames > p["num_frames"]:
        raise ValueError(f"{frames} frames asked of a clip of {p['num_frames']}: use a longer clip kind")
    sy, sx = height / p["height"], width / p["width"]
    centres = [(cx * sx, cy * sy) for cx, cy in p["centres"][:frames]]
    scaled = {**p, "centres": centres, "radius": p["radius"] * min(sx, sy), "height": height, "width": width,
              "num_frames": frames}
    return M.render_clip(scaled)


# ---------------------------------------------------------------------------------------------
# Batches and evaluation sets
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ClipSource:
    """What a study renders: the clip kind, the frames and size the model reads, the batch size
    and the caption width (``model.caption_max_bytes``)."""

    clips: str
    frames: int
    height: int
    width: int
    batch_size: int
    caption_bytes: int

    @classmethod
    def of(cls, cfg, clips: str) -> "ClipSource":
        d = cfg.data
        return cls(clips, int(d.num_frames), int(d.height), int(d.width), int(d.batch_size),
                   int(cfg.model.caption_max_bytes))

    def clip(self, stream: str, key: tuple[int, ...]) -> tuple[np.ndarray, str]:
        p = plan(stream, key, self.clips, self.width)
        return render(p, self.frames, self.height, self.width), p["caption"]

    def batch(self, seed: int, step: int) -> dict:
        """Training batch ``step`` of ``seed``: fresh clips of trained combinations, as a video
        decoder's batch (``video`` uint8 ``(B, F, H, W, 3)``, ``caption``, ``caption_len``)."""
        n0 = step * self.batch_size
        clips, captions = zip(*(self.clip("train", (seed, n0 + i)) for i in range(self.batch_size)))
        cap, cap_len = empty_captions(len(captions), self.caption_bytes)
        for i, c in enumerate(captions):
            set_caption(cap, cap_len, i, c)
        return {"video": np.stack(clips), "caption": cap, "caption_len": cap_len}


@dataclasses.dataclass
class EvalSet:
    """An evaluation set: ``x0`` ``(N, F, H, W, 3)`` in [-1, 1], its captions (and ``cond``,
    ``cond_len`` as the model reads them), and per clip a fixed ``x_t``, ``t`` and velocity target."""

    name: str
    x0: torch.Tensor
    captions: list[str]
    cond: np.ndarray
    cond_len: np.ndarray
    x_t: torch.Tensor
    t: torch.Tensor
    target: torch.Tensor

    @property
    def buckets(self) -> list[int]:
        return [i % BUCKETS for i in range(len(self.captions))]


def eval_inputs(x0: torch.Tensor, index: int) -> tuple[torch.Tensor, float, torch.Tensor]:
    """``(x_t, t, target)`` of evaluation clip ``index``: noise and t from ``EVAL_NOISE_SEED`` and
    the index alone, t in bucket ``index % BUCKETS``."""
    g = torch.Generator().manual_seed(EVAL_NOISE_SEED * 100003 + index)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float32)
    u = float(torch.rand((), generator=g, dtype=torch.float64))
    t = min(max((index % BUCKETS + u) / BUCKETS, 1e-4), 1 - 1e-4)
    return (1 - t) * x0 + t * noise, t, noise - x0


def eval_set(source: ClipSource, name: str, count: int, condition=None) -> EvalSet:
    """``count`` clips of set ``name`` (``EVAL_SETS``) with their fixed inputs; ``condition(captions)
    -> (cond, cond_len)`` turns captions into what the model reads (default: caption bytes)."""
    if name not in EVAL_SETS:
        raise ValueError(f"evaluation set {name!r} is not one of {EVAL_SETS}")
    clips, captions = zip(*(source.clip(name, (i,)) for i in range(count)))
    x0 = torch.from_numpy(np.stack(clips)).float() / 127.5 - 1.0
    x_t, t, target = zip(*(eval_inputs(x0[i], i) for i in range(count)))
    if condition is None:
        cond, cond_len = empty_captions(count, source.caption_bytes)
        for i, c in enumerate(captions):
            set_caption(cond, cond_len, i, c)
    else:
        cond, cond_len = condition(list(captions))
    return EvalSet(name, x0, list(captions), cond, cond_len, torch.stack(x_t), torch.tensor(t), torch.stack(target))


def sample_captions(seed: int, count: int, unseen: bool, clips: str = "simple") -> list[str]:
    """``count`` captions to sample for seed ``seed``: of trained combinations, or (``unseen``) of
    the report's unseen ones; each seed its own prompts, every kind of a seed the same."""
    out = []
    for j in range(count):
        rng = np.random.default_rng([STREAMS["samples"], seed, int(unseen), j])
        pool = combinations("unseen" if unseen else "trained", speeds_of(clips))  # a sampled prompt: any start
        out.append(_plan(rng, pool[int(rng.integers(len(pool)))], clips, M.WIDTH)["caption"])
    return out
