"""Every rule a config must meet, checked before Ray starts.

``validate(cfg)`` raises ``ConfigError`` on the first broken rule; each message names the
field, the value and what to do."""

from __future__ import annotations

import math
from pathlib import Path

from megaslide_ray.config.buckets import config_buckets, with_clip
from megaslide_ray.config.image_kinds import required_kind
from megaslide_ray.config.presets import PRESETS
from megaslide_ray.config.sections import Config, ConfigError


def fitting_window(window, grid, kind: str) -> tuple[int, ...]:
    """``window`` shrunk to fit the token ``grid``: each size at most its axis, odd unless ``kind``
    is swin (a window centred on each query needs a middle)."""
    out = []
    for k, n in zip(window, grid):
        k = min(k, n)
        if kind != "swin" and k % 2 == 0:
            k -= 1
        out.append(max(k, 1))
    return tuple(out)

def validate(cfg: Config) -> Config:
    """``cfg`` if every rule holds, else ``ConfigError`` naming the first broken one."""
    if cfg.model.arch == "wan":  # a wan model reads latents whatever an older config.toml said
        cfg.model.inputs = "latents"
    for check in (_check_sizes_and_model, _check_runtime_counts, _check_decoding, _check_shapes_and_attention,
                  _check_dense_levers, _check_buckets, _check_optimizer_and_runtime, _check_weight_average,
                  _check_run, _check_distillation):
        check(cfg)
    return cfg


def _check_sizes_and_model(cfg: Config) -> None:
    """Sizes and counts that must be positive, and the model's own fields."""
    m, a, d, o, t = cfg.model, cfg.attention, cfg.data, cfg.optim, cfg.training

    def positive(where: str, value: float) -> None:
        if not value > 0:
            raise ConfigError(f"{where}={value!r} must be > 0")

    for where, value in [("model.hidden_size", m.hidden_size), ("model.depth", m.depth),
                         ("model.num_heads", m.num_heads), ("model.mlp_ratio", m.mlp_ratio),
                         ("model.in_channels", m.in_channels), ("model.caption_dim", m.caption_dim),
                         ("model.caption_max_bytes", m.caption_max_bytes),
                         ("model.timestep_freq_dim", m.timestep_freq_dim),
                         ("data.num_frames", d.num_frames), ("data.height", d.height),
                         ("data.width", d.width), ("data.frame_stride", d.frame_stride),
                         ("data.batch_size", d.batch_size), ("data.prefetch", d.prefetch),
                         ("data.num_decoders", d.num_decoders), ("training.steps", t.steps),
                         ("training.log_every", t.log_every), ("training.sample_steps", t.sample_steps),
                         ("optim.lr", o.lr),
                         ("optim.eps", o.eps), ("training.flow_shift", t.flow_shift)]:
        positive(where, value)
    for i, p in enumerate(m.patch_size):
        positive(f"model.patch_size[{i}]", p)
    if m.inputs not in ("pixels", "latents"):
        raise ConfigError(f"model.inputs={m.inputs!r} is not one of ['pixels', 'latents']")
    if m.arch == "videodit" and m.inputs == "pixels" and m.in_channels != 3:
        raise ConfigError(f"model.in_channels={m.in_channels}: the video decoders deliver RGB clips (3 channels) and "
                          f"the videodit model reads pixels (model.inputs='pixels'); use model.in_channels=3 "
                          f"(VAE latents: model.inputs=latents)")
    for where, value in [("model.ffn_dim", m.ffn_dim), ("model.out_channels", m.out_channels),
                         ("attention.offset_groups", a.offset_groups)]:
        if value < 0:
            raise ConfigError(f"{where}={value} must be >= 0 (0 = the default it names)")
    if m.caption_layers < 0:
        raise ConfigError(f"model.caption_layers={m.caption_layers} must be >= 0 (0: a bag of bytes, no "
                          f"self-attention over the caption)")
    if m.arch == "videodit" and m.out_channels not in (0, m.in_channels):
        raise ConfigError(f"model.out_channels={m.out_channels}: the videodit model predicts its "
                          f"{m.in_channels} input channels; use 0 or {m.in_channels}")
    if m.prediction not in ("velocity", "sample"):
        raise ConfigError(f"model.prediction={m.prediction!r} is not one of ['velocity', 'sample']")
    if m.arch == "wan":
        _validate_wan(cfg)
    elif t.expert or t.boundary_ratio:
        raise ConfigError(f"training.expert={t.expert!r}, training.boundary_ratio={t.boundary_ratio}: experts are "
                          f"a wan model's (model.arch='wan'); leave them unset")
    elif m.inputs == "latents":
        for i, c in enumerate(m.latent_compression):
            if not c > 0:
                raise ConfigError(f"model.latent_compression[{i}]={c} must be > 0")


