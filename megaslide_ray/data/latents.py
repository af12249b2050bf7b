"""Precomputed latents and text embeddings: the *latent manifest* and its files.

Real video DiTs (Wan 2.x) train on VAE latents and UMT5 text embeddings, not on pixels and bytes.
``python -m megaslide_ray.precompute`` (see docs/cli.md) encodes a video manifest once; this
module reads (and writes) what it makes. It is a foundation module: it imports nothing of
``actors`` or ``pipelines``.

Layout of a cache folder
------------------------
::

    CACHE/manifest.parquet               the latent manifest (below)
    CACHE/latents/<stem>-<hash>.safetensors   one per clip: tensor "latents", (F, H, W, C)
                                         (image-to-video caches: also "condition" and "image",
                                         ``megaslide_ray.data.image_condition``)
    CACHE/text/<hash>.safetensors        one per distinct caption: tensor "text", (L, text_dim)
    CACHE/precompute.json                the settings the cache was made with (precompute refuses others)
    CACHE/skipped.json                   videos the last run could not use, with the reasons

Latents are the VAE posterior's mode, normalised per channel as the Wan pipelines do,
``(z - latents_mean) / latents_std``, stored **channels-last** ``(F', H', W', C)`` (the layout the
model wants) with ``F' = 1 + (F - 1) / t`` and ``H' = H / s``, ``W' = W / s`` for the VAE's
compression ``(t, s, s)``. Text embeddings are the UMT5 encoder's last hidden state for the
**valid tokens only** (the attention mask's length, at most ``text_len`` = 512): ``pad_text``
zero-pads them back to 512 rows, as the Wan pipeline pads. Both are stored in the manifest's
``dtype`` (bf16 by default) as safetensors (never pickle), one file per clip: it reads faster
than Parquet shards with tensor columns (``benchmarks/latents.py`` measures both).

The latent manifest (format version 1)
--------------------------------------
One row per clip, in the source manifest's order:

=================  ============  ==========================================================
column             type          meaning
=================  ============  ==========================================================
``latent_path``    string        the clip's latent file, relative to the manifest's folder
``text_path``      string        its caption's text file, relative (shared by equal captions)
``caption``        string        the caption text
``source_path``    string        the source video, relative to the manifest's folder when it
                                 was given relative (absolute otherwise)
``frame_start``    int64         first source frame of the clip
``frame_end``      int64         last source frame of the clip (inclusive)
``num_frames``     int64         pixel frames encoded (F)
``fps``            float64       the clip's frame rate (``--fps``, else the source rate; 0: unknown)
``height``         int64         pixel height encoded (after resize and crop)
``width``          int64         pixel width encoded
``latent_shape``   list<int64>   ``[F', H', W', C]``
``text_len``       int64         valid text tokens L (rows of the text file)
``dtype``          string        storage dtype of both files: ``bfloat16``, ``float16``, ``float32``
=================  ============  ==========================================================

Parquet schema metadata (``read_latent_manifest`` returns it parsed): ``kind`` = ``latent``;
``format_version`` (1); ``latents_mean``, ``latents_std`` (lists, the VAE normalisation, already
applied: keep them to decode samples); ``compression`` ``[t, s, s]``; ``latent_channels`` (C);
``text_dim``; ``text_len`` (512, the padded length); ``model_dir`` (the model folder's name);
``layout`` (``FHWC``); ``storage`` (``safetensors``); ``dtype``; ``clip`` (``{frames, height,
width, fps, frame_stride}``, the precompute settings). String values are stored as they are,
the others as JSON text.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from megaslide_ray.data.manifest import write_table_atomic

KIND = "latent"
FORMAT_VERSION = 1
TEXT_LEN = 512
"""Padded text length of the Wan models (their pipelines' ``max_sequence_length``)."""
LATENT_KEY = "latents"
TEXT_KEY = "text"
HEADER_KEY = "megaslide_latent"  # safetensors header entry of a latent file: the clip's row (JSON)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

SCHEMA = pa.schema([
    pa.field("latent_path", pa.string(), nullable=False),
    pa.field("text_path", pa.string(), nullable=False),
    pa.field("caption", pa.string()),
    pa.field("source_path", pa.string()),
    pa.field("frame_start", pa.int64()),
    pa.field("frame_end", pa.int64()),
    pa.field("num_frames", pa.int64()),
    pa.field("fps", pa.float64()),
    pa.field("height", pa.int64()),
    pa.field("width", pa.int64()),
    pa.field("latent_shape", pa.list_(pa.int64()), nullable=False),
    pa.field("text_len", pa.int64(), nullable=False),
    pa.field("dtype", pa.string(), nullable=False),
])
COLUMNS = tuple(f.name for f in SCHEMA)
REQUIRED_COLUMNS = ("latent_path", "text_path", "latent_shape", "text_len", "dtype")
REQUIRED_METADATA = ("kind", "format_version", "latents_mean", "latents_std", "compression", "latent_channels",
                     "text_dim")
_STRING_METADATA = ("kind", "model_dir", "layout", "storage", "dtype")


class LatentFileError(ValueError):
    """A latent or text file is missing, unreadable or not what its manifest row says."""


@dataclass(frozen=True)
class LatentInfo:
    """What a model must agree with, from a latent manifest (``latent_manifest_info``)."""

    latent_shape: tuple[int, int, int, int]
    """``(F', H', W', C)`` of every clip."""
    text_dim: int
    """Width of the text embeddings (UMT5's ``d_model``, 4096 for Wan)."""
    compression: tuple[int, int, int]
    """The VAE's ``(t, s, s)``: pixel frames/height/width per latent one."""
    text_len: int
    """Padded text length (512)."""
    rows: int
    """Clips in the manifest."""


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------


def _encode_metadata(metadata: Mapping[str, Any]) -> dict[bytes, bytes]:
    out = {}
    for key, value in metadata.items():
        text = value if key in _STRING_METADATA else json.dumps(value)
        out[key.encode()] = str(text).encode()
    return out


def _decode_metadata(raw: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        k, v = key.decode(errors="replace"), value.decode(errors="replace")
        if k.startswith("ARROW:") or k == "pandas":
            continue
        if k in _STRING_METADATA:
            out[k] = v
            continue
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


def is_latent_manifest(path: str | os.PathLike) -> bool:
    """True for a readable Parquet file whose schema metadata says ``kind = latent`` (only the
    footer is read). Anything else, including a missing file, is False."""
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException, ValueError):
        return False
    return (schema.metadata or {}).get(b"kind") == KIND.encode()


def write_latent_manifest(rows: Iterable[Mapping[str, Any]], metadata: Mapping[str, Any],
                          path: str | os.PathLike) -> Path:
    """Write rows (mappings with ``COLUMNS``) and the schema metadata (``kind`` and
    ``format_version`` are filled in) to a temporary sibling, then rename it into place."""
    path = Path(path)
    meta = {**metadata, "kind": KIND, "format_version": FORMAT_VERSION}
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise ValueError(f"latent manifest metadata lacks {missing}")
    records = [{name: r.get(name) for name in COLUMNS} for r in rows]
    schema = SCHEMA.with_metadata(_encode_metadata(meta))
    return write_table_atomic(pa.Table.from_pylist(records, schema=schema), path)


def read_latent_manifest(path: str | os.PathLike) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows, metadata)``: one dict per row with the ``COLUMNS`` (paths as stored, relative to
    the manifest's folder; ``latent_shape`` a tuple) and the parsed schema metadata."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"latent manifest {str(path)!r} does not exist; make one with "
                         f"`python -m megaslide_ray.precompute --model-dir WAN_DIR --data MANIFEST --out CACHE ...`")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"latent manifest {str(path)!r} is not a readable Parquet file ({e}); "
                         f"run `python -m megaslide_ray.precompute` again to rewrite it") from None
    meta = _decode_metadata(table.schema.metadata)
    if meta.get("kind") != KIND:
        raise ValueError(f"{str(path)!r} is not a latent manifest (its metadata has kind={meta.get('kind')!r}, "
                         f"not {KIND!r}); a video manifest is read with megaslide_ray.data.manifest.read_manifest")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"latent manifest {str(path)!r} has format_version={version!r}; this code reads up to "
                         f"{FORMAT_VERSION}: update megaslide-ray or precompute the cache again with this version")
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    missing_cols = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing or missing_cols:
        raise ValueError(f"latent manifest {str(path)!r} lacks metadata {missing} / columns {missing_cols}; "
                         f"precompute it again with `python -m megaslide_ray.precompute`")
    meta.setdefault("text_len", TEXT_LEN)
    columns = {}
    for field in SCHEMA:
        if field.name in table.column_names:
            columns[field.name] = table.column(field.name).cast(field.type).to_pylist()
    rows = []
    for i in range(table.num_rows):
        row = {name: columns[name][i] if name in columns else None for name in COLUMNS}
        shape = row["latent_shape"]
        if not shape or len(shape) != 4:
            raise ValueError(f"latent manifest {str(path)!r}: row {i} has latent_shape={shape!r}, not [F, H, W, C]")
        row["latent_shape"] = tuple(int(x) for x in shape)
        row["caption"] = row["caption"] or ""
        rows.append(row)
    return rows, meta


