"""A diffusers Wan directory in and out: the config comes from its config.json (contradictions
refused in one error), --init-from loads it into the parameter store shard by shard under the
diffusers names (the DSA offset heads start fresh, their last layer zero), and a checkpoint
exports back to a folder diffusers' WanTransformer3DModel.from_pretrained loads, with the same
weights. Tiny random models, built on the fly."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from diffusers import WanTransformer3DModel

from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError
from megaslide_ray.state.checkpoint import latest_checkpoint
from megaslide_ray.state.pretrained_io import (
    PretrainedMismatchError,
    check_pretrained,
    config_for_diffusers_dir,
    export_diffusers,
    is_diffusers_dir,
    model_names,
)

TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
            text_dim=12, freq_dim=16, ffn_dim=24, num_layers=2)
# A clip whose latent grid is 3 x 4 x 4 (tokens 3 x 2 x 2): 9 frames of 32 x 32 pixels.
CLIP = {"data.num_frames": 9, "data.height": 32, "data.width": 32, "attention.window": "3,1,1",
        "data.batch_size": 1}


@pytest.fixture(scope="module")
def sharded_wan_dir(tmp_path_factory):
    """A diffusers model directory with a sharded transformer/ (index + several files) of
    perturbed random weights (text_dim 12) and a vae/ of only its config: ``(root, the weights)``.
    Not the shared ``wan_dir`` of conftest.py: these tests need the shards and the weights."""
    root = tmp_path_factory.mktemp("wan") / "Wan-Tiny"
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**TINY)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(root / "transformer", max_shard_size="20KB")
    (root / "vae").mkdir()
    (root / "vae" / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 4}))
    return root, {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _initial_checkpoint(cfg, source, run):
    """A store initialised from ``source`` (--init-from), saved as the step-0 checkpoint of ``run``."""
    store = ParameterStore(cfg, str(run), init_from=str(source))
    try:
        store.save_checkpoint(str(run), 0, {"data_position": 0})
    finally:
        store.close()
    return run


def test_model_config_comes_from_the_directory_and_contradictions_are_refused(sharded_wan_dir):
    root, _ = sharded_wan_dir
    assert is_diffusers_dir(root) and is_diffusers_dir(root / "transformer") and not is_diffusers_dir(root / "vae")
    cfg = config_for_diffusers_dir(root, None, None, CLIP)
    m = cfg.model
    assert (m.arch, m.hidden_size, m.num_heads, m.depth, m.ffn_dim, m.in_channels, m.text_dim) == \
        ("wan", 16, 2, 2, 24, 4, 12)
    assert cfg.preset == "wan2.1-t2v-1.3b" and cfg.latent_grid == (3, 4, 4) and cfg.token_grid == (3, 2, 2)
    with pytest.raises(ConfigError) as e:
        config_for_diffusers_dir(root, None, None, {**CLIP, "model.depth": "3", "model.num_heads": "4"})
    assert "model.depth: the config has 3" in str(e.value) and "model.num_heads: the config has 4" in str(e.value)
    with pytest.raises(ConfigError, match="model.arch: the config has 'videodit'"):
        config_for_diffusers_dir(root, "tiny", None, {})


def test_init_from_loads_diffusers_weights_and_exports_back(sharded_wan_dir, tmp_path):
    root, weights = sharded_wan_dir
    cfg = config_for_diffusers_dir(root, None, None, {**CLIP, "attention.kind": "dsa",
                                                       "runtime.state_dir": str(tmp_path / "state")})
    source = check_pretrained(cfg, root)  # every model name but the offset heads is in the source
    names = model_names(cfg)
    fresh = sorted(n for n in names if n not in source)
    assert fresh and all(".attn1.offsets." in n for n in fresh)
    assert set(source) == set(weights) == set(names) - set(fresh)

    run = _initial_checkpoint(cfg, root, tmp_path / "run")
    ckpt = latest_checkpoint(run)
    out = tmp_path / "export"
    export_diffusers(ckpt, out, drop_offsets=True)
    loaded = WanTransformer3DModel.from_pretrained(str(out))
    got = loaded.state_dict()
    assert set(got) == set(weights)
    for name, want in weights.items():
        assert torch.equal(got[name], want), name
    # Kept offsets are exported too (under attn1.offsets.*), and the head's last layer is zero.
    full = tmp_path / "export-with-offsets"
    export_diffusers(ckpt, full)
    index = json.loads((full / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(names)
    from safetensors.torch import load_file

    out_w = {}
    for file in set(index.values()):
        out_w.update(load_file(str(full / file)))
    assert all(torch.count_nonzero(out_w[n]) == 0 for n in fresh if n.endswith("out.weight") or n.endswith("out.bias"))


def test_export_cli_and_refusals(sharded_wan_dir, tmp_path):
    root, _ = sharded_wan_dir
    cfg = config_for_diffusers_dir(root, None, None, {**CLIP, "runtime.state_dir": str(tmp_path / "state")})
    run = _initial_checkpoint(cfg, root, tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.pretrained", str(latest_checkpoint(run)),
                           str(tmp_path / "out"), "--format", "diffusers", "--dtype", "bfloat16"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    from safetensors import safe_open

    for file in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    loaded = WanTransformer3DModel.from_pretrained(str(tmp_path / "out"), torch_dtype=torch.bfloat16)
    assert loaded.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    # A directory with a tensor removed: one error naming it, before anything is loaded.
    broken = tmp_path / "broken"
    WanTransformer3DModel.from_pretrained(str(root / "transformer")).save_pretrained(broken)
    from safetensors.torch import load_file, save_file

    file = next(broken.glob("*.safetensors"))
    tensors = load_file(str(file))
    tensors.pop("blocks.1.ffn.net.2.weight")
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(PretrainedMismatchError, match=r"(?s)missing from the source \(1\).*blocks.1.ffn.net.2.weight"):
        check_pretrained(cfg, broken)