def _check_runtime_counts(cfg: Config) -> None:
    """The runtime's prefetch depth, token chunk and kept block inputs."""
    if cfg.runtime.prefetch_depth < 1:
        raise ConfigError(f"runtime.prefetch_depth={cfg.runtime.prefetch_depth} must be >= 1")
    if cfg.runtime.token_chunk < 0:
        raise ConfigError(f"runtime.token_chunk={cfg.runtime.token_chunk} must be >= 0 (0 = no chunking)")
    rt = cfg.runtime
    if rt.compute_actors != "auto" and (not isinstance(rt.compute_actors, int) or rt.compute_actors < 1):
        raise ConfigError(f"runtime.compute_actors={rt.compute_actors!r} must be an integer >= 1 or 'auto' (one "
                          f"compute actor per GPU of the node)")
    shards = cfg.model.depth + 2  # the input side, the blocks, the head (per expert: models.registry.num_shards)
    if not isinstance(rt.nodes, int) or not 1 <= rt.nodes <= shards:
        raise ConfigError(f"runtime.nodes={rt.nodes!r} must be an integer from 1 to the model's {shards} shards "
                          f"(model.depth + 2): each node owns the optimizer state of at least one shard")
    if not (rt.resident_gb >= 0 and math.isfinite(rt.resident_gb)):
        raise ConfigError(f"runtime.resident_gb={rt.resident_gb} must be a finite number of GB >= 0 (0: only the "
                          f"turn's block is kept from the forward to the backward)")
    _check_device_shards(cfg)
    if rt.grad_slots < 1:
        raise ConfigError(f"runtime.grad_slots={rt.grad_slots} must be >= 1 (2 lets a compute actor write one "
                          f"shard's gradient while the store sums the last)")
    if not (rt.grad_slot_mb >= 0 and math.isfinite(rt.grad_slot_mb)):
        raise ConfigError(f"runtime.grad_slot_mb={rt.grad_slot_mb} must be >= 0 (MB per gradient slot; 0: a slot "
                          f"holds the largest shard)")
    if cfg.training.micro_batches < 1:
        raise ConfigError(f"training.micro_batches={cfg.training.micro_batches} must be >= 1 (1: one batch of "
                          f"data.batch_size per compute actor and step)")
    if cfg.runtime.offload_keep < 0:
        raise ConfigError(f"runtime.offload_keep={cfg.runtime.offload_keep} must be >= 0 (0 = offload every "
                          f"block input; only used with runtime.offload_activations)")


def _check_device_shards(cfg: Config) -> None:
    """``runtime.device_shards``: shards 0..N-1 live on the one compute actor's device."""
    rt, t, n = cfg.runtime, cfg.training, cfg.runtime.device_shards
    if not isinstance(n, int) or not 0 <= n <= cfg.model.depth:
        raise ConfigError(f"runtime.device_shards={n!r} must be an integer from 0 to model.depth={cfg.model.depth} "
                          f"(the input shard and blocks; the head always streams)")
    if not n:
        return
    clashes = [(f"runtime.compute_actors={rt.compute_actors!r}", "set runtime.compute_actors=1")
               if rt.compute_actors != 1 else None,
               (f"runtime.nodes={rt.nodes}", "set runtime.nodes=1") if rt.nodes != 1 else None,
               (f"training.expert={t.expert!r}", "train one expert") if t.expert == "both" else None,
               (f"training.ema_decay={t.ema_decay}", "set training.ema_decay=0") if t.ema_decay else None]
    for what, fix in filter(None, clashes):
        raise ConfigError(f"runtime.device_shards={n} with {what}: shards kept and updated on the device need one "
                          f"compute actor on one node training one model without a moving average (their state "
                          f"lives on that device only); {fix}, or set runtime.device_shards=0")


