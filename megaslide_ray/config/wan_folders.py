"""What a diffusers Wan folder is, read from its ``model_index.json`` and transformer
``config.json`` alone (no weights), and the refusals of the folders this project does not train.

A folder is the model folder (with ``model_index.json`` and/or ``transformer/``) or one of its
transformer folders (``transformer/``, ``transformer_2/``: a ``config.json`` naming a transformer
class); a transformer folder is read together with its parent's ``model_index.json``, so
``ROOT/transformer_2`` of a two-expert model is known as one expert of that model.

Kinds (``WanFolder.kind``):

* ``t2v``: text-to-video, one transformer (Wan2.1 T2V, ``WanPipeline``; a
  ``WanVideoToVideoPipeline`` folder holds the same transformer);
* ``ti2v``: Wan2.2 TI2V-5B (``WanPipeline`` with ``expand_timesteps``): trained as text-to-video,
  or from an image with ``model.clean_first_frame``;
* ``t2v-a14b``: Wan2.2 T2V-A14B, two experts: ``transformer/`` denoises the timesteps ``t >=
  boundary_ratio x 1000`` (high noise), ``transformer_2/`` those below (low noise);
* ``i2v``, ``i2v-a14b``, ``flf2v``: image-to-video (Wan2.1 I2V, Wan2.2 I2V-A14B, Wan2.1
  first-last-frame): not supported;
* ``vace``, ``animate``, ``s2v``: Wan VACE, Animate, speech-to-video: not supported;
* ``unknown``: any other pipeline or transformer class: not supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megaslide_ray.config.sections import ConfigError

TEXT_TO_VIDEO = ("t2v", "ti2v", "t2v-a14b")
"""The kinds whose transformer this project trains (text-to-video)."""
IMAGE_TO_VIDEO = ("i2v", "i2v-a14b", "flf2v")
"""The image-to-video kinds whose transformer ``from_diffusers`` loads (``refuse_unsupported``'s
``image_to_video``)."""

NAMES = {
    "t2v": "a Wan text-to-video model",
    "ti2v": "a Wan2.2 TI2V-5B model (text-to-video, or from an image with model.clean_first_frame)",
    "t2v-a14b": "a Wan2.2 T2V-A14B model (two experts: transformer/ and transformer_2/)",
    "i2v": "a Wan2.1 image-to-video model",
    "i2v-a14b": "a Wan2.2 I2V-A14B image-to-video model (two experts)",
    "flf2v": "a Wan2.1 first-last-frame-to-video (FLF2V) model",
    "vace": "a Wan VACE model",
    "animate": "a Wan Animate model",
    "s2v": "a Wan speech-to-video (S2V) model",
    "unknown": "a model this project does not know",
}
"""What each kind is, in words (error messages)."""

_TRANSFORMER_DIRS = ("transformer", "transformer_2")
_IMAGE_KEYS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")
_T2V_PIPELINES = (None, "WanPipeline", "WanVideoToVideoPipeline")


@dataclass(frozen=True)
class WanFolder:
    """A diffusers Wan folder as its config files describe it."""
    path: Path
    """The folder given."""
    root: Path | None
    """The model folder (``model_index.json``, ``transformer/``...); None for a lone transformer folder."""
    kind: str
    """One of the module docstring's kinds."""
    pipeline: str | None
    """``model_index.json``'s ``_class_name``; None without one."""
    transformer_class: str | None
    """The transformer ``config.json``'s ``_class_name``; None without one."""
    boundary_ratio: float | None
    """``model_index.json``'s ``boundary_ratio`` (two experts); None without one."""
    given: str | None
    """The transformer folder ``path`` names (``transformer`` or ``transformer_2``); None when
    ``path`` is the model folder."""
    evidence: str
    """The config entries the kind was read from, for messages."""

    @property
    def name(self) -> str:
        return NAMES[self.kind]

    @property
    def two_experts(self) -> bool:
        return self.kind in ("t2v-a14b", "i2v-a14b")


