"""Run configuration: one dataclass per section, presets as functions, TOML and CLI overrides.

Every field carries a docstring (the string literal under it); ``describe_fields`` reads them
back for ``--help`` and the README. Validation runs before Ray starts and names the field and
the value in every message.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value was refused. The message names the field, the value and the fix."""


# ---------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    arch: Literal["videodit", "wan"] = "videodit"
    """Architecture: ``videodit`` (this project's pixel-space DiT with a built-in byte caption encoder)
    or ``wan`` (the Wan 2.x video transformer over VAE latents and UMT5 text embeddings; parameter
    names as in diffusers' ``WanTransformer3DModel``; ``megaslide_ray/wan.py``)."""
    hidden_size: int = 128
    """Transformer width (channels per token)."""
    depth: int = 4
    """Number of transformer blocks; each block is one streamed shard."""
    num_heads: int = 4
    """Attention heads; must divide ``hidden_size``."""
    mlp_ratio: float = 4.0
    """MLP hidden width as a multiple of ``hidden_size`` (unless ``ffn_dim`` is set)."""
    patch_size: tuple[int, int, int] = (2, 4, 4)
    """3D patch (frames, height, width): in pixels for a pixel-space ``videodit`` (must divide
    ``data.num_frames/height/width``), in latent positions for ``wan`` and a latent-space ``videodit``
    (must divide the latent grid, ``Config.latent_grid``)."""
    inputs: Literal["pixels", "latents"] = "pixels"
    """``videodit``: what the model reads. ``pixels``: the RGB clips the video decoders deliver
    (``in_channels`` 3). ``latents``: VAE latents of the clip (``model.latent_compression`` maps the
    pixel clip to the latent grid; ``in_channels`` latent channels), as the paper's presets and real
    video DiTs do. ``wan`` always reads latents (this field is ignored)."""
    in_channels: int = 3
    """Input channels. ``videodit`` on pixels: 3, the RGB pixels the video decoders deliver (other counts
    are refused); on latents: the VAE's latent channels. ``wan``: the VAE's latent channels (16 for
    Wan2.1, 48 for Wan2.2 TI2V-5B)."""
    timestep_freq_dim: int = 256
    """Sinusoidal features fed to the timestep MLP (diffusers' ``freq_dim`` for ``wan``)."""
    caption_dim: int = 64
    """``videodit``: width of the built-in byte-level caption encoder before projection to ``hidden_size``."""
    caption_max_bytes: int = 128
    """``videodit``: captions are UTF-8 encoded and cut to this many bytes."""
    caption_layers: int = 2
    """``videodit``: self-attention layers over the caption's bytes (with learned byte positions)
    before they are pooled into the condition. They make word order count: "a red circle on a dark
    blue background" and "a blue circle on a dark red background" hold the same bytes. 0: a bag
    of bytes, the first encoder (needed to resume or sample a checkpoint trained before this
    field existed)."""
    prediction: Literal["velocity", "sample"] = "velocity"
    """``videodit``: what the head outputs. ``velocity``: the flow's velocity ``noise - x0`` (the
    usual rectified-flow target). ``sample``: the clean clip ``x0`` (x-prediction), turned into
    the velocity ``(x_t - x0_hat) / max(t, 0.05)`` before the loss and the sampler, so the loss,
    the sampler and everything downstream are unchanged. A pixel-space model whose patch holds
    more values than it is wide need not copy the input's noise to its output; ``wan`` (pretrained
    on velocity) takes only ``velocity``."""
    cross_attention: bool = False
    """``videodit``: every block cross-attends from the video tokens to the caption's tokens (each
    byte's feature from the caption encoder, plus a learned null token), as Wan and PixArt do, so
    what the caption says can reach each position; the pooled caption still joins the timestep
    in the adaLN condition either way. Adds ``4 D^2`` parameters per block. Off by default: on
    ``tiny`` it costs about a quarter more step time and did not yet read captions better
    (benchmarks/RESULTS.md); the ``dit-*`` presets keep it off so their counts stay the paper's."""
    ffn_dim: int = 0
    """Feed-forward hidden width; 0: ``mlp_ratio * hidden_size``. The Wan models set it (8960, 13824,
    14336)."""
    out_channels: int = 0
    """Channels the model predicts per position; 0: ``in_channels`` (``videodit`` accepts nothing else)."""
    text_dim: int = 4096
    """``wan``: width of the text embeddings the model reads (UMT5-XXL's 4096)."""
    text_len: int = 512
    """``wan``: text tokens the cross-attention sees. Prompt embeddings are zeroed past each prompt's
    length and zero-padded to this many tokens, as the Wan pipeline does; no mask is applied."""
    latent_compression: tuple[int, int, int] = (4, 8, 8)
    """``wan`` and ``videodit`` with ``inputs = latents``: the VAE's compression (frames, height, width): ``F`` pixel frames give ``(F - 1) / 4 + 1``
    latent frames, ``H`` pixels ``H / 8`` latent rows. (4, 8, 8) for Wan2.1's VAE, (4, 16, 16) for Wan2.2
    TI2V-5B's."""
    rope_max_seq_len: int = 1024
    """``wan``: positions per axis of the 3D rotary embedding; every axis of the token grid must fit."""
    eps: float = 1e-6
    """``wan``: epsilon of the layer norms and the q/k RMS norms."""
    cross_attn_norm: bool = True
    """``wan``: an affine LayerNorm (``norm2``) before each block's cross-attention; False: none."""


