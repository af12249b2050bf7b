"""Image-to-video Wan models (megaslide_ray/models/wan.py) against diffusers' WanTransformer3DModel on
tiny random configs: Wan2.1 I2V (the image embedder, the image keys/values in cross-attention,
2 z + 4 input channels) and FLF2V (the image tokens of two frames with learned positions):
forward and every gradient in fp32, the token-chunked block, the bf16 float32 rule, folders
loaded by ``from_diffusers``. Nothing is downloaded."""

from __future__ import annotations

import copy

import pytest
import torch
from diffusers import WanTransformer3DModel
from wan_models import CLIP_TOKENS

from megaslide_ray.config import Config, ConfigError, apply_overrides
from megaslide_ray.config.validate import validate
from megaslide_ray.models.wan import WanTransformer
from megaslide_ray.models.wan_diffusers import (
    DiffusersWanTransformer,
    diffusers_config,
    from_diffusers,
    wan_config_from_diffusers,
)
from megaslide_ray.models.wan_layers import KEEP_FP32

Z, IMAGE_DIM, IMAGE_TOKENS, TEXT_TOKENS = 4, 10, 5, 512
"""Latent channels, CLIP state width, image tokens per frame, text tokens (diffusers' fixed 512)."""
I2V = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=2 * Z + 4, out_channels=Z,
           text_dim=12, freq_dim=16, ffn_dim=24, num_layers=2, image_dim=IMAGE_DIM, added_kv_proj_dim=16)
FLF2V = {**I2V, "pos_embed_seq_len": 2 * IMAGE_TOKENS}
LATENTS = (2 * Z + 4, 3, 6, 10)


def _diffusers(kw: dict, seed: int = 0) -> WanTransformer3DModel:
    """A random diffusers model, every parameter (norms, biases, ``pos_embed``) moved off its init."""
    torch.manual_seed(seed)
    ref = WanTransformer3DModel(**kw)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref.eval()


def _ours(ref: WanTransformer3DModel, **overrides) -> DiffusersWanTransformer:
    cfg = Config()
    apply_overrides(cfg, wan_config_from_diffusers(dict(ref.config)))
    apply_overrides(cfg, {"attention.kind": "dense", **overrides})
    model = DiffusersWanTransformer(cfg)
    missing, unexpected = model.load_state_dict(ref.state_dict(), strict=False)
    assert not unexpected and all(".attn1.offsets." in n for n in missing)
    return model


