"""Is the data what the model reads? Video for ``videodit`` in pixel space, a latent manifest
from ``python -m megaslide_ray.precompute`` for ``wan`` and the latent ``dit-*`` presets, with
the latent shape, text width and VAE compression the config implies. Checked by the CLI before
Ray starts, and by the Trainer."""

from __future__ import annotations

import logging

from megaslide_ray.config import Config, ConfigError
from megaslide_ray.config.buckets import parse_buckets, with_clip
from megaslide_ray.data.buckets import latent_row_buckets, row_buckets
from megaslide_ray.data.image_condition import IMAGE_CONDITION_KEY, condition_problems, required_kind
from megaslide_ray.data.latents import is_latent_manifest, latent_manifest_info, read_latent_manifest, resolve
from megaslide_ray.data.manifest import read_manifest

log = logging.getLogger(__name__)


def check_data(cfg: Config) -> None:
    """The data must be what the model reads: video for ``videodit``, a latent manifest from
    ``megaslide_ray.precompute`` for ``wan``, with the latent shape, text width and VAE
    compression the config implies. One ``ConfigError`` names every disagreement (called before
    Ray starts by the CLI, and by the Trainer). ``data.val_manifest`` is held to the same rules."""
    m, d = cfg.model, cfg.data
    if not d.manifest and m.arch == "videodit" and m.inputs == "latents":
        raise ConfigError(f"model.inputs='latents' (preset {cfg.preset!r}) trains on precomputed VAE latents, not "
                          f"on the demo videos: run `python -m megaslide_ray.precompute --model-dir WAN_DIR --data "
                          f"VIDEOS.parquet --out CACHE --frames F --height H --width W`, then pass --data with the "
                          f"latent manifest it writes (the videodit reads its caption column as bytes)")
    if not d.manifest and m.arch == "wan":
        raise ConfigError("model.arch='wan' trains on precomputed VAE latents and text embeddings, not on the "
                          "demo videos: run `python -m megaslide_ray.precompute --model-dir WAN_DIR --data "
                          "VIDEOS.parquet --out CACHE --frames F --height H --width W`, then pass --data with "
                          "the latent manifest it writes")
    if d.manifest:
        _check_manifest(cfg, "data.manifest", d.manifest)
    if d.val_manifest:
        _check_manifest(cfg, "data.val_manifest", d.val_manifest)


def _check_manifest(cfg: Config, field: str, path: str) -> None:
    """``check_data`` for one manifest (``field`` names it in the messages)."""
    m, d = cfg.model, cfg.data
    latent = is_latent_manifest(path)
    if m.arch == "wan" and not latent:
        raise ConfigError(f"{field}={path!r} is a video manifest; model.arch='wan' reads latents: "
                          f"precompute them first (python -m megaslide_ray.precompute ...)")
    if not cfg.latent_space and latent:
        raise ConfigError(f"{field}={path!r} holds precomputed latents; model.arch={m.arch!r} with "
                          f"model.inputs='pixels' reads video (latents are for the wan presets and the dit-* presets, "
                          f"model.inputs=latents)")
    if cfg.latent_space and not latent:
        raise ConfigError(f"{field}={path!r} is a video manifest; model.inputs='latents' reads latents: "
                          f"precompute them first (python -m megaslide_ray.precompute ...)")
    if not latent:
        if field == "data.manifest" and d.buckets.strip():
            _check_bucket_rows(cfg, path)
        return
    if field == "data.manifest" and d.buckets.strip():
        _check_latent_buckets(cfg, path)
        return
    info = latent_manifest_info(path)
    image = required_kind(m) if m.arch == "wan" else None
    want = (*cfg.latent_grid, (m.out_channels or m.in_channels) if image else m.in_channels)
    problems = []
    if tuple(info.latent_shape) != want:
        ct, cs, _ = info.compression
        F_, H_, W_, C = info.latent_shape
        problems.append(f"its latents are {tuple(info.latent_shape)} (frames, height, width, channels) but "
                        f"data.num_frames={d.num_frames}, data.height={d.height}, data.width={d.width} and "
                        f"model.{'out' if image else 'in'}_channels={want[-1]} make {want}: precomputed clips of "
                        f"{ct * (F_ - 1) + 1} frames of {cs * W_}x{cs * H_} need --data.num_frames "
                        f"{ct * (F_ - 1) + 1} --data.height {cs * H_} --data.width {cs * W_}")
    if m.arch == "wan" and info.text_dim != m.text_dim:
        problems.append(f"its text embeddings are {info.text_dim} wide, model.text_dim={m.text_dim}")
    if tuple(info.compression) != tuple(m.latent_compression):
        problems.append(f"its VAE compresses {tuple(info.compression)}, model.latent_compression="
                        f"{tuple(m.latent_compression)}")
    if m.arch == "wan" and info.text_len > m.text_len:
        problems.append(f"its text is padded to {info.text_len} tokens, model.text_len={m.text_len}")
    if problems:
        raise ConfigError(f"{field}={path!r} does not fit the model:\n  " + "\n  ".join(problems))
    rows, meta = read_latent_manifest(path)
    if m.arch == "wan":
        _check_image_condition(cfg, field, path, meta, info.latent_shape[-1])
    _check_latent_files(field, path, rows)