@dataclass
class AttentionConfig:
    kind: Literal["dense", "swin", "neighborhood", "dsa"] = "dsa"
    """Attention operator: ``dense`` (SDPA over all tokens), ``swin`` (3D shifted windows),
    ``neighborhood`` (DSA with offsets fixed at zero), ``dsa`` (3D Deformable Slide Attention)."""
    window: tuple[int, int, int] = (3, 3, 3)
    """Window (kt, kh, kw) in tokens, each at most the token grid's size. ``dsa`` and
    ``neighborhood``: the sampling window centred on each query, each size odd. ``swin``: the
    tiles the grid is cut into (any size; one that divides the grid needs no padding, e.g. (2, 4, 4)
    on a 4 x 8 x 8 grid, where (3, 3, 3) pads it to 6 x 9 x 9). ``dense`` ignores it."""
    max_offset: float = 0.0
    """If > 0, offsets are bounded as ``max_offset * tanh(raw)``; 0 leaves them unbounded."""
    scale: float = 0.0
    """Softmax scale; 0 means ``head_dim ** -0.5``."""
    offset_scale: float = 1.0
    """``dsa``: the offset head's raw output is multiplied by this before ``max_offset``'s bound.
    The head's last layer starts at zero and AdamW moves each weight by about the learning rate
    per step whatever the gradient's size, so this scales how fast offsets move: in effect the
    offsets' learning rate relative to ``optim.lr`` (0.1: ten times slower)."""
    offset_kernel: tuple[int, int, int] = (3, 3, 3)
    """``dsa``: the (frames, height, width) kernel, in tokens, of the offset head's depthwise
    convolution: how far around a token the head looks to choose its offsets. Motion it is to
    follow must show inside it (an object moving 3 tokens per frame is invisible to a 3x3x3
    head's view of the next frame: ``benchmarks/offset_signal.py``). Each size odd."""
    offset_groups: int = 0
    """``dsa``: heads share offsets in this many groups (consecutive heads, ``num_heads /
    offset_groups`` per group): the offset head predicts ``offset_groups * K * 3`` values per token.
    0: one group per head. Must divide ``model.num_heads``."""


