"""Build a manifest from a folder of videos.

    python -m megaslide_ray.index VIDEO_DIR --out manifest.parquet [--captions FILE.csv|FILE.jsonl]

Scans ``VIDEO_DIR`` recursively for ``.mp4 .mkv .webm .avi .mov .m4v`` files, opens each with
decord to read its frame count, frame rate and size (and decodes its first and last frames to
prove it decodes: a truncated file often opens and shows its first frame; ``--first-frame-only``
skips the last-frame check, which costs a seek per video), and writes one manifest row per
usable video (schema: ``megaslide_ray.data.manifest``). Images (``.png .jpg .jpeg .webp``) are
rows too: decoded whole with Pillow, recorded as one frame (``num_frames`` 1, ``fps`` 0) with
their size; training reads them as still clips (``data.buckets`` gives them one-frame buckets).
Paths in the manifest are relative to the manifest's folder, so both can move together.

Captions, first match wins:
1. the ``--captions`` file: CSV with columns ``path,caption`` or JSON lines with keys
   ``path`` and ``caption``; ``path`` is relative to ``VIDEO_DIR`` or a bare file name
   (a relative-path match beats a file-name match);
2. a sidecar text file beside the video with the same stem (``clip.mp4`` -> ``clip.txt``);
3. a manifest already in the video's folder (``manifest.parquet``, as the demo and motion sets
   have) that lists the video with a caption;
4. otherwise "".

A file that cannot be used (zero bytes, not a video, truncated, undecodable frames, a single
frame) is left out of the manifest and listed with the reason in the summary; the scan never
stops on a bad file.
The exit status is non-zero only when no usable video is found.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path

from megaslide_ray.data.clips import IMAGE_EXTENSIONS, ClipUnreadable, is_image, read_image
from megaslide_ray.data.manifest import MANIFEST_NAME, ManifestEntry, read_manifest

VIDEO_EXTENSIONS = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v")


def find_videos(video_dir: str | Path, images: bool = False) -> list[Path]:
    """Video files (and with ``images`` image files) under ``video_dir`` (recursive, by extension,
    case-insensitive), sorted."""
    root = Path(video_dir)
    kinds = VIDEO_EXTENSIONS + (IMAGE_EXTENSIONS if images else ())
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in kinds and p.is_file())


def load_captions(path: str | Path) -> dict[str, str]:
    """``path -> caption`` from a CSV (columns ``path``, ``caption``) or JSON-lines file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"captions file {str(path)!r} does not exist")
    mapping: dict[str, str] = {}
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    mapping[str(record["path"])] = str(record.get("caption") or "")
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"captions file {str(path)!r} line {lineno}: expected a JSON object with "
                                     f"keys 'path' and 'caption' ({e!r})") from None
    elif path.suffix.lower() == ".csv":
        with path.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "path" not in reader.fieldnames or "caption" not in reader.fieldnames:
                raise ValueError(f"captions file {str(path)!r} needs a header row with columns 'path' and "
                                 f"'caption' (found {reader.fieldnames})")
            for row in reader:
                mapping[str(row["path"])] = str(row["caption"] or "")
    else:
        raise ValueError(f"captions file {str(path)!r}: use a .csv (columns path,caption) or a .jsonl file")
    return mapping


def _pyav_reason(path: Path) -> str:
    """decord prints the cause to stderr and raises only "Error reading ..."; ask PyAV instead."""
    try:
        import av

        with av.open(str(path)) as container:
            if not container.streams.video:
                return "no video stream"
    except Exception as e:  # noqa: BLE001 - any failure is the reason we are after
        return str(getattr(e, "strerror", None) or e).strip()
    return ""


def probe_image(path: Path) -> tuple[dict | None, str]:
    """``(metadata, "")`` for an image Pillow decodes whole (one frame, no frame rate), ``(None,
    reason)`` otherwise."""
    try:
        if path.stat().st_size == 0:
            return None, "zero bytes"
        frame = read_image(str(path))
    except OSError as e:
        return None, f"cannot stat: {e.strerror or e}"
    except ClipUnreadable as e:
        return None, str(e)
    return dict(num_frames=1, fps=0.0, width=int(frame.shape[2]), height=int(frame.shape[1])), ""