def latent_shape_counts(rows: Iterable[Mapping[str, Any]]) -> Counter:
    """How many rows have each ``latent_shape``."""
    return Counter(tuple(r["latent_shape"]) for r in rows)


def single_latent_shape(rows: list[Mapping[str, Any]], path: str | os.PathLike = "the latent manifest"
                        ) -> tuple[int, int, int, int]:
    """The one ``latent_shape`` of all rows; a ``ValueError`` listing the shapes and their counts
    when they differ (a batch can only stack one shape)."""
    counts = latent_shape_counts(rows)
    if not counts:
        raise ValueError(f"latent manifest {str(path)!r} has no rows; precompute some clips first")
    if len(counts) > 1:
        listed = ", ".join(f"{list(s)} x {n}" for s, n in counts.most_common())
        raise ValueError(f"latent manifest {str(path)!r} mixes {len(counts)} latent shapes ({listed}); a batch "
                         f"stacks one shape: precompute all clips at one --frames/--height/--width, or split "
                         f"the manifest into one per shape")
    return next(iter(counts))


def latent_manifest_info(path: str | os.PathLike) -> LatentInfo:
    """The latent shape, text width and VAE compression of a latent manifest, for checking it
    against a model config before training starts (refuses mixed latent shapes)."""
    rows, meta = read_latent_manifest(path)
    shape = single_latent_shape(rows, path)
    return LatentInfo(latent_shape=shape, text_dim=int(meta["text_dim"]),
                      compression=tuple(int(c) for c in meta["compression"]),
                      text_len=int(meta.get("text_len", TEXT_LEN)), rows=len(rows))


