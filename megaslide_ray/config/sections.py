"""Run configuration: one dataclass per section, presets as functions, TOML and CLI overrides.

Every field carries a docstring (the string literal under it); ``describe_fields`` reads them
back for ``--help`` and the README. Validation runs before Ray starts and names the field and
the value in every message.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


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
    names as in diffusers' ``WanTransformer3DModel``; ``megaslide_ray/models/wan.py``)."""
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
    in the adaLN condition either way. Adds ``4 D^2`` parameters per block. Off by default (on ``tiny`` it costs about a quarter more step time); the ``dit-*`` presets keep
    it off so their counts stay the paper's."""
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
    image_dim: int = 0
    """``wan`` image-to-video (Wan2.1 I2V-14B, FLF2V): width of the CLIP image states (the vision
    encoder's penultimate hidden states, 1280) the ``condition_embedder.image_embedder`` projects
    to ``hidden_size``; each block's cross-attention then also attends to those image tokens
    (``add_k_proj``/``add_v_proj``/``norm_added_k``). 0: no image embedder (text-to-video,
    Wan2.2 I2V-A14B)."""
    added_kv_proj_dim: int = 0
    """``wan``: input width of the cross-attention's image keys and values (diffusers'
    ``added_kv_proj_dim``; ``hidden_size`` whenever ``image_dim`` is set). 0: none."""
    clean_first_frame: bool = False
    """``wan`` Wan2.2 TI2V-5B from an image (diffusers' ``expand_timesteps``): the first latent frame
    is the image's clean latents at timestep 0 and the others are noised at the sample's t
    (per-token timesteps: the blocks and the head modulate the first token frame with timestep
    0's embedding); training keeps the clip's first latent frame clean and leaves it out of the
    loss, sampling keeps it at ``--image``'s latents. False: text-to-video."""
    pos_embed_seq_len: int = 0
    """``wan`` FLF2V: image tokens of the first and last frames together (2 x 257), each with a
    learned position (``image_embedder.pos_embed``). 0: none."""


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
    """If > 0, offsets are bounded by it (``offset_bound`` says how); 0 leaves them unbounded. The
    GPU kernels run every call at this bound (nothing measured per call): it sizes the backward's
    deterministic key-side dk/dv pass (up to 3 tokens) and decides where the halo kernels (tensor
    cores) are predicted faster; unbounded offsets take the gather kernels and, for the few queries
    past 3 tokens, float atomics (``python -m megaslide_ray.plan`` notes it for a config)."""
    offset_bound: Literal["tanh", "clamp"] = "tanh"
    """How ``max_offset`` bounds the offsets: ``tanh``, ``max_offset * tanh(raw)`` (smooth, and
    already compressing well inside the bound: ``offset_scale = 1 / max_offset`` gives slope 1 at
    zero); ``clamp``, ``raw`` clipped to ``[-max_offset, max_offset]`` per coordinate (the
    unbounded head's offsets wherever they lie within it; no gradient where one is clipped, as
    for a sample the operator clamps at the grid's border)."""
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
    head's view of the next frame: ``benchmarks/studies/offset_signal.py``). Each size odd."""
    offset_condition: Literal["none", "add", "gate"] = "none"
    """``dsa``: what the offset head knows of the block's condition vector (``videodit``: the adaLN
    condition, timestep embedding plus pooled caption; ``wan``: the timestep embedding ``temb``),
    so offsets can depend on the noise level. ``none``: only the block's input. ``add``: a
    ``Linear(D -> D)`` of the condition is added to the head's features before its GELU. ``gate``:
    the offsets are multiplied by ``1 + Linear(D -> groups)`` of the condition (zero-initialised,
    so the gate starts at 1), which can learn to shrink them where the input is mostly noise.
    Either way the head's last layer starts at zero, so a fresh or converted model starts as
    neighborhood attention."""
    offset_source: Literal["block", "query"] = "block"
    """``dsa``: what the offset head's convolution reads. ``block``: the block's normalised,
    modulated input (the attention's input). ``query``: the attention's queries (heads merged;
    ``wan``: after the q norm, before RoPE), so offsets are chosen from what each token looks for."""
    offset_groups: int = 0
    """``dsa``: heads share offsets in this many groups (consecutive heads, ``num_heads /
    offset_groups`` per group): the offset head predicts ``offset_groups * K * 3`` values per token.
    0: one group per head. Must divide ``model.num_heads``."""
    backend: Literal["auto", "reference", "cpu", "matrix", "chunked", "triton"] = "auto"
    """``dsa`` and ``neighborhood``: the 3D-DSA kernel. ``auto`` picks per call and logs its pick
    once: on CPU ``matrix`` (two dense products through an interpolation matrix) for small clips
    and ``cpu`` (the linear path) above, on CUDA the Triton kernels. ``reference`` is the
    pure-PyTorch definition (slow, O(N*K*d) memory), ``chunked`` the reference over query chunks;
    ``triton`` (the fused kernels) needs CUDA. Every path computes the same function (docs/dsa.md)."""
    learn_temperature: bool = False
    """Each block's self-attention gets a learnable per-head log-temperature ``tau`` (one value per
    head, starting at 0): head h's scores are ``scale * exp(tau_h) * <q, k>``, computed by scaling
    the queries per head before the attention operator (every kind and kernel, token-chunked blocks
    too). A lever for the quality gap after swapping the attention of a pretrained model: a
    sparser or wider window may want a sharper or flatter softmax. ``tau`` starts at 0, so the
    model starts unchanged; a pretrained source without it loads (``tau`` starts fresh, at 0).
    The offset head (``dsa``) reads the unscaled queries."""
    dense_blocks: tuple[int, ...] = ()
    """Blocks (0-based, ``0 .. model.depth - 1``; ``"0,20,39"`` on the command line) whose
    self-attention is dense (SDPA over every token) whatever ``kind``; they have no offset head, so
    a converted or pretrained model loads into them as it is. The other blocks use ``kind``. A few
    dense layers among local ones is what Radial Attention keeps; each costs a dense attention
    (``python -m kernels.dsa_lever_cost``). Empty: none."""
    dense_above_t: float = 0.0
    """Samples whose flow time ``t >= dense_above_t`` (t = 1: pure noise, as the trainer draws it)
    use dense self-attention in every block; the others ``kind``. Chosen per sample (a batch may
    mix t), in training, validation and sampling alike; 0: off. On Wan2.2 A14B ``training.expert =
    high`` trains only ``t >= training.boundary_ratio`` (0.875): ``dense_above_t <= boundary_ratio``
    then makes the whole high-noise expert dense, a value above it only its noisiest part."""
    dense_warmup_steps: int = 0
    """A dense-to-sparse curriculum: at training step ``s < dense_warmup_steps`` self-attention is
    ``(1 - a) dense + a kind`` with ``a = s / dense_warmup_steps`` (step 0 dense, linear to pure
    ``kind``), then pure ``kind``. The step comes from the trainer (a resumed run continues the
    schedule from its checkpoint's step); validation and sampling use the schedule's end (pure
    ``kind``, except ``dense_above_t``). 0: off."""


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
    buckets: str = ""
    """Train on clips of several shapes: a comma-separated list of ``HEIGHTxWIDTHxFRAMES``
    buckets (e.g. ``"480x832x81,832x480x81,512x512x1"``), or ``auto`` (five aspect ratios at the
    area ``data.height x data.width``, with ``data.num_frames`` frames, plus one-frame buckets for
    images when the model can read one frame). Each manifest row goes to the bucket nearest its
    aspect ratio among those it has the frames for (resized and centre-cropped to it); every batch
    comes from one bucket, in a seeded order the checkpoint's data position fixes
    (docs/buckets.md). Needs the manifest's ``width``, ``height`` and ``num_frames`` columns
    (``megaslide_ray.index`` writes them). Empty: one clip shape, ``data.num_frames x height x
    width``. The planner answers for the bucket of the most tokens."""
    clip_cache_mb: float = 0.0
    """Each decoder keeps the clips it decoded (resized and cropped) in memory, up to this many MiB,
    the least recently used dropped first, and serves a clip drawn again (same file, frames and
    crop: a later epoch of a small dataset) without decoding it. A cached clip is the same bytes
    as a new decode; a file changed on disk is decoded again. 0: no cache. Latent manifests
    ignore it."""
    cache_dir: str = ""
    """Where the built-in data sets (the demo set an empty ``manifest`` trains on, the motion sets
    of ``--demo``) are generated on first use and found afterwards. Empty (default): the
    environment's ``$MEGASLIDE_CACHE`` if set, else ``~/.cache/megaslide_ray``."""


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
    adamw: Literal["", "fused", "compiled", "auto"] = ""
    """The parameter store's AdamW kernel. ``fused``: torch's fused CPU AdamW on each flat shard,
    then ``master`` copied into ``w``. ``compiled``: one ``torch.compile`` pass over gradient and
    state that writes ``master``, ``m``, ``v`` and ``w`` at once (checked against
    ``torch.optim.AdamW`` when built; about 2x faster on a bf16 store, but compiling costs seconds
    per store process); refused if it cannot be built. ``auto``: ``compiled`` where it builds, else
    ``fused``. Empty (default): ``auto`` for models of 100M parameters or more, ``fused`` below."""