@dataclass
class DataConfig:
    manifest: str = ""
    """Parquet manifest of videos (columns ``path``, ``caption``). Empty: the built-in demo set,
    generated on first use in the cache directory."""
    val_manifest: str = ""
    """Held-out manifest for the validation loss (``training.eval_every``): a video manifest for
    ``videodit``, a latent manifest for ``wan``, of the same clip shape as ``manifest``. Its first
    ``training.val_clips`` readable rows are the validation clips (first frames, centre crop).
    Empty: no validation set."""
    num_frames: int = 16
    """Frames per training clip."""
    height: int = 64
    """Clip height in pixels after resize (shorter side) and crop."""
    width: int = 64
    """Clip width in pixels after resize and crop."""
    frame_stride: int = 1
    """Take every ``frame_stride``-th frame of the source video (leave at 1 when ``fps`` is set)."""
    fps: float = 0.0
    """Sample clips at this frame rate instead of by ``frame_stride`` (frame ``j`` is source frame
    ``start + round(j * source_fps / fps)``); 0: use ``frame_stride``. Videos without a known
    frame rate are then skipped."""
    batch_size: int = 2
    """Clips per training step."""
    prefetch: int = 2
    """Batches each decoder keeps decoded ahead of the trainer."""
    num_decoders: int = 1
    """Decoder actors. Decoder ``i`` draws the data positions ``p`` with ``p % num_decoders == i``
    and serves the steps ``k`` with ``k % num_decoders == i``; a run must be resumed with the same
    number (the checkpoint holds each decoder's position)."""
    random_crop: bool = True
    """Random temporal start of each clip (False: ``fixed_start``, e.g. for evaluation)."""
    fixed_start: Literal["first", "center"] = "first"
    """Temporal start when ``random_crop`` is False: the video's first frames or its middle."""
    spatial_crop: Literal["center", "random"] = "center"
    """After resizing the shorter side, crop the center or a random window (drawn per clip from
    the seed and the data position, the same for every frame of the clip)."""
    short_clips: Literal["loop", "skip"] = "loop"
    """A video shorter than a clip's span: ``loop`` it (frame indices wrap) or ``skip`` it (counted
    as a skipped file)."""
    decode_timeout_s: float = 60.0
    """A decoder stuck this long on one file (or without progress while a batch is owed) is killed
    and replaced; the file is marked bad ("decode timed out") and skipped from then on."""
    max_bad_fraction: float = 0.5
    """Stop with an error listing examples when more than this fraction of the distinct manifest
    rows a decoder has tried are unusable (judged once it has tried 20 rows, or its whole share of
    a smaller manifest); 1 never stops."""
    clip_cache_mb: float = 0.0
    """Each decoder keeps the clips it decoded (resized and cropped) in memory, up to this many MiB,
    the least recently used dropped first, and serves a clip drawn again (same file, frames and
    crop: a later epoch of a small dataset) without decoding it. A cached clip is the same bytes
    as a new decode; a file changed on disk is decoded again. 0: no cache. Latent manifests
    ignore it."""


