"""VideoDecoder: manifest rows -> fixed-size clip batches, decoded ahead on a thread.

A plain class; ``pipelines`` wraps it with ``ray.remote``, and tests build it in-process.

Sample order (deterministic, resumable)
---------------------------------------
A *position* ``p`` counts draws from the manifest (``n`` rows) over all epochs. Position
``p`` is epoch ``e = p // n`` and row ``perm_e[p % n]`` with
``perm_e = numpy.random.default_rng([seed, e]).permutation(n)``. With ``world_size > 1``
a decoder takes the positions ``p`` with ``p % world_size == rank``.

Each batch reports ``position`` = one past the last position it drew; a decoder built with
``start_position`` equal to that value continues with exactly the batches that would have
followed. A row that fails to decode is *skipped*: its position is used up, the batch is
filled from the next positions, and the ``skipped`` counter grows. Skipping depends only on
the files, so it repeats identically on a resumed run.

Decoder pools
-------------
``pipelines.decoder_pool`` runs ``data.num_decoders`` of these with ``world_size`` = that number:
decoder ``i`` takes the positions ``p % n == i`` and batch slot ``u``'s batch comes from decoder
``u % n`` (a slot is one compute actor's batch of one step: with one compute actor, slot = step).
``first_step`` tells a decoder the slot of its first batch (its ``j``-th batch then fills slot
``first_step + j * world_size``), which is how ``faults.fault_point`` and ``BatchInfo.step`` name
steps. ``skipped_before`` and ``bad_rows`` carry what an earlier
decoder of the same stream knew (a resumed run, or a replacement for a decoder that hung or
died), so counts and skips continue exactly.

Clips
-----
Frame offsets within a clip are ``arange(F) * data.frame_stride``, or with ``data.fps > 0``
``floor(j * source_fps / data.fps + 0.5)`` (the video's own average frame rate; a video
without one is skipped). The clip *spans* ``offsets[-1] + 1`` source frames. Its start is
drawn from ``default_rng([seed, p, 1])`` when ``data.random_crop`` (uniform over the starts that
fit the whole span), else ``data.fixed_start``: 0 (``first``) or ``(frames - span) // 2``
(``center``). A video shorter than the span either loops (``data.short_clips = "loop"``:
indices wrap modulo its frame count, so a 10-frame video read as 16 frames plays 0..9, 0..5)
or is skipped (``"skip"``). Frames are resized so the shorter side covers the target (aspect
kept; bilinear with antialias, in float), then cropped to ``(data.height, data.width)``: at the
center, or (``data.spatial_crop = "random"``) at an offset drawn from ``default_rng([seed, p, 2])``,
the same for every frame of the clip.

Decoded-clip cache
------------------
With ``data.clip_cache_mb > 0`` each decoder keeps the clips it decoded (after resize and crop)
in memory, least recently used dropped first, and serves a clip drawn again from there: a later
epoch of a small dataset then decodes nothing. A clip is keyed by its manifest row, its frame
indices and its crop, and a file's frame count and rate are remembered with its size and
modification time, so a file changed on disk is decoded again. A cached clip is the same bytes
as a fresh decode (tests/test_data.py); only ``DecoderStats.clips_from_cache`` tells them apart.

Bad files
---------
A missing, zero-byte, unopenable or undecodable file, one of a single frame (or one too short,
with ``short_clips = "skip"``) never raises: it is skipped, logged once per path
(``logging.warning`` with the path and the reason) and counted. Once a decoder has tried
``min(BAD_FRACTION_MIN_ROWS, ceil(rows / world_size))`` distinct rows, it stops with a
``RuntimeError`` listing examples when more than ``data.max_bad_fraction`` of the distinct rows
it tried are unusable (each decoder judges the rows it drew: a random sample of the manifest).

A decode that never returns cannot be caught here (decord can spin holding the GIL). Instead
the decoder writes what it is about to decode (position, row, path) to ``status_path`` before
it enters decord; the driver's watchdog (``pipelines.decoder_pool``) reads it, kills a decoder
stuck on one file longer than ``data.decode_timeout_s``, and starts a replacement that knows the
file is bad.

Buckets
-------
With ``data.buckets`` (a list; ``validate`` resolves ``auto``), every batch holds clips of one
bucket's shape: rows are assigned to buckets from the manifest's sizes and lengths and batches
are *blocks* of one bucket, in the seeded order of ``megaslide_ray.data.buckets``. A position then
counts blocks, not clips (decoder ``i`` of a pool takes the blocks ``p % world_size == rank``;
``start_position`` continues exactly as above); a row that cannot be used is skipped and counted
and its slot filled from the next rows of the same bucket, each draw seeded by the block and the
draw's place in it. A latent manifest made by ``precompute --buckets`` is read the same way, each
row in the bucket of the pixel clip it encodes. docs/buckets.md has the rules.

Latent manifests
----------------
When ``data.manifest`` is a *latent manifest* (``megaslide_ray.data.latents``, made by ``python -m
megaslide_ray.precompute``), the decoder decodes no video: it loads each row's precomputed latents
and text embeddings and yields ``latents`` float32 (B, F', H', W', C), ``text`` float32
(B, 512, text_dim) zero-padded after each caption's valid tokens, ``text_len`` int32 (B,), and
the same ``index``, ``position`` and ``skipped`` as video batches. Sample order, ``start_position``,
pools, ``bad_rows`` and the bad-fraction limit are exactly as above (a row is a clip). A missing,
unreadable or mismatched latent or text file is a bad row: skipped, logged once and counted like
a bad video. Every row must have one latent shape (checked when the decoder starts:
``latents.single_latent_shape``). With ``latent_captions="bytes"`` (a ``videodit`` reading
latents, ``model.inputs = latents``) the text files are not read: each row's ``caption`` column
becomes ``caption`` / ``caption_len`` bytes as for video batches (``megaslide_ray.data.captions``). The video-specific options do not apply and are ignored:
``data.num_frames``, ``height``, ``width``, ``frame_stride``, ``fps``, ``random_crop``,
``fixed_start``, ``spatial_crop``, ``short_clips`` (the clip was fixed when it was precomputed), as
is ``caption_max_bytes`` unless ``latent_captions="bytes"``. ``DecoderStats.frames_decoded`` then
counts latent frames.

Caution (decord2 3.4): for some frame widths (16, 24, 32, 48, 96, 144, ... : where the
padded RGB row stride divides evenly by the width) decord reports a wrong channel count
(e.g. ``(64, 96, 4)``) and ``get_batch`` fails with "DECORDArrayCopyFromTo: The size must
exactly match". ``read_frames`` then reads frame by frame and strips the row padding.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from megaslide_ray.config import DataConfig
from megaslide_ray.config.buckets import parse_buckets
from megaslide_ray.data.buckets import BucketSchedule, latent_row_buckets, row_buckets
from megaslide_ray.data.captions import empty_captions, set_caption
from megaslide_ray.data.clips import ClipCache, ClipUnreadable, clip_indices, decode_clip, is_image, spatial_offset
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.data.image_condition import IMAGE_CONDITION_KEY, condition_arrays, load_condition
from megaslide_ray.data.latents import (
    TEXT_LEN,
    LatentFileError,
    is_latent_manifest,
    load_latent_sample,
    load_latents,
    read_latent_manifest,
    resolve,
    single_latent_shape,
)
from megaslide_ray.data.manifest import ManifestEntry, read_manifest
from megaslide_ray.runtime.faults import fault_point

logger = logging.getLogger(__name__)

MAX_REPORTED_PATHS = 8
"""``DecoderStats.skipped_paths`` keeps the first this-many distinct bad paths."""
BAD_FRACTION_MIN_ROWS = 20
"""Distinct rows a decoder tries before ``data.max_bad_fraction`` is judged (fewer if its share
of the manifest is smaller)."""


@dataclass(frozen=True)
class DecoderStats:
    """Counters as of the last batch handed out by ``next_batch``."""

    position: int
    """Data position after the last batch handed out (the ``start_position`` before any)."""
    batches: int
    """Batches handed out."""
    clips: int
    """Clips in those batches."""
    skipped: int
    """Draws skipped because the file could not be used, counting ``skipped_before`` (a bad row
    drawn twice counts twice)."""
    skipped_paths: tuple[str, ...]
    """The first few distinct paths that were skipped."""
    frames_decoded: int
    """Clip frames produced for those batches (F per clip; a looped frame counts each time)."""
    decode_seconds: float
    """Time spent opening, decoding and resizing for those batches."""
    clips_from_cache: int = 0
    """Clips of those batches served from the decoded-clip cache (``data.clip_cache_mb``)."""


@dataclass(frozen=True)
class BatchInfo:
    """What the driver needs to know about a batch without fetching its pixels."""

    step: int
    """The batch slot this batch fills (``first_step + j * world_size`` for the j-th batch): the
    training step with one compute actor (slots: ``pipelines/decoder_pool.py``)."""
    rank: int
    """The decoder that made it."""
    position: int
    """Data position after the batch (a decoder built with it continues exactly)."""
    skipped: int
    """This decoder stream's skipped draws up to and including this batch (with ``skipped_before``)."""
    rows: tuple[int, ...]
    """Manifest rows of the clips, in batch order."""