@dataclass
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the compute actor runs: ``auto`` takes a GPU when the Ray cluster has one. The
    planner counts the GPU attention kernels' scratch for ``auto`` and ``cuda``, not for ``cpu``."""
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
    store_timeout_s: float = 600.0
    """Seconds the compute actor waits for the parameter store to answer a step's gradient
    reports; a store that does not answer in time is treated as dead: killed, restarted on its
    shared-memory state and the step recovered as after a crash. 0: wait forever."""
    resident_gb: float = 0.0
    """Device memory (decimal GB, 1e9 B) for shards kept on the device from their forward to their
    backward: the blocks nearest the turn (L-1, L-2, ...; then the input shard) whose weights fit stay
    where the forward's fetch put them and the backward reuses them, so each crosses the link once
    per step instead of twice, as the last block at the turn always does. A model that fits whole
    streams once per step. 0: only the turn's block. ``plan --resident-gb auto`` finds the most that
    fits the device. Where the compute reads the weights in place (a CPU compute actor without
    ``link_gbps``) nothing is fetched, and this changes nothing."""
    device_shards: int = 0
    """The forward's first N shards (the input side, then blocks 1, 2, ...) kept on the compute
    device across steps with their AdamW state (fp32 weights and moments: 16 B per parameter on the
    device beside the compute copy) and updated there right after the step's backward, with the
    global gradient norm the compute actor sums from every shard's norm. They cross the link
    neither at the step's start (each fetch there waits for the shard's update, which waits for the
    step's last gradient) nor at its end (their gradients are the backward's last): the step
    boundary's fetches and returns go. Checkpoints take their state from the compute actor; a
    compute actor that dies takes it with it, so the run rolls back to the latest checkpoint
    instead of recovering in place. One node, one compute actor, one expert, no moving average.
    0: every shard lives in the parameter store."""
    compute_actors: int | Literal["auto"] = 1
    """Compute actors training data-parallel on the parameter store's node, all sharing its one
    store: each trains its own batch (``data.batch_size`` x ``training.micro_batches`` clips) on the
    same weight versions, read from the store's shared memory, and the store sums their gradients
    in fp32 in a fixed order (actor 0, 1, ...: bit-identical run to run) before one update; the loss
    is the mean over the global batch of ``compute_actors x micro_batches x batch_size`` clips, so N
    actors equal one actor with N times the batch. ``auto``: one per GPU of the node (at least 1).
    A CPU compute actor reserves one Ray CPU (an equal share when the cluster has fewer than N).
    A compute actor that dies is replaced together with the others and the step redone."""
    grad_slots: int = 2
    """With ``compute_actors`` > 1: gradient slots per compute actor in the store's in-flight
    scratch, each ``grad_slot_mb`` (at most the largest shard in the compute dtype; the planner
    counts ``compute_actors x grad_slots`` of them). An actor whose slots are all full waits until the
    store has summed one; 2 lets it write a shard's gradient while the last one is summed. Not used
    with one compute actor (its gradient lands in the shard's own ``w`` segment)."""
    grad_slot_mb: float = 512.0
    """With ``compute_actors`` > 1: the size of one gradient slot in MB (decimal), at most the
    largest shard. A compute actor sends a larger shard's gradient in pieces of this size, each
    through its own slot, and the store sums each piece as soon as every actor sent it, so the
    slots (``compute_actors x grad_slots`` of them) and the fp32 sum are sub-block sized: 8 GPUs
    with 2 slots of 512 MB take 8.2 GB of host, not 95 GB of whole ``dit-105b`` blocks. 0: one
    slot holds the largest shard (whole-shard slots)."""
    nodes: int = 1
    """Ray nodes the run trains on, data-parallel: one parameter store per node, each node's
    ``compute_actors`` beside it. Every node keeps the compute copy ``w`` of every shard and the
    optimizer state (master, m, v) of the shards it owns (shard l on node l % nodes): about
    ``w bytes + 12 / nodes`` B/param of host state per node. Each owner sums the nodes' gradients of
    its shards in fp32 in node order, updates them with the exact global gradient norm, and sends the
    new weights to every node (through Ray's object store). The global batch is ``nodes x
    compute_actors x micro_batches x batch_size`` clips; a run equals one node with that batch. The
    Ray cluster (``ray.address``) needs that many alive nodes; node 0 is the driver's, its store
    writes the checkpoints, which resume on any number of nodes (``--resume`` reads the run
    directory from every node: a filesystem they share). A dead compute actor or store is recovered
    in place (``runtime.max_restarts``); a lost node stops the run with the ``--resume`` command."""
    inject_fault: str = ""
    """For drills: make an actor fail at a chosen point, once (docs/failures.md, "Fault drills"):
    comma-separated specs ``POINT[@STEP][/NODE][:ACTION]``; the hidden flag ``--inject-fault SPEC``
    sets it. Empty (default): the environment's ``$MEGASLIDE_FAULT`` if set, else no fault. The run
    hands it to every actor through that variable, with a fresh marker folder
    (``$MEGASLIDE_FAULT_DIR``, unless set) that keeps each spec from firing twice. Never saved in
    ``config.toml``: a resumed run injects only what it is given again."""


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
    tracker: Literal["none", "tensorboard", "wandb"] = "none"
    """Experiment tracker fed the rows of metrics.jsonl as they are written (every numeric field,
    the config once, each sample video): ``tensorboard`` (event files in ``RUN_DIR/tensorboard``;
    ``pip install tensorboard``) or ``wandb`` (Weights & Biases, a run in ``RUN_DIR/wandb``, offline
    unless ``WANDB_MODE`` says otherwise; ``pip install wandb``); ``none`` only metrics.jsonl. A
    missing package is refused before Ray starts."""
    init_from: str = ""
    """The pretrained weights a new run starts from (``--init-from``: a checkpoint, a safetensors
    file or folder, a diffusers Wan folder), as an absolute path; empty: the seeded
    initialisation. A resumed run continues from its checkpoint and only records it."""
    t_sampling: Literal["uniform", "logit_normal"] = "logit_normal"
    """Distribution of the flow-matching time t in (0, 1)."""
    flow_shift: float = 1.0
    """Time shift s of flow matching: a sampled t becomes ``s t / (1 + (s - 1) t)`` (more steps
    near the noise end), in training and in the sampler's time grid; 1 = no shift. Wan 2.x
    models use 3 (480p) to 5 (720p)."""
    expert: Literal["", "high", "low", "both"] = ""
    """Which experts of a two-expert Wan2.2 A14B model train (``training.boundary_ratio`` > 0):
    ``high`` (``transformer/``, the flow times ``t >= boundary_ratio``), ``low`` (``transformer_2/``,
    ``t < boundary_ratio``), each with its t drawn only in its range, or ``both`` (one parameter
    store holding both: each step draws one expert, with the probability of its range under
    ``t_sampling`` and ``flow_shift``, then every clip's t within that range, so over the steps t
    has its usual distribution; only that expert's blocks stream, and only it is updated: the
    other's weights and AdamW moments are untouched, each expert counts its own steps for AdamW
    and is clipped by its own gradient norm; the learning-rate schedule follows the run's step).
    Routing is diffusers' ``WanPipeline``'s: timestep ``1000 t >= boundary_ratio x 1000`` runs
    ``transformer``. Empty: a one-transformer model. Set from ``--init-from ROOT/transformer`` or
    ``ROOT/transformer_2``; ``--init-from ROOT`` of an A14B folder needs it."""
    boundary_ratio: float = 0.0
    """A two-expert model's boundary (``model_index.json``'s ``boundary_ratio``, 0.875 for Wan2.2
    T2V-A14B), read from the ``--init-from`` folder; 0: a one-transformer model."""
    low_expert_lr: float = 0.0
    """With ``training.expert = both``: the low-noise expert's (``transformer_2/``) peak learning
    rate; the high-noise expert's is ``optim.lr``. Both follow ``optim.schedule`` at the run's
    step (a step of the low expert takes ``lr_at(step) x low_expert_lr / optim.lr``). 0: ``optim.lr``
    for both. (One expert per run: set ``optim.lr``.)"""
    sample_every: int = 0
    """Every this many steps, sample each prompt (``sample_prompt``, or the lines of
    ``sample_prompts_file``) with the weights of that step, denoised through the compute actor;
    the sample writer actor (its own Ray actor, off the training path) decodes it (a latent
    model's with the VAE of ``sample_model_dir``) and writes
    ``RUN_DIR/samples/step_{N:06d}_{i:02d}_{prompt slug}.mp4``, a ``.png`` contact sheet beside it
    and a line of ``samples/samples.jsonl``; the tracker shows each video. 0 never."""
    sample_prompt: str = "a red circle moving right on a dark blue background"
    """Caption of the samples taken during training (when ``sample_prompts_file`` is empty)."""
    sample_prompts_file: str = ""
    """A UTF-8 text file of the prompts to sample during training, one per line (blank lines and
    lines starting with ``#`` are skipped); empty: ``sample_prompt`` alone. An image-to-video model
    samples each prompt from its image: lines ``PROMPT | IMAGE`` (FLF2V: ``PROMPT | IMAGE |
    LAST_IMAGE``), paths relative to the file's folder, encoded once as ``sample --image`` encodes
    them."""
    sample_seed: int = 0
    """The noise of prompt i's samples is drawn from seed ``sample_seed + i``: the same at every
    sampling step and in every run (whatever ``seed``), so samples compare across steps and runs."""
    sample_steps: int = 10
    """Euler steps of each sample taken during training."""
    sample_cfg_scale: float = 1.0
    """Classifier-free guidance of the samples taken during training (1: none; each Euler step then
    costs one forward, else two). Wan pipelines use 5."""
    sample_negative_prompt: str = ""
    """``wan``: the negative prompt whose embedding is the unconditional half of guidance
    (``sample_cfg_scale != 1``)."""
    sample_model_dir: str = ""
    """A latent-space model (``wan``, or ``videodit`` on latents): the local diffusers folder whose
    ``vae/`` decodes the samples (and for ``wan`` whose ``text_encoder/`` and ``tokenizer/``
    encode the prompts, once, when the run starts). Empty: the ``init_from`` folder (a diffusers
    Wan folder, or the one above its ``transformer/``). Unused by pixel models."""
    sample_device: Literal["cpu", "cuda"] = "cpu"
    """Where the sample writer actor runs the text encoder and the VAE decode. ``cpu``: beside
    training, which waits only for the denoising (the compute actor's own time); ``cuda``: on the
    training GPU, between steps (the next step waits for the decode too, and the VAE stays on the
    GPU)."""
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
    micro_batches: int = 1
    """Layer-major micro-batches per compute actor and step: each block runs all k micro-batches of
    ``data.batch_size`` clips while its weights are on the device, its gradient accumulates on the
    device and goes to the store once per step, so the weight traffic per step does not grow with
    k (the block inputs kept for the backward do: k per block). The loss is the mean over the k
    micro-batches, so k micro-batches of b clips equal one batch of k x b; a decoder batch holds
    the k x b clips of one compute actor's step."""
    ema_decay: float = 0.0
    """An exponential moving average of the weights, kept beside the master weights (fp32, 4 more
    bytes per parameter in host RAM, and in every checkpoint): after each optimizer step ``ema =
    ema_decay x ema + (1 - ema_decay) x master``. 0: off. Typical 0.999 to 0.9999 (an average over
    about ``1 / (1 - ema_decay)`` steps). ``ema_eval`` says which weights evaluation and sampling use."""
    ema_start_step: int = 0
    """With ``ema_decay``: until this many optimizer steps are done the average is the weights
    themselves (``ema = master``), so it does not average the first steps, far from where the
    weights settle; from there on it averages. 0: from the first step."""
    ema_eval: bool = True
    """With ``ema_decay``: the validation loss (``eval_every``) and the samples taken during training
    (``sample_every``) use the averaged weights; false: the trained weights. The ``sample`` and
    ``evaluate`` commands and the export choose for themselves (``--weights ema``)."""
    distill_weight: float = 0.0
    """Distillation from the dense teacher beside the task loss (adapting a pretrained dense model
    to ``attention.kind`` dsa, neighborhood or swin): each step adds ``distill_weight x`` the mean
    squared difference between the model's velocity and that of the teacher on the same noised
    input, t and conditioning. The teacher is the model of ``training.init_from`` run with dense
    attention (no offset heads), frozen: its weights stay in host RAM in the compute dtype beside
    the state (``plan`` counts them) and stream for one forward without gradients per step.
    ``training.init_from`` must name it (on ``--resume`` it is read again from there; the teacher is
    never saved). 0 (default): off, nothing changes. ``metrics.jsonl`` logs the term as
    ``distill_loss`` (``loss`` stays the task loss)."""
    distill_target: Literal["output"] = "output"
    """What ``distill_weight`` matches: ``output``, the model's predicted velocity."""
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
    connect_timeout_s: float = 45.0
    """Seconds joining ``address`` may take; then the run stops with one line naming the address
    (Ray itself retries for many minutes). An address where nothing listens is refused at once."""


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


# ---------------------------------------------------------------------------------------------
# Field docs, overrides, TOML
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# The configuration reference: docs/configuration.md, generated from the field docstrings
# ---------------------------------------------------------------------------------------------
