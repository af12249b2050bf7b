"""A small Wan model (``model.arch = wan``) on the motion set, for the studies.

Wan reads VAE latents and UMT5 text embeddings; neither model's weights can be downloaded here,
and a random VAE would make samples the motion metric cannot read. So the study's Wan reads the
clip's pixels as 3-channel "latents" (``model.latent_compression = (1, 1, 1)``: no VAE, the latent
grid is the pixel clip) and a fixed stand-in for the text encoder: each word of the caption a
fixed random vector (seeded by the word), plus a sin/cos code of its position, ``TEXT_DIM`` wide,
at most ``TEXT_LEN`` words, zero past the caption as the Wan pipeline pads. Everything else is
the product's Wan transformer (``megaslide_ray.models.wan``: RoPE on q and k before 3D-DSA in the
self-attention, dense cross-attention to the text), trained with the product's objective.

``WAN_OVERRIDES`` turn ``tiny-motion`` (width 128, 4 blocks, 4 heads, 8 frames of 16x16 in 2x2x2
patches) into that Wan model; batches and validation sets of the pixel pipeline are converted with
``wan_batch`` and ``wan_val_set``.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
import torch

TEXT_DIM, TEXT_LEN = 32, 16
"""Width of the stand-in text embedding and the tokens the model sees (motion captions have at
most 13 words)."""

WAN_OVERRIDES = {"model.arch": "wan", "model.prediction": "velocity", "model.in_channels": 3,
                 "model.latent_compression": "1,1,1", "model.ffn_dim": 512, "model.text_dim": TEXT_DIM,
                 "model.text_len": TEXT_LEN, "model.rope_max_seq_len": 64}
"""On ``tiny-motion``: Wan at the same width, depth and token grid (Wan predicts the velocity:
``tiny-motion``'s x-prediction is a ``videodit`` option)."""


def caption_text(caption: str) -> torch.Tensor:
    """The stand-in text embedding of ``caption``: ``(words, TEXT_DIM)`` float32, at most
    ``TEXT_LEN`` words (module docstring)."""
    words = caption.lower().split()[:TEXT_LEN]
    rows = []
    for p, word in enumerate(words):
        g = torch.Generator().manual_seed(zlib.crc32(word.encode()))
        vec = torch.randn(TEXT_DIM, generator=g)
        freqs = torch.exp(-math.log(100.0) * torch.arange(TEXT_DIM // 2) / (TEXT_DIM // 2))
        rows.append(vec + torch.cat([torch.sin(p * freqs), torch.cos(p * freqs)]))
    return torch.stack(rows) if rows else torch.zeros(0, TEXT_DIM)


def caption_condition(caption: str) -> tuple[np.ndarray, np.ndarray]:
    """``(text (1, TEXT_LEN, TEXT_DIM), text_len (1,))`` of one caption, zero-padded: what the
    Wan model's input shard takes."""
    text = caption_text(caption)
    padded = torch.zeros(1, TEXT_LEN, TEXT_DIM)
    padded[0, :len(text)] = text
    return padded.numpy(), np.array([len(text)], dtype=np.int32)


def _captions(caption_bytes: np.ndarray, lengths: np.ndarray) -> list[str]:
    return [bytes(np.asarray(c[:n], dtype=np.uint8)).decode() for c, n in zip(caption_bytes, lengths)]


def wan_batch(batch: dict) -> dict:
    """A decoder's video batch as the Wan model trains on it: ``latents`` (the pixels in [-1, 1]),
    ``text`` and ``text_len`` (the stand-in embeddings of its captions)."""
    texts, lens = zip(*(caption_condition(c) for c in _captions(batch["caption"], batch["caption_len"])))
    video = torch.from_numpy(np.array(batch["video"])).float() / 127.5 - 1.0
    return {"latents": video.numpy(), "text": np.concatenate(texts), "text_len": np.concatenate(lens)}


def wan_val_set(val):
    """A ``validation.ValSet`` of the pixel pipeline with the captions' stand-in text embeddings
    as its conditions (the clips are already pixels in [-1, 1])."""
    texts, lens = zip(*(caption_condition(c) for c in _captions(val.cond, val.cond_len)))
    return dataclasses.replace(val, cond=np.concatenate(texts), cond_len=np.concatenate(lens))