def _read(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(out, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return out


def _has_component(index: dict, root: Path | None, name: str) -> bool:
    entry = index.get(name)
    if isinstance(entry, list) and any(x is not None for x in entry):
        return True
    return root is not None and (root / name / "config.json").is_file()


def _locate(p: Path, need_transformer: bool) -> tuple[Path | None, str | None, Path | None]:
    """(model folder, the transformer folder named, that folder's config.json)."""
    if (p / "model_index.json").is_file() or (p / "transformer" / "config.json").is_file():
        tconf = p / "transformer" / "config.json"
        return p, None, tconf if tconf.is_file() else None
    if (p / "config.json").is_file():
        parent = p.parent
        root = parent if (parent / "model_index.json").is_file() else None
        return root, p.name, p / "config.json"
    if not need_transformer:  # a folder of the encoders alone (vae/, text_encoder/, tokenizer/)
        return p, None, None
    raise FileNotFoundError(f"{str(p)!r} holds neither model_index.json, transformer/config.json nor config.json: not "
                      f"a diffusers model folder or one of its transformer folders")


def describe_wan_folder(path: str | Path, need_transformer: bool = True) -> WanFolder:
    """What the folder ``path`` is (module docstring), from its config files only. Without
    ``need_transformer`` a folder with neither ``model_index.json`` nor a transformer (the
    encoders alone: ``precompute``, ``sample --model-dir``) is ``t2v``."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"{str(path)!r}: no such folder")
    root, given, tconf = _locate(p, need_transformer)
    index = _read(root / "model_index.json") if root is not None and (root / "model_index.json").is_file() else {}
    tcfg = _read(tconf) if tconf is not None else {}
    pipeline, tcls = index.get("_class_name"), tcfg.get("_class_name")
    boundary = index.get("boundary_ratio")
    two = _has_component(index, root, "transformer_2")
    image = {k: tcfg[k] for k in _IMAGE_KEYS if tcfg.get(k) is not None}
    # noise + 4 mask channels + the image latents: an image-to-video input (36 = 2 x 16 + 4)
    wide_input = tcfg.get("in_channels") is not None and tcfg.get("out_channels") is not None and \
        int(tcfg["in_channels"]) == 2 * int(tcfg["out_channels"]) + 4
    evidence = [f"pipeline {pipeline}" if pipeline else "", f"transformer {tcls}" if tcls else "",
                ", ".join(f"{k}={v}" for k, v in image.items()),
                f"in_channels={tcfg['in_channels']} out_channels={tcfg['out_channels']}" if wide_input else "",
                "transformer_2" if two else "", f"boundary_ratio={boundary}" if boundary is not None else "",
                "expand_timesteps" if index.get("expand_timesteps") else ""]
    words = f"{pipeline or ''} {tcls or ''}".lower()
    if "vace" in words:
        kind = "vace"
    elif "animate" in words:
        kind = "animate"
    elif "s2v" in words or "speech" in words or "audio" in words:
        kind = "s2v"
    elif tcls not in (None, "WanTransformer3DModel"):
        kind = "unknown"
    elif pipeline == "WanImageToVideoPipeline" or image or wide_input:
        kind = "flf2v" if tcfg.get("pos_embed_seq_len") is not None else ("i2v-a14b" if two else "i2v")
    elif pipeline not in _T2V_PIPELINES:
        kind = "unknown"
    elif two or boundary is not None:
        kind = "t2v-a14b"
    else:
        kind = "ti2v" if index.get("expand_timesteps") else "t2v"
    return WanFolder(path=p, root=root, kind=kind, pipeline=pipeline, transformer_class=tcls,
                     boundary_ratio=None if boundary is None else float(boundary), given=given,
                     evidence=", ".join(e for e in evidence if e) or "no model_index.json")


def refuse_unsupported(folder: WanFolder, flag: str, image_to_video: bool = False) -> None:
    """A ``ConfigError`` naming what ``folder`` is when it is not a text-to-video Wan model
    (image-to-video, VACE, Animate, S2V, an unknown class). ``flag``: the option that gave it.
    ``image_to_video``: the image-to-video kinds pass too (what the caller handles)."""
    if folder.kind in TEXT_TO_VIDEO or (image_to_video and folder.kind in IMAGE_TO_VIDEO):
        return
    what = folder.name
    if folder.kind in ("i2v", "i2v-a14b", "flf2v"):
        why = ("image-to-video is not supported (its image condition: the image embedder, the image "
               "cross-attention and the extra input channels, is not implemented); treating it as text-to-video "
               "would train and store the wrong thing")
    elif folder.kind == "unknown":
        why = "only Wan text-to-video folders (WanPipeline, WanTransformer3DModel) are supported"
    else:
        why = "it is not supported (only Wan text-to-video models are)"
    raise ConfigError(f"{flag} {str(folder.path)!r} is {what} ({folder.evidence}): {why}. Give a Wan2.1 T2V, "
                      f"Wan2.2 TI2V-5B or Wan2.2 T2V-A14B folder")

