"""The validation loss: a held-out flow-matching loss, forward only, streamed like sampling.

The validation set is the first ``training.val_clips`` readable rows of ``data.val_manifest``
(a video manifest for ``videodit``, a latent manifest for ``wan``), decoded with the decoders'
own rules (``actors.decoder.decode_clip``) but with no randomness: the clip's first frames
(``data.fixed_start``) and the centre crop. Every clip ``i`` is evaluated once in each of
``training.val_t_buckets`` equal buckets of t in [0, 1]: for bucket ``b`` the flow time
``t = (b + u) / n_buckets`` (``u`` uniform) and the noise are drawn from a generator seeded by
``(seed, i, b)`` alone (``val_generator``), so the inputs are a pure function of the seed. No
``flow_shift`` is applied: the buckets are the times the model sees.

The items (clip, bucket) go through ``predictor.predict`` in clip-major order in chunks of
``data.batch_size`` (a training batch: no more memory than a step's forward), i.e. through the
compute actor exactly as sampling does: weights streamed shard by shard, no gradients, no
second copy of the model. The loss of an item is the mean squared error of its predicted
velocity in float64; ``val_loss`` is the mean over all items and ``val_loss_t{b}`` the mean
over bucket ``b``'s items. The same weights, config and device give the same numbers to the
last bit, in training (``Trainer``) and here.

    python -m megaslide_ray.evaluate --checkpoint RUN_OR_CKPT [--data MANIFEST] [--json]

runs in this process (no Ray), with the checkpoint's weights served read-only as ``sample``
does, and prints a summary (``--json``: one object).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from actors.compute import ComputeActor
from megaslide_ray.config import Config, ConfigError, config_from_dict, validate
from megaslide_ray.data.captions import empty_captions, set_caption
from megaslide_ray.data.checks import _check_manifest
from megaslide_ray.data.clips import ClipUnreadable, decode_clip
from megaslide_ray.data.image_condition import IMAGE_CONDITION_KEY, load_condition, required_kind, uses_clip
from megaslide_ray.data.latents import (
    LatentFileError,
    is_latent_manifest,
    load_latent_sample,
    pad_text,
    read_latent_manifest,
)
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.sampling import CheckpointWeights, use_average
from megaslide_ray.state.checkpoint import read_checkpoint_state, resolve_checkpoint
from megaslide_ray.state.segments import DTYPES
from megaslide_ray.training.flow import EXPERT_NAMES, HIGH, LOW, expert_t_range, route_expert, video_to_unit

log = logging.getLogger(__name__)

_VAL_STREAM = 0x56414C  # "VAL": keeps the validation draws apart from the training steps'


@dataclass(frozen=True)
class ValSet:
    """The validation clips, held by the driver (decoded once)."""

    x0: torch.Tensor          # (N, F, H, W, C) float32: pixels in [-1, 1], or normalised latents
    cond: np.ndarray          # (N, Lc) uint8 caption bytes, or (N, L, text_dim) float32 text embeddings
    cond_len: np.ndarray      # (N,) int32
    rows: tuple[int, ...]     # the manifest rows used
    manifest: str
    condition: torch.Tensor | None = None  # image-to-video: (N, F, H, W, mask + C) mask and image latents
    image: torch.Tensor | None = None      # image-to-video with CLIP: (N, n, Li, image_dim) image states

    def condition_of(self, idx: list[int]) -> dict:
        """``predict``'s image-to-video arguments for clips ``idx`` (empty for text-to-video)."""
        out = {}
        if self.condition is not None:
            out["condition"] = self.condition[idx]
        if self.image is not None:
            out["image"] = self.image[idx].flatten(0, 1)
        return out