def _inputs(frames: int = 1, B: int = 2, seed: int = 1):
    """Latents (noise, mask, image latents), timesteps, 512 text tokens, ``frames`` frames' CLIP
    states per sample (FLF2V: 2, stacked along the batch as the pipeline does)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, *LATENTS, generator=g), torch.tensor([137.0, 912.5])[:B],
            torch.randn(B, TEXT_TOKENS, I2V["text_dim"], generator=g),
            torch.randn(frames * B, IMAGE_TOKENS, IMAGE_DIM, generator=g))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("kw,frames", [(I2V, 1), (FLF2V, 2)], ids=["i2v", "flf2v"])
def test_forward_and_every_gradient_match_diffusers_with_image_states(kw, frames):
    ref = _diffusers(kw)
    ours = _ours(ref)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    x, ts, text, image = _inputs(frames)
    want = ref(x, ts, text, encoder_hidden_states_image=image, return_dict=False)[0]
    got = ours(x, ts, text, image)
    assert got.shape == want.shape == (2, Z, *LATENTS[1:])
    assert _rel(got, want) < 1e-5
    weight = torch.randn_like(want)
    (want * weight).sum().backward()
    (got * weight).sum().backward()
    ref_params = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert p.grad is not None and ref_params[n].grad is not None, n
        assert p.grad.abs().sum() > 0, n
        assert _rel(p.grad, ref_params[n].grad) < 1e-4, n
    # the image matters: other image states change the output
    with torch.no_grad():
        assert _rel(ours(x, ts, text, torch.randn_like(image)), got) > 1e-3  # (not a shift: norm1 removes it)


def test_token_chunked_blocks_give_the_whole_clip_result_with_image_states():
    ref = _diffusers(I2V)
    whole, chunked = _ours(ref), _ours(ref, **{"runtime.token_chunk": 16})
    x, ts, text, image = _inputs()
    a = whole(x, ts, text, image)
    b = chunked(x, ts, text, image)
    assert _rel(b, a) < 1e-6
    a.square().sum().backward()
    b.square().sum().backward()
    grads = dict(whole.named_parameters())
    for n, p in chunked.named_parameters():
        assert _rel(p.grad, grads[n].grad) < 1e-5, n


def test_image_states_are_required_exactly_where_the_model_reads_them():
    ours = _ours(_diffusers(I2V))
    x, ts, text, image = _inputs()
    with pytest.raises(ValueError, match="needs the CLIP image states of its first frame"):
        ours(x, ts, text)
    with pytest.raises(ValueError, match="the text has 7 tokens: an image-to-video model reads model.text_len=512"):
        ours(x, ts, text[:, :7], image)
    t2v = _ours(_diffusers({**I2V, "image_dim": None, "added_kv_proj_dim": None}))
    with pytest.raises(ValueError, match="without an image embedder"):
        t2v(x, ts, text, image)


def test_bf16_keeps_diffusers_float32_modules_including_the_image_norms(tmp_path):
    ref = _diffusers(I2V)
    ref.save_pretrained(tmp_path / "transformer")
    ours = from_diffusers(tmp_path, dtype=torch.bfloat16)
    keep = WanTransformer3DModel._keep_in_fp32_modules
    fp32 = {n for n, p in ours.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {n for n, _ in ref.named_parameters() if any(k in n.split(".") for k in keep)}
    assert {"condition_embedder.image_embedder.norm1.weight", "condition_embedder.image_embedder.norm2.bias"} <= fp32
    assert all(any(k in n.split(".") for k in KEEP_FP32) for n in fp32)
    theirs = copy.deepcopy(ref)
    for n, p in theirs.named_parameters():
        p.data = p.data.to(torch.float32 if n in fp32 else torch.bfloat16)
    x, ts, text, image = _inputs()
    with torch.no_grad():
        exact = ref(x, ts, text, encoder_hidden_states_image=image, return_dict=False)[0]
        theirs_out = theirs(x.bfloat16(), ts, text.bfloat16(), encoder_hidden_states_image=image.bfloat16(),
                            return_dict=False)[0]
        ours_out = ours(x.bfloat16(), ts, text.bfloat16(), image.bfloat16())
    assert 0 < _rel(theirs_out, exact) < 0.05
    assert _rel(ours_out, exact) <= 2 * _rel(theirs_out, exact)


def test_image_config_round_trips_and_is_checked():
    overrides = wan_config_from_diffusers(dict(_diffusers(FLF2V).config))
    assert (overrides["model.image_dim"], overrides["model.added_kv_proj_dim"],
            overrides["model.pos_embed_seq_len"], overrides["model.in_channels"]) == (IMAGE_DIM, 16, 10, 12)
    cfg = Config()
    apply_overrides(cfg, {**overrides, "attention.kind": "dense", "data.num_frames": 9, "data.height": 32,
                          "data.width": 32})
    exported = diffusers_config(cfg)
    with torch.device("meta"):
        theirs = WanTransformer3DModel.from_config(exported)
        ours = WanTransformer(cfg)
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    validate(cfg)
    with pytest.raises(ConfigError, match="both .* or neither"):
        validate(apply_overrides(copy.deepcopy(cfg), {"model.added_kv_proj_dim": 0}))
    with pytest.raises(ConfigError, match="set it to 16"):
        validate(apply_overrides(copy.deepcopy(cfg), {"model.added_kv_proj_dim": 8}))
    with pytest.raises(ConfigError, match="reads 512 text tokens; set model.text_len=512"):
        validate(apply_overrides(copy.deepcopy(cfg), {"model.text_len": 256}))


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """kind -> a tiny folder saved by diffusers' WanImageToVideoPipeline (``tests/wan_models.py``)."""
    from wan_models import make_family_dir, make_wan_dir

    root = tmp_path_factory.mktemp("i2v-family")
    base = make_wan_dir(root / "base")
    return {kind: make_family_dir(base, root / kind, kind) for kind in ("i2v", "flf2v", "i2v-a14b")}


@pytest.mark.parametrize("kind,part", [("i2v", ""), ("flf2v", ""), ("i2v-a14b", "transformer"),
                                       ("i2v-a14b", "transformer_2")])
