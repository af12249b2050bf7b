"""The video manifest: one Parquet file, one row per video.

Schema
------
============  =========  ========  ==================================================
column        type       required  meaning
============  =========  ========  ==================================================
``path``      string     yes       video (or image) file; a relative path is relative to the
                                   folder holding the manifest (so a manifest and its
                                   videos can move together)
``caption``   string     no        text describing the video; missing or null -> ""
``num_frames``  int64    no        frames in the video (as decord counts them; 1 for an image)
``fps``       float64    no        average frame rate
``width``     int64      no        frame width in pixels
``height``    int64      no        frame height in pixels
============  =========  ========  ==================================================

The metadata columns are informational (the decoder reads the video itself), except that
``data.buckets`` assigns rows to buckets from ``width``, ``height`` and ``num_frames``; a missing
column or a null reads back as ``None``. Other columns are ignored.

Build a manifest from a folder of videos with ``python -m megaslide_ray.index VIDEO_DIR
--out manifest.parquet``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST_NAME = "manifest.parquet"

SCHEMA = pa.schema([
    pa.field("path", pa.string(), nullable=False),
    pa.field("caption", pa.string()),
    pa.field("num_frames", pa.int64()),
    pa.field("fps", pa.float64()),
    pa.field("width", pa.int64()),
    pa.field("height", pa.int64()),
])
OPTIONAL_COLUMNS = ("caption", "num_frames", "fps", "width", "height")


@dataclass(frozen=True)
class ManifestEntry:
    path: str
    """Video file. ``read_manifest`` returns it resolved against the manifest's folder."""
    caption: str = ""
    """Caption text ("" when the manifest has none)."""
    num_frames: int | None = None
    """Frame count, if recorded."""
    fps: float | None = None
    """Average frame rate, if recorded."""
    width: int | None = None
    """Frame width in pixels, if recorded."""
    height: int | None = None
    """Frame height in pixels, if recorded."""


def _row_dict(row: ManifestEntry | Mapping[str, Any], i: int) -> dict[str, Any]:
    d = dataclasses.asdict(row) if isinstance(row, ManifestEntry) else dict(row)
    path = d.get("path")
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"manifest row {i} has no usable 'path' (got {path!r}); every row needs a video path")
    out = {"path": str(path), "caption": d.get("caption") or ""}
    for name in OPTIONAL_COLUMNS[1:]:
        out[name] = d.get(name)
    return out


def write_manifest(rows: Iterable[ManifestEntry | Mapping[str, Any]], path: str | Path) -> Path:
    """Write rows (``ManifestEntry`` or mappings with the schema's keys) to a Parquet file.

    Paths are stored as given. The file is written to a temporary sibling and renamed into
    place, so readers never see a half-written manifest.
    """
    path = Path(path)
    records = [_row_dict(r, i) for i, r in enumerate(rows)]
    return write_table_atomic(pa.Table.from_pylist(records, schema=SCHEMA), path)


def write_table_atomic(table: pa.Table, path: Path) -> Path:
    """Write a Parquet table to a temporary sibling, then rename it into place: a reader never
    sees half a manifest, and a crash leaves the previous one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_manifest(path: str | Path) -> list[ManifestEntry]:
    """Rows of a manifest, with relative video paths resolved against the manifest's folder."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"manifest {str(path)!r} does not exist; build one with "
                         f"`python -m megaslide_ray.index VIDEO_DIR --out {path}` "
                         f"(or leave data.manifest empty to use the demo set)")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"manifest {str(path)!r} is not a readable Parquet file ({e}); rebuild it with "
                         f"`python -m megaslide_ray.index VIDEO_DIR --out {path}`") from None
    names = table.column_names
    if "path" not in names:
        raise ValueError(f"manifest {str(path)!r} has no required column 'path' (it has {names}); "
                         f"add a string column 'path' with one video file per row, or rebuild it with "
                         f"`python -m megaslide_ray.index VIDEO_DIR --out {path}`")
    columns: dict[str, list[Any]] = {}
    for field in SCHEMA:
        if field.name not in names:
            continue
        col = table.column(field.name)
        try:
            columns[field.name] = col.cast(field.type).to_pylist()
        except (pa.ArrowException, ValueError) as e:
            raise ValueError(f"manifest {str(path)!r}: column {field.name!r} has type {col.type}, "
                             f"which does not convert to {field.type} ({e}); fix the column's type") from None
    base = path.resolve().parent
    entries = []
    for i in range(table.num_rows):
        video = columns["path"][i]
        if not video:
            raise ValueError(f"manifest {str(path)!r}: row {i} has an empty 'path'; remove the row or fill it in")
        video_path = Path(video)
        if not video_path.is_absolute():
            video_path = base / video_path
        kw = {name: columns[name][i] for name in OPTIONAL_COLUMNS if name in columns}
        kw["caption"] = kw.get("caption") or ""
        entries.append(ManifestEntry(path=str(video_path), **kw))
    return entries