def _check_decoding(cfg: Config) -> None:
    """How clips are read: frame rate or stride, decode timeout, clip cache, bad files."""
    d = cfg.data
    if d.fps < 0 or not math.isfinite(d.fps):
        raise ConfigError(f"data.fps={d.fps} must be >= 0 (0: sample by data.frame_stride)")
    if d.fps > 0 and d.frame_stride != 1:
        raise ConfigError(f"data.fps={d.fps} and data.frame_stride={d.frame_stride} both set; choose one "
                          f"(fps samples at a frame rate, frame_stride every n-th frame): set frame_stride=1 "
                          f"or fps=0")
    if not (d.decode_timeout_s > 0 and math.isfinite(d.decode_timeout_s)):
        raise ConfigError(f"data.decode_timeout_s={d.decode_timeout_s} must be a finite number of seconds > 0")
    if d.clip_cache_mb < 0:
        raise ConfigError(f"data.clip_cache_mb={d.clip_cache_mb} must be >= 0 (0: no decoded-clip cache)")
    if not 0 <= d.max_bad_fraction <= 1:
        raise ConfigError(f"data.max_bad_fraction={d.max_bad_fraction} must lie in [0, 1] (1 never stops)")


def _check_shapes_and_attention(cfg: Config) -> None:
    """Heads, patches and the clip against the token grid; the attention window and offset head."""
    m, a, d = cfg.model, cfg.attention, cfg.data
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
                          f"pick heads that divide the width (e.g. {_divisor_near(m.hidden_size, m.num_heads)})")
    if m.timestep_freq_dim % 2:
        raise ConfigError(f"model.timestep_freq_dim={m.timestep_freq_dim} must be even")
    if a.offset_groups and m.num_heads % a.offset_groups:
        raise ConfigError(f"attention.offset_groups={a.offset_groups} does not divide model.num_heads={m.num_heads}; "
                          f"use a divisor (e.g. {_divisor_near(m.num_heads, a.offset_groups)}) or 0 (one group per head)")
    if not cfg.latent_space:
        for axis, size, p in (("num_frames", d.num_frames, m.patch_size[0]), ("height", d.height, m.patch_size[1]),
                              ("width", d.width, m.patch_size[2])):
            if size % p:
                raise ConfigError(f"data.{axis}={size} is not divisible by the patch size {p} "
                                  f"(model.patch_size={m.patch_size}); use a multiple of {p}")
    else:
        _validate_latent_clip(cfg)
    grid = cfg.token_grid
    for i, (axis, k, n) in enumerate(zip(("frames", "height", "width"), a.window, grid)):
        if k <= 0 or (k % 2 == 0 and a.kind != "swin"):
            raise ConfigError(f"attention.window={a.window}: the {axis} size {k} must be odd and positive"
                              + ("" if k <= 0 else f" for attention.kind={a.kind!r} (a window centred on each "
                                 f"query; only swin's tiles may be even)"))
        if a.kind in ("dsa", "neighborhood", "swin") and k > n:
            raise ConfigError(f"attention.window={a.window}: the {axis} size {k} exceeds the token grid's "
                              f"{n} {axis} (grid {grid} = {'latent' if cfg.latent_space else 'data'} size / "
                              f"model.patch_size); a window that fits: --attention.window "
                              f"{','.join(str(w) for w in fitting_window(a.window, grid, a.kind))}")
    for i, k in enumerate(a.offset_kernel):
        if k <= 0 or k % 2 == 0:
            raise ConfigError(f"attention.offset_kernel={tuple(a.offset_kernel)}: size {k} (axis {i}) must be odd "
                              f"and positive, e.g. (3, 3, 3) or (3, 7, 7)")
    if not (a.offset_scale > 0 and math.isfinite(a.offset_scale)):
        raise ConfigError(f"attention.offset_scale={a.offset_scale} must be a finite number > 0 (1: the offsets "
                          f"learn at optim.lr; 0.1: ten times slower)")
    if a.max_offset < 0:
        raise ConfigError(f"attention.max_offset={a.max_offset} must be >= 0 (0 = unbounded)")
    if a.scale < 0:
        raise ConfigError(f"attention.scale={a.scale} must be >= 0 (0 = head_dim ** -0.5)")


