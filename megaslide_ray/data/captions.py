"""Captions as the ``videodit`` model reads them: bytes, not tokens.

The model's built-in caption encoder (``megaslide_ray.models.videodit.CaptionEncoder``) embeds raw UTF-8
bytes, so no tokenizer or text model has to be downloaded. A caption is its UTF-8 encoding cut
at ``model.caption_max_bytes`` bytes without splitting a character (a cut inside a multi-byte
character drops that character), in a batch of

* ``caption``: uint8 ``(B, max_bytes)``, the bytes, zero padded on the right;
* ``caption_len``: int32 ``(B,)``, how many bytes of each row are the caption (0: no caption,
  which classifier-free guidance uses as the unconditional input).

Training (``actors.decoder``) and sampling (``megaslide_ray.sample``) both build their batches
here, so a prompt at sampling time reaches the model exactly as the captions it was trained on.
"""

from __future__ import annotations

import numpy as np


def encode_caption(text: str, max_bytes: int) -> bytes:
    """UTF-8 bytes of ``text`` cut to ``max_bytes`` without splitting a character."""
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore").encode("utf-8")


def empty_captions(batch: int, max_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of ``batch`` empty captions: ``(caption, caption_len)``, all zeros."""
    return np.zeros((batch, max_bytes), dtype=np.uint8), np.zeros((batch,), dtype=np.int32)


def set_caption(caption: np.ndarray, caption_len: np.ndarray, row: int, text: str) -> None:
    """Write ``text`` into row ``row`` of a batch from ``empty_captions`` (cut to its width)."""
    data = encode_caption(text, caption.shape[1])
    caption[row, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    caption[row, len(data):] = 0
    caption_len[row] = len(data)


def caption_batch(prompt: str, max_bytes: int, batch: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``prompt`` in every row of a batch of ``batch``: ``(caption, caption_len)``."""
    caption, caption_len = empty_captions(batch, max_bytes)
    for row in range(batch):
        set_caption(caption, caption_len, row, prompt)
    return caption, caption_len