@dataclass
class OptimizerConfig:
    lr: float = 5e-3
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (applied to every parameter)."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    """Learning-rate decay after warm-up, over ``training.steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr`` for the cosine and linear schedules."""
    max_bad_steps: int = 20
    """A step whose loss or gradients hold NaN/Inf is skipped on every shard (counted and logged);
    after this many such steps in a row the run stops with an error. 0: never stop."""


@dataclass
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the compute actor runs: ``auto`` takes a GPU when the Ray cluster has one."""
    state_dir: str = ""
    """Directory of the host parameter store's shared-memory segments. Empty: ``/dev/shm``
    when it exists, else the system temp dir. A disk path lets state exceed RAM."""
    transport: Literal["auto", "shm", "object_ref"] = "auto"
    """How weights and gradients move between the store and the compute actor: ``shm`` maps the
    store's segments (same node only), ``object_ref`` sends them through Ray's object store;
    ``auto`` picks ``shm`` when both actors share a node."""
    compute_threads: int = 0
    """Torch intra-op threads in the compute actor; 0 uses every core of the machine."""
    overlap: bool = True
    """Stage the next shards and return gradients on background threads while the current shard
    computes. False: fetch, compute, return strictly in sequence (the "no async streaming" ablation)."""
    prefetch_depth: int = 1
    """Shards staged ahead of the one computing (with ``overlap``)."""
    token_chunk: int = 0
    """Run a block's per-token parts (modulation, norms, projections, MLP, cross-attention) over
    chunks of this many tokens in forward, recompute and backward, and its attention over query
    chunks (``dsa``/``neighborhood``: slabs of whole frames, at least one; ``swin`` stays whole),
    so a block's working set scales with the chunk instead of the clip. 0: whole clip at once."""
    link_gbps: float = 0.0
    """CPU runs: throttle weight staging and gradient return (and offloaded activations) to this
    many GB/s, to simulate a PCIe link without a GPU (0: no throttle; weights are then read in
    place from shared memory)."""
    offload_activations: bool = False
    """Keep the block inputs saved for the backward in host memory instead of on the compute
    device: each goes out right after the forward uses it and comes back ahead of its block's
    backward, so device memory no longer grows with model depth. Costs one round trip of
    depth x batch x tokens x width values per step over the link. The host copy is an unlinked
    file in ``runtime.state_dir`` (``/dev/shm`` by default), pinned on CUDA."""
    offload_keep: int = 0
    """With ``offload_activations``: the last N block inputs stay on the compute device (they are
    the first the backward needs, so they also cost no round trip over the link); the rest go to
    the host segment, which then has depth - N slots. Trades device memory (N more inputs of
    batch x tokens x width) for host memory and link traffic. 0: all offloaded; N >= depth:
    none. Ignored without ``offload_activations``."""
    recompute_blocks: bool = True
    """Activation checkpointing at block boundaries: the forward keeps only each block's input and
    the backward runs the block's forward again before its backward (one more forward per step).
    False keeps every block's autograd graph from the forward instead, so the backward computes
    no forward again (about a quarter less compute per step) at the cost of every block's
    activations in memory. For a CPU compute reading the weights in place: a kept graph holds
    its block's weights, which a streamed GPU step passes through reused buffers. So a compute
    actor that lands on a GPU (``runtime.device`` ``auto``) recomputes anyway and logs it, and
    ``runtime.device = cuda``, ``link_gbps`` > 0 and ``offload_activations`` are refused with it."""
    optimizer_threads: int = 0
    """Torch threads in the parameter store for AdamW; 0 uses every core of the machine."""
    max_restarts: int = 3
    """Actor failures (a parameter store, compute or decoder actor that died or hung) the run
    recovers from; one more stops it with a message saying how to resume."""