def _check_dense_levers(cfg: Config) -> None:
    """``attention.dense_blocks``, ``dense_above_t`` and ``dense_warmup_steps``: in range, and only
    beside a kind that is not already dense."""
    a, depth = cfg.attention, cfg.model.depth
    blocks = tuple(a.dense_blocks)
    bad = [i for i in blocks if not 0 <= i < depth]
    if bad:
        raise ConfigError(f"attention.dense_blocks={list(blocks)}: block {bad[0]} is not one of the model's blocks "
                          f"0 .. {depth - 1} (model.depth={depth}); list indices from 0, e.g. "
                          f"--attention.dense_blocks 0,{depth - 1}")
    if len(set(blocks)) != len(blocks):
        raise ConfigError(f"attention.dense_blocks={list(blocks)} names a block twice; list each once")
    if not (math.isfinite(a.dense_above_t) and 0 <= a.dense_above_t < 1):
        raise ConfigError(f"attention.dense_above_t={a.dense_above_t} must be a flow time in [0, 1) (t = 1 is pure "
                          f"noise, which no sample reaches; 0 = off), e.g. 0.9 for the noisiest tenth of the path")
    if a.dense_warmup_steps < 0:
        raise ConfigError(f"attention.dense_warmup_steps={a.dense_warmup_steps} must be >= 0 (0 = no curriculum)")
    t = cfg.training
    if t.expert == "low" and t.boundary_ratio > 0 and a.dense_above_t >= t.boundary_ratio:
        raise ConfigError(f"attention.dense_above_t={a.dense_above_t} with training.expert='low': the low-noise "
                          f"expert only sees t < training.boundary_ratio={t.boundary_ratio}, so no sample is ever "
                          f"dense; set it below the boundary or to 0")
    if a.kind == "dense":
        on = [f"{k}={v}" for k, v in (("dense_blocks", list(blocks)), ("dense_above_t", a.dense_above_t),
                                      ("dense_warmup_steps", a.dense_warmup_steps)) if v]
        if on:
            raise ConfigError(f"attention.{on[0]} with attention.kind='dense': every block is already dense; "
                              f"set attention.kind to dsa (or neighborhood, swin) or drop the lever")


def _check_optimizer_and_runtime(cfg: Config) -> None:
    """AdamW's settings, the fields that must be >= 0, kept block graphs, the schedule and caption dropout."""
    o, t = cfg.optim, cfg.training
    b1, b2 = o.betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ConfigError(f"optim.betas={o.betas} must each lie in [0, 1)")
    for where, value in [("optim.weight_decay", o.weight_decay), ("optim.grad_clip", o.grad_clip),
                         ("optim.warmup_steps", o.warmup_steps), ("training.checkpoint_every", t.checkpoint_every),
                         ("training.sample_every", t.sample_every), ("training.eval_every", t.eval_every),
                         ("runtime.compute_threads", cfg.runtime.compute_threads),
                         ("runtime.optimizer_threads", cfg.runtime.optimizer_threads),
                         ("runtime.link_gbps", cfg.runtime.link_gbps),
                         ("runtime.max_restarts", cfg.runtime.max_restarts),
                         ("runtime.store_timeout_s", cfg.runtime.store_timeout_s),
                         ("optim.max_bad_steps", o.max_bad_steps),
                         ("ray.num_cpus", cfg.ray.num_cpus),
                         ("ray.metrics_export_port", cfg.ray.metrics_export_port)]:
        if value < 0:
            raise ConfigError(f"{where}={value} must be >= 0")
    if not (cfg.ray.connect_timeout_s > 0 and math.isfinite(cfg.ray.connect_timeout_s)):
        raise ConfigError(f"ray.connect_timeout_s={cfg.ray.connect_timeout_s} must be a finite number of seconds > 0")
    if not cfg.runtime.recompute_blocks:
        rt = cfg.runtime
        for bad, what in ((rt.device == "cuda", "runtime.device='cuda'"),
                          (rt.link_gbps > 0, f"runtime.link_gbps={rt.link_gbps}"),
                          (rt.offload_activations, "runtime.offload_activations=true")):
            if bad:
                raise ConfigError(f"runtime.recompute_blocks=false with {what}: keeping block graphs needs the "
                                  f"weights read in place by a CPU compute (device 'cpu' or 'auto', link_gbps 0, "
                                  f"no offload_activations); set runtime.recompute_blocks=true")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1]")
    if not 0 <= t.caption_dropout < 1:
        raise ConfigError(f"training.caption_dropout={t.caption_dropout} must lie in [0, 1) (0.1 is usual; 0 never "
                          f"drops a caption)")