@dataclass
class _Tally:
    """The counters a batch in the making adds to (``DecoderStats``'s, as of the last batch)."""

    skipped: int
    frames_decoded: int
    seconds: float
    skipped_paths: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, s: DecoderStats) -> _Tally:
        return cls(s.skipped, s.frames_decoded, s.decode_seconds, list(s.skipped_paths))


# ---------------------------------------------------------------------------------------------
# Small pieces (pure functions, tested on their own)
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Decode status: what a decoder is doing, readable by the driver even when the decoder is frozen
# ---------------------------------------------------------------------------------------------


class DecodeStatus:
    """A small JSON file, replaced atomically: ``{"token", "seq", "state", "position", "row",
    "path"}``. ``state`` is ``started`` (constructor ran), ``decoding`` (inside decord for ``path``)
    or ``idle`` (between files). ``seq`` grows with every write, so a reader can tell progress."""

    def __init__(self, path: str | os.PathLike | None, token: str = ""):
        self.path = Path(path) if path else None
        self.token = token
        self.seq = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")

    def write(self, state: str, position: int = -1, row: int = -1, path: str = "") -> None:
        if self.path is None:
            return
        self.seq += 1
        record = {"token": self.token, "seq": self.seq, "state": state, "position": position, "row": row,
                  "path": path}
        # Replace, not rewrite in place: a reader never sees half a record, even if we are killed.
        self._tmp.write_text(json.dumps(record))
        os.replace(self._tmp, self.path)

    @staticmethod
    def read(path: str | os.PathLike) -> dict | None:
        try:
            return json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


