"""A diffusers Wan folder in and out: its ``config.json`` as ``model.*`` overrides, the config
back as a diffusers ``config.json``, its weight files, and ``from_diffusers``, the whole model
loaded as a ``WanTransformer`` called like diffusers' ``WanTransformer3DModel``."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn

from megaslide_ray.config import WAN_WINDOW, Config, ConfigError, apply_overrides
from megaslide_ray.config.presets import GPU_OFFSET_FIELDS
from megaslide_ray.config.wan_folders import describe_wan_folder, refuse_unsupported
from megaslide_ray.models.diffusers_dsa import CONFIG_KEY as DSA_CONFIG_KEY
from megaslide_ray.models.layers import ffn_width
from megaslide_ray.models.wan import WanTransformer, initialize_shard
from megaslide_ray.models.wan_layers import cast_like_diffusers


class DiffusersWanTransformer(WanTransformer):
    """A ``WanTransformer`` called like diffusers' model (what ``from_diffusers`` returns)."""

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor | None = None) -> torch.Tensor:
        return self.forward_diffusers(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image)


_DIFFUSERS_CLASS = "WanTransformer3DModel"


_DIFFUSERS_DEFAULTS: dict[str, Any] = {
    "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
"""The arguments of diffusers' ``WanTransformer3DModel.__init__`` and their defaults (a config.json
may leave out those at their default)."""


_IMAGE_KEYS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")


def wan_config_from_diffusers(config_json: dict, vae_config: dict | None = None) -> dict[str, Any]:
    """``model.*`` overrides from a diffusers transformer ``config.json`` (and, when given, the
    VAE's ``config.json``, for ``model.latent_compression``); an image-to-video model's
    ``image_dim``/``added_kv_proj_dim``/``pos_embed_seq_len`` become the same ``model.*`` fields.
    Refuses other classes, other q/k norms and keys this module does not know, naming each."""
    cls = config_json.get("_class_name", _DIFFUSERS_CLASS)
    if cls != _DIFFUSERS_CLASS:
        raise ConfigError(f"diffusers class {cls!r} is not supported; only {_DIFFUSERS_CLASS} (Wan2.1 / Wan2.2 "
                          f"text-to-video transformers)")
    unknown = sorted(k for k in config_json
                     if not k.startswith("_") and k not in _DIFFUSERS_DEFAULTS and k != DSA_CONFIG_KEY)
    if unknown:
        raise ConfigError(f"unknown {_DIFFUSERS_CLASS} config keys {unknown}: this module re-implements the model "
                          f"and would ignore them")
    c = {**_DIFFUSERS_DEFAULTS, **{k: v for k, v in config_json.items()
                                   if not k.startswith("_") and k != DSA_CONFIG_KEY}}
    if c["qk_norm"] != "rms_norm_across_heads":
        raise ConfigError(f"qk_norm={c['qk_norm']!r} is not supported; only 'rms_norm_across_heads'")
    if len(c["patch_size"]) != 3:
        raise ConfigError(f"patch_size={c['patch_size']!r} must have three values (frames, height, width)")
    heads, head_dim = int(c["num_attention_heads"]), int(c["attention_head_dim"])
    out = {
        "model.arch": "wan",
        "model.hidden_size": heads * head_dim,
        "model.num_heads": heads,
        "model.depth": int(c["num_layers"]),
        "model.ffn_dim": int(c["ffn_dim"]),
        "model.patch_size": tuple(int(p) for p in c["patch_size"]),
        "model.in_channels": int(c["in_channels"]),
        "model.out_channels": int(c["out_channels"] or c["in_channels"]),
        "model.text_dim": int(c["text_dim"]),
        "model.timestep_freq_dim": int(c["freq_dim"]),
        "model.cross_attn_norm": bool(c["cross_attn_norm"]),
        "model.eps": float(c["eps"]),
        "model.rope_max_seq_len": int(c["rope_max_seq_len"]),
    }
    for key in _IMAGE_KEYS:  # image-to-video (Wan2.1 I2V, FLF2V); absent: 0 (none)
        out[f"model.{key}"] = int(c[key] or 0)
    dsa = config_json.get(DSA_CONFIG_KEY)
    if dsa:  # an export of ours trained with local attention: its attention shapes its offset heads
        out.update({"attention.kind": dsa["kind"], "attention.window": tuple(dsa["window"]),
                    "attention.scale": float(dsa["scale"]), "attention.max_offset": float(dsa["max_offset"]),
                    "attention.offset_groups": int(dsa["offset_groups"]),
                    "attention.offset_kernel": tuple(dsa["offset_kernel"]),
                    "attention.offset_scale": float(dsa["offset_scale"]),
                    "attention.offset_condition": dsa.get("offset_condition", "none"),
                    "attention.offset_source": dsa.get("offset_source", "block"),
                    "attention.offset_bound": dsa.get("offset_bound", "tanh"),
                    "attention.dense_blocks": tuple(dsa.get("dense_blocks", ()))})  # the blocks without heads
    if vae_config is not None:
        z = vae_config.get("z_dim")
        if z is not None and out["model.in_channels"] not in (int(z), 2 * int(z) + 4):
            raise ConfigError(f"the VAE makes {z} latent channels (z_dim) but the transformer reads "
                              f"in_channels={out['model.in_channels']} (neither {z} nor an image-to-video "
                              f"model's {2 * int(z) + 4}: noise, 4 mask channels and the image latents)")
        if z is not None and int(z) != out["model.out_channels"]:
            raise ConfigError(f"the VAE makes {z} latent channels (z_dim) but the transformer predicts "
                              f"out_channels={out['model.out_channels']}")
        ct = int(vae_config.get("scale_factor_temporal") or 4)
        cs = int(vae_config.get("scale_factor_spatial") or 8)
        out["model.latent_compression"] = (ct, cs, cs)
    return out


def transformer_dir(path: str | Path) -> Path:
    """A diffusers model directory's ``transformer/`` folder, or ``path`` if it is that folder."""
    p = Path(path)
    if (p / "transformer" / "config.json").is_file():
        return p / "transformer"
    if (p / "config.json").is_file():
        return p
    raise FileNotFoundError(f"{str(p)!r} holds neither transformer/config.json nor config.json: not a diffusers "
                            f"model directory or its transformer/ folder")


def diffusers_overrides(path: str | Path) -> dict[str, Any]:
    """``wan_config_from_diffusers`` of a directory: its transformer's ``config.json``, and the VAE's
    (``vae/config.json`` beside ``transformer/``) when there is one."""
    tdir = transformer_dir(path)
    vae = tdir.parent / "vae" / "config.json"
    return wan_config_from_diffusers(json.loads((tdir / "config.json").read_text()),
                                     json.loads(vae.read_text()) if vae.is_file() else None)


def _effective(cfg: Config, key: str) -> Any:
    section, name = key.split(".", 1)
    value = getattr(getattr(cfg, section), name)
    if key == "model.out_channels":
        return value or cfg.model.in_channels
    if key == "model.ffn_dim":
        return ffn_width(cfg)
    return tuple(value) if isinstance(value, list) else value


def check_against(cfg: Config, overrides: dict[str, Any], source: str = "the diffusers config") -> None:
    """Raise one ``ConfigError`` listing every field where ``cfg`` contradicts ``overrides`` (values
    compared as the model uses them: ``out_channels`` 0 is ``in_channels``, ``ffn_dim`` 0 is
    ``mlp_ratio * hidden_size``)."""
    bad = []
    for key, want in overrides.items():
        have = _effective(cfg, key)
        want = tuple(want) if isinstance(want, list) else want
        same = math.isclose(have, want, rel_tol=1e-9) if isinstance(want, float) else have == want
        if not same:
            bad.append(f"{key}: the config has {have!r}, {source} has {want!r}")
    if bad:
        raise ConfigError(f"the config contradicts {source} in {len(bad)} field(s):\n  " + "\n  ".join(bad)
                          + "\nleave these fields unset (or set them to the model's values)")


def diffusers_config(cfg: Config) -> dict[str, Any]:
    """The ``config.json`` of diffusers' ``WanTransformer3DModel`` for ``cfg`` (the DSA offset heads
    are not part of it)."""
    m = cfg.model
    if m.arch != "wan":
        raise ConfigError(f"model.arch={m.arch!r}: only a wan model has a diffusers config")
    return {
        "_class_name": _DIFFUSERS_CLASS,
        "patch_size": list(m.patch_size),
        "num_attention_heads": m.num_heads,
        "attention_head_dim": m.hidden_size // m.num_heads,
        "in_channels": m.in_channels,
        "out_channels": m.out_channels or m.in_channels,
        "text_dim": m.text_dim,
        "freq_dim": m.timestep_freq_dim,
        "ffn_dim": ffn_width(cfg),
        "num_layers": m.depth,
        "cross_attn_norm": m.cross_attn_norm,
        "qk_norm": "rms_norm_across_heads",
        "eps": m.eps,
        "image_dim": m.image_dim or None,
        "added_kv_proj_dim": m.added_kv_proj_dim or None,
        "rope_max_seq_len": m.rope_max_seq_len,
        "pos_embed_seq_len": m.pos_embed_seq_len or None,
    }


def weight_files(tdir: Path) -> list[Path]:
    """The safetensors files of a transformer folder: those of its index, or the single file."""
    index = tdir / "diffusion_pytorch_model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (tdir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names files that are not there: {missing}")
        return [tdir / n for n in names]
    single = tdir / "diffusion_pytorch_model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no safetensors weights in {tdir} (diffusion_pytorch_model.safetensors or its .index.json); "
                            f"pickled .bin weights are never read")