def _check_weight_average(cfg: Config) -> None:
    """The moving average of the weights (``training.ema_*``)."""
    t = cfg.training
    if not (math.isfinite(t.ema_decay) and 0 <= t.ema_decay < 1):
        raise ConfigError(f"training.ema_decay={t.ema_decay} must lie in [0, 1): 0 turns the average of the weights "
                          f"off, 0.999 to 0.9999 is usual (an average over about 1 / (1 - ema_decay) steps)")
    if t.ema_start_step < 0:
        raise ConfigError(f"training.ema_start_step={t.ema_start_step} must be >= 0 (the optimizer steps before the "
                          f"average starts; 0: from the first)")
    if t.ema_decay and cfg.runtime.nodes > 1:
        raise ConfigError(f"training.ema_decay={t.ema_decay} with runtime.nodes={cfg.runtime.nodes}: the average of "
                          f"the weights is kept on one node only; set runtime.nodes=1 or training.ema_decay=0")


def _check_run(cfg: Config) -> None:
    """The preset, the manifests, validation and sampling during training."""
    d, o, t = cfg.data, cfg.optim, cfg.training
    if cfg.preset not in PRESETS:
        raise ConfigError(f"preset={cfg.preset!r} is unknown; choose one of {sorted(PRESETS)}")
    if d.manifest and not Path(d.manifest).is_file():
        raise ConfigError(f"data.manifest={d.manifest!r} does not exist; build one with "
                          f"`python -m megaslide_ray.index VIDEO_DIR --out manifest.parquet` or leave it empty "
                          f"for the demo set")
    if d.val_manifest and not Path(d.val_manifest).is_file():
        raise ConfigError(f"data.val_manifest={d.val_manifest!r} does not exist; give the held-out manifest "
                          f"(video, or latents for wan) or leave it empty")
    if t.val_clips < 1 or t.val_t_buckets < 1:
        raise ConfigError(f"training.val_clips={t.val_clips} and training.val_t_buckets={t.val_t_buckets} must "
                          f"both be >= 1")
    if t.eval_every and not d.val_manifest:
        raise ConfigError(f"training.eval_every={t.eval_every} needs data.val_manifest (the held-out clips); "
                          f"give --data.val_manifest MANIFEST or set training.eval_every=0")
    if not math.isfinite(o.lr):
        raise ConfigError(f"optim.lr={o.lr} must be finite")
    if t.sample_every:
        _check_sampling(cfg)


def _check_distillation(cfg: Config) -> None:
    """``training.distill_weight``: a finite weight >= 0, a known target, and when on a teacher to
    distil from (``training.init_from``) and a student that is not dense already."""
    t = cfg.training
    if not (t.distill_weight >= 0 and math.isfinite(t.distill_weight)):
        raise ConfigError(f"training.distill_weight={t.distill_weight} must be a finite number >= 0 (0: no "
                          f"distillation; e.g. 1.0 weighs the teacher's term like the task loss)")
    if t.distill_target != "output":
        raise ConfigError(f"training.distill_target={t.distill_target!r} is not one of ['output'] (the predicted "
                          f"velocity)")
    if not t.distill_weight:
        return
    if not t.init_from:
        raise ConfigError(f"training.distill_weight={t.distill_weight} distils from the pretrained dense model the "
                          f"run starts from, but training.init_from is empty (no teacher): give --init-from "
                          f"WEIGHTS (the dense model's checkpoint, safetensors or diffusers folder), or set "
                          f"training.distill_weight=0")
    if cfg.attention.kind == "dense":
        raise ConfigError(f"training.distill_weight={t.distill_weight} with attention.kind='dense': the model is the "
                          f"dense teacher itself, nothing to distil; set training.distill_weight=0, or adapt to "
                          f"attention.kind dsa, neighborhood or swin")


IMAGE_SEP = " | "
"""Splits a line of ``training.sample_prompts_file`` into its prompt and its images."""


