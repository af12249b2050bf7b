"""What the learned DSA offsets do: the offset field of one clip, drawn and measured.

A ``dsa`` block predicts, for every token and head (or head group), K = kt*kh*kw offsets
``(dt, dy, dx)`` that move its samples away from the fixed window. To follow an object that
moves ``v`` tokens per latent frame, the samples in the window's time slice at relative time
``tau`` (-1, 0, +1 for kt = 3) should move by about ``tau * v``: so the offsets, averaged over
each time slice's kh*kw samples, are regressed on ``tau`` and the slope is the block's
**motion estimate** ``(vy, vx)`` in tokens per frame (``motion_estimate``). With ``kt == 1``
there is no time slice to compare and the estimate is the mean spatial offset.

* ``offset_field(checkpoint, clip, caption)`` runs the input shard and blocks ``1..block`` of a
  checkpoint (its fp32 ``master`` weights) on one clip noised at a fixed ``t`` with fixed noise
  and returns that block's offsets ``(T, H, W, nh, K, 3)`` in tokens.
* ``draw_offset_field`` draws the motion estimate as arrows over a frame, one panel per head
  group (``attention.offset_groups``; heads of a group share offsets), the arrow lengths in
  pixels (tokens times the patch size).
* ``motion_alignment`` compares the estimate with a known motion: the cosine between the mean
  estimate over a set of tokens (e.g. the moving object's) and the true direction, and the
  ratio of their lengths.

``python -m megaslide_ray.report RUN_DIR`` draws ``offsets.png`` for a ``dsa`` run from its
latest checkpoint and the first clip of its data.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from megaslide_ray.config import Config, config_from_dict
from megaslide_ray.data.captions import caption_batch
from megaslide_ray.data.clips import decode_clip
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation.plotting import pyplot
from megaslide_ray.models.attention import OffsetPredictor
from megaslide_ray.models.registry import build_shard
from megaslide_ray.state.checkpoint import (
    CheckpointReader,
    latest_checkpoint,
    read_checkpoint_state,
    resolve_checkpoint,
)


def _load_shard(cfg: Config, ckpt, index: int) -> torch.nn.Module:

    module = build_shard(cfg, index, "cpu")
    module.load_state_dict({k: v.float() for k, v in ckpt.tensors(index, "master").items()})
    return module.eval()


def _offset_modules(block: torch.nn.Module) -> list[torch.nn.Module]:

    found = [m for m in block.modules() if isinstance(m, OffsetPredictor)]
    if not found:  # the wan block names its predictor attn1.offsets; it is the same class or not
        found = [m for n, m in block.named_modules() if n.endswith("offsets")]
    return found


@torch.no_grad()
def offset_field(checkpoint: str | Path, clip: np.ndarray, caption: str, block: int = 1, t: float = 0.5,
                 seed: int = 0) -> tuple[torch.Tensor, Config]:
    """Offsets of block ``block`` for ``clip`` (uint8 ``(F, H, W, C)`` at the checkpoint's data
    size) with ``caption``, at flow time ``t`` with noise from ``seed``. Returns
    ``(offsets (T, H, W, nh, K, 3) float32, the checkpoint's config)``."""
    path = resolve_checkpoint(checkpoint)
    with CheckpointReader(path) as ckpt:
        cfg = config_from_dict(ckpt.state["config"])
        cfg.runtime.token_chunk = 0  # one call of the offset predictor per block
        cfg.attention.dense_above_t = 0.0  # the head's offsets at any t, even where the run attends densely
        if cfg.model.arch != "videodit":
            raise ValueError(f"offset_field draws videodit runs; this checkpoint is model.arch={cfg.model.arch!r}")
        if cfg.attention.kind != "dsa":
            raise ValueError(f"the checkpoint's attention.kind is {cfg.attention.kind!r}: only dsa learns offsets")
        if not 1 <= block <= cfg.model.depth:
            raise ValueError(f"block={block}: the model has blocks 1..{cfg.model.depth}")
        if block - 1 in tuple(cfg.attention.dense_blocks):
            raise ValueError(f"block={block} is dense (attention.dense_blocks={list(cfg.attention.dense_blocks)}, "
                             f"0-based): it has no offset head; pick another block")
        d = cfg.data
        want = (d.num_frames, d.height, d.width, cfg.model.in_channels)
        if tuple(clip.shape) != want:
            raise ValueError(f"clip of shape {tuple(clip.shape)}; the checkpoint's model reads {want} (F, H, W, C)")
        x0 = torch.from_numpy(np.asarray(clip, dtype=np.float32))[None] / 127.5 - 1.0
        noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
        x_t = (1 - t) * x0 + t * noise
        cap, cap_len = caption_batch(caption, cfg.model.caption_max_bytes, 1)
        x, c = _load_shard(cfg, ckpt, 0)(x_t, torch.full((1,), t), torch.from_numpy(cap), torch.from_numpy(cap_len))
        for i in range(1, block):
            x = _load_shard(cfg, ckpt, i)(x, c)
        target = _load_shard(cfg, ckpt, block)
        got: list[torch.Tensor] = []
        hooks = [m.register_forward_hook(lambda mod, args, out: got.append(out)) for m in _offset_modules(target)]
        try:
            target(x, c)
        finally:
            for h in hooks:
                h.remove()
    if len(got) != 1:
        raise RuntimeError(f"expected one offset prediction from block {block}, got {len(got)}")
    return got[0][0].float(), cfg


def motion_estimate(offsets: torch.Tensor, window: tuple[int, int, int]) -> torch.Tensor:
    """``(..., nh, K, 3)`` offsets -> ``(..., nh, 2)`` ``(vy, vx)`` in tokens per frame: the slope
    of the per-time-slice mean spatial offset against the slice's relative time (module
    docstring); for ``kt == 1`` the mean spatial offset."""
    kt, kh, kw = window
    o = offsets[..., 1:].reshape(*offsets.shape[:-2], kt, kh * kw, 2).mean(dim=-2)  # (..., nh, kt, 2)
    if kt == 1:
        return o[..., 0, :]
    tau = torch.arange(kt, dtype=o.dtype) - (kt - 1) / 2
    return (o * tau[:, None]).sum(dim=-2) / float((tau * tau).sum())


def head_groups(cfg: Config) -> int:
    return cfg.attention.offset_groups or cfg.model.num_heads


def motion_alignment(estimate: torch.Tensor, mask: torch.Tensor, velocity: tuple[float, float]) -> dict:
    """``estimate (T, H, W, nh, 2)``, ``mask (T, H, W)`` bool (the tokens to average, e.g. the
    object's), ``velocity (vy, vx)`` in tokens per frame -> ``{"cosine", "length_ratio",
    "mean_estimate"}`` of the mean estimate over the masked tokens and all heads."""
    if not bool(mask.any()):
        raise ValueError("the mask selects no token")
    mean = estimate[mask].mean(dim=(0, 1))  # (2,)
    v = torch.tensor(velocity, dtype=mean.dtype)
    norm_v, norm_m = float(v.norm()), float(mean.norm())
    cos = float(mean @ v) / (norm_v * norm_m) if norm_v > 0 and norm_m > 0 else 0.0
    return {"cosine": cos, "length_ratio": norm_m / norm_v if norm_v > 0 else math.nan,
            "mean_estimate": [float(mean[0]), float(mean[1])]}


def draw_offset_field(frame: np.ndarray, estimate: torch.Tensor, patch: tuple[int, int, int], groups: int,
                      out: str | Path, title: str = "", max_panels: int = 4) -> Path:
    """Arrows of ``estimate (H, W, nh, 2)`` (one time slice) over ``frame`` (uint8 ``(Hp, Wp, 3)``),
    one panel per head group (the first ``max_panels``), lengths in pixels. Returns ``out``."""
    plt = pyplot()
    H, W, nh, _ = estimate.shape
    per = nh // groups
    panels = min(groups, max_panels)
    _, ph, pw = patch
    ys, xs = np.meshgrid((np.arange(H) + 0.5) * ph, (np.arange(W) + 0.5) * pw, indexing="ij")
    fig, axes = plt.subplots(1, panels, figsize=(3.2 * panels, 3.4), squeeze=False)
    for g in range(panels):
        ax = axes[0, g]
        e = estimate[:, :, g * per].numpy()  # heads of a group share offsets: its first head stands for it
        ax.imshow(frame, interpolation="nearest")
        ax.quiver(xs, ys, e[..., 1] * pw, e[..., 0] * ph, color="yellow", angles="xy", scale_units="xy", scale=1,
                  width=0.006)
        ax.set_title(f"head group {g}" + (f" (heads {g * per}-{g * per + per - 1})" if per > 1 else f" (head {g})"),
                     fontsize=8)
        ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=9)
    out = Path(out)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def draw_run_offsets(checkpoint: str | Path, clip: np.ndarray, caption: str, out: str | Path,
                     block: int = 1) -> Path:
    """``offset_field`` + ``motion_estimate`` + ``draw_offset_field`` at the clip's middle latent
    frame."""
    offsets, cfg = offset_field(checkpoint, clip, caption, block)
    est = motion_estimate(offsets, tuple(cfg.attention.window))
    ti = est.shape[0] // 2
    pt = cfg.model.patch_size[0]
    frame = np.asarray(clip[min(ti * pt, clip.shape[0] - 1)])
    if frame.shape[-1] == 1:
        frame = np.repeat(frame, 3, axis=-1)
    mean_len = float(est.norm(dim=-1).mean())
    return draw_offset_field(frame, est[ti], tuple(cfg.model.patch_size), head_groups(cfg), out,
                             title=f"block {block}, frame {ti}: motion estimate from the learned offsets "
                                   f"(mean {mean_len:.2f} tokens/frame) for {caption!r}")