@dataclass(frozen=True)
class ValResult:
    val_loss: float
    bucket_losses: tuple[float, ...]  # bucket b covers t in [lo + b (hi - lo) / n, lo + (b + 1) (hi - lo) / n)
    clips: int
    seconds: float
    version: int                      # the weights' version (optimizer steps applied)
    expert_losses: tuple = ()         # a two-expert model: (("high", loss), ("low", loss)) over each one's items
    t_range: tuple = (0.0, 1.0)       # the times evaluated (one expert of a two-expert model: its range)

    def as_row(self) -> dict:
        """The metrics.jsonl fields: ``val_loss`` and ``val_loss_t0`` ... ``val_loss_t{n-1}``, and
        per expert ``val_loss_high`` / ``val_loss_low``."""
        return {"val_loss": self.val_loss, **{f"val_loss_t{b}": v for b, v in enumerate(self.bucket_losses)},
                **{f"val_loss_{name}": v for name, v in self.expert_losses}, "val_seconds": self.seconds}

    def as_json(self) -> dict:
        n, (lo, hi) = len(self.bucket_losses), self.t_range
        return {"val_loss": self.val_loss, "buckets": {f"val_loss_t{b}": v for b, v in enumerate(self.bucket_losses)},
                "bucket_edges": [[lo + b * (hi - lo) / n, lo + (b + 1) * (hi - lo) / n] for b in range(n)],
                **({"experts": dict(self.expert_losses)} if self.expert_losses else {}), "clips": self.clips,
                "step": self.version, "seconds": self.seconds}


# ---------------------------------------------------------------------------------------------
# The clips and their fixed inputs
# ---------------------------------------------------------------------------------------------


ALL_ROWS = -1
"""``load_val_set(clips=ALL_ROWS)``: every readable row of the manifest."""


def load_val_set(cfg: Config, manifest: str | None = None, clips: int | None = None) -> ValSet:
    """The first ``clips`` (default ``training.val_clips``; ``ALL_ROWS``: all) readable rows of
    ``manifest`` (default ``data.val_manifest``). Unreadable rows are skipped with a warning; a
    ``ValueError`` when fewer than ``clips`` rows (or none) are readable."""
    path = manifest or cfg.data.val_manifest
    n = int(clips or cfg.training.val_clips)
    if not path:
        raise ValueError("no validation manifest: set data.val_manifest")
    x0, cond, lens, rows, conditions = [], [], [], [], []
    if is_latent_manifest(path):
        entries, meta = read_latent_manifest(path)
        info = meta.get(IMAGE_CONDITION_KEY) if cfg.model.arch == "wan" and required_kind(cfg.model) else None
        text_len = int(meta.get("text_len", cfg.model.text_len))
        n = len(entries) if n == ALL_ROWS else n
        for row, entry in enumerate(entries):
            if len(rows) == n:
                break
            try:
                latents, text = load_latent_sample(path, entry, int(meta["text_dim"]))
                if info:
                    conditions.append(load_condition(path, entry, info))
            except LatentFileError as e:
                log.warning("validation: skipping row %d of %s: %s", row, path, e)
                continue
            x0.append(latents)
            cond.append(pad_text(text, text_len).numpy())
            lens.append(min(text.shape[0], text_len))
            rows.append(row)
    else:
        d = replace(cfg.data, manifest=str(path), random_crop=False, spatial_crop="center")
        entries = read_manifest(path)
        n = len(entries) if n == ALL_ROWS else n
        for row, entry in enumerate(entries):
            if len(rows) == n:
                break
            try:
                frames = decode_clip(entry.path, d, cfg.training.seed, row).frames
            except ClipUnreadable as e:
                log.warning("validation: skipping %s: %s", entry.path, e)
                continue
            cap, cap_len = empty_captions(1, cfg.model.caption_max_bytes)
            set_caption(cap, cap_len, 0, entry.caption)
            x0.append(video_to_unit(frames))
            cond.append(cap[0])
            lens.append(int(cap_len[0]))
            rows.append(row)
    if rows and clips == ALL_ROWS:
        n = len(rows)
    if len(rows) < n or not rows:
        raise ValueError(f"validation manifest {str(path)!r}: {len(rows)} readable row(s) of {len(entries)}, "
                         f"training.val_clips={n} wanted; lower training.val_clips or add clips")
    condition = torch.stack([c for c, _ in conditions]) if conditions else None
    image = torch.stack([i for _, i in conditions]) if conditions and uses_clip(required_kind(cfg.model)) else None
    return ValSet(torch.stack(x0).float(), np.stack(cond), np.asarray(lens, dtype=np.int32), tuple(rows), str(path),
                  condition, image)


