"""The image condition precompute makes for the Wan image-to-video folders (tiny random models
saved by diffusers' WanImageToVideoPipeline) against the pipeline's own ``prepare_latents`` and
``encode_image`` on the same first (and last) frame: the mask layout, grey frames, the VAE
latents, CLIP's penultimate hidden states; stored in the latent file and named in the manifest."""

from __future__ import annotations

import json

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image
from wan_models import CLIP_DIM, CLIP_TOKENS, FRAMES, LATENT_SHAPE, SIZE, Z, make_family_dir, make_wan_dir

from megaslide_ray.data.clips import decode_clip
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.data.image_condition import IMAGE_CONDITION_KEY, condition_mask, load_condition
from megaslide_ray.data.latent_cache import clip_config
from megaslide_ray.data.latents import read_latent_manifest, resolve
from pipelines.latent_precompute import precompute


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """kind -> (model folder, latent manifest) for i2v, flf2v and i2v-a14b."""
    root = tmp_path_factory.mktemp("i2v-pre")
    base = make_wan_dir(root / "base")
    videos = ensure_demo_dataset(root / "videos", num_videos=2)
    out = {}
    for kind in ("i2v", "flf2v", "i2v-a14b"):
        folder = make_family_dir(base, root / kind, kind)
        report = precompute(folder, videos, root / f"cache-{kind}", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32",
                            num_encoders=0, progress=False)
        assert report.clips == 2
        out[kind] = (folder, report.manifest)
    return out


def test_mask_layout_is_the_pipelines():
    """diffusers' mask for 9 frames at temporal compression 4: latent frame 0 all ones, the rest
    zero; FLF2V's last latent frame has its last channel one."""
    m = condition_mask(9, 4, 2, 3)
    assert m.shape == (3, 2, 3, 4)
    assert m[0].eq(1).all() and m[1:].eq(0).all()
    f = condition_mask(9, 4, 2, 3, last=True)
    assert f[0].eq(1).all() and f[1].eq(0).all() and f[2, ..., :3].eq(0).all() and f[2, ..., 3].eq(1).all()
    with pytest.raises(ValueError, match="10 frames is not 4k\\+1"):
        condition_mask(10, 4, 2, 3)


@pytest.mark.parametrize("kind", ["i2v", "flf2v", "i2v-a14b"])
def test_the_stored_condition_is_the_pipelines_prepare_latents_and_encode_image(caches, kind):
    folder, manifest = caches[kind]
    rows, meta = read_latent_manifest(manifest)
    info = meta[IMAGE_CONDITION_KEY]
    last = kind == "flf2v"
    clip_tokens, clip_dim = (CLIP_TOKENS, CLIP_DIM) if kind != "i2v-a14b" else (0, 0)
    assert info == {"kind": kind, "mask_channels": 4, "frames": 2 if last else 1, "image_tokens": clip_tokens,
                    "image_dim": clip_dim}
    pipe = diffusers.WanImageToVideoPipeline.from_pretrained(str(folder))
    row = rows[0]
    clip = decode_clip(str(resolve(manifest, row["source_path"])), clip_config(FRAMES, SIZE, SIZE, 0.0), 0, 0)
    first, final = (Image.fromarray(np.ascontiguousarray(f)) for f in (clip.frames[0], clip.frames[-1]))
    image = pipe.video_processor.preprocess(first, height=SIZE, width=SIZE).float()
    last_image = pipe.video_processor.preprocess(final, height=SIZE, width=SIZE).float() if last else None
    with torch.no_grad():
        _, want = pipe.prepare_latents(image, 1, Z, SIZE, SIZE, FRAMES, torch.float32, "cpu",
                                       torch.Generator().manual_seed(0), None, last_image)
    condition, states = load_condition(manifest, row, info)
    assert condition.shape == (*LATENT_SHAPE[:3], 4 + Z)
    got = condition.permute(3, 0, 1, 2)[None]
    assert torch.equal(got[:, :4], want[:, :4])  # the mask, exactly
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    if kind == "i2v-a14b":
        assert states is None
        return
    with torch.no_grad():
        want_states = pipe.encode_image([first, final] if last else first, "cpu")
    assert states.shape == want_states.shape == (2 if last else 1, CLIP_TOKENS, CLIP_DIM)
    assert float((states - want_states).abs().max()) < 1e-5