@dataclass
class TrainingConfig:
    steps: int = 30
    """Optimizer steps to run (in total, counting steps done before a ``--resume``)."""
    seed: int = 0
    """Seed for initial weights, data order, noise and timesteps."""
    log_every: int = 5
    """Write one log line every this many steps (every step goes to metrics.jsonl)."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps; 0 only at the end of the run."""
    run_dir: str = ""
    """Output directory; empty means ``runs/<timestamp>``."""
    t_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    """Distribution of the flow-matching time t in (0, 1)."""
    flow_shift: float = 1.0
    """Time shift s of flow matching: a sampled t becomes ``s t / (1 + (s - 1) t)`` (more steps
    near the noise end), in training and in the sampler's time grid; 1 = no shift. Wan 2.x
    models use 3 (480p) to 5 (720p)."""
    sample_every: int = 0
    """Every this many steps, sample ``sample_prompt`` through the compute actor into
    ``RUN_DIR/samples/step_N.mp4`` (and a ``.png`` contact sheet); 0 never."""
    sample_prompt: str = "a red circle moving right on a dark blue background"
    """Caption of the samples taken during training."""
    sample_steps: int = 10
    """Euler steps of each sample taken during training."""
    eval_every: int = 0
    """Every this many steps, compute the validation loss on ``data.val_manifest`` (forward only,
    through the compute actor, with the weights after that step's update) into metrics.jsonl
    (``val_loss``, ``val_loss_t0``...); 0 never. Needs ``data.val_manifest``."""
    val_clips: int = 4
    """Validation clips: the first this many readable rows of ``data.val_manifest``."""
    val_t_buckets: int = 4
    """The validation loss is measured on every clip at one flow time t in each of this many equal
    buckets of [0, 1] (t and the noise are fixed by ``seed``, the clip and the bucket), and reported
    per bucket as ``val_loss_t{b}``."""
    caption_dropout: float = 0.1
    """``videodit``: the fraction of training clips whose caption is replaced by the empty caption
    (drawn from ``seed`` and the step), so the model also learns the unconditional prediction that
    classifier-free guidance (``sample --cfg-scale``) mixes in. 0: never (guidance then mixes in an
    untrained prediction). ``wan`` ignores it: its unconditional input is a negative prompt's
    embedding, which the training data does not carry."""
    overfit_one_batch: bool = False
    """Debug: train on the first batch only, with the same noise and timesteps every step (the loss
    must fall steadily; a quick check that model, streaming and optimizer work together)."""


