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

Clips
-----
The temporal start is drawn from ``default_rng([seed, p, 1])`` when ``data.random_crop``
(uniform over the starts that fit the whole clip), else 0. Frame indices are
``start + arange(F) * frame_stride``; **a video shorter than the clip's span loops**:
indices wrap modulo its frame count (a 10-frame video read as 16 frames plays 0..9, 0..5).
Frames are resized so the shorter side covers the target (aspect kept; bilinear with
antialias, in float) and center-cropped to ``(data.height, data.width)``.

Bad files
---------
A missing, zero-byte, unopenable or undecodable file never raises: it is skipped, logged
once per path (``logging.warning`` with the path and the reason) and counted. When every
row of the manifest has failed, ``next_batch`` raises a ``RuntimeError`` naming some of
them, instead of looping forever.

Caution (decord2 3.4): for some frame widths (16, 24, 32, 48, 96, 144, ... : where the
padded RGB row stride divides evenly by the width) decord reports a wrong channel count
(e.g. ``(64, 96, 4)``) and ``get_batch`` fails with "DECORDArrayCopyFromTo: The size must
exactly match". ``read_frames`` then reads frame by frame and strips the row padding.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from megaslide_ray.config import DataConfig
from megaslide_ray.manifest import ManifestEntry, read_manifest

logger = logging.getLogger(__name__)

MAX_REPORTED_PATHS = 8
"""``DecoderStats.skipped_paths`` keeps the first this-many distinct bad paths."""

_CROP_STREAM = 1  # third word of the crop RNG's seed: keeps it apart from the permutation's [seed, e]


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
    """Draws skipped because the file could not be decoded (a bad row drawn twice counts twice)."""
    skipped_paths: tuple[str, ...]
    """The first few distinct paths that were skipped."""
    frames_decoded: int
    """Clip frames produced for those batches (F per clip; a looped frame counts each time)."""
    decode_seconds: float
    """Time spent opening, decoding and resizing for those batches."""


class ClipUnreadable(Exception):
    """A video could not be turned into a clip; ``str(e)`` is the reason."""


# ---------------------------------------------------------------------------------------------
# Small pieces (pure functions, tested on their own)
# ---------------------------------------------------------------------------------------------


def clip_frame_indices(video_frames: int, num_frames: int, stride: int, start: int) -> np.ndarray:
    """``start + arange(num_frames) * stride``, wrapped modulo ``video_frames`` (short videos loop)."""
    return (start + np.arange(num_frames, dtype=np.int64) * stride) % video_frames


def clip_start(video_frames: int, num_frames: int, stride: int, seed: int, position: int, random: bool) -> int:
    """Temporal start of the clip drawn at ``position``: uniform over the starts that fit, else 0."""
    span = (num_frames - 1) * stride + 1
    if not random or video_frames <= span:
        return 0
    rng = np.random.default_rng([seed, position, _CROP_STREAM])
    return int(rng.integers(0, video_frames - span + 1))


def _strip_row_padding(frames: np.ndarray) -> np.ndarray:
    """Undo decord2's wrong channel count: ``(..., h, w, c)`` whose rows hold ``w*c`` bytes, of
    which the first ``w*3`` are the RGB pixels (the rest is the decoder's row alignment)."""
    if frames.shape[-1] == 3:
        return frames
    *lead, h, w, c = frames.shape
    if c < 3:
        raise ClipUnreadable(f"decord returned {c} channels per pixel")
    rows = frames.reshape(*lead, h, w * c)[..., : w * 3]
    return rows.reshape(*lead, h, w, 3)