def _attention_config(tdir: Path, attention_kind: str | None, window, offset_groups: int | None
                      ) -> tuple[Config, str]:
    """The model's config from ``tdir``'s ``config.json``: an export's recorded attention kept unless
    the caller names another, else ``dense`` with the presets' window; a ``dsa`` model without a
    recorded bound gets the presets' clamp."""
    cfg = Config()
    found = diffusers_overrides(tdir)
    apply_overrides(cfg, found)
    recorded = "attention.kind" in found  # an export's own attention settings: kept unless overridden
    attention_kind = attention_kind or found.get("attention.kind", "dense")
    chosen = {"attention.kind": attention_kind}
    if window is not None or not recorded:
        chosen["attention.window"] = tuple(window or WAN_WINDOW)
    if offset_groups is not None or not recorded:
        chosen["attention.offset_groups"] = offset_groups or 0
    if attention_kind == "dsa" and "attention.max_offset" not in found:  # the Wan presets' bound
        chosen.update({f"attention.{k}": v for k, v in GPU_OFFSET_FIELDS.items()})
    if recorded and attention_kind == found["attention.kind"]:  # the export's dense samples, as it ran them (a
        dsa = json.loads((tdir / "config.json").read_text()).get(DSA_CONFIG_KEY, {})  # run's --init-from picks its own)
        chosen["attention.dense_above_t"] = float(dsa.get("dense_above_t", 0.0))
    else:
        chosen["attention.dense_blocks"] = ()  # another kind than the export's: every block of it
    apply_overrides(cfg, chosen)
    return cfg, attention_kind


