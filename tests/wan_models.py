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


BOUNDARY = 0.875
"""The ``boundary_ratio`` of the tiny two-expert folders (Wan2.2 T2V-A14B's)."""


def _pipeline_parts(base: Path) -> dict:
    """The encoders of a ``make_wan_dir`` folder and a flow-matching scheduler, as pipeline parts."""
    return dict(tokenizer=transformers.AutoTokenizer.from_pretrained(str(base / "tokenizer")),
                text_encoder=transformers.UMT5EncoderModel.from_pretrained(str(base / "text_encoder")),
                vae=diffusers.AutoencoderKLWan.from_pretrained(str(base / "vae")),
                scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))


CLIP_DIM, CLIP_TOKENS = 8, 5
"""The tiny CLIP vision encoder's width (the I2V transformers' ``image_dim``) and its tokens per
image (2 x 2 patches of 16 pixels and the class token)."""


def tiny_clip() -> dict:
    """A random ``CLIPVisionModel`` (two layers, 32-pixel images) and its ``CLIPImageProcessor``,
    as the ``image_encoder``/``image_processor`` of a ``WanImageToVideoPipeline``."""
    cfg = transformers.CLIPVisionConfig(hidden_size=CLIP_DIM, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=32, patch_size=16, projection_dim=8)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return dict(image_encoder=transformers.CLIPVisionModel(cfg).eval(), image_processor=processor)


def make_family_dir(base: Path, folder: Path, kind: str, seed: int = 0) -> Path:
    """A tiny random diffusers folder of one Wan layout, saved by diffusers' own pipeline class
    (the encoders of ``base``, a ``make_wan_dir`` folder): ``t2v`` (WanPipeline), ``t2v-a14b``
    (WanPipeline with ``transformer_2`` and ``boundary_ratio``), ``i2v`` (WanImageToVideoPipeline,
    a transformer with ``image_dim`` and a tiny CLIP image encoder), ``i2v-a14b`` (two 3Z+4-channel experts, no image encoder),
    ``flf2v`` (``pos_embed_seq_len``), ``vace`` (WanVACEPipeline), ``ti2v`` (WanPipeline with
    ``expand_timesteps``, Wan2.2 TI2V-5B's layout)."""
    torch.manual_seed(seed)
    parts = _pipeline_parts(base)
    t = dict(TRANSFORMER)
    if kind == "t2v":
        pipe = diffusers.WanPipeline(transformer=diffusers.WanTransformer3DModel(**t), **parts)
    elif kind == "ti2v":  # Wan2.2 TI2V-5B's layout: WanPipeline with expand_timesteps
        pipe = diffusers.WanPipeline(transformer=diffusers.WanTransformer3DModel(**t), expand_timesteps=True, **parts)
    elif kind == "t2v-a14b":
        pipe = diffusers.WanPipeline(transformer=diffusers.WanTransformer3DModel(**t),
                                     transformer_2=diffusers.WanTransformer3DModel(**t), boundary_ratio=BOUNDARY,
                                     **parts)
    elif kind in ("i2v", "flf2v", "i2v-a14b"):
        t["in_channels"] = 2 * Z + 4
        if kind != "i2v-a14b":
            t.update(image_dim=CLIP_DIM, added_kv_proj_dim=16)
        if kind == "flf2v":
            t["pos_embed_seq_len"] = 2 * CLIP_TOKENS
        two = kind == "i2v-a14b"
        clip = {} if two else tiny_clip()
        pipe = diffusers.WanImageToVideoPipeline(
            transformer=diffusers.WanTransformer3DModel(**t),
            transformer_2=diffusers.WanTransformer3DModel(**t) if two else None,
            boundary_ratio=0.9 if two else None, **clip, **parts)
    elif kind == "vace":
        pipe = diffusers.WanVACEPipeline(transformer=diffusers.WanVACETransformer3DModel(
            **t, vace_layers=[0], vace_in_channels=3 * Z), **parts)
    else:
        raise ValueError(kind)
    pipe.save_pretrained(folder)
    return folder