@dataclass
class RayConfig:
    address: str = ""
    """Ray cluster to join (``auto`` or ``host:port``); empty starts a local cluster."""
    dashboard_host: str = "127.0.0.1"
    """Interface the dashboard of a locally started cluster listens on."""
    num_cpus: int = 0
    """CPUs a locally started cluster offers; 0 lets Ray count them."""
    metrics_export_port: int = 0
    """Port where a locally started cluster exports metrics in Prometheus text (the megaslide_*
    metrics among them); 0 lets Ray choose one."""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    preset: str = "tiny"
    """Name of the preset this config started from (informational)."""

    # -- derived quantities -------------------------------------------------------------------
    @property
    def latent_space(self) -> bool:
        """True when the model reads VAE latents (``wan``, or ``videodit`` with ``model.inputs =
        latents``): ``data.num_frames/height/width`` are then the pixel clip the VAE encodes."""
        return self.model.arch == "wan" or self.model.inputs == "latents"

    @property
    def latent_grid(self) -> tuple[int, int, int]:
        """The (frames, height, width) grid the model reads: in latent space (``latent_space``) the
        VAE latents of the pixel clip (``(F - 1) // ct + 1``, ``H // ch``, ``W // cw`` with
        ``model.latent_compression``), else the pixel clip itself."""
        d = self.data
        if self.latent_space:
            ct, ch, cw = self.model.latent_compression
            return ((d.num_frames - 1) // ct + 1, d.height // ch, d.width // cw)
        return (d.num_frames, d.height, d.width)

    @property
    def token_grid(self) -> tuple[int, int, int]:
        """The token grid: ``latent_grid`` divided by ``model.patch_size``."""
        pt, ph, pw = self.model.patch_size
        f, h, w = self.latent_grid
        return (f // pt, h // ph, w // pw)

    @property
    def tokens_per_sample(self) -> int:
        t, h, w = self.token_grid
        return t * h * w

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = ("model", "attention", "data", "optim", "runtime", "training", "ray")


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------


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
    to show the prompted colour, shape and direction (``benchmarks.learning``; benchmarks/RESULTS.md)."""
    cfg = Config(preset="tiny-motion")
    cfg.model = ModelConfig(patch_size=(2, 2, 2), prediction="sample")
    # swin tiles of 2x4x4 tokens divide the 4x8x8 grid (3x3x3 pads it to 6x9x9): a cheaper step,
    # and with 2400 steps 32 of 48 training prompts shown against 19 (benchmarks/RESULTS.md)
    cfg.attention = AttentionConfig(kind="swin", window=(2, 4, 4))
    cfg.data = DataConfig(num_frames=8, height=16, width=16, batch_size=8, clip_cache_mb=64)
    cfg.optim = OptimizerConfig(lr=1e-3)
    # The step is all compute: no recomputed forward (kept graphs, on a CPU), no re-decoding of
    # the 48 clips every 6 steps (the cache holds each 6 KB clip).
    cfg.runtime = RuntimeConfig(recompute_blocks=False)
    cfg.training = TrainingConfig(steps=2400, log_every=50, checkpoint_every=600,
                                  sample_prompt="a red circle moving right at medium speed on a dark blue background")
    return cfg


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
    cfg.attention = AttentionConfig(kind="dsa", window=(3, 5, 5))
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
the learned offsets reach beyond it."""


def _wan(name: str, hidden: int, depth: int, heads: int, ffn: int, channels: int,
         compression: tuple[int, int, int], height: int, width: int) -> Config:
    cfg = Config(preset=name)
    cfg.model = ModelConfig(
        arch="wan", hidden_size=hidden, depth=depth, num_heads=heads, ffn_dim=ffn, patch_size=(1, 2, 2),
        in_channels=channels, out_channels=channels, timestep_freq_dim=256, text_dim=4096, text_len=512,
        latent_compression=compression, rope_max_seq_len=1024, eps=1e-6, cross_attn_norm=True,
    )
    cfg.attention = AttentionConfig(kind="dsa", window=WAN_WINDOW)
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


PRESETS: dict[str, typing.Callable[[], Config]] = {
    "tiny": tiny,
    "tiny-motion": tiny_motion,
    "dit-105b": dit_105b,
    "dit-33b": dit_33b,
    "dit-28b": dit_28b,
    "wan2.1-t2v-1.3b": wan21_t2v_1_3b,
    "wan2.1-t2v-14b": wan21_t2v_14b,
    "wan2.2-ti2v-5b": wan22_ti2v_5b,
}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()


# ---------------------------------------------------------------------------------------------
# Field docs, overrides, TOML
# ---------------------------------------------------------------------------------------------


def describe_fields(cls: type) -> dict[str, str]:
    """Field name -> docstring, read from the source of a config dataclass."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(section: str, name: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (a CLI string, or a TOML value) to the field's declared type."""
    where = f"{section}.{name}"
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not one of {list(choices)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):
            parts = [p for p in value.replace("(", "").replace(")", "").replace("x", ",").split(",") if p.strip()]
        else:
            parts = list(value)
        if len(parts) != len(args):
            raise ConfigError(f"{where}={value!r} needs {len(args)} values, e.g. "
                              f"--{where} {','.join('1' for _ in args)}")
        return tuple(_coerce(section, name, a, p) for a, p in zip(args, parts))
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, str):
                f = float(value)
                if not f.is_integer():
                    raise ValueError(value)
                return int(f)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r} is not a valid {tp.__name__}") from None
    raise ConfigError(f"{where}: unsupported field type {tp}")  # pragma: no cover


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set dotted keys (``model.depth``) on ``cfg``; unknown keys are refused."""
    for key, value in overrides.items():
        if key == "preset":
            cfg.preset = str(value)
            continue
        if "." not in key:
            raise ConfigError(f"unknown config key {key!r}: use SECTION.FIELD with SECTION in {list(SECTIONS)}")
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r} in {key!r}; sections are {list(SECTIONS)}")
        sec = getattr(cfg, section)
        types = _field_types(type(sec))
        if name not in types:
            raise ConfigError(f"unknown config key {key!r}; {section} has {sorted(types)}")
        setattr(sec, name, _coerce(section, name, types[name], value))
    return cfg


def _flatten_toml(doc: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(f"config table [{key}.{sub}] is nested too deeply; use [{key}] with {sub} = ...")
                flat[f"{key}.{sub}"] = v
        else:
            flat[key] = value
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with p.open("rb") as f:
            return _flatten_toml(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)  # pragma: no cover


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML; ``--config`` reads it back to the same Config."""
    lines = [f"preset = {_toml_value(cfg.preset)}"]
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
    return "\n".join(lines) + "\n"


