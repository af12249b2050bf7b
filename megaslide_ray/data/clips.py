"""From a video row to a clip: the rules every reader of videos shares.

The decoder actors (training), the validation set and ``precompute`` all cut clips the same
way (an image, ``IMAGE_EXTENSIONS``, is a still clip: its one frame repeated, ``read_image``): which frames (``clip_offsets``, ``clip_start``: consecutive or resampled to
``data.fps``, a random or fixed start, looping a video shorter than the clip), which crop
(``resize_crop``: the shorter side resized to cover the clip, then a random or centre crop),
and ``decode_clip``, which does all of it for one row. ``ClipCache`` keeps decoded clips for a
decoder that draws them again (``data.clip_cache_mb``)."""

from __future__ import annotations

import math
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megaslide_ray.config import DataConfig

_CROP_STREAM = 1     # third word of the temporal-crop RNG's seed: apart from the permutation's [seed, e]


_SPATIAL_STREAM = 2  # third word of the spatial-crop RNG's seed


class ClipUnreadable(Exception):
    """A video could not be turned into a clip; ``str(e)`` is the reason."""


IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
"""Still images: a one-frame clip (looped to the clip's length when it has more frames)."""


def is_image(path: str) -> bool:
    """By extension (case-insensitive): ``IMAGE_EXTENSIONS``."""
    return os.path.splitext(str(path))[1].lower() in IMAGE_EXTENSIONS


def read_image(path: str) -> np.ndarray:
    """An image file as uint8 ``(1, h, w, 3)`` (Pillow; alpha dropped, palette and grey made
    RGB); ``ClipUnreadable`` when Pillow cannot decode all of it."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()  # decodes every byte: a truncated file fails here, not later
            rgb = np.array(im.convert("RGB"), dtype=np.uint8)
    except Exception as e:  # noqa: BLE001 - PIL raises OSError, SyntaxError, ValueError ...
        raise ClipUnreadable(f"Pillow could not decode it ({_first_line(e)})") from None
    if rgb.ndim != 3 or min(rgb.shape[:2]) < 1:
        raise ClipUnreadable(f"Pillow returned an image of shape {rgb.shape}")
    return rgb[None]


def clip_offsets(num_frames: int, stride: int = 1, source_fps: float = 0.0, target_fps: float = 0.0) -> np.ndarray:
    """Frame offsets from the clip's start: ``arange(F) * stride``, or, with ``target_fps > 0``,
    ``floor(j * source_fps / target_fps + 0.5)`` (frames repeat when the target is the faster)."""
    j = np.arange(num_frames, dtype=np.int64)
    if target_fps <= 0:
        return j * stride
    return np.floor(j * (source_fps / target_fps) + 0.5).astype(np.int64)


def clip_frame_indices(video_frames: int, offsets: np.ndarray, start: int) -> np.ndarray:
    """``start + offsets`` (``clip_offsets``), wrapped modulo ``video_frames`` (short videos loop)."""
    return (start + offsets) % video_frames


def clip_start(video_frames: int, span: int, seed: int, position: int, random: bool, fixed: str = "first") -> int:
    """Temporal start of the clip drawn at ``position`` for a clip spanning ``span`` source frames:
    uniform over the starts that fit when ``random``, else 0 (``first``) or centered (``center``)."""
    if video_frames <= span:
        return 0
    if not random:
        return (video_frames - span) // 2 if fixed == "center" else 0
    rng = np.random.default_rng([seed, position, _CROP_STREAM])
    return int(rng.integers(0, video_frames - span + 1))


def spatial_offset(seed: int, position: int, random: bool) -> tuple[float, float] | None:
    """Crop offset as fractions (top, left) of the slack for the clip at ``position``; None = center."""
    if not random:
        return None
    top, left = np.random.default_rng([seed, position, _SPATIAL_STREAM]).random(2)
    return float(top), float(left)


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


def resize_crop(frames: np.ndarray, height: int, width: int, offset: tuple[float, float] | None = None) -> np.ndarray:
    """uint8 ``(F, h, w, 3)`` -> uint8 ``(F, height, width, 3)``: cover-resize, then crop at the
    center (``offset`` None) or at ``offset`` = (top, left) fractions of the slack in [0, 1]."""
    f, h, w, _ = frames.shape
    scale = max(height / h, width / w)
    new_h, new_w = max(height, round(h * scale)), max(width, round(w * scale))
    if (new_h, new_w) != (h, w):
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # (F, 3, h, w)
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=True)
        frames = x.round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()  # (F, H', W', 3)
    if offset is None:
        top, left = (new_h - height) // 2, (new_w - width) // 2
    else:
        top = min(new_h - height, int(offset[0] * (new_h - height + 1)))
        left = min(new_w - width, int(offset[1] * (new_w - width + 1)))
    return np.ascontiguousarray(frames[:, top: top + height, left: left + width])


@dataclass(frozen=True)
class Clip:
    """A decoded clip and where it came from (``decode_clip``)."""

    frames: np.ndarray
    """uint8 ``(F, height, width, 3)``, resized and cropped."""
    indices: np.ndarray
    """The source frame of each clip frame (int64, ``(F,)``)."""
    source_fps: float
    """The video's average frame rate (0.0 when decord does not know it)."""
    video_frames: int
    """Frames in the video."""


