"""The presets: plain functions that return a ``Config``.

``tiny`` (the default: seconds per step on 2 CPU cores), ``tiny-motion`` (learns the simple
motion set on a CPU), the paper's latent DiTs (``dit-28b``, ``dit-33b``, ``dit-105b``, whose
parameter counts match the paper's) and the Wan 2.x sizes (``wan2.1-t2v-1.3b``,
``wan2.1-t2v-14b``, ``wan2.2-ti2v-5b``)."""

from __future__ import annotations

import typing

from megaslide_ray.config.sections import (
    AttentionConfig,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimizerConfig,
    RuntimeConfig,
    TrainingConfig,
)


def tiny() -> Config:
    """About two seconds per step on two CPU cores: 16 frames of 64x64 in 2x4x4 patches (2048 tokens),
    4 blocks of width 128. The width exceeds the patch's 96 values, so the model can carry the
    noise it must predict (a pixel DiT narrower than its patch cannot)."""
    return Config(preset="tiny")


def tiny_motion() -> Config:
    """``tiny``'s model sized to learn, on a CPU, to draw what its caption says: 8 frames of 16x16
    in 2x2x2 patches (256 tokens), batch 8 at lr 1e-3, x-prediction, ``swin`` attention in 2x4x4
    tiles (at this size dsa's CPU step is about 2.4x this one), 2400 steps, kept block graphs and a
    decoded-clip cache (under 9 minutes on 2 CPU cores through the actors). Made for the motion
    set's simple variant (``train --preset tiny-motion --demo motion-simple``), where its samples learn
    to show the prompted colour, shape and direction (``benchmarks.studies.learning`` scores them)."""
    cfg = Config(preset="tiny-motion")
    cfg.model = ModelConfig(patch_size=(2, 2, 2), prediction="sample")
    # swin tiles of 2x4x4 tokens divide the 4x8x8 grid (3x3x3 pads it to 6x9x9): a cheaper step,
    # and more training prompts shown after 2400 steps than with 3x3x3
    cfg.attention = AttentionConfig(kind="swin", window=(2, 4, 4))
    cfg.data = DataConfig(num_frames=8, height=16, width=16, batch_size=8, clip_cache_mb=64)
    cfg.optim = OptimizerConfig(lr=1e-3)
    # The step is all compute: no recomputed forward (kept graphs, on a CPU), no re-decoding of
    # the 48 clips every 6 steps (the cache holds each 6 KB clip).
    cfg.runtime = RuntimeConfig(recompute_blocks=False)
    cfg.training = TrainingConfig(steps=2400, log_every=50, checkpoint_every=600,
                                  sample_prompt="a red circle moving right at medium speed on a dark blue background")
    return cfg


GPU_MAX_OFFSET = 1.5
"""The paper's and the Wan presets' offset bound, in tokens, clamped (``attention.offset_bound
clamp``): within it a head's offsets are its own. At every preset's shape it keeps each DSA pass on
tensor cores (the halo kernels, then the key-side pass: deterministic dk/dv without atomics), where
unbounded offsets send the calls whose largest offset passes 2 tokens to the gather kernels (CUDA
cores) and past 3 add float atomics; it also lets a token-chunked block hold only the key frames a
slab reaches. ``attention.max_offset 0`` restores unbounded offsets (what the bound costs in
held-out loss: docs/status.md)."""

GPU_OFFSET_FIELDS = {"max_offset": GPU_MAX_OFFSET, "offset_bound": "clamp"}
"""The ``attention`` fields that give a dsa model the GPU presets' bound."""


def _dsa(window: tuple[int, int, int]) -> AttentionConfig:
    return AttentionConfig(kind="dsa", window=window, **GPU_OFFSET_FIELDS)


def _paper(name: str, hidden: int, depth: int, heads: int) -> Config:
    """The paper's presets work on VAE latents as real video DiTs do: 16 channels of a VAE that
    compresses 4x in time and 8x in space (Wan2.1's), patches of 1x2x2 latent positions; the clip
    (81 frames of 480x832, 21 x 30 x 52 tokens) is given in pixels, 4k+1 frames."""
    cfg = Config(preset=name)
    cfg.model = ModelConfig(
        hidden_size=hidden, depth=depth, num_heads=heads, mlp_ratio=4.0, patch_size=(1, 2, 2),
        inputs="latents", in_channels=16, latent_compression=(4, 8, 8), caption_dim=1024, caption_max_bytes=256,
        cross_attention=False,
    )
    cfg.attention = _dsa((3, 5, 5))
    cfg.data = DataConfig(num_frames=81, height=480, width=832, batch_size=1)
    cfg.optim = OptimizerConfig(lr=1e-5, warmup_steps=100, weight_decay=0.01)
    cfg.training = TrainingConfig(steps=1000, checkpoint_every=100)
    return cfg