ADDED_LATER: dict[str, Any] = {
    "model.caption_layers": 0,  # before it: a bag-of-bytes caption encoder
    "training.caption_dropout": 0.0,  # before it: captions were never dropped
    "model.cross_attention": False,  # before it: the pooled caption was the only condition
}
"""Fields added after runs were already being saved, with the behaviour of the time before them.
A saved config (a run's ``config.toml``, a checkpoint's state) records every field of its day, so
a field it lacks was not there yet: the run is continued, evaluated or sampled as it was trained
(its checkpoint holds that model), not with today's default."""


def _with_old_behaviour(values: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in ADDED_LATER.items() if k not in values}, **values}


def build_config(preset_name: str | None = None, config_file: str | None = None,
                 overrides: dict[str, Any] | None = None, saved_run: bool = False) -> Config:
    """Preset, then TOML file, then CLI overrides; validated. ``saved_run``: the file is a run's
    own ``config.toml``, so fields it lacks keep their old behaviour (``ADDED_LATER``)."""
    file_values = load_toml(config_file) if config_file else {}
    if saved_run:
        file_values = _with_old_behaviour(file_values)
    name = preset_name or file_values.pop("preset", None) or "tiny"
    file_values.pop("preset", None)
    cfg = preset(name)
    apply_overrides(cfg, file_values)
    apply_overrides(cfg, overrides or {})
    validate(cfg)
    return cfg


def config_from_dict(doc: dict[str, Any]) -> Config:
    """The config a ``Config.to_dict()`` describes (a checkpoint's ``state.json``): its preset,
    then every field it records; fields it lacks keep their old behaviour (``ADDED_LATER``). Not
    validated: the caller may still change the clip shape."""
    cfg = preset(doc.get("preset", "tiny"))
    apply_overrides(cfg, _with_old_behaviour({f"{section}.{name}": value for section in SECTIONS
                                              for name, value in doc.get(section, {}).items()}))
    return cfg


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate(cfg: Config) -> Config:
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
    elif m.inputs == "latents":
        for i, c in enumerate(m.latent_compression):
            if not c > 0:
                raise ConfigError(f"model.latent_compression[{i}]={c} must be > 0")
    if cfg.runtime.prefetch_depth < 1:
        raise ConfigError(f"runtime.prefetch_depth={cfg.runtime.prefetch_depth} must be >= 1")
    if cfg.runtime.token_chunk < 0:
        raise ConfigError(f"runtime.token_chunk={cfg.runtime.token_chunk} must be >= 0 (0 = no chunking)")
    if cfg.runtime.offload_keep < 0:
        raise ConfigError(f"runtime.offload_keep={cfg.runtime.offload_keep} must be >= 0 (0 = offload every "
                          f"block input; only used with runtime.offload_activations)")
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
                              f"{n} {axis} (grid {grid} = {'latent' if cfg.latent_space else 'data'} size / model.patch_size); "
                              f"shrink the window")
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
                         ("optim.max_bad_steps", o.max_bad_steps),
                         ("ray.num_cpus", cfg.ray.num_cpus),
                         ("ray.metrics_export_port", cfg.ray.metrics_export_port)]:
        if value < 0:
            raise ConfigError(f"{where}={value} must be >= 0")
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
    if cfg.latent_space and t.sample_every:
        after = ("sample a checkpoint with `python -m megaslide_ray.sample --checkpoint RUN --model-dir WAN_DIR "
                 "--prompt TEXT`" if m.arch == "wan" else "sample it later (decoding a latent videodit's samples "
                 "with a VAE is not wired into `megaslide_ray.sample` yet)")
        raise ConfigError(f"training.sample_every={t.sample_every} with model.arch={m.arch!r} on latents: samples "
                          f"during training need the model's VAE (and for wan its text encoder), which the trainer "
                          f"does not load; set it to 0 and {after}")
    return cfg


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