def clip_indices(video_frames: int, source_fps: float, d: DataConfig, seed: int, position: int) -> np.ndarray:
    """The source frames of the clip drawn at ``position`` from a video of ``video_frames``
    frames at ``source_fps`` (module docstring, "Clips"); ``ClipUnreadable`` when the video
    cannot give one under ``d``."""
    if video_frames < 2:  # a still image is not a clip, whatever data.short_clips says
        raise ClipUnreadable("no frames" if video_frames < 1 else "one frame")
    if d.fps > 0 and source_fps == 0.0:
        raise ClipUnreadable(f"unknown frame rate (decord reports none); data.fps={d.fps} needs it")
    offsets = clip_offsets(d.num_frames, d.frame_stride, source_fps, d.fps)
    span = int(offsets[-1]) + 1
    if video_frames < span and d.short_clips == "skip":
        raise ClipUnreadable(f"too short: {video_frames} frames, a clip spans {span} (data.short_clips='skip')")
    start = clip_start(video_frames, span, seed, position, d.random_crop, d.fixed_start)
    return clip_frame_indices(video_frames, offsets, start)


class ClipCache:
    """Decoded clips by key, the least recently used dropped first once they hold more than
    ``max_bytes``; a clip larger than the whole budget is not kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self._clips: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._clips)

    def get(self, key: tuple) -> np.ndarray | None:
        frames = self._clips.get(key)
        if frames is not None:
            self._clips.move_to_end(key)
        return frames

    def put(self, key: tuple, frames: np.ndarray) -> None:
        if frames.nbytes > self.max_bytes:
            return
        old = self._clips.pop(key, None)
        self.bytes += frames.nbytes - (0 if old is None else old.nbytes)
        self._clips[key] = frames
        while self.bytes > self.max_bytes:
            _, dropped = self._clips.popitem(last=False)
            self.bytes -= dropped.nbytes


def decode_clip(path: str, d: DataConfig, seed: int, position: int) -> Clip:
    """The clip drawn at ``position`` of the file ``path`` under the data config ``d`` (frame
    indices, temporal start, resize and crop as the module docstring says); ``ClipUnreadable``
    for any problem with the file. ``VideoDecoder`` and ``megaslide_ray.precompute`` both use it."""
    import decord

    _regular_file(path)
    if is_image(path):
        return _image_clip(path, d, seed, position)
    try:
        reader = decord.VideoReader(path, ctx=decord.cpu(0))
        video_frames = len(reader)
    except Exception as e:  # noqa: BLE001 - decord raises RuntimeError / DECORDError
        raise ClipUnreadable(f"decord could not open it ({_first_line(e)})") from None
    source_fps = _reader_fps(reader)
    indices = clip_indices(video_frames, source_fps, d, seed, position)
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
    offset = spatial_offset(seed, position, d.spatial_crop == "random")
    return Clip(resize_crop(frames, d.height, d.width, offset), indices, source_fps, video_frames)


def _regular_file(path: str) -> os.stat_result:
    """``os.stat(path)`` of a non-empty regular file, else ``ClipUnreadable`` saying what it is."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ClipUnreadable("missing file") from None
    except OSError as e:
        raise ClipUnreadable(f"cannot stat: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):  # a fifo or device could block the open forever
        raise ClipUnreadable("not a regular file")
    if st.st_size == 0:
        raise ClipUnreadable("zero bytes")
    return st


def _image_clip(path: str, d: DataConfig, seed: int, position: int) -> Clip:
    """An image as a still clip of ``d.num_frames`` frames (the one frame repeated), resized and
    cropped as a video's frames are."""
    frame = read_image(path)
    offset = spatial_offset(seed, position, d.spatial_crop == "random")
    still = resize_crop(frame, d.height, d.width, offset)
    indices = np.zeros((d.num_frames,), dtype=np.int64)
    return Clip(np.ascontiguousarray(np.repeat(still, d.num_frames, axis=0)), indices, 0.0, 1)


def _reader_fps(reader) -> float:
    """A decord reader's average frame rate; 0.0 when it does not know one."""
    try:
        fps = float(reader.get_avg_fps())
    except Exception:  # noqa: BLE001 - decord raises RuntimeError / DECORDError
        return 0.0
    return fps if math.isfinite(fps) and fps > 0 else 0.0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