def _prompt_lines(cfg: Config) -> list[str]:
    """The non-blank, non-comment lines of ``training.sample_prompts_file``, else
    ``training.sample_prompt`` alone. ``ConfigError`` when the file cannot be read or is empty."""
    t = cfg.training
    if not t.sample_prompts_file:
        return [t.sample_prompt]
    path = Path(t.sample_prompts_file).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"training.sample_prompts_file={t.sample_prompts_file!r} cannot be read ({e}); give a "
                          f"UTF-8 text file with one prompt per line, or leave it empty to sample "
                          f"training.sample_prompt") from None
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ConfigError(f"training.sample_prompts_file={t.sample_prompts_file!r} holds no prompt (blank lines and "
                          f"lines starting with # are skipped); write one prompt per line")
    return prompts


def sample_prompts(cfg: Config) -> list[str]:
    """The prompts sampled during training: the lines of ``training.sample_prompts_file`` (blank
    lines and ``#`` comments skipped; a line's images, after `` | ``, left out), else
    ``training.sample_prompt`` alone."""
    return [line.split(IMAGE_SEP)[0].strip() for line in _prompt_lines(cfg)]


def sample_prompt_images(cfg: Config) -> list[tuple[str | None, str | None]]:
    """Each prompt's ``(image, last image)`` for an image-to-video model: a line ``PROMPT | IMAGE``
    (FLF2V: ``PROMPT | IMAGE | LAST_IMAGE``), paths relative to the prompts file's folder; ``(None,
    None)`` for a line without them."""
    t = cfg.training
    base = Path(t.sample_prompts_file).expanduser().parent if t.sample_prompts_file else Path(".")
    out = []
    for line in _prompt_lines(cfg):
        parts = [p.strip() for p in line.split(IMAGE_SEP)[1:]]
        paths = [str(base / Path(p).expanduser()) if p else None for p in parts] + [None, None]
        out.append((paths[0], paths[1]))
    return out


def _check_prompt_images(cfg: Config) -> None:
    """An image-to-video model samples each prompt from its image(s); a text-to-video one takes none."""
    m, t = cfg.model, cfg.training
    kind = required_kind(m) if m.arch == "wan" else None
    wants_image = kind is not None or m.clean_first_frame
    for (image, last), prompt in zip(sample_prompt_images(cfg), sample_prompts(cfg)):
        where = f"training.sample_prompts_file={t.sample_prompts_file!r}, prompt {prompt!r}"
        if not wants_image and (image or last):
            raise ConfigError(f"{where}: gives an image, but model is text-to-video; write the prompt alone")
        if not wants_image:
            continue
        if image is None:
            raise ConfigError(f"{where if t.sample_prompts_file else 'training.sample_prompt'}: an image-to-video "
                              f"model ({kind or 'TI2V from an image'}) samples from an image: give "
                              f"--training.sample_prompts_file with lines 'PROMPT | IMAGE'"
                              + (" | LAST_IMAGE'" if kind == "flf2v" else ""))
        if (last is not None) != (kind == "flf2v"):
            raise ConfigError(f"{where}: " + ("a first-last-frame (FLF2V) model needs 'PROMPT | IMAGE | LAST_IMAGE'"
                                              if kind == "flf2v" else "only an FLF2V model takes a last image"))
        for path in (image, last):
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{where}: the image {path!r} does not exist (paths are relative to the prompts "
                                  f"file's folder)")


def _check_sampling(cfg: Config) -> None:
    """Sampling during training (``training.sample_every`` > 0): its guidance, device, prompts and experts."""
    t = cfg.training
    if not math.isfinite(t.sample_cfg_scale):
        raise ConfigError(f"training.sample_cfg_scale={t.sample_cfg_scale} must be finite (1: no guidance)")
    if t.sample_device not in ("cpu", "cuda"):
        raise ConfigError(f"training.sample_device={t.sample_device!r} is not one of 'cpu', 'cuda'")
    if t.expert in ("high", "low"):
        raise ConfigError(f"training.sample_every={t.sample_every} with training.expert={t.expert!r}: a sample runs "
                          f"both experts of a two-expert model, and this run trains one; set training.sample_every=0 "
                          f"(or train both: training.expert=both)")
    _check_prompt_images(cfg)