def _validate_latent_clip(cfg: Config) -> None:
    """Latent space (``wan``, or ``videodit`` with ``model.inputs = latents``):
    ``data.num_frames/height/width`` are the pixel clip the VAE encodes; the latent grid must divide
    into patches, and for ``wan`` every token-grid axis must fit the rotary embedding."""
    m, d = cfg.model, cfg.data
    ct, ch, cw = m.latent_compression
    if (d.num_frames - 1) % ct:
        below = (d.num_frames - 1) // ct * ct + 1
        choices = [f for f in (below, below + ct) if f >= 1]
        raise ConfigError(f"data.num_frames={d.num_frames}: the {'Wan ' if m.arch == 'wan' else ''}VAE encodes {ct}k+1 frames "
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


# ---------------------------------------------------------------------------------------------
# The configuration reference: docs/configuration.md, generated from the field docstrings
# ---------------------------------------------------------------------------------------------

REFERENCE_PATH = "docs/configuration.md"
REFERENCE_COMMAND = f"python -m megaslide_ray.config --write {REFERENCE_PATH}"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _preset_changes(cfg: Config) -> list[tuple[str, Any]]:
    """(SECTION.FIELD, value) of every field where ``cfg`` differs from ``Config()``."""
    base, out = Config(), []
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if value != getattr(getattr(base, section), f.name):
                out.append((f"{section}.{f.name}", value))
    return out


def reference_markdown() -> str:
    """The configuration reference as Markdown: every section and field with its default and its
    docstring (``describe_fields``), then every preset with the fields it changes. This is
    ``docs/configuration.md``; ``REFERENCE_COMMAND`` regenerates it."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from megaslide_ray/config.py by `{REFERENCE_COMMAND}`; do not edit by hand. -->",
        "",
        "Every field, as `--SECTION.FIELD VALUE` on the command line or `FIELD = VALUE` under `[SECTION]`",
        "in a TOML file (`--config`; a run's `config.toml` is one). Order of precedence: preset, then the",
        "`--config` file, then flags. Invalid values are refused before Ray starts, with the field and the",
        "value in the message. The defaults below are those of `Config()`, the `tiny` preset; the other",
        "presets change the fields listed under [Presets](#presets).",
        "",
    ]
    cfg = Config()
    for section in SECTIONS:
        sec = getattr(cfg, section)
        docs = describe_fields(type(sec))
        lines += [f"## [{section}]", "", "| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(sec):
            lines.append(f"| `{section}.{f.name}` | `{getattr(sec, f.name)!r}` | {_md_cell(docs.get(f.name, ''))} |")
        lines.append("")
    lines += ["## Presets", "", "`--preset NAME` (default `tiny`) picks the starting point:", ""]
    for name, make in PRESETS.items():
        doc = " ".join((make.__doc__ or "").split())
        lines += [f"### `{name}`", "", doc, ""]
        changes = _preset_changes(make())
        if changes:
            lines += ["Fields that differ from the defaults above:", ""]
            lines += [f"- `{key}` = `{value!r}`" for key, value in changes if key != "preset"]
        else:
            lines.append("The defaults above.")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m megaslide_ray.config",
                                description="Render the configuration reference (every section, field, default "
                                            "and meaning, and the presets) as Markdown.")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--markdown", action="store_true", help="print it to stdout")
    out.add_argument("--write", metavar="PATH", help=f"write it to PATH (the repository's copy: {REFERENCE_PATH})")
    args = p.parse_args(argv)
    text = reference_markdown()
    if args.write:
        path = Path(args.write)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
