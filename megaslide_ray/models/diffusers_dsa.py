"""Run an exported 3D-DSA Wan model inside diffusers, as it was trained.

``python -m megaslide_ray.pretrained CKPT OUT --format diffusers`` writes a folder that diffusers'
``WanTransformer3DModel.from_pretrained(OUT)`` loads; but diffusers' self-attention is dense, and it
drops the offset heads (``blocks.{i}.attn1.offsets.*``) as unexpected weights, so on its own it
runs a different model from the one trained. ``enable_dsa`` makes it the trained one:

    from diffusers import WanTransformer3DModel
    from megaslide_ray.models.diffusers_dsa import enable_dsa
    transformer = enable_dsa(WanTransformer3DModel.from_pretrained("OUT"))

(or ``enable_dsa(pipe)`` on a ``WanPipeline`` whose transformer is the export). It reads the
export's attention settings (``config.json``, key ``megaslide_dsa``: kind, window, scale, the
offset head's shape), loads the offset heads from the folder's safetensors into each block's
``attn1.offsets`` (so ``.to()``, ``save_pretrained`` and ``state_dict`` carry them), and sets
``DSAAttnProcessor`` on every ``attn1``: diffusers' projections and q/k norms, diffusers' RoPE,
then this project's one self-attention dispatch (``models.attention.self_attention``) on the
channels-last token grid: the arithmetic of ``megaslide_ray.models.wan`` (held equal by
tests/test_diffusers_dsa.py). Cross-attention (``attn2``) keeps diffusers' processor.

The token grid is not an argument of diffusers' attention processors: a forward pre-hook on the
transformer's ``rope`` module (which sees the latents) records it for the processors of that
forward. Likewise an offset head trained with ``attention.offset_condition`` reads the timestep
embedding ``temb``, which a forward hook on the transformer's ``condition_embedder`` records (its
first output); one trained with ``attention.offset_source = query`` reads the normed queries
before RoPE, which the processor has at hand. Blocks of ``attention.dense_blocks`` keep diffusers'
processor (dense, no offset head); with ``attention.dense_above_t`` a forward pre-hook on
``condition_embedder`` records each sample's timestep, and a sample at or above it gets dense
attention in every block, as in training. The ``megaslide_dsa`` key is also what a plain
load shows: diffusers warns about config attributes it does not expect and prints them, and the
key's ``note`` says that attention is dense without ``enable_dsa``."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from megaslide_ray.models.attention import OffsetPredictor, reads_queries, self_attention

log = logging.getLogger(__name__)

CONFIG_KEY = "megaslide_dsa"
DENSE_NOTE = ("this transformer was trained with {kind} self-attention (megaslide-ray); loaded by diffusers alone its "
              "self-attention is DENSE and its offset heads are dropped: a different model. Run it as trained with: "
              "from megaslide_ray.models.diffusers_dsa import enable_dsa; transformer = enable_dsa(transformer)")


def export_settings(kind: str, window, scale: float, max_offset: float, offset_groups: int, offset_kernel,
                    offset_scale: float, offsets: bool, offset_condition: str = "none",
                    offset_source: str = "block", offset_bound: str = "tanh", dense_blocks=(),
                    dense_above_t: float = 0.0) -> dict:
    """The ``config.json`` entry (``CONFIG_KEY``) an export of a model with ``attention.kind`` other
    than dense carries: everything ``enable_dsa`` needs, and the note a plain load prints. An
    entry without ``offset_condition`` / ``offset_source`` / ``offset_bound`` / ``dense_blocks`` /
    ``dense_above_t`` (older exports) means ``none`` / ``block`` / ``tanh`` / none / 0."""
    return {"note": DENSE_NOTE.format(kind=kind), "kind": kind, "window": list(window), "scale": scale,
            "max_offset": max_offset, "offset_groups": offset_groups, "offset_kernel": list(offset_kernel),
            "offset_scale": offset_scale, "offsets": offsets, "offset_condition": offset_condition,
            "offset_source": offset_source, "offset_bound": offset_bound, "dense_blocks": list(dense_blocks),
            "dense_above_t": dense_above_t}


class TokenGrid:
    """The (frames, height, width) token grid of the forward in progress, recorded from the latents
    the transformer's ``rope`` module sees."""

    def __init__(self, patch_size):
        self.patch_size = tuple(int(p) for p in patch_size)
        self.shape: tuple[int, int, int] | None = None

    def record(self, module: nn.Module, args: tuple) -> None:  # a forward pre-hook
        _, _, F, H, W = args[0].shape
        pt, ph, pw = self.patch_size
        self.shape = (F // pt, H // ph, W // pw)


class TimestepEmbedding:
    """The timestep embedding ``temb (B, D)`` of the forward in progress, recorded from the first
    output of the transformer's ``condition_embedder`` (what an offset head trained with
    ``attention.offset_condition`` reads, as ``models.wan`` hands it); with ``dense_above_t`` > 0
    (``attention.dense_above_t``) also each sample's weight of dense attention, from the timestep
    it was called with (``mix``: 1 where ``timestep / 1000 >= dense_above_t``)."""

    def __init__(self, dense_above_t: float = 0.0):
        self.temb: torch.Tensor | None = None
        self.dense_above_t = dense_above_t
        self.mix: torch.Tensor | None = None

    def record_time(self, module: nn.Module, args: tuple, kwargs: dict) -> None:  # a forward pre-hook
        t = args[0].float() / 1000.0
        tokens = kwargs.get("timestep_seq_len")
        if tokens is not None:  # Wan2.2 TI2V's per-token timesteps, flattened: the sample's t is on its last token
            t = t.view(-1, tokens)[:, -1]
        self.mix = (t >= self.dense_above_t).float()

    def record(self, module: nn.Module, args: tuple, output) -> None:  # a forward hook
        temb = output[0]
        if temb.dim() != 2:
            raise ValueError(f"the timestep embedding has shape {tuple(temb.shape)}, not (batch, dim): a per-token "
                             f"timestep (expand_timesteps) is not what the offset heads were trained with")
        self.temb = temb


@dataclass
class _Attention:
    """What ``models.attention.self_attention`` reads of a block's self-attention."""
    kind: str
    window: tuple[int, int, int]
    shift: bool
    scale: float | None
    num_heads: int
    head_dim: int
    backend: str
    offsets: nn.Module | None


def rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan RoPE on ``x (B, N, nh, d)``: channel pairs ``(2i, 2i+1)`` rotated by the
    angles in its ``(1, N, 1, d)`` tables (each angle stored twice), in the tables' precision."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class DSAAttnProcessor:
    """A diffusers attention processor for a Wan block's ``attn1``: 3D-DSA (or the window kind the
    model was trained with) over the token grid instead of dense attention."""

    def __init__(self, grid: TokenGrid, kind: str, window, scale: float | None, shift: bool = False,
                 backend: str = "auto", temb: TimestepEmbedding | None = None):
        self.grid, self.kind, self.window, self.scale = grid, kind, tuple(window), scale
        self.shift, self.backend, self.temb = shift, backend, temb

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, rotary_emb=None) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("DSAAttnProcessor is for a Wan block's self-attention (attn1), without a mask")
        if getattr(attn, "fused_projections", False):
            raise ValueError("DSAAttnProcessor reads to_q/to_k/to_v: unfuse the projections (unfuse_qkv_projections)")
        if self.grid.shape is None:
            raise RuntimeError("the token grid is unknown: call enable_dsa on the WanTransformer3DModel itself")
        T, H, W = self.grid.shape
        B, N, D = hidden_states.shape
        if N != T * H * W:
            raise ValueError(f"{N} tokens do not make the recorded {T}x{H}x{W} grid")
        q_normed = attn.norm_q(attn.to_q(hidden_states))
        q = q_normed.unflatten(2, (attn.heads, -1))  # (B, N, nh, d)
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        head = getattr(attn, "offsets", None) if self.kind == "dsa" else None
        spec = _Attention(self.kind, self.window, self.shift, self.scale, attn.heads, D // attn.heads, self.backend,
                          head)
        grid = (B, T, H, W, attn.heads, D // attn.heads)
        # The offset head reads the block's modulated input (or, offset_source = query, the normed
        # queries before RoPE), channels-last, and with offset_condition the timestep embedding:
        # as in models.wan.
        off_in = q_normed if reads_queries(spec) else hidden_states
        cond = None
        if head is not None and head.condition != "none":
            if self.temb is None or self.temb.temb is None:
                raise RuntimeError("the timestep embedding is unknown: call enable_dsa on the WanTransformer3DModel itself")
            cond = self.temb.temb
        mix = self.temb.mix if self.temb is not None else None  # attention.dense_above_t
        o = self_attention(spec, q.reshape(grid), k.reshape(grid), v.reshape(grid), off_in.view(B, T, H, W, D), cond,
                           mix)
        o = o.reshape(B, N, D).type_as(q)
        return attn.to_out[1](attn.to_out[0](o))


def _export_folder(transformer: nn.Module, path: str | Path | None) -> Path:
    """The folder the transformer was loaded from (its ``config.json``), or ``path``."""
    p = Path(path or getattr(transformer.config, "_name_or_path", "") or "")
    for cand in (p, p / "transformer"):
        if (cand / "config.json").is_file():
            return cand
    raise FileNotFoundError(f"no config.json in {str(p)!r}: pass enable_dsa(transformer, path=EXPORT_FOLDER), the "
                            f"folder `python -m megaslide_ray.pretrained CKPT OUT --format diffusers` wrote")


def _offset_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if ".attn1.offsets." in key:
                    out[key] = f.get_tensor(key)
    return out


def enable_dsa(model, path: str | Path | None = None, backend: str = "auto"):
    """Make a diffusers ``WanTransformer3DModel`` loaded from an export (or a ``WanPipeline`` holding
    one) run the self-attention it was trained with; returns ``model``. ``path``: the export folder
    (default: where the transformer was loaded from). ``backend``: the 3D-DSA kernel
    (``attention.backend``: ``auto``, ``reference``, ``triton``, ...).

    A Wan 2.2 pipeline's second transformer (``transformer_2``, the low-noise expert) is enabled
    too when it was loaded from an export of its own; when it was not, it stays dense and a
    warning says so (a run trains one transformer)."""
    transformer = getattr(model, "transformer", None) or model
    _enable(transformer, path, backend)
    second = getattr(model, "transformer_2", None) if transformer is not model else None
    if second is not None:
        try:
            folder = _export_folder(second, None)
            exported = CONFIG_KEY in json.loads((folder / "config.json").read_text())
        except FileNotFoundError:
            exported = False
        if exported:
            _enable(second, None, backend)
        else:
            log.warning("enable_dsa: the pipeline's transformer_2 is not an export of a model trained with local "
                        "attention; it keeps diffusers' dense self-attention (load an export into it to change that)")
    return model


def _enable(transformer: nn.Module, path: str | Path | None, backend: str) -> None:
    """``enable_dsa`` on one ``WanTransformer3DModel``."""
    folder = _export_folder(transformer, path)
    settings = json.loads((folder / "config.json").read_text()).get(CONFIG_KEY)
    if not settings:
        raise ValueError(f"{folder / 'config.json'} has no {CONFIG_KEY!r} entry: it is not an export of a model "
                         f"trained with local attention (a dense one needs nothing: diffusers runs it as it is)")
    kind = settings["kind"]
    if kind == "dsa" and not settings.get("offsets", True):
        raise ValueError(f"{folder} was exported with --drop-offsets: without its offset heads the model cannot run "
                         f"as trained; export it again without that flag")
    param = transformer.blocks[0].attn1.to_q.weight  # the heads take the attention's device and dtype
    heads = {}
    dense = set(settings.get("dense_blocks", ()))  # attention.dense_blocks: diffusers' own attention
    if kind == "dsa":
        weights = _offset_weights(folder)
        for i, block in enumerate(transformer.blocks):
            if i in dense:
                continue
            attn = block.attn1
            D = attn.to_q.out_features
            head = OffsetPredictor(D, attn.heads, tuple(settings["window"]), settings["max_offset"],
                                   settings["offset_groups"], tuple(settings["offset_kernel"]), settings["offset_scale"],
                                   settings.get("offset_condition", "none"), settings.get("offset_source", "block"),
                                   settings.get("offset_bound", "tanh"))
            prefix = f"blocks.{i}.attn1.offsets."
            state = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
            missing = sorted(set(head.state_dict()) - set(state))
            if missing:
                raise ValueError(f"{folder}: the offset head of block {i} lacks {', '.join(prefix + m for m in missing)}")
            head.load_state_dict(state)
            heads[i] = head.to(device=param.device, dtype=param.dtype)
    grid = TokenGrid(transformer.config.patch_size)
    if getattr(transformer, "_megaslide_grid_hook", None) is not None:
        transformer._megaslide_grid_hook.remove()  # enabled twice: one hook
    transformer._megaslide_grid_hook = transformer.rope.register_forward_pre_hook(grid.record)
    temb = _record_timestep(transformer, heads, settings.get("dense_above_t", 0.0))
    scale = settings["scale"] if settings["scale"] > 0 else None
    for i, block in enumerate(transformer.blocks):
        if i in dense:
            continue
        if i in heads:
            block.attn1.offsets = heads[i]  # a submodule: moved, saved and listed with the model
        # swin shifts its windows on every other block (models.wan: block index i + 1 even)
        block.attn1.set_processor(DSAAttnProcessor(grid, kind, settings["window"], scale, shift=(i + 1) % 2 == 0,
                                                   backend=backend, temb=temb))


def _record_timestep(transformer: nn.Module, heads: dict, dense_above_t: float) -> TimestepEmbedding | None:
    """The hooks on ``condition_embedder`` that record what the processors read of the timestep:
    ``temb`` for offset heads with ``offset_condition``, each sample's dense weight for
    ``dense_above_t`` (None: neither is needed). Enabled twice: one set of hooks."""
    for name in ("_megaslide_temb_hook", "_megaslide_time_hook"):
        if getattr(transformer, name, None) is not None:
            getattr(transformer, name).remove()
            setattr(transformer, name, None)
    conditioned = any(h.condition != "none" for h in heads.values())
    if not conditioned and not dense_above_t > 0:
        return None
    temb = TimestepEmbedding(dense_above_t)
    embedder = transformer.condition_embedder
    if conditioned:
        transformer._megaslide_temb_hook = embedder.register_forward_hook(temb.record)
    if dense_above_t > 0:
        transformer._megaslide_time_hook = embedder.register_forward_pre_hook(temb.record_time, with_kwargs=True)
    return temb