def read_frames(reader, indices: np.ndarray) -> np.ndarray:
    """Frames ``indices`` of a ``decord.VideoReader`` as uint8 ``(len(indices), h, w, 3)``.

    Each distinct frame is decoded once, in increasing order (wrapped clips repeat frames).
    """
    unique, inverse = np.unique(indices, return_inverse=True)
    try:
        frames = reader.get_batch(unique.tolist()).asnumpy()
    except Exception as e:  # decord raises RuntimeError / DECORDError
        if "DECORDArrayCopyFromTo" not in str(e):
            raise
        # decord2 quirk (module docstring): per-frame reads work and keep the padding visible.
        frames = np.stack([reader[int(i)].asnumpy() for i in unique])
    return _strip_row_padding(frames)[inverse]


def resize_center_crop(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 ``(F, h, w, 3)`` -> uint8 ``(F, height, width, 3)``: cover-resize, then center crop."""
    f, h, w, _ = frames.shape
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    if (new_h, new_w) != (h, w):
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # (F, 3, h, w)
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
        frames = x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()  # (F, H', W', 3)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return np.ascontiguousarray(frames[:, top: top + height, left: left + width])


def encode_caption(text: str, max_bytes: int) -> bytes:
    """UTF-8 bytes of ``text`` cut to ``max_bytes`` without splitting a character."""
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------


class VideoDecoder:
    """Decodes batches of clips from a manifest, keeping ``data.prefetch`` batches ready.

    ``next_batch()`` returns (B = ``data.batch_size``, F = ``data.num_frames``):
    ``video`` uint8 (B, F, H, W, 3); ``caption`` uint8 (B, caption_max_bytes) zero-padded
    UTF-8; ``caption_len`` int32 (B,); ``index`` int64 (B,) manifest rows; ``position`` int64
    0-d, the data position after this batch; ``skipped`` int64 0-d, draws this decoder has
    skipped since it was built (a resumed decoder counts from 0; checkpoint the sum if needed).
    """

    def __init__(self, data: DataConfig, seed: int, caption_max_bytes: int, start_position: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need world_size >= 1 and 0 <= rank < world_size")
        if start_position < 0:
            raise ValueError(f"start_position={start_position} must be >= 0")
        if seed < 0:
            raise ValueError(f"seed={seed} must be >= 0 (numpy seeds the sample order with it)")
        if caption_max_bytes < 1:
            raise ValueError(f"caption_max_bytes={caption_max_bytes} must be >= 1")
        self.data = data
        self.seed = int(seed)
        self.caption_max_bytes = int(caption_max_bytes)
        self.rank, self.world_size = int(rank), int(world_size)
        if data.manifest:
            self.manifest_path = Path(data.manifest)
        else:
            from megaslide_ray.demo_data import ensure_demo_dataset

            self.manifest_path = ensure_demo_dataset()
        self.entries: list[ManifestEntry] = read_manifest(self.manifest_path)
        if not self.entries:
            raise ValueError(f"manifest {str(self.manifest_path)!r} has no rows; add videos to it or rebuild it "
                             f"with `python -m megaslide_ray.index VIDEO_DIR --out {self.manifest_path}`")

        # -- producer state (touched only by the prefetch thread once it runs)
        offset = (rank - start_position) % world_size
        self._next_position = start_position + offset  # first position >= start that belongs to this rank
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)
        self._bad_rows: dict[int, str] = {}  # row -> reason; failures are permanent, so never retried
        self._warned_paths: set[str] = set()
        self._produced = DecoderStats(position=start_position, batches=0, clips=0, skipped=0, skipped_paths=(),
                                      frames_decoded=0, decode_seconds=0.0)
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
        return payload

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

    def _row_at(self, position: int) -> int:
        n = len(self.entries)
        epoch, k = divmod(position, n)
        if epoch != self._perm_epoch:
            self._perm_epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(n)
        return int(self._perm[k])

    def _produce_batch(self) -> dict[str, np.ndarray]:
        d = self.data
        b, f = d.batch_size, d.num_frames
        video = np.empty((b, f, d.height, d.width, 3), dtype=np.uint8)
        caption = np.zeros((b, self.caption_max_bytes), dtype=np.uint8)
        caption_len = np.zeros((b,), dtype=np.int32)
        index = np.zeros((b,), dtype=np.int64)
        s = self._produced
        skipped, skipped_paths = s.skipped, list(s.skipped_paths)
        frames_decoded, seconds = s.frames_decoded, s.decode_seconds
        filled = 0
        last = self._next_position - self.world_size
        while filled < b:
            position = self._next_position
            self._next_position += self.world_size
            last = position
            row = self._row_at(position)
            entry = self.entries[row]
            if row not in self._bad_rows:
                t0 = time.perf_counter()
                try:
                    clip = self._decode_clip(entry.path, position)
                except ClipUnreadable as e:
                    self._mark_bad(row, entry.path, str(e))
                else:
                    video[filled] = clip
                    text = encode_caption(entry.caption, self.caption_max_bytes)
                    caption[filled, : len(text)] = np.frombuffer(text, dtype=np.uint8)
                    caption_len[filled] = len(text)
                    index[filled] = row
                    frames_decoded += f
                    filled += 1
                seconds += time.perf_counter() - t0
                if row not in self._bad_rows:
                    continue
            skipped += 1
            if entry.path not in skipped_paths and len(skipped_paths) < MAX_REPORTED_PATHS:
                skipped_paths.append(entry.path)
        self._produced = DecoderStats(position=last + 1, batches=s.batches + 1, clips=s.clips + b, skipped=skipped,
                                      skipped_paths=tuple(skipped_paths), frames_decoded=frames_decoded,
                                      decode_seconds=seconds)
        return {"video": video, "caption": caption, "caption_len": caption_len, "index": index,
                "position": np.array(last + 1, dtype=np.int64), "skipped": np.array(skipped, dtype=np.int64)}

    def _mark_bad(self, row: int, path: str, reason: str) -> None:
        self._bad_rows[row] = reason
        if path not in self._warned_paths:
            self._warned_paths.add(path)
            logger.warning("skipping video %s: %s", path, reason)
        if len(self._bad_rows) == len(self.entries):
            examples = "; ".join(f"{self.entries[r].path}: {why}" for r, why in list(self._bad_rows.items())[:3])
            raise RuntimeError(f"no row of manifest {str(self.manifest_path)!r} decodes (all {len(self.entries)} "
                               f"failed), e.g. {examples}. Check the files, or rebuild the manifest with "
                               f"`python -m megaslide_ray.index VIDEO_DIR --out {self.manifest_path}`")

    def _decode_clip(self, path: str, position: int) -> np.ndarray:
        """One clip as uint8 (F, H, W, 3); ``ClipUnreadable`` for any problem with the file."""
        import decord

        d = self.data
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise ClipUnreadable("missing file") from None
        except OSError as e:
            raise ClipUnreadable(f"cannot stat: {e.strerror or e}") from None
        if size == 0:
            raise ClipUnreadable("zero bytes")
        try:
            reader = decord.VideoReader(path, ctx=decord.cpu(0))
            video_frames = len(reader)
        except Exception as e:  # noqa: BLE001 - decord raises RuntimeError / DECORDError
            raise ClipUnreadable(f"decord could not open it ({_first_line(e)})") from None
        if video_frames < 1:
            raise ClipUnreadable("no frames")
        start = clip_start(video_frames, d.num_frames, d.frame_stride, self.seed, position, d.random_crop)
        indices = clip_frame_indices(video_frames, d.num_frames, d.frame_stride, start)
        try:
            frames = read_frames(reader, indices)
        except Exception as e:  # noqa: BLE001
            raise ClipUnreadable(f"decord could not decode frames {indices.min()}..{indices.max()} "
                                 f"({_first_line(e)})") from None
        finally:
            del reader
        if frames.ndim != 4 or frames.shape[0] != d.num_frames or min(frames.shape[1:3]) < 1:
            raise ClipUnreadable(f"decord returned frames of shape {frames.shape}")
        # Resizing is our code, outside the try: a bug here must surface, not become a skip.
        return resize_center_crop(frames, d.height, d.width)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