def _check_latent_files(field: str, path: str, rows: list[dict]) -> None:
    """A latent manifest none of whose files exists is refused; some missing are warned about."""
    missing = [r["latent_path"] for r in rows if not resolve(path, r["latent_path"]).is_file()]
    if missing and len(missing) == len(rows):  # found here in a second, not by the decoders after Ray is up
        raise ConfigError(f"{field}={path!r}: none of its {len(rows)} latent files exists (e.g. "
                          f"{resolve(path, missing[0])}); run `python -m megaslide_ray.precompute` again with the "
                          f"arguments that made it (it recomputes missing files)")
    if missing:
        log.warning("%s=%r: %d of its %d latent files are missing (e.g. %s): those rows are skipped; run "
                    "`python -m megaslide_ray.precompute` again to recompute them", field, path, len(missing),
                    len(rows), resolve(path, missing[0]))


def _check_bucket_rows(cfg: Config, path: str) -> None:
    """With ``data.buckets`` every row must say its size and length (the decoders pick its bucket
    from them), and each bucket that gets no row is reported (its shape never trains)."""
    if cfg.data.buckets.strip().lower() == "auto":
        raise ConfigError("data.buckets='auto' is resolved by validate(); build the config with build_config")
    buckets = parse_buckets(cfg.data.buckets)
    try:
        bucket_of = row_buckets(read_manifest(path), buckets, path, cfg.data.frame_stride, cfg.data.fps)
    except ValueError as e:
        raise ConfigError(f"data.manifest={path!r}: {e}") from None
    counts = [bucket_of.count(j) for j in range(len(buckets))]
    log.info("data.buckets: %s", ", ".join(f"{b} {n} rows" for b, n in zip(buckets, counts)))
    empty = [str(b) for b, n in zip(buckets, counts) if n == 0]
    if empty:
        log.warning("data.buckets: no row of %s falls in %s", path, ", ".join(empty))


def _check_latent_buckets(cfg: Config, path: str) -> None:
    """A latent manifest keyed by bucket (``precompute --buckets``): every row's clip is one of
    ``data.buckets`` and its latents are that bucket's latent grid; the text and VAE agree with the
    model as for one shape."""
    m = cfg.model
    if m.arch == "wan" and (required_kind(m) is not None or m.clean_first_frame):
        raise ConfigError(f"data.buckets={cfg.data.buckets!r} with an image-to-video model "
                          f"({required_kind(m) or 'TI2V from an image'}): its image condition is not kept by bucket "
                          "yet; train it on one clip shape (leave data.buckets empty)")
    buckets = parse_buckets(cfg.data.buckets)
    rows, meta = read_latent_manifest(path)
    try:
        bucket_of = latent_row_buckets(rows, buckets, path)
    except ValueError as e:
        raise ConfigError(f"data.manifest={path!r}: {e}") from None
    problems = []
    for row, j in zip(rows, bucket_of):
        want = (*with_clip(cfg, buckets[j]).latent_grid, m.in_channels)
        if tuple(row["latent_shape"]) != want and len(problems) < 3:
            problems.append(f"{row['latent_path']} ({buckets[j]}) holds latents {tuple(row['latent_shape'])}, the "
                            f"model reads {want} at that clip")
    if tuple(meta["compression"]) != tuple(m.latent_compression):
        problems.append(f"its VAE compresses {tuple(meta['compression'])}, model.latent_compression="
                        f"{tuple(m.latent_compression)}")
    if m.arch == "wan" and int(meta["text_dim"]) != m.text_dim:
        problems.append(f"its text embeddings are {meta['text_dim']} wide, model.text_dim={m.text_dim}")
    if problems:
        raise ConfigError(f"data.manifest={path!r} does not fit the model:\n  " + "\n  ".join(problems))
    _check_latent_files("data.manifest", path, rows)


def _check_image_condition(cfg: Config, field: str, path: str, meta: dict, latent_channels: int) -> None:
    """An image-to-video model needs the manifest's image condition (``megaslide_ray.data.image_condition``),
    made by precompute from an image-to-video folder of its kind: else a ``ConfigError`` names
    the precompute command to run."""
    kind = required_kind(cfg.model)
    if kind is None:
        return
    problems = condition_problems(cfg.model, meta.get(IMAGE_CONDITION_KEY), latent_channels)
    if problems:
        d = cfg.data
        raise ConfigError(f"{field}={path!r} does not fit the image-to-video model ({kind}):\n  "
                          + "\n  ".join(problems) + f"\nprecompute the clips with the model's own folder, which "
                          f"makes the first frame's condition: `python -m megaslide_ray.precompute --model-dir "
                          f"I2V_MODEL_DIR --data VIDEOS.parquet --out CACHE --frames {d.num_frames} --height "
                          f"{d.height} --width {d.width}`, then train with --data CACHE/manifest.parquet")
