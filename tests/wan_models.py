"""Tiny random Wan-like models for the tests, built on the fly (nothing is downloaded): a
diffusers-format ``WAN_DIR`` with ``vae/`` (AutoencoderKLWan, compression 4x8x8, 4 latent
channels), ``text_encoder/`` (UMT5, d_model 16, one layer) and ``tokenizer/`` (word level)."""

from __future__ import annotations

from pathlib import Path

import diffusers
import torch
import transformers

FRAMES, SIZE, Z, TEXT_DIM = 9, 32, 4, 16
"""Clips of 9 frames of 32x32 pixels; 4 latent channels; text embeddings 16 wide."""
LATENT_SHAPE = (3, 4, 4, Z)
"""Their latents, (F', H', W', C)."""
TRANSFORMER = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=Z, out_channels=Z,
                   text_dim=TEXT_DIM, freq_dim=16, ffn_dim=24, num_layers=2)
"""A tiny ``WanTransformer3DModel`` that reads those latents and text embeddings."""


def make_wan_dir(folder: Path) -> Path:
    """A tiny random ``WAN_DIR``: ``vae/`` (AutoencoderKLWan, compression 4x8x8, 4 channels),
    ``text_encoder/`` (UMT5, d_model 16, one layer), ``tokenizer/`` (word level, ``</s>`` appended)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(base_dim=8, z_dim=Z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.3, 0.05],
                               latents_std=[1.5, 2.0, 0.5, 1.25]).save_pretrained(folder / "vae")
    words = ("a an and on moving left right up down red green blue yellow orange purple white cyan circle square "
             "triangle dark gray black beige background").split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder / "tokenizer")
    cfg = transformers.UMT5Config(vocab_size=len(vocab), d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                  relative_attention_num_buckets=8, relative_attention_max_distance=16)
    transformers.UMT5EncoderModel(cfg).save_pretrained(folder / "text_encoder")
    return folder