def test_from_diffusers_loads_the_image_to_video_folders(family, kind, part):
    """Each saved transformer gives diffusers' own output from its folder (FLF2V: two frames'
    CLIP tokens each; I2V-A14B: the wider input alone, no image states)."""
    path = family[kind] / part if part else family[kind]
    ref = WanTransformer3DModel.from_pretrained(str(family[kind] / (part or "transformer"))).eval()
    ours = from_diffusers(path)
    g = torch.Generator().manual_seed(5)
    c = ref.config
    x = torch.randn(1, c.in_channels, 3, 4, 4, generator=g)
    text = torch.randn(1, TEXT_TOKENS, c.text_dim, generator=g)
    frames = 2 if c.pos_embed_seq_len else 1
    image = torch.randn(frames, CLIP_TOKENS, c.image_dim, generator=g) if c.image_dim else None
    with torch.no_grad():
        want = ref(x, torch.tensor([700.0]), text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = ours(x, torch.tensor([700.0]), text, image)
    assert _rel(got, want) < 1e-5


@pytest.mark.parametrize("name", ["wan2.1-i2v-14b-480p", "wan2.1-i2v-14b-720p", "wan2.1-flf2v-14b-720p",
                                  "wan2.2-i2v-a14b"])
def test_image_to_video_presets_are_diffusers_models(name):
    """Each preset's dense model has diffusers' parameters for its config.json (image embedder,
    image keys/values, 36 input channels; FLF2V's positions), and the planner counts them and,
    for I2V-A14B, both experts on the host."""
    from megaslide_ray.config import build_config
    from megaslide_ray.planning.estimate import plan

    cfg = build_config(name, None, {"attention.kind": "dense"})
    with torch.device("meta"):
        theirs = WanTransformer3DModel.from_config(diffusers_config(cfg))
        ours = WanTransformer(cfg)
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}
    assert cfg.model.in_channels == 36 and (cfg.model.out_channels or 16) == 16
    p = plan(cfg, ram_gb=1649, gpu_gb=141)
    assert p.params == sum(x.numel() for x in theirs.parameters())
    assert p.experts == (2 if name == "wan2.2-i2v-a14b" else 1) and p.fits
    if p.experts == 2:
        with pytest.raises(ConfigError, match="--preset wan2.2-i2v-a14b with a --config TOML"):
            plan(cfg, gpus_per_node=8)


def test_an_image_to_video_folder_starts_from_its_preset(tmp_path):
    """--init-from a folder of the I2V-14B shape starts from wan2.1-i2v-14b-480p, FLF2V's from its
    preset, I2V-A14B's from wan2.2-i2v-a14b (both experts), and TI2V-5B's stays text-to-video
    (its image mode is asked for with --model.clean_first_frame)."""
    import json

    from megaslide_ray.config import build_config
    from megaslide_ray.state.pretrained_io import config_for_diffusers_dir

    vae = json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 16})
    cases = {"wan2.1-i2v-14b-720p": ("wan2.1-i2v-14b-480p", ("transformer",)),
             "wan2.1-flf2v-14b-720p": ("wan2.1-flf2v-14b-720p", ("transformer",)),
             "wan2.2-i2v-a14b": ("wan2.2-i2v-a14b", ("transformer", "transformer_2"))}
    for source, (want, parts) in cases.items():
        transformer = json.dumps(diffusers_config(build_config(source)))
        for part in (*parts, "vae"):
            (tmp_path / source / part).mkdir(parents=True)
            (tmp_path / source / part / "config.json").write_text(vae if part == "vae" else transformer)
        index = {"_class_name": "WanImageToVideoPipeline", **({"boundary_ratio": 0.9} if len(parts) == 2 else {})}
        (tmp_path / source / "model_index.json").write_text(json.dumps(index))
        cfg = config_for_diffusers_dir(tmp_path / source, None, None, {})
        assert cfg.preset == want and not cfg.model.clean_first_frame, source
    ti2v = tmp_path / "ti2v"
    for part in ("transformer", "vae"):
        (ti2v / part).mkdir(parents=True)
    (ti2v / "transformer" / "config.json").write_text(json.dumps(diffusers_config(build_config("wan2.2-ti2v-5b"))))
    (ti2v / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 48,
                                                          "scale_factor_spatial": 16}))
    (ti2v / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": True}))
    cfg = config_for_diffusers_dir(ti2v, None, None, {})
    assert cfg.preset == "wan2.2-ti2v-5b" and not cfg.model.clean_first_frame
    assert config_for_diffusers_dir(ti2v, None, None, {"model.clean_first_frame": True}).model.clean_first_frame