def run_offsets_plot(run_dir: str | Path, out: str | Path, block: int = 1) -> tuple[Path | None, str]:
    """``offsets.png`` for a run: its latest checkpoint and the first clip of its validation set
    (else of its training data), decoded as the validation set is (first frames, centre crop).
    Returns ``(path, "")``, or ``(None, why not)`` for a run that has no offsets to draw."""
    from dataclasses import replace


    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None, "no checkpoint yet"
    cfg = config_from_dict(read_checkpoint_state(ckpt)["config"])
    if cfg.attention.kind != "dsa" or cfg.model.arch != "videodit" or cfg.latent_space:
        return None, f"attention.kind={cfg.attention.kind!r}, model.arch={cfg.model.arch!r}: no pixel-space dsa offsets"
    local = [i for i in range(1, cfg.model.depth + 1) if i - 1 not in tuple(cfg.attention.dense_blocks)]
    if not local:
        return None, "every block is dense (attention.dense_blocks): no offsets"
    block = block if block in local else local[0]  # a dense block has no offset head: the first dsa one
    manifest = cfg.data.val_manifest or cfg.data.manifest
    if not manifest or not Path(manifest).is_file():
        return None, f"its data manifest {manifest!r} is not here"
    entry = read_manifest(manifest)[0]
    d = replace(cfg.data, manifest=manifest, random_crop=False, spatial_crop="center")
    clip = decode_clip(entry.path, d, cfg.training.seed, 0).frames
    return draw_run_offsets(ckpt, clip, entry.caption, out, block), ""
