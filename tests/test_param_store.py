"""ParameterStore on its own: shared segments, exact AdamW with clipping, bf16 compute copies,
checkpoint round trip."""

import math

import pytest
import torch

from actors.param_store import ParameterStore, latest_checkpoint, map_segment
from megaslide_ray.config import build_config
from megaslide_ray.model import build_model
from megaslide_ray.schedule import lr_at

OVR = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "optim.weight_decay": 0.1,
       "optim.grad_clip": 0.5, "optim.warmup_steps": 1, "training.steps": 3}


@pytest.fixture
def cfg(tmp_path):
    return build_config("tiny", None, {**OVR, "runtime.state_dir": str(tmp_path)})


@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_update_equals_torch_adamw_with_global_clipping(cfg, tmp_path, w_dtype):
    store = ParameterStore(cfg, str(tmp_path / "run"), w_dtype=w_dtype)
    model = build_model(cfg)
    params = [torch.cat([p.detach().reshape(-1) for p in s.parameters()]).clone().requires_grad_() for s in
              model.shards()]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                            weight_decay=cfg.optim.weight_decay)
    gen = torch.Generator().manual_seed(0)
    try:
        for i, p in enumerate(params):
            assert torch.equal(store.seg[i]["master"], p.detach())
        for step in range(3):
            grads = [torch.randn(p.shape, generator=gen).to(store.seg[0]["g"].dtype) for p in params]
            for i, g in enumerate(grads):  # the compute actor's side: fill g, report ||g||^2
                store.seg[i]["g"].copy_(g)
                store.report_grad(i, step, float(g.float().pow(2).sum()), None)
            result = store.wait_step(step)
            for p, g in zip(params, grads):
                p.grad = g.float().clone()
            norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg.optim, cfg.training.steps, step)
            opt.step()
            assert result.clip_coef < 1 and math.isclose(result.grad_norm, float(norm), rel_tol=1e-5)
            assert store.status().versions == (step + 1,) * len(params)
        for i, p in enumerate(params):
            rel = float((store.seg[i]["master"] - p.detach()).norm() / p.detach().norm())
            assert rel < 1e-6, f"shard {i}: {rel:.2e}"
            assert torch.equal(store.seg[i]["w"], store.seg[i]["master"].to(store.seg[i]["w"].dtype))
    finally:
        store.close()


def test_segments_are_shared_memory(cfg, tmp_path):
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        info = store.shard_infos()[1]
        other_view = map_segment(info.paths["w"], info.numel, torch.float32)  # what the compute actor maps
        store.seg[1]["w"][:4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
        assert other_view[:4].tolist() == [1.0, 2.0, 3.0, 4.0]
    finally:
        store.close()
    assert not store.dir.exists(), "closing the store removes its segments"


def test_checkpoint_round_trip_is_bit_exact(cfg, tmp_path):
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        for i in range(store.n):
            store.seg[i]["g"].normal_()
            store.report_grad(i, 0, float(store.seg[i]["g"].pow(2).sum()), None)
        store.wait_step(0)
        path = store.save_checkpoint(str(tmp_path / "run"), 1, {"data_position": 7})
        saved = [{k: store.seg[i][k].clone() for k in ("w", "master", "m", "v")} for i in range(store.n)]
    finally:
        store.close()
    assert latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_1"
    restored = ParameterStore(cfg, str(tmp_path / "run2"), resume_checkpoint=path)
    try:
        assert restored.status().versions == (1,) * restored.n
        for i in range(restored.n):
            for k, t in saved[i].items():
                assert torch.equal(restored.seg[i][k], t), (i, k)
    finally:
        restored.close()