class VideoDecoder:
    """Decodes batches of clips from a manifest, keeping ``data.prefetch`` batches ready.

    ``next_batch()`` returns (B = ``data.batch_size``, F = ``data.num_frames``):
    ``video`` uint8 (B, F, H, W, 3); ``caption`` uint8 (B, caption_max_bytes) zero-padded
    UTF-8 and ``caption_len`` int32 (B,) (see ``megaslide_ray.data.captions``); ``index`` int64 (B,)
    manifest rows; ``position`` int64 0-d, the data position after this batch; ``skipped``
    int64 0-d, draws this decoder's stream has skipped up to this batch (``skipped_before`` plus
    this decoder's own skips). From a latent manifest, ``latents``, ``text`` and ``text_len``
    replace ``video``, ``caption`` and ``caption_len`` (module docstring, "Latent manifests").
    ``next_batch_and_info()`` returns the same batch with its ``BatchInfo``.
    """

    def __init__(self, data: DataConfig, seed: int, caption_max_bytes: int, start_position: int = 0,
                 rank: int = 0, world_size: int = 1, *, first_step: int = 0, skipped_before: int = 0,
                 bad_rows: dict[int, str] | None = None, status_path: str | None = None,
                 status_token: str = "", latent_captions: str = "text") -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
        if start_position < 0:
            raise ValueError(f"start_position={start_position} must be >= 0")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0 (numpy seeds the sample order with it)")
        if caption_max_bytes < 1:
            raise ValueError(f"caption_max_bytes={caption_max_bytes} must be >= 1")
        if latent_captions not in ("text", "bytes"):
            raise ValueError(f"latent_captions={latent_captions!r} is not 'text' or 'bytes'")
        self.latent_captions = latent_captions
        if skipped_before < 0 or first_step < 0:
            raise ValueError(f"skipped_before={skipped_before}, first_step={first_step}: both must be >= 0")
        self.status = DecodeStatus(status_path, status_token)
        self.status.write("started")
        self.data = data
        self.seed = int(seed)
        self.caption_max_bytes = int(caption_max_bytes)
        self.rank, self.world_size = int(rank), int(world_size)
        self.first_step = int(first_step)
        if data.manifest:
            self.manifest_path = Path(data.manifest)
        else:

            self.manifest_path = ensure_demo_dataset(data.cache_dir or None)
        self.latent_rows: list[dict] | None = None  # a latent manifest's rows (None: videos)
        self.image_condition = None
        if is_latent_manifest(self.manifest_path):
            rows, meta = read_latent_manifest(self.manifest_path)
            self.latent_rows = rows
            # one shape, or with data.buckets one per bucket (_bucketing)
            self.latent_shape = None if data.buckets.strip() else single_latent_shape(rows, self.manifest_path)
            self.text_dim, self.text_len = int(meta["text_dim"]), int(meta.get("text_len", TEXT_LEN))
            self.image_condition = meta.get(IMAGE_CONDITION_KEY)  # an image-to-video cache: loaded with each clip
            # bad-row bookkeeping, logs and the watchdog's status name the latent file
            self.entries: list[ManifestEntry] = [
                ManifestEntry(path=str(resolve(self.manifest_path, r["latent_path"])), caption=r["caption"])
                for r in rows]
        else:
            self.entries = read_manifest(self.manifest_path)
        if not self.entries:
            raise ValueError(f"manifest {str(self.manifest_path)!r} has no rows; add videos to it or rebuild it "
                             f"with `python -m megaslide_ray.index VIDEO_DIR --out {self.manifest_path}`")
        self._bucket_latent: list[tuple[int, ...]] = []  # a bucketed latent manifest: each bucket's latent shape
        self._schedule, self._bucket_data = self._bucketing(data)
        n = len(self.entries)
        self._min_rows_judged = min(BAD_FRACTION_MIN_ROWS, math.ceil(n / self.world_size))

        # -- producer state (touched only by the prefetch thread once it runs, except mark_bad)
        offset = (rank - start_position) % world_size
        self._next_position = start_position + offset  # first position >= start that belongs to this rank
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        # row -> reason; failures are permanent, so never retried. Rows known bad from the start
        # (a replaced or resumed decoder) were logged by whoever found them.
        self._bad_rows: dict[int, str] = {int(r): why for r, why in (bad_rows or {}).items() if 0 <= int(r) < n}
        self._warned_paths: set[str] = {self.entries[r].path for r in self._bad_rows}
        self._tried_rows: set[int] = set()
        self._tried_bad = 0  # distinct rows in _tried_rows that are bad
        # decoded clips kept for later draws (data.clip_cache_mb), and what each cached row's file was
        self._clip_cache = ClipCache(int(data.clip_cache_mb * 2**20)) if data.clip_cache_mb > 0 else None
        self._video_meta: dict[int, tuple[tuple[int, int], int, float]] = {}  # row -> (size, mtime), frames, fps
        self._clips_from_cache = 0
        self._produced = DecoderStats(position=start_position, batches=0, clips=0, skipped=int(skipped_before),
                                      skipped_paths=(), frames_decoded=0, decode_seconds=0.0)
        # -- consumer state
        self._stats = self._produced
        self._error: BaseException | None = None
        self._closed = False
        # Bounded queue: the thread decodes at most ``prefetch`` batches ahead (plus the one in hand).
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, data.prefetch))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._prefetch_loop, name=f"VideoDecoder-prefetch-{rank}",
                                        daemon=True)
        self._thread.start()

    # -- public API ---------------------------------------------------------------------------

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next batch, in the deterministic order; re-raises a failure of the decode thread."""
        return self.next_batch_and_info()[0]

    def next_batch_and_info(self) -> tuple[dict[str, np.ndarray], BatchInfo]:
        """``(batch, info)``; the pipeline calls it with ``num_returns=2`` so the driver can read
        the small ``info`` while the pixels go straight to the compute actor."""
        if self._closed:
            raise RuntimeError("VideoDecoder.next_batch() called after close()")
        if self._error is not None:
            raise self._error
        while True:
            try:
                kind, payload, stats = self._queue.get(timeout=0.2)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the VideoDecoder prefetch thread stopped without a batch or an error") from None
        if kind == "error":
            self._error = payload
            raise payload
        self._stats = stats
        batch = payload
        info = BatchInfo(step=self.first_step + (stats.batches - 1) * self.world_size, rank=self.rank,
                         position=int(batch["position"]), skipped=int(batch["skipped"]),
                         rows=tuple(int(r) for r in batch["index"]))
        return batch, info

    def mark_bad(self, row: int, reason: str) -> None:
        """Another decoder found ``row`` unusable (its decode hung): skip it from now on. Not
        logged again here; the finder logged it."""
        row = int(row)
        if 0 <= row < len(self.entries) and row not in self._bad_rows:
            self._warned_paths.add(self.entries[row].path)
            self._bad_rows[row] = reason

    def stats(self) -> DecoderStats:
        return self._stats

    def close(self) -> None:
        """Stop the prefetch thread and drop decoded batches. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def __enter__(self) -> VideoDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- producer (prefetch thread) -------------------------------------------------------------

    def _prefetch_loop(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self._produce_batch()
                self._put(("batch", batch, self._produced))
        except BaseException as e:  # noqa: BLE001 - handed to the caller of next_batch
            self._put(("error", e, None))

    def _put(self, item: tuple) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _bucketing(self, data: DataConfig) -> tuple[BucketSchedule | None, list[DataConfig]]:
        """With ``data.buckets`` (module docstring, "Buckets"): the block order and each bucket's
        clip shape; ``(None, [])`` without."""
        text = data.buckets.strip()
        if not text:
            return None, []
        if text.lower() == "auto":
            raise ValueError("data.buckets='auto' reached a decoder unresolved; validate the config first "
                             "(megaslide_ray.config.validate lists the buckets it stands for)")
        buckets = parse_buckets(text)
        if self.latent_rows is not None:
            bucket_of = latent_row_buckets(self.latent_rows, buckets, str(self.manifest_path))
            self._bucket_latent = [tuple(self.latent_rows[bucket_of.index(j)]["latent_shape"]) if j in bucket_of
                                   else () for j in range(len(buckets))]
            for row, j in zip(self.latent_rows, bucket_of):
                if tuple(row["latent_shape"]) != self._bucket_latent[j]:
                    raise ValueError(f"latent manifest {self.manifest_path}: {row['latent_path']} has latent shape "
                                     f"{row['latent_shape']}, others of bucket {buckets[j]} "
                                     f"{self._bucket_latent[j]}; precompute it again")
        else:
            bucket_of = row_buckets(self.entries, buckets, str(self.manifest_path), data.frame_stride, data.fps)
        schedule = BucketSchedule(bucket_of, len(buckets), data.batch_size, self.seed)
        shapes = [replace(data, num_frames=b.frames, height=b.height, width=b.width) for b in buckets]
        return schedule, shapes

    def _row_at(self, position: int) -> int:
        n = len(self.entries)
        epoch, k = divmod(position, n)
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(n)
        return int(self._perm[k])

    def _produce_batch(self) -> dict[str, np.ndarray]:
        if self._schedule is not None:
            return self._produce_bucket_batch()
        out = self._empty_batch(self.data)
        b = self.data.batch_size
        index = np.zeros((b,), dtype=np.int64)
        tally = _Tally.of(self._produced)
        step = self.first_step + self._produced.batches * self.world_size
        filled = 0
        last = self._next_position - self.world_size
        while filled < b:
            position = self._next_position
            self._next_position += self.world_size
            last = position
            row = self._row_at(position)
            if self._draw(out, filled, row, position, self.data, step, tally):
                index[filled] = row
                filled += 1
        return self._finish_batch(out, index, last, tally)

    def _produce_bucket_batch(self) -> dict[str, np.ndarray]:
        """One block's batch (``megaslide_ray.data.buckets``): every clip of one bucket; a row that
        cannot be used gives its place to the next of the bucket's shuffle; a bucket where none
        decodes gives up its block and the next block of this decoder is drawn."""
        b = self.data.batch_size
        tally = _Tally.of(self._produced)
        step = self.first_step + self._produced.batches * self.world_size
        while True:
            position = self._next_position
            self._next_position += self.world_size
            bucket, rows = self._schedule.block(position)
            d = self._bucket_data[bucket]
            out = self._empty_batch(d, self._bucket_latent[bucket] if self._bucket_latent else None)
            index = np.zeros((b,), dtype=np.int64)
            filled, t, last_fill = 0, 0, 0
            while filled < b and t - last_fill < len(rows):
                row = int(rows[t % len(rows)])
                if self._draw(out, filled, row, (position << 32) + t, d, step, tally):
                    index[filled] = row
                    filled += 1
                    last_fill = t + 1
                t += 1
            if filled == b:
                return self._finish_batch(out, index, position, tally)

    def _empty_batch(self, d: DataConfig, latent_shape: tuple[int, ...] | None = None) -> dict[str, np.ndarray]:
        b = d.batch_size
        if self.latent_rows is not None:
            latent_shape = latent_shape or self.latent_shape
        if self.latent_rows is not None and self.latent_captions == "bytes":
            caption, caption_len = empty_captions(b, self.caption_max_bytes)
            return {"latents": np.empty((b, *latent_shape), dtype=np.float32), "caption": caption,
                    "caption_len": caption_len}
        if self.latent_rows is not None:
            out = {"latents": np.empty((b, *latent_shape), dtype=np.float32),
                   "text": np.zeros((b, self.text_len, self.text_dim), dtype=np.float32),
                   "text_len": np.zeros((b,), dtype=np.int32)}
            if self.image_condition:  # an image-to-video cache: the condition (and CLIP states) of each clip
                out.update(condition_arrays(self.image_condition, b, latent_shape))
            return out
        caption, caption_len = empty_captions(b, self.caption_max_bytes)
        return {"video": np.empty((b, d.num_frames, d.height, d.width, 3), dtype=np.uint8), "caption": caption,
                "caption_len": caption_len}

    def _draw(self, out: dict[str, np.ndarray], i: int, row: int, position: int, d: DataConfig, step: int,
              tally: _Tally) -> bool:
        """Try row ``row`` (drawn at ``position``) into slot ``i`` of ``out``; False when it is
        unusable (skipped: counted in ``tally``)."""
        entry = self.entries[row]
        if row not in self._bad_rows:
            t0 = time.perf_counter()
            # Written before decord is entered: if it never returns, the driver knows the file.
            self.status.write("decoding", position, row, entry.path)
            fault_point("decoder.mid_batch", step)
            try:
                tally.frames_decoded += self._fill(out, i, row, entry, position, d)
            except ClipUnreadable as e:
                self._mark_bad(row, entry.path, str(e))
            self.status.write("idle", position)
            tally.seconds += time.perf_counter() - t0
        self._note_tried(row)
        if row not in self._bad_rows:
            return True
        tally.skipped += 1
        if entry.path not in tally.skipped_paths and len(tally.skipped_paths) < MAX_REPORTED_PATHS:
            tally.skipped_paths.append(entry.path)
        return False

    def _finish_batch(self, out: dict[str, np.ndarray], index: np.ndarray, last: int, tally: _Tally
                      ) -> dict[str, np.ndarray]:
        s, b = self._produced, len(index)
        self._produced = DecoderStats(position=last + 1, batches=s.batches + 1, clips=s.clips + b,
                                      skipped=tally.skipped, skipped_paths=tuple(tally.skipped_paths),
                                      frames_decoded=tally.frames_decoded, decode_seconds=tally.seconds,
                                      clips_from_cache=self._clips_from_cache)
        return {**out, "index": index, "position": np.array(last + 1, dtype=np.int64),
                "skipped": np.array(tally.skipped, dtype=np.int64)}

    def _fill(self, out: dict[str, np.ndarray], i: int, row: int, entry: ManifestEntry, position: int,
              d: DataConfig) -> int:
        """Put row ``row`` into slot ``i`` of the batch ``out`` (clip shape ``d``); frames produced,
        or ``ClipUnreadable``."""
        if self.latent_rows is None:
            out["video"][i] = self._decode_clip(entry.path, position, row, d)
            set_caption(out["caption"], out["caption_len"], i, entry.caption)
            return d.num_frames
        if self.latent_captions == "bytes":
            try:
                latents = load_latents(self.manifest_path, self.latent_rows[row])
            except LatentFileError as e:
                raise ClipUnreadable(str(e)) from None
            out["latents"][i] = latents.numpy()
            set_caption(out["caption"], out["caption_len"], i, entry.caption)
            return int(latents.shape[0])
        try:
            latents, text = load_latent_sample(self.manifest_path, self.latent_rows[row], self.text_dim)
        except LatentFileError as e:
            raise ClipUnreadable(str(e)) from None
        if text.shape[0] > self.text_len:
            raise ClipUnreadable(f"{text.shape[0]} text tokens, more than the manifest's text_len={self.text_len}")
        if self.image_condition:
            self._fill_condition(out, i, row)
        out["latents"][i] = latents.numpy()
        out["text"][i, : text.shape[0]] = text.numpy()
        out["text_len"][i] = text.shape[0]
        return int(latents.shape[0])

    def _fill_condition(self, out: dict[str, np.ndarray], i: int, row: int) -> None:
        """An image-to-video cache's condition (and CLIP states) of row ``row`` into slot ``i``."""
        try:
            condition, image = load_condition(self.manifest_path, self.latent_rows[row], self.image_condition)
        except LatentFileError as e:
            raise ClipUnreadable(str(e)) from None
        out["condition"][i] = condition.numpy()
        if image is not None:
            out["image"][i] = image.numpy()

    def _note_tried(self, row: int) -> None:
        """Count distinct rows tried and stop when too many of them are unusable."""
        if row in self._tried_rows:
            return
        self._tried_rows.add(row)
        self._tried_bad += row in self._bad_rows
        tried, bad = len(self._tried_rows), self._tried_bad
        n = len(self.entries)
        if bad == n:
            raise RuntimeError(f"no row of manifest {str(self.manifest_path)!r} decodes (all {n} failed), e.g. "
                               f"{self._examples(1)}. {self._advice()}")
        limit = self.data.max_bad_fraction
        if tried >= self._min_rows_judged and bad > limit * tried:
            raise RuntimeError(
                f"{bad} of the {tried} distinct manifest rows decoder {self.rank} tried are unusable "
                f"({100 * bad / tried:.0f}% > data.max_bad_fraction={limit}), e.g. {self._examples()}. "
                f"{self._advice()}, or raise data.max_bad_fraction")

    def _advice(self) -> str:
        if self.latent_rows is not None:
            return ("Run `python -m megaslide_ray.precompute` again with the arguments that made the manifest (it "
                    "recomputes missing or damaged files)")
        return (f"Check the files, or rebuild the manifest with `python -m megaslide_ray.index VIDEO_DIR --out "
                f"{self.manifest_path}` (it leaves unusable files out)")

    def _examples(self, k: int = 3) -> str:
        bad = [r for r in self._tried_rows if r in self._bad_rows] or list(self._bad_rows)
        more = f" (and {len(bad) - k} more)" if len(bad) > k else ""
        return "; ".join(f"{self.entries[r].path}: {self._bad_rows[r]}" for r in sorted(bad)[:k]) + more

    def _mark_bad(self, row: int, path: str, reason: str) -> None:
        self._bad_rows[row] = reason
        if path not in self._warned_paths:
            self._warned_paths.add(path)
            logger.warning("skipping %s %s: %s", "video" if self.latent_rows is None else "latent file", path,
                           reason)

    def _decode_clip(self, path: str, position: int, row: int, d: DataConfig) -> np.ndarray:
        """One clip as uint8 (F, H, W, 3), from the decoded-clip cache when it holds it;
        ``ClipUnreadable`` for any problem with the file."""
        cache = self._clip_cache
        if cache is None or is_image(path):  # an image decodes in one read: nothing to save
            return decode_clip(path, d, self.seed, position).frames
        try:  # the file's identity: a file changed on disk is decoded again
            st = os.stat(path)
            stamp = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None  # decode_clip says what is wrong with it
        offset = spatial_offset(self.seed, position, d.spatial_crop == "random")
        known = self._video_meta.get(row)
        if stamp is not None and known is not None and known[0] == stamp:
            indices = clip_indices(known[1], known[2], d, self.seed, position)
            frames = cache.get((row, indices.tobytes(), offset))
            if frames is not None:
                self._clips_from_cache += 1
                return frames  # copied into the batch by the caller: the cache's copy stays private
        clip = decode_clip(path, d, self.seed, position)
        if stamp is not None:
            self._video_meta[row] = (stamp, clip.video_frames, clip.source_fps)
            cache.put((row, clip.indices.tobytes(), offset), clip.frames)
        return clip.frames