def dit_105b() -> Config:
    """The paper's 105B model: width 12288, 35 blocks, 96 heads (104.9e9 parameters), on VAE latents
    (16 channels, 4x8x8 compression, 1x2x2 patches)."""
    return _paper("dit-105b", hidden=12288, depth=35, heads=96)


def dit_33b() -> Config:
    """The 33.3B scaling point: width 5632, 53 blocks, 44 heads (33.36e9 parameters), on VAE latents
    like ``dit-105b``."""
    return _paper("dit-33b", hidden=5632, depth=53, heads=44)


def dit_28b() -> Config:
    """The 28.4B scaling point: width 5632, 45 blocks, 44 heads (28.34e9 parameters), on VAE latents
    like ``dit-105b``."""
    return _paper("dit-28b", hidden=5632, depth=45, heads=44)


WAN_WINDOW = (3, 7, 7)
"""The Wan presets' DSA window, in tokens: 3 latent frames (about 12 video frames, 0.75 s at Wan's
16 fps) by 7 x 7 tokens (112 x 112 pixels through Wan2.1's 8x VAE and 2x2 patches, 224 x 224 for
Wan2.2 TI2V-5B), K = 147 keys per query against 32,760 for dense attention on an 81 x 480 x 832 clip;
the learned offsets reach up to ``GPU_MAX_OFFSET`` beyond it."""


def _wan(name: str, hidden: int, depth: int, heads: int, ffn: int, channels: int,
         compression: tuple[int, int, int], height: int, width: int) -> Config:
    cfg = Config(preset=name)
    cfg.model = ModelConfig(
        arch="wan", hidden_size=hidden, depth=depth, num_heads=heads, ffn_dim=ffn, patch_size=(1, 2, 2),
        inputs="latents", in_channels=channels, out_channels=channels, timestep_freq_dim=256, text_dim=4096, text_len=512,
        latent_compression=compression, rope_max_seq_len=1024, eps=1e-6, cross_attn_norm=True,
    )
    cfg.attention = _dsa(WAN_WINDOW)
    cfg.data = DataConfig(num_frames=81, height=height, width=width, batch_size=1)
    cfg.optim = OptimizerConfig(lr=1e-5, warmup_steps=100, weight_decay=0.01)
    cfg.training = TrainingConfig(steps=1000, checkpoint_every=100)
    return cfg


def wan21_t2v_1_3b() -> Config:
    """Wan2.1 text-to-video 1.3B: width 1536, 30 blocks, 12 heads, FFN 8960, 16 latent channels (1,418,996,800
    parameters with dense attention, plus the DSA offset heads); 81 frames of 480x832."""
    return _wan("wan2.1-t2v-1.3b", hidden=1536, depth=30, heads=12, ffn=8960, channels=16,
                compression=(4, 8, 8), height=480, width=832)


def wan21_t2v_14b() -> Config:
    """Wan2.1 text-to-video 14B: width 5120, 40 blocks, 40 heads, FFN 13824, 16 latent channels
    (14,288,491,584 parameters with dense attention, plus the DSA offset heads); 81 frames of 720x1280."""
    return _wan("wan2.1-t2v-14b", hidden=5120, depth=40, heads=40, ffn=13824, channels=16,
                compression=(4, 8, 8), height=720, width=1280)


def wan22_ti2v_5b() -> Config:
    """Wan2.2 TI2V-5B, trained here as text-to-video: width 3072, 30 blocks, 24 heads, FFN 14336, 48 latent
    channels of a (4, 16, 16) VAE (4,999,787,712 parameters with dense attention, plus the DSA offset heads);
    81 frames of 480x832."""
    return _wan("wan2.2-ti2v-5b", hidden=3072, depth=30, heads=24, ffn=14336, channels=48,
                compression=(4, 16, 16), height=480, width=832)


def wan22_t2v_a14b() -> Config:
    """Wan2.2 text-to-video A14B: two experts of the Wan2.1 14B shape (width 5120, 40 blocks, 40
    heads, FFN 13824, 16 latent channels; 2 x 14,288,491,584 parameters with dense attention, plus
    the DSA offset heads), ``transformer/`` for t >= 0.875 and ``transformer_2/`` below, both
    trained in one run (``training.expert = both``); 81 frames of 720x1280. ``flow_shift`` 5 (Wan's
    720p value): each step trains the high-noise expert with probability 0.37 (logit-normal t)."""
    cfg = _wan("wan2.2-t2v-a14b", hidden=5120, depth=40, heads=40, ffn=13824, channels=16,
               compression=(4, 8, 8), height=720, width=1280)
    cfg.training.expert, cfg.training.boundary_ratio, cfg.training.flow_shift = "both", 0.875, 5.0
    return cfg