def probe_video(path: Path, check_last_frame: bool = True) -> tuple[dict | None, str]:
    """``(metadata, "")`` for a usable video, ``(None, reason)`` otherwise (an image:
    ``probe_image``)."""
    import decord

    if is_image(str(path)):
        return probe_image(path)

    try:
        size = path.stat().st_size
    except OSError as e:
        return None, f"cannot stat: {e.strerror or e}"
    if size == 0:
        return None, "zero bytes"
    try:
        vr = decord.VideoReader(str(path), ctx=decord.cpu(0))
        num_frames = len(vr)
        fps = float(vr.get_avg_fps())
        # Only (height, width): decord2 3.4 can report a wrong channel count for some widths.
        height, width = vr[0].shape[:2]
    except Exception as e:  # noqa: BLE001 - never stop on a bad file
        reason = f"decord: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}"
        detail = _pyav_reason(path)
        return None, f"{reason} ({detail})" if detail else reason
    if num_frames == 0:
        return None, "no frames"
    if num_frames == 1:
        return None, "one frame"
    if check_last_frame:
        try:
            vr[num_frames - 1]
        except Exception:  # noqa: BLE001 - decord's message is a long internal check; ours says what it means
            return None, f"frame {num_frames - 1} (the last) does not decode: truncated or corrupt"
    return dict(num_frames=int(num_frames), fps=fps, width=int(width), height=int(height)), ""


def _caption_for(video: Path, root: Path, mapping: dict[str, str]) -> str:
    rel = video.relative_to(root).as_posix()
    if rel in mapping:
        return mapping[rel]
    if video.name in mapping:
        return mapping[video.name]
    sidecar = video.with_suffix(".txt")
    if sidecar.is_file():
        return sidecar.read_text(encoding="utf-8", errors="replace").strip()
    return _folder_captions(video.parent).get(video.resolve(), "")


_FOLDER_CAPTIONS: dict[Path, dict[Path, str]] = {}


def _folder_captions(folder: Path) -> dict[Path, str]:
    """The captions a manifest in ``folder`` (``manifest.parquet``) gives its videos, by absolute
    path (read once per folder; a folder without a readable one gives none)."""
    folder = folder.resolve()
    if folder not in _FOLDER_CAPTIONS:
        found = {}
        if (folder / MANIFEST_NAME).is_file():
            try:
                found = {Path(e.path).resolve(): e.caption for e in read_manifest(folder / MANIFEST_NAME)
                         if e.caption}
            except ValueError:  # not ours, or not readable: no captions from it
                found = {}
        _FOLDER_CAPTIONS[folder] = found
    return _FOLDER_CAPTIONS[folder]


def index_videos(video_dir: str | Path, captions: str | Path | None = None, check_last_frame: bool = True,
                 images: bool = True) -> tuple[list[ManifestEntry], list[tuple[str, str]]]:
    """Probe every video (and with ``images`` every image) under ``video_dir``.

    Returns ``(rows, problems)``: manifest rows with absolute paths for the usable videos, and
    ``(path, reason)`` for each file left out.
    """
    root = Path(video_dir).resolve()
    if not root.is_dir():
        raise ValueError(f"video folder {str(video_dir)!r} does not exist or is not a folder")
    mapping = load_captions(captions) if captions else {}
    _FOLDER_CAPTIONS.clear()  # a manifest read in an earlier call may have changed since
    rows: list[ManifestEntry] = []
    problems: list[tuple[str, str]] = []
    for video in find_videos(root, images):
        meta, reason = probe_video(video, check_last_frame)
        if meta is None:
            problems.append((str(video), reason))
            continue
        rows.append(ManifestEntry(path=str(video), caption=_caption_for(video, root, mapping), **meta))
    return rows, problems


def _relative_to_manifest(rows: list[ManifestEntry], out: Path) -> list[ManifestEntry]:
    base = out.resolve().parent
    return [dataclasses.replace(r, path=Path(os.path.relpath(r.path, base)).as_posix()) for r in rows]
