"""The image-to-video kinds of the Wan family as a model config says them: what condition a
``wan`` model reads (``required_kind``), how many pixel frames it keeps (``kept_frames``) and
whether it reads CLIP states (``uses_clip``). Pure functions of the config: precompute, the
decoders and the trainer all ask them."""

from __future__ import annotations

from typing import Any

KINDS = ("i2v", "flf2v", "i2v-a14b")
"""The image-to-video kinds whose condition precompute makes."""


def kept_frames(kind: str) -> int:
    """Pixel frames the condition keeps: 2 for ``flf2v`` (first and last), else 1."""
    if kind not in KINDS:
        raise ValueError(f"image condition kind {kind!r} is not one of {KINDS}")
    return 2 if kind == "flf2v" else 1


def uses_clip(kind: str) -> bool:
    """Whether the kind's transformer reads CLIP states (Wan2.1 I2V and FLF2V; not I2V-A14B)."""
    kept_frames(kind)
    return kind != "i2v-a14b"


def required_kind(model: Any) -> str | None:
    """The condition a ``wan`` model config reads (None: a text-to-video model): ``flf2v`` with
    FLF2V's positions, ``i2v`` with an image embedder, ``i2v-a14b`` with only the wider input
    (``in_channels = 2 out_channels + 4``)."""
    if model.pos_embed_seq_len:
        return "flf2v"
    if model.image_dim:
        return "i2v"
    out = model.out_channels or model.in_channels
    return "i2v-a14b" if model.in_channels != out and model.in_channels > out else None
