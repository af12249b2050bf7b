"""The Wan family's folders, as diffusers' own pipeline classes save them (tiny random models):
what each is is read from model_index.json and the transformer's config.json, and every folder
this project does not train (image-to-video, FLF2V, VACE, Animate, S2V, unknown) is refused by
``train --init-from``, ``precompute`` and ``sample --model-dir`` before any work, naming what it
is; a Wan2.2 A14B folder is never trained as one transformer over every timestep."""

from __future__ import annotations

import json
import shutil

import pytest
from wan_models import BOUNDARY, make_family_dir, make_wan_dir

from megaslide_ray import precompute as precompute_cli
from megaslide_ray import train as train_cli
from megaslide_ray.config import ConfigError
from megaslide_ray.config.wan_folders import describe_wan_folder
from megaslide_ray.evaluation.sampling import check_model_files
from megaslide_ray.models.wan_diffusers import from_diffusers
from megaslide_ray.state.pretrained import PretrainedMismatchError, check_pretrained, config_for_diffusers_dir

KINDS = ("t2v", "t2v-a14b", "i2v", "flf2v", "i2v-a14b", "vace")
CLIP = {"data.num_frames": 9, "data.height": 32, "data.width": 32, "attention.window": "3,1,1"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """kind -> a tiny folder saved by diffusers' pipeline of that kind; also ``animate`` and
    ``s2v`` (a t2v folder whose model_index.json names those pipelines, which diffusers cannot
    build small here)."""
    root = tmp_path_factory.mktemp("family")
    base = make_wan_dir(root / "base")
    out = {kind: make_family_dir(base, root / kind, kind) for kind in KINDS}
    for kind, pipeline in (("animate", "WanAnimatePipeline"), ("s2v", "WanSpeechToVideoPipeline")):
        shutil.copytree(out["t2v"], root / kind)
        index = json.loads((root / kind / "model_index.json").read_text())
        (root / kind / "model_index.json").write_text(json.dumps({**index, "_class_name": pipeline}))
        out[kind] = root / kind
    return out


@pytest.mark.parametrize("kind", [*KINDS, "animate", "s2v"])
def test_the_kind_is_read_from_the_folder(family, kind):
    folder = describe_wan_folder(family[kind])
    assert folder.kind == kind
    assert folder.two_experts == (kind in ("t2v-a14b", "i2v-a14b"))
    assert folder.boundary_ratio == {"t2v-a14b": BOUNDARY, "i2v-a14b": 0.9}.get(kind)
    # A transformer folder is read with its model folder's model_index.json.
    expert = describe_wan_folder(family[kind] / "transformer")
    assert (expert.kind, expert.given) == (kind, "transformer")


REFUSED = {"i2v": "Wan2.1 image-to-video", "flf2v": "first-last-frame", "i2v-a14b": "I2V-A14B image-to-video",
           "vace": "Wan VACE", "animate": "Wan Animate", "s2v": "speech-to-video"}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_unsupported_folders_are_refused_everywhere_before_any_work(family, kind, tmp_path, capsys):
    path = family[kind]
    # train --init-from: refused while the config is built (before Ray), exit 2.
    assert train_cli.main(["--init-from", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert REFUSED[kind] in err and str(path) in err
    # The launch path (check_pretrained, before Ray) refuses it as well.
    cfg = config_for_diffusers_dir(family["t2v"], None, None, CLIP)
    with pytest.raises(PretrainedMismatchError, match=REFUSED[kind]):
        check_pretrained(cfg, path)
    # precompute: refused before anything is read or written.
    out = tmp_path / "cache"
    rc = precompute_cli.main(["--model-dir", str(path), "--data", str(tmp_path / "none.parquet"), "--out", str(out),
                              "--frames", "9", "--height", "32", "--width", "32", "--num-encoders", "0"])
    assert rc == 2 and REFUSED[kind] in capsys.readouterr().err and not out.exists()
    # sample --model-dir and from_diffusers.
    with pytest.raises(ConfigError, match=REFUSED[kind]):
        check_model_files(path, ("vae",))
    with pytest.raises(ConfigError, match=REFUSED[kind]):
        from_diffusers(path)


def test_image_to_video_is_never_stored_as_text_to_video(family, tmp_path, capsys):
    """The tiny I2V-A14B's VAE makes 4 channels and its transformer reads 12: the refusal says
    image-to-video, not a channel mismatch."""
    assert train_cli.main(["--init-from", str(family["i2v-a14b"]), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "image-to-video is not supported" in err and "z_dim" not in err


@pytest.mark.parametrize("part", ["", "transformer", "transformer_2"])
def test_a_two_expert_folder_is_not_trained_as_one_transformer(family, part, capsys):
    path = family["t2v-a14b"] / part if part else family["t2v-a14b"]
    assert train_cli.main(["--init-from", str(path), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "Wan2.2 T2V-A14B" in err and "boundary_ratio" in err


def test_text_to_video_folders_still_load(family, tmp_path):
    cfg = config_for_diffusers_dir(family["t2v"], None, None, CLIP)
    assert cfg.model.arch == "wan" and check_pretrained(cfg, family["t2v"])
    assert check_model_files(family["t2v-a14b"], ("vae",)) == family["t2v-a14b"].resolve()  # its encoders
    with pytest.raises(ConfigError, match="load one expert by its folder"):
        from_diffusers(family["t2v-a14b"])
    low = from_diffusers(family["t2v-a14b"] / "transformer_2")
    assert low.cfg.model.depth == 2