def _wan_i2v(name: str, height: int, width: int, flf2v: bool = False) -> Config:
    """Wan2.1 image-to-video 14B (the T2V 14B shape with 36 input channels, noise + 4 mask + 16
    image latent channels, a 1280-wide CLIP image embedder and image keys/values in every
    cross-attention); FLF2V: the image tokens of the first and last frames, with positions."""
    cfg = _wan(name, hidden=5120, depth=40, heads=40, ffn=13824, channels=16, compression=(4, 8, 8), height=height,
               width=width)
    cfg.model.in_channels, cfg.model.image_dim, cfg.model.added_kv_proj_dim = 36, 1280, 5120
    cfg.model.pos_embed_seq_len = 2 * 257 if flf2v else 0
    cfg.training.flow_shift = 3.0 if height <= 480 else 5.0  # Wan's sampling shift at 480p / 720p
    return cfg


def wan21_i2v_14b_480p() -> Config:
    """Wan2.1 image-to-video 14B at 480p: the Wan2.1 14B shape reading 36 channels (noisy latents, the
    4-channel first-frame mask, the first frame's latents) and the first frame's CLIP states (257 x 1280)
    through its image embedder and image keys/values (16,394,878,784 parameters with dense attention,
    plus the DSA offset heads); 81 frames of 480x832, ``flow_shift`` 3."""
    return _wan_i2v("wan2.1-i2v-14b-480p", 480, 832)


def wan21_i2v_14b_720p() -> Config:
    """Wan2.1 image-to-video 14B at 720p: ``wan2.1-i2v-14b-480p``'s model on 81 frames of 720x1280,
    ``flow_shift`` 5."""
    return _wan_i2v("wan2.1-i2v-14b-720p", 720, 1280)


def wan21_flf2v_14b_720p() -> Config:
    """Wan2.1 first-last-frame-to-video 14B at 720p: the I2V model whose image embedder reads the first
    and the last frames' CLIP states (2 x 257 tokens, each with a learned position; 16,395,536,704 parameters
    with dense attention, plus the DSA offset heads); 81 frames of 720x1280."""
    return _wan_i2v("wan2.1-flf2v-14b-720p", 720, 1280, flf2v=True)


def wan22_i2v_a14b() -> Config:
    """Wan2.2 image-to-video A14B: two experts of the Wan2.1 14B shape reading 36 channels (no CLIP image
    embedder; 2 x 14,288,901,184 parameters with dense attention, plus the DSA offset heads),
    ``transformer/`` for t >= 0.9 and ``transformer_2/`` below, both trained in one run;
    81 frames of 720x1280, ``flow_shift`` 5."""
    cfg = _wan("wan2.2-i2v-a14b", hidden=5120, depth=40, heads=40, ffn=13824, channels=16,
               compression=(4, 8, 8), height=720, width=1280)
    cfg.model.in_channels = 36
    cfg.training.expert, cfg.training.boundary_ratio, cfg.training.flow_shift = "both", 0.9, 5.0
    return cfg


def wan22_ti2v_5b_i2v() -> Config:
    """Wan2.2 TI2V-5B from an image (``model.clean_first_frame``): ``wan2.2-ti2v-5b``'s model with the
    first latent frame the image's clean latents at timestep 0, the others noised (diffusers'
    ``expand_timesteps``); the same parameters; 81 frames of 480x832."""
    cfg = _wan("wan2.2-ti2v-5b-i2v", hidden=3072, depth=30, heads=24, ffn=14336, channels=48,
               compression=(4, 16, 16), height=480, width=832)
    cfg.model.clean_first_frame = True
    return cfg


PRESETS: dict[str, typing.Callable[[], Config]] = {
    "tiny": tiny,
    "tiny-motion": tiny_motion,
    "dit-105b": dit_105b,
    "dit-33b": dit_33b,
    "dit-28b": dit_28b,
    "wan2.1-t2v-1.3b": wan21_t2v_1_3b,
    "wan2.1-t2v-14b": wan21_t2v_14b,
    "wan2.2-ti2v-5b": wan22_ti2v_5b,
    "wan2.2-t2v-a14b": wan22_t2v_a14b,
    "wan2.1-i2v-14b-480p": wan21_i2v_14b_480p,
    "wan2.1-i2v-14b-720p": wan21_i2v_14b_720p,
    "wan2.1-flf2v-14b-720p": wan21_flf2v_14b_720p,
    "wan2.2-i2v-a14b": wan22_i2v_a14b,
    "wan2.2-ti2v-5b-i2v": wan22_ti2v_5b_i2v,
}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
