"""Precomputed latents keyed by bucket: ``python -m megaslide_ray.precompute ... --buckets LIST``.

Each row of the video manifest goes to its bucket (``megaslide_ray.data.buckets.assign_bucket``,
from the manifest's ``width``, ``height`` and ``num_frames``, as training assigns it) and is
encoded at that bucket's shape by ``precompute`` (``pipelines/latent_precompute.py``), one
sub-folder per bucket::

    CACHE/manifest.parquet            the merged latent manifest: every bucket's rows
    CACHE/480x832x81/                 one precompute folder per bucket (its own manifest,
    CACHE/512x512x1/                  latents/, text/, precompute.json, skipped.json)

The merged manifest's paths point into the sub-folders; its rows keep their pixel
``num_frames``, ``height`` and ``width``, which is how the decoders find each row's bucket
(``data.buckets`` must list the same shapes). Each sub-folder resumes as a plain precompute does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megaslide_ray.config.buckets import Bucket
from megaslide_ray.data.buckets import row_buckets
from megaslide_ray.data.latents import read_latent_manifest, write_latent_manifest
from megaslide_ray.data.manifest import MANIFEST_NAME, read_manifest, write_manifest
from pipelines.encoder_pool import start_ray, stop_ray
from pipelines.latent_precompute import PrecomputeReport, precompute

SOURCE_NAME = "source.parquet"
"""A bucket sub-folder's share of the video manifest (absolute paths)."""


def precompute_buckets(model_dir: str | os.PathLike, data: str | os.PathLike, out: str | os.PathLike,
                       buckets: list[Bucket], **kwargs: Any) -> list[tuple[Bucket, PrecomputeReport]]:
    """Encode the video manifest ``data`` into ``out``, each row at its bucket's shape (module
    docstring); ``kwargs`` go to ``precompute`` (``fps``, ``device``, ``dtype`` ...). Returns each
    bucket that got rows with its report; the merged manifest is ``out/manifest.parquet``."""
    out = Path(out)
    entries = read_manifest(data)
    try:
        bucket_of = row_buckets(entries, buckets, str(data), fps=float(kwargs.get("fps", 0.0)))
    except ValueError as e:
        raise ValueError(f"--buckets: {e}") from None
    # One Ray for every bucket's precompute (each would start and stop its own).
    started = kwargs.get("num_encoders") != 0 and start_ray()
    try:
        reports, merged, metadata = _each_bucket(model_dir, entries, bucket_of, out, buckets, kwargs)
    finally:
        if started:
            stop_ray()
    if not reports:
        raise ValueError(f"--buckets: no row of {data} falls in any bucket")
    metadata = {k: v for k, v in metadata.items() if k not in ("kind", "format_version")}
    metadata["buckets"] = [str(b) for b, _ in reports]
    write_latent_manifest(merged, metadata, out / MANIFEST_NAME)
    return reports


def _each_bucket(model_dir, entries, bucket_of, out: Path, buckets, kwargs) -> tuple[list, list[dict], dict]:
    reports: list[tuple[Bucket, PrecomputeReport]] = []
    merged: list[dict] = []
    metadata: dict = {}
    for j, bucket in enumerate(buckets):
        rows = [e for e, b in zip(entries, bucket_of) if b == j]
        if not rows:
            continue
        sub = out / str(bucket)
        source = write_manifest(rows, sub / SOURCE_NAME)
        rep = precompute(model_dir, source, sub, bucket.frames, bucket.height, bucket.width, **kwargs)
        reports.append((bucket, rep))
        latent_rows, meta = read_latent_manifest(rep.manifest)
        metadata = metadata or meta
        merged += [_under(row, str(bucket)) for row in latent_rows]
    return reports, merged, metadata


def _under(row: dict, folder: str) -> dict:
    """A sub-folder's latent-manifest row with its relative paths made relative to the parent."""
    out = dict(row)
    out["latent_shape"] = list(row["latent_shape"])
    for key in ("latent_path", "text_path", "source_path"):
        value = row.get(key)
        if value and not Path(value).is_absolute():
            out[key] = Path(os.path.normpath(f"{folder}/{value}")).as_posix()
    return out
