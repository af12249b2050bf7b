"""The built-in demo dataset: small, real H.264 clips of coloured shapes, made on first use.

Each video shows one or two shapes (circle, square, triangle) moving in a straight line
(left, right, up or down) over a plain background, with a caption such as
"a red circle moving right on a dark blue background". Sizes alternate between 64x64 and
96x64 (landscape, so the decoder's resize-then-crop path is exercised), 32-40 frames at
8 fps, encoded with libx264 / yuv420p through PyAV. Everything is drawn from a fixed seed,
so two machines build the same clips.

The set lives in ``<cache>/demo-v1`` (``<cache>`` = ``$MEGASLIDE_CACHE`` or
``~/.cache/megaslide_ray``) with a Parquet manifest beside the videos. It is built in a
temporary sibling directory and renamed into place when complete (``data.folders``), so a crash
never leaves a half-made set that a later run would trust.

    python -m megaslide_ray.demo_data [--out DIR] [--num-videos N]
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megaslide_ray.data.folders import build_folder_atomically, cache_root
from megaslide_ray.data.manifest import MANIFEST_NAME, ManifestEntry, write_manifest

DEMO_VERSION = "demo-v1"
DEFAULT_NUM_VIDEOS = 24
DEMO_SEED = 20240917
DEMO_FPS = 8
DEMO_SIZES = ((64, 64), (96, 64))  # (width, height); both even, as yuv420p needs

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 230),
    "yellow": (240, 220, 40),
    "orange": (250, 140, 20),
    "purple": (150, 60, 200),
    "white": (245, 245, 245),
    "cyan": (40, 210, 220),
}
BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "dark blue": (15, 20, 70),
    "dark green": (15, 60, 25),
    "black": (0, 0, 0),
    "gray": (110, 110, 110),
    "dark red": (70, 10, 10),
    "beige": (225, 210, 170),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS: dict[str, tuple[int, int]] = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


# ---------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------


def _shape_mask(shape: str, cx: float, cy: float, r: float, height: int, width: int) -> np.ndarray:
    """Boolean (H, W) mask of a shape of half-size ``r`` centred at (cx, cy) in pixels."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
    if shape == "circle":
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= r * r
    if shape == "square":
        return (np.abs(xs - cx) <= r) & (np.abs(ys - cy) <= r)
    if shape == "triangle":  # apex up; half-width grows linearly from 0 at the apex to r at the base
        top = cy - r
        inside_rows = (ys >= top) & (ys <= cy + r)
        return inside_rows & (np.abs(xs - cx) <= (ys - top) / 2.0)
    raise ValueError(f"unknown shape {shape!r}; choose one of {SHAPES}")


def _plan_video(rng: np.random.Generator, i: int) -> dict:
    """Random but seeded description of video ``i``: size, length, background, moving shapes."""
    width, height = DEMO_SIZES[i % len(DEMO_SIZES)]
    num_frames = int(rng.integers(32, 41))
    bg = str(rng.choice(list(BACKGROUNDS)))
    n_shapes = 1 + int(rng.random() < 0.4)
    objects = []
    used_colours: set[str] = set()
    for _ in range(n_shapes):
        colour = str(rng.choice([c for c in COLOURS if c not in used_colours]))
        used_colours.add(colour)
        shape = str(rng.choice(SHAPES))
        direction = str(rng.choice(list(DIRECTIONS)))
        r = float(rng.uniform(6.0, 10.0))
        dx, dy = DIRECTIONS[direction]
        # Travel from one side to the other, staying fully inside the frame.
        lo_x, hi_x, lo_y, hi_y = r, width - r, r, height - r
        cross_x = float(rng.uniform(lo_x, hi_x))
        cross_y = float(rng.uniform(lo_y, hi_y))
        if dx:
            start = (lo_x if dx > 0 else hi_x, cross_y)
            end = (hi_x if dx > 0 else lo_x, cross_y)
        else:
            start = (cross_x, lo_y if dy > 0 else hi_y)
            end = (cross_x, hi_y if dy > 0 else lo_y)
        objects.append(dict(shape=shape, colour=colour, direction=direction, r=r, start=start, end=end))
    parts = [f"a {o['colour']} {o['shape']} moving {o['direction']}" for o in objects]
    caption = " and ".join(parts) + f" on a {bg} background"
    return dict(width=width, height=height, num_frames=num_frames, background=bg, objects=objects,
                caption=caption)