def test_precompute_settings_name_the_condition(caches, tmp_path):
    """A cache made for an image-to-video folder records its kind; the same videos through a
    text-to-video folder into that cache are refused as other settings."""
    folder, manifest = caches["i2v"]
    settings = json.loads((manifest.parent / "precompute.json").read_text())
    assert settings["condition"] == "i2v"
    t2v = make_family_dir(folder.parent / "base", tmp_path / "t2v", "t2v")
    videos = ensure_demo_dataset(folder.parent / "videos", num_videos=2)
    with pytest.raises(ValueError, match="condition: 'i2v' -> None"):
        precompute(t2v, videos, manifest.parent, FRAMES, SIZE, SIZE, device="cpu", dtype="fp32", num_encoders=0,
                   progress=False)


def _config(folder, manifest):
    from megaslide_ray.config import Config, apply_overrides
    from megaslide_ray.models.wan_diffusers import diffusers_overrides

    cfg = Config()
    apply_overrides(cfg, {**diffusers_overrides(folder), "attention.kind": "dense", "data.num_frames": FRAMES,
                          "data.height": SIZE, "data.width": SIZE, "data.manifest": str(manifest)})
    return cfg


def test_an_image_to_video_model_needs_its_condition_in_the_manifest(caches, tmp_path):
    """Each kind's model accepts its own cache; a text-to-video cache (no condition) is refused
    naming the precompute command, and so is another kind's; I2V-A14B takes an I2V cache (the
    same mask and latents; the CLIP states unused)."""
    from megaslide_ray.config import ConfigError
    from megaslide_ray.data.checks import check_data

    folder, manifest = caches["i2v"]
    t2v = make_family_dir(folder.parent / "base", tmp_path / "t2v", "t2v")
    videos = ensure_demo_dataset(folder.parent / "videos", num_videos=2)
    plain = precompute(t2v, videos, tmp_path / "cache", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32",
                       num_encoders=0, progress=False).manifest
    for kind in ("i2v", "flf2v", "i2v-a14b"):
        check_data(_config(caches[kind][0], caches[kind][1]))
        with pytest.raises(ConfigError, match=f"(?s)image-to-video model \\({kind}\\).*holds no image condition.*"
                                              f"python -m megaslide_ray.precompute --model-dir I2V_MODEL_DIR"):
            check_data(_config(caches[kind][0], plain))
    check_data(_config(caches["i2v-a14b"][0], caches["i2v"][1]))
    with pytest.raises(ConfigError, match="its image condition is 'i2v', the model reads 'flf2v'"):
        check_data(_config(caches["flf2v"][0], caches["i2v"][1]))
    check_data(_config(t2v, caches["i2v"][1]))  # a text-to-video model ignores the condition


def test_train_refuses_a_condition_less_cache_before_ray(caches, tmp_path, capsys):
    """``train --init-from I2V_DIR`` on a text-to-video cache: exit 2 before Ray, naming the
    precompute command."""
    from megaslide_ray import train as train_cli

    folder, manifest = caches["i2v"]
    t2v = make_family_dir(folder.parent / "base", tmp_path / "t2v", "t2v")
    videos = ensure_demo_dataset(folder.parent / "videos", num_videos=2)
    plain = precompute(t2v, videos, tmp_path / "cache", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32",
                       num_encoders=0, progress=False).manifest
    rc = train_cli.main(["--init-from", str(folder), "--data", str(plain), "--data.num_frames", str(FRAMES),
                         "--data.height", str(SIZE), "--data.width", str(SIZE), "--attention.window", "3,1,1",
                         "--steps", "1", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds no image condition" in err and "python -m megaslide_ray.precompute --model-dir" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