def val_generator(seed: int, clip: int, bucket: int) -> torch.Generator:
    """The generator of clip ``clip``'s draws in bucket ``bucket``: a function of these alone."""
    key = (int(seed) * 0x9E3779B1 + int(clip) * 0xC2B2AE35 + int(bucket) * 0x27D4EB2F + _VAL_STREAM) % (2**63 - 1)
    return torch.Generator(device="cpu").manual_seed(key)


def val_inputs(x0: torch.Tensor, seed: int, clip: int, bucket: int, buckets: int,
               t_range: tuple[float, float] = (0.0, 1.0)) -> tuple[torch.Tensor, float, torch.Tensor]:
    """``(x_t, t, target)`` of clip ``x0`` (one clip, no batch axis) in bucket ``bucket`` of
    ``t_range`` (one expert's range; [0, 1] otherwise)."""
    g = val_generator(seed, clip, bucket)
    noise = torch.randn(x0.shape, generator=g, dtype=torch.float32)
    u = float(torch.rand((), generator=g, dtype=torch.float64))
    lo, hi = t_range
    t = min(max(lo + (hi - lo) * (bucket + u) / buckets, 1e-4), 1 - 1e-4)
    x_t = (1 - t) * x0 + t * noise
    return x_t, t, noise - x0


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def validation_loss(predictor, cfg: Config, val: ValSet, version: int, *, seed: int | None = None,
                    buckets: int | None = None, batch_size: int | None = None) -> ValResult:
    """The validation loss of the weights of ``version`` (optimizer steps applied).

    ``predictor.predict(x_t, t, cond, cond_len, version)`` is the compute actor (or the training
    pipeline). It waits, shard by shard, until the store's version of the shard is at least
    ``version`` before it reads its weights. During training the caller passes ``k + 1`` after
    step ``k``: the version AdamW writes when it has updated the shard for step ``k``. That wait
    matters: between a shard's backward and its update the store may hold the shard's gradient
    in its ``w`` segment, so ``version k`` would read a gradient, not weights; ``k + 1`` is only
    reached after the update has written the new weights (and nothing may be queued past it).
    """
    t0 = time.perf_counter()
    seed = cfg.training.seed if seed is None else int(seed)
    nb = int(buckets or cfg.training.val_t_buckets)
    bs = int(batch_size or cfg.data.batch_size)
    t_range, groups = _expert_items(cfg, val, seed, nb)
    items = [item for group in groups.values() for item in group]
    losses: dict[tuple[int, int], float] = {}
    for group in groups.values():  # a call never mixes two experts' items
        for start in range(0, len(group), bs):
            chunk = group[start:start + bs]
            xs, ts, targets = zip(*(val_inputs(val.x0[i], seed, i, b, nb, t_range) for i, b in chunk))
            idx = [i for i, _ in chunk]
            x_t, target = torch.stack(xs), torch.stack(targets)
            first = int(cfg.model.arch == "wan" and cfg.model.clean_first_frame)  # TI2V from an image
            if first:
                x_t[:, :1] = val.x0[idx][:, :1]
            pred = predictor.predict(x_t, torch.tensor(ts, dtype=torch.float32), val.cond[idx],
                                     val.cond_len[idx], version, **val.condition_of(idx))
            err = (pred[:, first:].double() - target[:, first:].double()).pow(2)
            losses.update(zip(chunk, err.reshape(len(chunk), -1).mean(dim=1).tolist()))
    items.sort()  # clip-major, as without experts: the sums below add in the same order
    by_bucket = [math.fsum(losses[k] for k in items if k[1] == bucket) / len(val.rows) for bucket in range(nb)]
    experts = tuple((EXPERT_NAMES[e], math.fsum(losses[k] for k in group) / len(group))
                    for e, group in groups.items() if e is not None and group)
    return ValResult(math.fsum(losses[k] for k in items) / len(items), tuple(by_bucket), len(val.rows),
                     time.perf_counter() - t0, int(version), experts, t_range)