def render_frames(plan: dict) -> np.ndarray:
    """Frames of a planned video as uint8 ``(F, H, W, 3)``."""
    f, h, w = plan["num_frames"], plan["height"], plan["width"]
    frames = np.empty((f, h, w, 3), dtype=np.uint8)
    frames[:] = np.asarray(BACKGROUNDS[plan["background"]], dtype=np.uint8)
    for t in range(f):
        a = t / max(f - 1, 1)
        for o in plan["objects"]:
            cx = o["start"][0] + a * (o["end"][0] - o["start"][0])
            cy = o["start"][1] + a * (o["end"][1] - o["start"][1])
            frames[t][_shape_mask(o["shape"], cx, cy, o["r"], h, w)] = COLOURS[o["colour"]]
    return frames


def write_video(path: str | Path, frames: np.ndarray, fps: int = DEMO_FPS, faststart: bool = False) -> None:
    """Encode uint8 ``(F, H, W, 3)`` RGB frames as an H.264 (yuv420p) mp4 with PyAV
    (``faststart``: the index (moov) before the frames, as streaming files have it)."""
    import av

    f, h, w, _ = frames.shape
    if h % 2 or w % 2:
        raise ValueError(f"frame size {w}x{h} must be even for yuv420p")
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", options=options) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        # One thread and a fixed preset: the bitstream is the same on every run.
        stream.options = {"crf": "18", "preset": "veryfast", "threads": "1"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():  # flush the encoder's delayed frames
            container.mux(packet)


# ---------------------------------------------------------------------------------------------
# Bad files (for tests and for trying the decoder's skipping)
# ---------------------------------------------------------------------------------------------

BAD_VIDEO_KINDS: dict[str, str] = {
    "zero_bytes.mp4": "an empty file",
    "truncated.mp4": "the first half of an mp4 whose index (moov) is at the end: does not open",
    "not_a_video.mp4": "a text file named .mp4",
    "one_frame.mp4": "a valid video of a single frame",
    "undecodable_frames.mp4": "a faststart mp4 whose frame data after the first frame is junk: it opens "
                              "(the index is intact and lists every frame), its frames do not decode",
}


def write_bad_videos(folder: str | Path, num_frames: int = 24, size: int = 32) -> dict[str, Path]:
    """One file of each kind in ``BAD_VIDEO_KINDS`` under ``folder``; returns name -> path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(DEMO_SEED)
    # Noise: every frame costs many bytes, so half the file really holds half the frames.
    frames = rng.integers(0, 256, size=(num_frames, size, size, 3), dtype=np.uint8)
    out = {name: folder / name for name in BAD_VIDEO_KINDS}
    out["zero_bytes.mp4"].write_bytes(b"")
    out["not_a_video.mp4"].write_text("this is a text file, not a video\n")
    write_video(out["one_frame.mp4"], frames[:1])
    import av

    for name, faststart in (("truncated.mp4", False), ("undecodable_frames.mp4", True)):
        whole = folder / f".whole-{name}"
        write_video(whole, frames, faststart=faststart)
        data = whole.read_bytes()
        if faststart:  # keep the index (moov, in front) and the first frame; junk after it
            with av.open(str(whole)) as container:
                first = next(p for p in container.demux(video=0) if p.size)
                end = first.pos + first.size
            junk = np.random.default_rng(1).integers(0, 256, size=len(data) - end, dtype=np.uint8).tobytes()
            out[name].write_bytes(data[:end] + junk)
        else:  # the index is at the end: cut it off
            out[name].write_bytes(data[: len(data) // 2])
        whole.unlink()
    return out


# ---------------------------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------------------------


def _build(target: Path, num_videos: int) -> None:
    rng = np.random.default_rng(DEMO_SEED)
    rows = []
    for i in range(num_videos):
        plan = _plan_video(rng, i)
        name = f"video_{i:04d}.mp4"
        write_video(target / name, render_frames(plan))
        rows.append(ManifestEntry(path=name, caption=plan["caption"], num_frames=plan["num_frames"],
                                  fps=float(DEMO_FPS), width=plan["width"], height=plan["height"]))
    write_manifest(rows, target / MANIFEST_NAME)


def ensure_demo_dataset(cache_dir: str | Path | None = None, num_videos: int = DEFAULT_NUM_VIDEOS) -> Path:
    """Path of the demo set's Parquet manifest, generating the set on first use.

    The set goes to ``<cache_dir>/demo-v1`` (``demo-v1-n<N>`` for a non-default ``num_videos``,
    so sets of different sizes never stand in for each other). A complete set is reused.
    """
    if num_videos < 1:
        raise ValueError(f"num_videos={num_videos} must be >= 1")
    name = DEMO_VERSION if num_videos == DEFAULT_NUM_VIDEOS else f"{DEMO_VERSION}-n{num_videos}"
    final = cache_root(cache_dir) / name
    build_folder_atomically(final, MANIFEST_NAME, lambda folder: _build(folder, num_videos),
                            f"the demo dataset ({num_videos} videos)")
    return final / MANIFEST_NAME