def _validate_wan(cfg: Config) -> None:
    """The model fields only ``arch=wan`` reads (the clip is checked by ``_validate_latent_clip``)."""
    m = cfg.model
    if m.prediction != "velocity":
        raise ConfigError(f"model.prediction={m.prediction!r}: the wan models predict the velocity (they were "
                          f"pretrained on it); use model.prediction=velocity")
    for where, value in [("model.text_dim", m.text_dim), ("model.text_len", m.text_len),
                         ("model.rope_max_seq_len", m.rope_max_seq_len), ("model.eps", m.eps)]:
        if not value > 0:
            raise ConfigError(f"{where}={value!r} must be > 0")
    for i, c in enumerate(m.latent_compression):
        if not c > 0:
            raise ConfigError(f"model.latent_compression[{i}]={c} must be > 0")
    _validate_image_fields(cfg)
    _validate_experts(cfg)


def _validate_image_fields(cfg: Config) -> None:
    """The image-to-video fields: the image embedder and the image keys/values come together,
    the keys' width is the model's, FLF2V's positions need the embedder."""
    m = cfg.model
    for where, value in [("model.image_dim", m.image_dim), ("model.added_kv_proj_dim", m.added_kv_proj_dim),
                         ("model.pos_embed_seq_len", m.pos_embed_seq_len)]:
        if value < 0:
            raise ConfigError(f"{where}={value} must be >= 0 (0: none)")
    if bool(m.image_dim) != bool(m.added_kv_proj_dim):
        raise ConfigError(f"model.image_dim={m.image_dim} and model.added_kv_proj_dim={m.added_kv_proj_dim}: an "
                          f"image-to-video Wan model has both (the image embedder and the image keys/values) or "
                          f"neither; set both (added_kv_proj_dim = model.hidden_size) or both to 0")
    if m.added_kv_proj_dim and m.text_len != 512:
        raise ConfigError(f"model.text_len={m.text_len} with image keys/values (model.added_kv_proj_dim): diffusers' "
                          f"Wan attention takes the last 512 tokens of the context as the text and those before as "
                          f"the image, so an image-to-video model reads 512 text tokens; set model.text_len=512")
    if m.added_kv_proj_dim and m.added_kv_proj_dim != m.hidden_size:
        raise ConfigError(f"model.added_kv_proj_dim={m.added_kv_proj_dim}: the image embedder projects to "
                          f"model.hidden_size={m.hidden_size}, so the image keys/values read that width; set "
                          f"it to {m.hidden_size}")
    if m.pos_embed_seq_len and not m.image_dim:
        raise ConfigError(f"model.pos_embed_seq_len={m.pos_embed_seq_len} (FLF2V) needs the image embedder "
                          f"(model.image_dim > 0)")
    image_to_video = m.image_dim or m.in_channels > (m.out_channels or m.in_channels)
    if m.clean_first_frame and (image_to_video or m.patch_size[0] != 1 or cfg.runtime.token_chunk):
        raise ConfigError(f"model.clean_first_frame (Wan2.2 TI2V from an image) needs a text-to-video input "
                          f"(model.in_channels = out_channels, no image embedder), model.patch_size[0] = 1 (got "
                          f"{m.patch_size[0]}) and runtime.token_chunk = 0 (got {cfg.runtime.token_chunk}: the "
                          f"chunked block does not modulate per frame yet)")
    if m.pos_embed_seq_len % 2:
        raise ConfigError(f"model.pos_embed_seq_len={m.pos_embed_seq_len}: FLF2V's positions cover the first and "
                          f"last frames' image tokens alike, so it is even (2 x 257)")