def _expert_items(cfg: Config, val: ValSet, seed: int, nb: int) -> tuple[tuple[float, float], dict]:
    """The times evaluated and the items ``(clip, bucket)`` by expert: one group (key None) for a
    one-transformer model; for one expert of a two-expert model (``training.expert`` high or low)
    the buckets divide its range; with both, each item goes to the expert diffusers' pipeline runs
    at its t (``route_expert``)."""
    t = cfg.training
    items = [(i, b) for i in range(len(val.rows)) for b in range(nb)]
    if not t.expert:
        return (0.0, 1.0), {None: items}
    if t.expert != "both":
        expert = HIGH if t.expert == "high" else LOW
        return expert_t_range(t.boundary_ratio, expert), {expert: items}
    groups: dict = {HIGH: [], LOW: []}
    for i, b in items:
        groups[route_expert(val_inputs(val.x0[i], seed, i, b, nb)[1], t.boundary_ratio)].append((i, b))
    return (0.0, 1.0), groups


# ---------------------------------------------------------------------------------------------
# A checkpoint
# ---------------------------------------------------------------------------------------------


def eval_config(state: dict, manifest: str | None, clips: int | None = None, buckets: int | None = None,
                seed: int | None = None, batch_size: int | None = None, device: str = "auto") -> Config:
    """The checkpoint's config for evaluating on ``manifest`` (default: its ``data.val_manifest``)
    with the training's validation settings unless given."""
    cfg = config_from_dict(state["config"])
    path = manifest or cfg.data.val_manifest
    if not path:
        raise ConfigError("give --data MANIFEST: this checkpoint's config has no data.val_manifest")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--data {path!r} does not exist")
    cfg.data.manifest = ""
    cfg.data.val_manifest = str(path)
    cfg.runtime.state_dir = ""
    cfg.runtime.device = device
    cfg.training.sample_every = 0
    cfg.training.eval_every = 0
    for field, value in (("val_clips", clips), ("val_t_buckets", buckets), ("seed", seed)):
        if value is not None:
            setattr(cfg.training, field, int(value))
    if batch_size is not None:
        cfg.data.batch_size = int(batch_size)
    validate(cfg)

    _check_manifest(cfg, "--data", str(path))
    return cfg


def evaluate_checkpoint(checkpoint: str | Path, manifest: str | None = None, clips: int | None = None,
                        buckets: int | None = None, seed: int | None = None, batch_size: int | None = None,
                        device: str = "auto", weights: str = "auto") -> ValResult:
    """The validation loss of ``checkpoint`` (a checkpoint or run directory: its latest), in this
    process: the compute actor streams the checkpoint's weights as ``sample`` does. A ``manifest``
    given without ``clips`` is scored whole (every readable row); with neither, the run's own
    validation set (``data.val_manifest``, ``training.val_clips``), so the loss equals the logged one.
    ``weights``: the trained weights or their moving average (``sampling.WEIGHTS``; ``auto``: what
    the run evaluated with, ``training.ema_eval``)."""
    try:
        ckpt = resolve_checkpoint(checkpoint)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--checkpoint {e}") from None
    state = read_checkpoint_state(ckpt)
    cfg = eval_config(state, manifest, clips, buckets, seed, batch_size, device)
    on_cpu = device == "cpu" or not torch.cuda.is_available()
    kind = "master" if on_cpu and DTYPES.get(state.get("w_dtype", "float32")) is torch.bfloat16 else "w"
    val = load_val_set(cfg, clips=ALL_ROWS if manifest and clips is None else None)
    source = CheckpointWeights(ckpt, cfg, kind, use_average(state, weights))
    compute = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    try:
        return validation_loss(compute, cfg, val, source.step)
    finally:
        compute.close()
        source.close()