# ---------------------------------------------------------------------------------------------
# The files
# ---------------------------------------------------------------------------------------------


def resolve(manifest_path: str | os.PathLike, relative: str) -> Path:
    """A path stored in a latent manifest, resolved against the manifest's folder."""
    p = Path(relative)
    return p if p.is_absolute() else Path(manifest_path).resolve().parent / p


def _load_tensor(path: Path, key: str, what: str) -> torch.Tensor:
    from safetensors import safe_open

    redo = "run `python -m megaslide_ray.precompute` again with the same arguments (it recomputes missing files)"
    if not path.is_file():
        raise LatentFileError(f"{what} file {str(path)!r} is missing; {redo}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types, OSError, ...
        raise LatentFileError(f"{what} file {str(path)!r} is unreadable ({type(e).__name__}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); delete it and {redo}"
                              ) from None


def load_latents(manifest_path: str | os.PathLike, row: Mapping[str, Any]) -> torch.Tensor:
    """The latents of one manifest row, float32 ``(F', H', W', C)``, without its text (a
    ``videodit`` reads the row's caption as bytes instead); errors as ``load_latent_sample``."""
    dtype_name = row.get("dtype")
    if dtype_name not in DTYPES:
        raise LatentFileError(f"row has dtype {dtype_name!r}; expected one of {sorted(DTYPES)}")
    latent_file = resolve(manifest_path, row["latent_path"])
    latents = _load_tensor(latent_file, LATENT_KEY, "latent")
    shape = tuple(row["latent_shape"])
    if tuple(latents.shape) != shape or latents.dtype != DTYPES[dtype_name]:
        raise LatentFileError(f"latent file {str(latent_file)!r} holds {latents.dtype} {tuple(latents.shape)}, but "
                              f"its manifest row says {DTYPES[dtype_name]} {shape}; delete it and run "
                              f"`python -m megaslide_ray.precompute` again (or rebuild the manifest)")
    return latents.float()


def load_latent_sample(manifest_path: str | os.PathLike, row: Mapping[str, Any],
                       text_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latents, text)`` of one manifest row, both float32: latents ``(F', H', W', C)``, text
    ``(L_valid, text_dim)`` (pad it with ``pad_text``). A ``LatentFileError`` (a ``ValueError``)
    names the file and what to do when it is missing, unreadable, or its shape or dtype is not
    the row's."""
    dtype_name = row.get("dtype")
    if dtype_name not in DTYPES:
        raise LatentFileError(f"row has dtype {dtype_name!r}; expected one of {sorted(DTYPES)}")
    want_dtype = DTYPES[dtype_name]
    latent_file = resolve(manifest_path, row["latent_path"])
    text_file = resolve(manifest_path, row["text_path"])
    latents = _load_tensor(latent_file, LATENT_KEY, "latent")
    text = _load_tensor(text_file, TEXT_KEY, "text")
    fix = "delete it and run `python -m megaslide_ray.precompute` again (or rebuild the manifest)"
    shape = tuple(row["latent_shape"])
    if tuple(latents.shape) != shape or latents.dtype != want_dtype:
        raise LatentFileError(f"latent file {str(latent_file)!r} holds {latents.dtype} {tuple(latents.shape)}, but "
                              f"its manifest row says {want_dtype} {shape}; {fix}")
    length = int(row["text_len"])
    if text.ndim != 2 or text.shape[0] != length or text.dtype != want_dtype or (
            text_dim is not None and text.shape[1] != text_dim):
        want = f"({length}, {text_dim if text_dim is not None else 'text_dim'})"
        raise LatentFileError(f"text file {str(text_file)!r} holds {text.dtype} {tuple(text.shape)}, but its manifest "
                              f"row says {want_dtype} {want}; {fix}")
    return latents.float(), text.float()


def pad_text(text: torch.Tensor, length: int = TEXT_LEN) -> torch.Tensor:
    """``(L, D)`` -> ``(length, D)``: the valid rows, then zeros (as the Wan pipeline pads)."""
    if text.ndim != 2:
        raise ValueError(f"text must be (L, D), got shape {tuple(text.shape)}")
    if text.shape[0] > length:
        raise ValueError(f"text has {text.shape[0]} tokens, more than length={length}")
    out = text.new_zeros((length, text.shape[1]))
    out[: text.shape[0]] = text
    return out


def save_tensor_file(path: str | os.PathLike, key: str, tensor: torch.Tensor,
                     metadata: Mapping[str, str] | None = None,
                     extra: Mapping[str, torch.Tensor] | None = None) -> Path:
    """Write one tensor (and the ``extra`` ones beside it: an image-to-video clip's condition) as
    a safetensors file: to a temporary sibling, then renamed into place (a reader, or a resumed
    run, never sees half a file)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{id(tensor):x}")
    tensors = {key: tensor.contiguous(), **{k: v.contiguous() for k, v in (extra or {}).items()}}
    try:
        save_file(tensors, str(tmp), metadata=dict(metadata or {}))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def read_file_metadata(path: str | os.PathLike) -> dict[str, str] | None:
    """A safetensors file's header metadata, or None when the file is missing or unreadable."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 - any unreadable file is "not there"
        return None