def _validate_experts(cfg: Config) -> None:
    """``training.expert`` and ``training.boundary_ratio``: a two-expert model names the experts it
    trains; ``both`` runs on one node with one compute actor."""
    t, rt = cfg.training, cfg.runtime
    if t.expert not in ("", "high", "low", "both"):
        raise ConfigError(f"training.expert={t.expert!r} is not one of '', 'high', 'low', 'both'")
    if not 0.0 <= t.boundary_ratio < 1.0:
        raise ConfigError(f"training.boundary_ratio={t.boundary_ratio} must be in [0, 1) (0: a one-transformer "
                          f"model)")
    if t.boundary_ratio and not t.expert:
        raise ConfigError(f"training.boundary_ratio={t.boundary_ratio}: a two-expert Wan2.2 A14B model; say which "
                          f"experts train: --training.expert both (both in one run, routed by timestep), high "
                          f"(transformer/, t >= {t.boundary_ratio}) or low (transformer_2/, t < {t.boundary_ratio})")
    if t.low_expert_lr < 0 or (t.low_expert_lr and t.expert != "both"):
        raise ConfigError(f"training.low_expert_lr={t.low_expert_lr}: the low-noise expert's learning rate when both "
                          f"experts train in one run (training.expert='both', here {t.expert!r}), >= 0; with one "
                          f"expert set optim.lr")
    if t.expert and not t.boundary_ratio:
        raise ConfigError(f"training.expert={t.expert!r} needs a two-expert model (training.boundary_ratio > 0, "
                          f"read from an A14B folder's model_index.json by --init-from); leave it empty")
    if t.expert == "both" and (rt.nodes != 1 or rt.compute_actors not in (1, "auto")):
        raise ConfigError(f"training.expert='both' runs on one node with one compute actor (runtime.nodes="
                          f"{rt.nodes}, runtime.compute_actors={rt.compute_actors!r}); set both to 1, or train "
                          f"the experts in separate runs (training.expert high / low)")


def _check_buckets(cfg: Config) -> None:
    """Every bucket of ``data.buckets`` must be a clip the model reads, as ``data.num_frames/height/width``
    is. ``auto`` is replaced by the buckets it stands for, so a run's saved config lists them (and a
    resumed run draws the same batches)."""
    buckets = config_buckets(cfg)
    if cfg.data.buckets.strip().lower() == "auto":
        cfg.data.buckets = ",".join(str(b) for b in buckets)
    for bucket in buckets:
        try:
            _check_shapes_and_attention(with_clip(cfg, bucket))
        except ConfigError as e:
            raise ConfigError(f"data.buckets={cfg.data.buckets!r}: the bucket {bucket} (height x width x frames) "
                              f"does not fit the model: {e}") from None


def _validate_latent_clip(cfg: Config) -> None:
    """Latent space (``wan``, or ``videodit`` with ``model.inputs = latents``):
    ``data.num_frames/height/width`` are the pixel clip the VAE encodes; the latent grid must divide
    into patches, and for ``wan`` every token-grid axis must fit the rotary embedding."""
    m, d = cfg.model, cfg.data
    ct, ch, cw = m.latent_compression
    if (d.num_frames - 1) % ct:
        below = (d.num_frames - 1) // ct * ct + 1
        choices = [f for f in (below, below + ct) if f >= 1]
        vae = "Wan VAE" if m.arch == "wan" else "VAE"
        raise ConfigError(f"data.num_frames={d.num_frames}: the {vae} encodes {ct}k+1 frames "
                          f"(model.latent_compression={m.latent_compression}); use "
                          f"{' or '.join(str(f) for f in choices)}")
    head_dim = m.hidden_size // m.num_heads
    if m.arch == "wan" and head_dim % 2:
        raise ConfigError(f"model.hidden_size / model.num_heads = {head_dim}: the Wan rotary embedding needs an "
                          f"even head width")
    for axis, size, c, p in (("height", d.height, ch, m.patch_size[1]), ("width", d.width, cw, m.patch_size[2])):
        if size % (c * p):
            unit = c * p
            near = sorted({max(unit, size // unit * unit), size // unit * unit + unit})
            raise ConfigError(f"data.{axis}={size} is not divisible by {unit} (VAE compression {c} x "
                              f"model.patch_size {p}); use {' or '.join(str(v) for v in near)}")
    frames = cfg.latent_grid[0]
    if frames % m.patch_size[0]:
        raise ConfigError(f"data.num_frames={d.num_frames} gives {frames} latent frames, not divisible by the "
                          f"patch size {m.patch_size[0]} (model.patch_size={m.patch_size})")
    for axis, n in zip(("frames", "height", "width"), cfg.token_grid):
        if m.arch == "wan" and n > m.rope_max_seq_len:
            raise ConfigError(f"the token grid {cfg.token_grid} has {n} {axis}, more than model.rope_max_seq_len="
                              f"{m.rope_max_seq_len} rotary positions; use a shorter clip or raise the field")


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: (abs(d - k), d))
