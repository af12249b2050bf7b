"""An exported 3D-DSA Wan model runs in diffusers as it was trained: ``enable_dsa`` on diffusers'
``WanTransformer3DModel`` loaded from ``python -m megaslide_ray.pretrained ... --format diffusers``
gives ``megaslide_ray.models.wan``'s outputs (fp32: to rounding; bf16: within twice our own bf16
error), and loading the export without it warns that attention will be dense."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.utils import logging as dlog

from megaslide_ray.config import build_config
from megaslide_ray.models.diffusers_dsa import DSAAttnProcessor, enable_dsa
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.models.wan import WanTransformer
from megaslide_ray.models.wan_layers import cast_like_diffusers
from megaslide_ray.state.checkpoint import write_checkpoint
from megaslide_ray.state.pretrained_io import config_for_diffusers_dir, export_diffusers

WINDOWS = {"dsa": "3,3,3", "neighborhood": "3,3,3", "swin": "3,2,2"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _trained_export(tmp_path, kind: str, head: dict | None = None):
    """A tiny wan model with ``kind`` self-attention and weights as a run would leave them (offset
    heads far from zero), written as a checkpoint and exported to diffusers; ``(model, folder)``.
    ``head``: options of the offset head (``attention.offset_condition``, ``offset_source``)."""
    cfg = build_config("tiny", None, {**(head or {}),
        "model.arch": "wan", "model.hidden_size": 16, "model.num_heads": 2, "model.depth": 2, "model.ffn_dim": 24,
        "model.in_channels": 4, "model.patch_size": "1,2,2", "model.text_dim": 16, "model.text_len": 8,
        "model.timestep_freq_dim": 16, "data.num_frames": 9, "data.height": 64, "data.width": 64,
        "attention.kind": kind, "attention.window": WINDOWS[kind]})  # latents 3x8x8: a 3x4x4 token grid
    model = WanTransformer(cfg)
    model.initialize_weights(0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            big = ".offsets.out." in name or ".offsets.gate." in name or ".offsets.cond." in name
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if big else 0.05))
    shards = model.shards()

    def flat_shards():
        for i, shard in enumerate(shards):
            lay = ShardLayout.of(shard, i)
            flat = torch.empty(lay.numel)
            lay.flatten_into(shard, flat)
            yield lay, {"master": flat, "m": torch.zeros_like(flat), "v": torch.zeros_like(flat)}

    ckpt = write_checkpoint(tmp_path / "run", 1, flat_shards(), {"w_dtype": "float32", "config": cfg.to_dict()})
    export_diffusers(ckpt, tmp_path / "export")
    return model, tmp_path / "export"


def _inputs():
    g = torch.Generator().manual_seed(2)
    return (torch.randn(1, 4, 3, 8, 8, generator=g), torch.tensor([700.0]), torch.randn(1, 5, 16, generator=g))


@pytest.mark.parametrize("kind", ["dsa", "neighborhood", "swin"])
def test_enable_dsa_runs_the_export_as_trained(tmp_path, kind, caplog):
    ours, folder = _trained_export(tmp_path, kind)
    x, ts, text = _inputs()
    # what diffusers' warning says, as it prints it; diffusers' logger does not propagate to the root
    # logger (so to caplog) unless told to, and whether an earlier test told it depends on the order
    dlog.enable_propagation()
    try:
        plain = WanTransformer3DModel.from_pretrained(str(folder))
    finally:
        dlog.disable_propagation()
    warned = "\n".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "megaslide_dsa" in warned and "self-attention is DENSE" in warned and "enable_dsa(transformer)" in warned
    model = enable_dsa(WanTransformer3DModel.from_pretrained(str(folder)))
    with torch.no_grad():
        want = ours.forward_diffusers(x, ts, text)
        got = model(x, ts, text, return_dict=False)[0]
        dense = plain(x, ts, text, return_dict=False)[0]
    assert _rel(got, want) < 1e-5
    assert _rel(dense, want) > 1e-3  # what a plain load runs: another model
    if kind == "dsa":  # the offset heads are the model's own now: listed, moved and saved with it
        assert {n for n, _ in model.named_parameters() if ".offsets." in n} == {
            n for n, _ in ours.named_parameters() if ".offsets." in n}


@pytest.mark.parametrize("head", [{"attention.offset_condition": "add"}, {"attention.offset_condition": "gate"},
                                  {"attention.offset_source": "query"},
                                  {"attention.offset_bound": "clamp", "attention.max_offset": 1.5}],
                         ids=["condition-add", "condition-gate", "query", "clamp"])
def test_enable_dsa_runs_every_offset_head_option(tmp_path, head):
    """Heads that read the timestep embedding or the queries run in diffusers as trained; the
    export records the options and --init-from reads them back."""
    ours, folder = _trained_export(tmp_path, "dsa", head)
    settings = json.loads((folder / "config.json").read_text())["megaslide_dsa"]
    cfg = config_for_diffusers_dir(folder, None, None, {})
    for field, value in head.items():
        assert settings[field.split(".")[1]] == value
        assert getattr(cfg.attention, field.split(".")[1]) == value
    x, ts, text = _inputs()
    model = enable_dsa(WanTransformer3DModel.from_pretrained(str(folder)))
    with torch.no_grad():
        want = ours.forward_diffusers(x, ts, text)
        got = model(x, ts, text, return_dict=False)[0]
        other = ours.forward_diffusers(x, ts * 0.5, text)
        got_other = model(x, ts * 0.5, text, return_dict=False)[0]
    assert _rel(got, want) < 1e-5
    assert _rel(got_other, other) < 1e-5  # the timestep embedding is the forward's own, not a stale one


def test_enable_dsa_in_bf16_is_within_twice_our_own_bf16_error(tmp_path):
    ours, folder = _trained_export(tmp_path, "dsa")
    x, ts, text = _inputs()
    model = enable_dsa(WanTransformer3DModel.from_pretrained(str(folder), torch_dtype=torch.bfloat16))
    assert model.blocks[0].attn1.offsets.out.weight.dtype == torch.bfloat16
    ours16 = cast_like_diffusers(WanTransformer(ours.cfg), torch.bfloat16)
    ours16.load_state_dict(ours.state_dict())
    with torch.no_grad():
        exact = ours.forward_diffusers(x, ts, text)
        got = model(x.bfloat16(), ts, text.bfloat16(), return_dict=False)[0]
        own = ours16.forward_diffusers(x.bfloat16(), ts, text.bfloat16())
    assert got.dtype == torch.bfloat16
    assert _rel(got, exact) <= 2 * _rel(own, exact) + 1e-3


def test_enable_dsa_refuses_what_it_cannot_run(tmp_path):
    _, folder = _trained_export(tmp_path, "dsa")
    dropped = tmp_path / "dropped"
    export_diffusers(tmp_path / "run" / "checkpoints" / "step_1", dropped, drop_offsets=True)
    with pytest.raises(ValueError, match="exported with --drop-offsets"):
        enable_dsa(WanTransformer3DModel.from_pretrained(str(dropped)))
    dense = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=24, num_layers=1)
    dense.save_pretrained(tmp_path / "dense")
    with pytest.raises(ValueError, match="has no 'megaslide_dsa' entry"):
        enable_dsa(WanTransformer3DModel.from_pretrained(str(tmp_path / "dense")))


def test_enable_dsa_on_a_two_transformer_pipeline(tmp_path, caplog):
    """A Wan 2.2 pipeline holds two transformers: each loaded from an export runs as trained; a
    dense second one stays dense, with a warning that says so."""
    ours, folder = _trained_export(tmp_path, "dsa")
    x, ts, text = _inputs()
    with torch.no_grad():
        want = ours.forward_diffusers(x, ts, text)
    both = SimpleNamespace(transformer=WanTransformer3DModel.from_pretrained(str(folder)),
                           transformer_2=WanTransformer3DModel.from_pretrained(str(folder)))
    assert enable_dsa(both) is both
    dense = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=24, num_layers=1)
    dense.save_pretrained(tmp_path / "dense")
    one = SimpleNamespace(transformer=WanTransformer3DModel.from_pretrained(str(folder)),
                          transformer_2=WanTransformer3DModel.from_pretrained(str(tmp_path / "dense")))
    caplog.clear()
    enable_dsa(one)
    assert any("transformer_2 is not an export" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        for model in (both.transformer, both.transformer_2, one.transformer):
            assert _rel(model(x, ts, text, return_dict=False)[0], want) < 1e-5
    assert not isinstance(one.transformer_2.blocks[0].attn1.processor, DSAAttnProcessor)


def test_enable_dsa_keeps_dense_blocks_and_dense_samples(tmp_path):
    """An export of a model with ``attention.dense_blocks`` (block 0: no offset head) and
    ``attention.dense_above_t``: diffusers runs block 0 dense and a sample at t = 0.7 dense in every
    block, one at 0.3 with DSA in block 1, in one batch, as ours does; ``--init-from`` reads the
    dense blocks back and ``from_diffusers`` both."""
    from megaslide_ray.models.wan_diffusers import from_diffusers

    ours, folder = _trained_export(tmp_path, "dsa", {"attention.dense_blocks": "0", "attention.dense_above_t": 0.5})
    assert {n.split(".attn1")[0] for n, _ in ours.named_parameters() if ".offsets." in n} == {"blocks.1"}
    settings = json.loads((folder / "config.json").read_text())["megaslide_dsa"]
    assert settings["dense_blocks"] == [0] and settings["dense_above_t"] == 0.5
    assert config_for_diffusers_dir(folder, None, None, {}).attention.dense_blocks == (0,)
    x, _, text = _inputs()
    x, text, ts = x.expand(2, -1, -1, -1, -1), text.expand(2, -1, -1), torch.tensor([700.0, 300.0])
    model = enable_dsa(WanTransformer3DModel.from_pretrained(str(folder)))
    assert isinstance(model.blocks[1].attn1.processor, DSAAttnProcessor)
    assert not isinstance(model.blocks[0].attn1.processor, DSAAttnProcessor)
    loaded = from_diffusers(folder)
    assert loaded.cfg.attention.dense_blocks == (0,) and loaded.cfg.attention.dense_above_t == 0.5
    cfg = copy.deepcopy(ours.cfg)
    cfg.attention.dense_above_t = 0.0
    never = WanTransformer(cfg)  # the same weights without dense samples
    never.load_state_dict(ours.state_dict())
    with torch.no_grad():
        want = ours.forward_diffusers(x, ts, text)
        got = model(x, ts, text, return_dict=False)[0]
        again = loaded(x, ts, text)
        sparse = never.forward_diffusers(x, ts, text)
    assert _rel(got, want) < 1e-5 and _rel(again, want) < 1e-5
    assert torch.equal(want[1], sparse[1])  # t = 0.3: DSA in block 1
    assert _rel(want[0], sparse[0]) > 1e-3  # t = 0.7: dense there too