def from_diffusers(path: str | Path, attention_kind: str | None = None, window: Sequence[int] | None = None,
                   offset_groups: int | None = None, dtype: torch.dtype | None = None, seed: int = 0,
                   device: str | torch.device = "cpu") -> DiffusersWanTransformer:
    """Load a diffusers Wan transformer (a model directory with ``transformer/``, or that folder):
    ``config.json`` and safetensors weights (sharded with an index, or one file); nothing pickled
    is read. The module's ``forward(hidden_states, timestep, encoder_hidden_states)`` returns what
    ``WanTransformer3DModel(...)(..., return_dict=False)[0]`` returns.

    ``attention_kind``/``window``/``offset_groups`` choose the self-attention; left None, an export
    of ours (``config.json``'s ``megaslide_dsa`` entry) keeps the attention it was trained with
    (kind, window, offset groups and bound as recorded), any other folder gets ``dense``,
    diffusers' own, with the presets' ``WAN_WINDOW`` and per-head offset heads. A ``dsa`` model gets offset
    heads initialised from ``seed`` with the last layer zero, their offsets clamped at the presets'
    ``GPU_MAX_OFFSET`` unless the directory is an export of ours that records its own bound. ``dtype``: float32 by default; bf16
    keeps diffusers' float32 modules (``KEEP_FP32``) in float32. The model is built in ``dtype``
    and filled one tensor at a time: a bf16 14B model takes its 28.6 GB, not an fp32 copy first.
    A folder that is neither a text-to-video nor an image-to-video Wan model (VACE, Animate, S2V,
    unknown) is refused naming what it is, and so is the
    model folder of a two-expert Wan2.2 A14B model: name the expert's folder (``ROOT/transformer``
    or ``ROOT/transformer_2``)."""
    from safetensors import safe_open

    tdir = transformer_dir(path)
    folder = describe_wan_folder(path)
    refuse_unsupported(folder, "from_diffusers:", image_to_video=True)
    if folder.two_experts and folder.given is None:
        raise ConfigError(f"from_diffusers: {str(path)!r} is {folder.name} ({folder.evidence}): load one expert by "
                          f"its folder, {str(Path(path) / 'transformer')!r} (t >= boundary_ratio x 1000) or "
                          f"{str(Path(path) / 'transformer_2')!r} (below)")
    cfg, attention_kind = _attention_config(tdir, attention_kind, window, offset_groups)
    dtype = dtype or torch.float32
    with torch.device("meta"):
        model = DiffusersWanTransformer(cfg)
    if dtype != torch.float32:
        cast_like_diffusers(model, dtype)  # on the meta device: the model is only ever built in its dtype
    model.to_empty(device=device)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # Pass 1, headers only: every missing, unexpected or wrong-shape name in one error.
    where: dict[str, Path] = {}
    problems, unexpected = [], []
    for file in weight_files(tdir):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in expected:
                    # diffusers ignores norm_added_q too; an export's offset heads go unused when the
                    # caller asked for an attention without them
                    if "norm_added_q" not in key and not (".attn1.offsets." in key and attention_kind != "dsa"):
                        unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != expected[key]:
                    problems.append(f"{key}: shape {shape} in {file.name}, the model needs {expected[key]}")
                where[key] = file
    missing = sorted(n for n in expected if n not in where and ".attn1.offsets." not in n)
    if missing or unexpected or problems:
        lines = [f"missing: {n}" for n in missing] + [f"unexpected: {n}" for n in sorted(unexpected)] + problems
        raise ValueError(f"the weights in {tdir} do not fit the Wan transformer of its config.json "
                         f"({len(lines)} problem(s)):\n  " + "\n  ".join(lines[:50]))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for index, block in enumerate(model.blocks, start=1):
            if block.attn1.offsets is not None:  # fresh offset heads, last layer zero (drawn in fp32, then cast)
                fresh = copy.deepcopy(block.attn1.offsets).float()
                initialize_shard(fresh, seed, index)
                nn.init.zeros_(fresh.out.weight)
                for (_, p), (_, q) in zip(block.attn1.offsets.named_parameters(), fresh.named_parameters()):
                    p.copy_(q)
        # Pass 2: one tensor at a time into its parameter (the whole checkpoint is never held).
        for file in sorted(set(where.values())):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if where.get(key) == file:
                        params[key].copy_(f.get_tensor(key))
    return model
