"""Rows to buckets, and the order of bucketed batches (``data.buckets``; docs/buckets.md).

Assignment
----------
A row goes to the bucket nearest its aspect ratio (``|log(w/h) - log(W/H)|``) among the buckets
it has the frames for (``frames <=`` the clip frames it gives without looping at
``data.frame_stride`` or ``data.fps``: ``clip_frames``; an image has one frame); ties go to the bucket
of more frames, then of the larger area, then to the first listed. A video shorter than every
bucket goes to the nearest of the buckets of the fewest frames (``data.short_clips`` then loops
or skips it, as without buckets). The frames are resized to cover the bucket and centre-cropped
(``data.spatial_crop`` as usual). Assignment reads only the manifest's ``width``, ``height`` and
``num_frames``, so it is the same on every run.

Batch order
-----------
A *block* is one batch. In epoch ``e`` bucket ``j``'s rows are shuffled by
``default_rng([seed, e, 3, j])`` and cut into ``ceil(n_j / B)`` blocks of ``B`` rows (the last
one filled from the start of the same shuffle); the blocks of all buckets are then shuffled by
``default_rng([seed, e, 4])``. Data position ``p`` is block ``p % K`` of epoch ``p // K`` (``K``
blocks per epoch). A bucketed decoder's position counts blocks (batches), not clips: a decoder
built at a checkpoint's position continues exactly. A row that cannot be used is skipped and
counted, and its place is taken by the next rows of the same bucket's shuffle (after the
block's own), so a batch never mixes shapes; a bucket none of whose rows decodes loses its
blocks (each draw counted as skipped).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megaslide_ray.config.buckets import Bucket
from megaslide_ray.data.clips import is_image

_ROWS_STREAM = 3    # third word of a bucket's row shuffle seed: [seed, epoch, 3, bucket]
_BLOCKS_STREAM = 4  # third word of the block shuffle seed: [seed, epoch, 4]


def assign_bucket(width: int, height: int, frames: int, buckets: Sequence[Bucket]) -> int:
    """The index in ``buckets`` of the bucket a ``width x height`` clip of ``frames`` frames goes to
    (module docstring, "Assignment")."""
    if not buckets:
        raise ValueError("assign_bucket needs at least one bucket")
    fit = [i for i, b in enumerate(buckets) if b.frames <= frames]
    if not fit:
        fewest = min(b.frames for b in buckets)
        fit = [i for i, b in enumerate(buckets) if b.frames == fewest]
    aspect = math.log(width / height)

    def key(i: int) -> tuple:
        b = buckets[i]
        return (round(abs(aspect - math.log(b.width / b.height)), 9), -b.frames, -b.height * b.width, i)

    return min(fit, key=key)


class BucketSchedule:
    """The blocks of a bucketed run (module docstring, "Batch order"): ``bucket_of[row]`` is each
    row's bucket (-1: in none), ``batch_size`` rows per block."""

    def __init__(self, bucket_of: Sequence[int], num_buckets: int, batch_size: int, seed: int):
        self.members = [np.array([r for r, j in enumerate(bucket_of) if j == b], dtype=np.int64)
                        for b in range(num_buckets)]
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.blocks = [math.ceil(len(m) / self.batch_size) for m in self.members]
        self.per_epoch = sum(self.blocks)
        if self.per_epoch == 0:
            raise ValueError("no manifest row falls in any bucket")
        self._epoch, self._order, self._perms = -1, [], []

    def _load_epoch(self, e: int) -> None:
        if e == self._epoch:
            return
        self._perms = [m[np.random.default_rng([self.seed, e, _ROWS_STREAM, j]).permutation(len(m))]
                       for j, m in enumerate(self.members)]
        blocks = [(j, k * self.batch_size) for j, n in enumerate(self.blocks) for k in range(n)]
        order = np.random.default_rng([self.seed, e, _BLOCKS_STREAM]).permutation(len(blocks))
        self._epoch, self._order = e, [blocks[i] for i in order]

    def block(self, position: int) -> tuple[int, np.ndarray]:
        """``(bucket, rows)`` of the block at ``position``: ``rows`` is the bucket's shuffle from the
        block's first row on, wrapped once around (its first ``batch_size`` are the block; the rest
        stand in, in order, for rows that cannot be used)."""
        e, k = divmod(int(position), self.per_epoch)
        self._load_epoch(e)
        j, start = self._order[k]
        return j, np.roll(self._perms[j], -start)

    def bucket_sizes(self) -> list[int]:
        return [len(m) for m in self.members]


def clip_frames(num_frames: int, source_fps: float | None, stride: int = 1, fps: float = 0.0) -> int:
    """How many clip frames a video of ``num_frames`` frames gives without looping: every
    ``stride``-th frame, or resampled from ``source_fps`` to ``fps`` when both are known."""
    if fps > 0 and source_fps:
        return int((num_frames - 1) * fps / source_fps) + 1
    return (num_frames - 1) // max(1, stride) + 1


def row_buckets(entries: Sequence, buckets: Sequence[Bucket], where: str, stride: int = 1,
                fps: float = 0.0) -> list[int]:
    """Each manifest row's bucket (``assign_bucket``) from its ``width``, ``height`` and the clip
    frames its ``num_frames`` give at ``data.frame_stride`` / ``data.fps`` (``clip_frames``; an
    image without ``num_frames`` has one); ``ValueError`` naming the first row that lacks them
    (``where`` names the manifest)."""
    out = []
    for i, e in enumerate(entries):
        frames = e.num_frames if e.num_frames is not None else (1 if is_image(e.path) else None)
        if not e.width or not e.height or not frames:
            raise ValueError(f"manifest {where}: row {i} ({e.path}) has no width, height or num_frames, which "
                             f"data.buckets needs to pick its bucket; rebuild the manifest with "
                             f"`python -m megaslide_ray.index VIDEO_DIR --out {where}` (it records them)")
        usable = clip_frames(int(frames), e.fps, stride, fps)
        out.append(assign_bucket(int(e.width), int(e.height), usable, buckets))
    return out


def latent_row_buckets(rows: Sequence[dict], buckets: Sequence[Bucket], where: str) -> list[int]:
    """Each latent-manifest row's bucket: the one its pixel clip (``height``, ``width``,
    ``num_frames``, as ``precompute --buckets`` encoded it) is; ``ValueError`` naming the first
    row whose clip is no bucket."""
    index = {b: j for j, b in enumerate(buckets)}
    out = []
    for i, r in enumerate(rows):
        clip = Bucket(int(r.get("height") or 0), int(r.get("width") or 0), int(r.get("num_frames") or 0))
        if clip not in index:
            raise ValueError(f"latent manifest {where}: row {i} ({r['latent_path']}) holds a {clip} clip, which is "
                             f"none of data.buckets ({', '.join(str(b) for b in buckets)}); precompute with "
                             f"--buckets listing the same shapes as data.buckets")
        out.append(index[clip])
    return out
