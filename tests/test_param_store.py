"""ParameterStore on its own: shared segments, exact AdamW with clipping (both AdamW kernels),
bf16 compute copies, checkpoint round trip, pretrained weights in (--init-from) and out."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.models.registry import build_model
from megaslide_ray.state import segments
from megaslide_ray.state.checkpoint import (
    CheckpointReader,
    latest_checkpoint,
    shard_file,
)
from megaslide_ray.state.pretrained_io import (
    PretrainedMismatchError,
    check_pretrained,
    export_state_dict,
)
from megaslide_ray.state.segments import map_segment
from megaslide_ray.train import main as train_main
from megaslide_ray.training import adamw as adamw_kernels
from megaslide_ray.training.schedule import lr_at

OVR = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "optim.weight_decay": 0.1,
       "optim.grad_clip": 0.5, "optim.warmup_steps": 1, "training.steps": 3}


def apply_random_step(store: ParameterStore, step: int) -> None:
    """Play the compute actor for one step: random gradients into every shard, then the update."""
    for i in range(store.n):
        store.seg[i]["w"].normal_()
        store.report_grad(i, step, float(store.seg[i]["w"].pow(2).sum()), None)
    store.wait_step(step)


@pytest.fixture
def cfg(tmp_path):
    return build_config("tiny", None, {**OVR, "runtime.state_dir": str(tmp_path)})


@pytest.mark.parametrize("adamw", ["fused", "compiled"])
@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_update_equals_torch_adamw_with_global_clipping(cfg, tmp_path, w_dtype, adamw):
    store = ParameterStore(cfg, str(tmp_path / "run"), w_dtype=w_dtype, adamw=adamw)
    assert store.adamw == adamw
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
            grads = [torch.randn(p.shape, generator=gen).to(store.seg[0]["w"].dtype) for p in params]
            for i, g in enumerate(grads):  # the compute actor's side: fill g, report ||g||^2
                store.seg[i]["w"].copy_(g)
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


def test_the_update_thread_uses_the_optimizer_threads_under_ray_s_omp_setting(tmp_path):
    """Ray starts its workers with OMP_NUM_THREADS=1, and OpenMP keeps the thread count per
    thread: the store's update thread must set its own, or AdamW runs on one core. Checked in a
    fresh process with that environment, reading OpenMP's count inside the update thread."""
    script = f"""
import ctypes, json, threading
import torch
from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
omp = next(ctypes.CDLL(line.split()[-1]) for line in open("/proc/self/maps") if "libgomp" in line)
cfg = build_config("tiny", None, {{**{OVR!r}, "runtime.state_dir": {str(tmp_path)!r},
                                   "runtime.optimizer_threads": 3}})
store = ParameterStore(cfg, {str(tmp_path / "run")!r})
seen = {{}}
real = store._apply_update
def spy(step, sq):
    seen["update"] = omp.omp_get_max_threads()
    return real(step, sq)
store._apply_update = spy
t = threading.Thread(target=lambda: seen.setdefault("plain_thread", omp.omp_get_max_threads()))
t.start(); t.join()
for i in range(store.n):
    store.report_grad(i, 0, 1.0, None)
store.wait_step(0)
store.close()
print(json.dumps(seen))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"plain_thread": 1, "update": 3}, seen  # a plain thread shows the environment's 1


def test_adamw_kernel_choice(cfg, tmp_path, monkeypatch):
    def with_adamw(kind):
        return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, adamw=kind))

    with pytest.raises(ValueError, match="sideways"):
        ParameterStore(with_adamw("sideways"), str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="sideways"):  # refused with the other fields, before any work
        build_config("tiny", None, {"optim.adamw": "sideways"})

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(adamw_kernels, "compile_single_pass", broken)
    store = ParameterStore(with_adamw("auto"), str(tmp_path / "run"))
    try:
        assert store.adamw == "fused"  # auto falls back
    finally:
        store.close()
    with pytest.raises(RuntimeError, match="no compiler here"):
        ParameterStore(cfg, str(tmp_path / "run"), adamw="compiled")  # forced: no silent fallback
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        assert store.adamw == "fused"  # the default
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


@pytest.mark.parametrize("w_dtype", ["float32", "bfloat16"])
def test_checkpoint_round_trip_is_bit_exact(cfg, tmp_path, w_dtype):
    store = ParameterStore(cfg, str(tmp_path / "run"), w_dtype=w_dtype)
    try:
        apply_random_step(store, 0)
        path = store.save_checkpoint(str(tmp_path / "run"), 1, {"data_position": 7})
        saved = [{k: store.seg[i][k].clone() for k in ("w", "master", "m", "v")} for i in range(store.n)]
    finally:
        store.close()
    assert latest_checkpoint(tmp_path / "run") == tmp_path / "run" / "checkpoints" / "step_1"
    # w (= master cast) is not stored: 12 bytes per parameter on disk, and a reader still serves it.
    with CheckpointReader(path) as ckpt:
        for i in range(ckpt.num_shards):
            assert sorted(ckpt._files[i].keys()) == ["m", "master", "v"]
            assert torch.equal(ckpt.tensor(i, "w"), saved[i]["w"])
            assert ckpt.dtype(i, "w") == ("BF16" if w_dtype == "bfloat16" else "F32")
    restored = ParameterStore(cfg, str(tmp_path / "run2"), w_dtype=w_dtype, resume_checkpoint=path)
    try:
        assert restored.status().versions == (1,) * restored.n
        for i in range(restored.n):
            for k, t in saved[i].items():
                assert torch.equal(restored.seg[i][k], t), (i, k)
    finally:
        restored.close()


def test_checkpoint_of_the_older_format_with_w_still_loads(cfg, tmp_path):
    store = ParameterStore(cfg, str(tmp_path / "run"), w_dtype="bfloat16")
    try:
        apply_random_step(store, 0)
        path = store.save_checkpoint(str(tmp_path / "run"), 1, {})
        saved = [{k: store.seg[i][k].clone() for k in ("w", "master", "m", "v")} for i in range(store.n)]
    finally:
        store.close()
    for i in range(len(saved)):  # rewrite each shard file as the format before it dropped w
        file = Path(path) / shard_file(i)
        with safe_open(str(file), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        tensors["w"] = saved[i]["w"]
        save_file(tensors, str(file), metadata=meta)
    with CheckpointReader(path) as ckpt:
        assert "w" in ckpt._files[0].keys() and torch.equal(ckpt.tensor(0, "w"), saved[0]["w"])
    restored = ParameterStore(cfg, str(tmp_path / "run2"), w_dtype="bfloat16", resume_checkpoint=path)
    try:
        for i in range(restored.n):
            for k, t in saved[i].items():
                assert torch.equal(restored.seg[i][k], t), (i, k)
    finally:
        restored.close()


# -- pretrained weights (--init-from) ------------------------------------------------------------


def _flat_shards(model):
    return [torch.cat([p.detach().reshape(-1) for p in s.parameters()]) for s in model.shards()]


def test_init_from_a_state_dict_file_gives_exactly_those_weights(cfg, tmp_path):
    model = build_model(cfg, seed=7)
    with torch.no_grad():
        for p in model.parameters():  # nothing zero-initialised: every tensor must really land
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "weights.safetensors"))
    store = ParameterStore(cfg, str(tmp_path / "run"), w_dtype="bfloat16",
                           init_from=str(tmp_path / "weights.safetensors"))
    try:
        assert store.status().versions == (0,) * store.n
        for i, want in enumerate(_flat_shards(model)):
            assert torch.equal(store.seg[i]["master"], want), i
            assert torch.equal(store.seg[i]["w"], want.to(torch.bfloat16)), i
            assert not store.seg[i]["m"].any() and not store.seg[i]["v"].any()
    finally:
        store.close()


def test_init_from_checkpoint_and_its_export(cfg, tmp_path):
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        apply_random_step(store, 0)
        ckpt = store.save_checkpoint(str(tmp_path / "run"), 1, {})
        trained = [store.seg[i]["master"].clone() for i in range(store.n)]
    finally:
        store.close()
    one = export_state_dict(ckpt, tmp_path / "export.safetensors")
    per_shard = export_state_dict(ckpt, tmp_path / "export_dir")
    assert len(one) == 1 and len(per_shard) == len(trained)
    model = build_model(cfg)
    model.load_state_dict(load_file(one[0]))  # standard names: loads into VideoDiT as is
    assert all(torch.equal(a, b) for a, b in zip(_flat_shards(model), trained))
    for k, source in enumerate([ckpt, one[0], str(tmp_path / "export_dir")]):
        fresh = ParameterStore(cfg, str(tmp_path / f"fresh{k}"), init_from=source)
        try:
            assert fresh.status().versions == (0,) * fresh.n
            for i, want in enumerate(trained):
                assert torch.equal(fresh.seg[i]["master"], want) and torch.equal(fresh.seg[i]["w"], want)
                assert not fresh.seg[i]["m"].any() and not fresh.seg[i]["v"].any()
        finally:
            fresh.close()


def test_init_from_mismatches_are_listed_in_one_error(cfg, tmp_path, capsys):
    sd = {k: v.contiguous() for k, v in build_model(cfg).state_dict().items()}
    del sd["blocks.1.attn.qkv.bias"]
    sd["blocks.7.attn.qkv.bias"] = torch.zeros(3)
    sd["head.linear.weight"] = torch.zeros(5, 5)
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad))
    with pytest.raises(PretrainedMismatchError) as err:
        check_pretrained(cfg, bad)
    msg = str(err.value)
    for text in ("missing from the source (1)", "blocks.1.attn.qkv.bias", "unexpected in the source (1)",
                 "blocks.7.attn.qkv.bias", "wrong shape (1)", "head.linear.weight: source [5, 5]"):
        assert text in msg, text
    with pytest.raises(PretrainedMismatchError, match="blocks.7.attn.qkv.bias"):  # the store refuses it too
        ParameterStore(cfg, str(tmp_path / "run"), init_from=str(bad))
    # The CLI refuses it before Ray starts, exit code 2.
    argv = ["--init-from", str(bad), "--run-dir", str(tmp_path / "cli")] + [
        f"--{k}={v}" for k, v in {**OVR, "runtime.state_dir": str(tmp_path)}.items()]
    assert train_main(argv) == 2
    assert "head.linear.weight" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


def test_a_fresh_store_removes_states_whose_driver_is_gone(cfg, tmp_path, caplog):
    import json
    import os
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)
    me = segments.this_machine()
    states = {}
    for name, owner in {"dead": {**me, "pid": dead_pid}, "alive": {**me, "pid": 1},
                        "rebooted": {**me, "boot_id": "another-boot", "pid": 1},
                        "other-host": {**me, "host": me["host"] + "-elsewhere", "pid": dead_pid},
                        "no-owner": None}.items():
        d = tmp_path / f"megaslide-{name}"
        d.mkdir()
        (d / "shard_0000.w").write_bytes(b"\0" * 4096)
        if owner is not None:
            (d / "owner.json").write_text(json.dumps(owner))
        states[name] = d
    with caplog.at_level("WARNING"):
        store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        left = {name for name, d in states.items() if d.exists()}
        assert left == {"alive", "other-host", "no-owner"}
        assert f"driver (pid {dead_pid})" in caplog.text
        owner = json.loads((store.dir / "owner.json").read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == me["host"]
    finally:
        store.close()


def test_a_store_records_the_drivers_machine_so_another_machine_never_sweeps_a_live_state(cfg, tmp_path):
    """A run on several nodes: the store of a node on another machine records the driver's pid and
    the driver's machine. A later store on that machine must leave the state alone (the driver's
    pid means nothing there: checked locally it looks gone, and the state would be swept while its
    run is live). Simulated on one machine with an owner whose machine is another host."""
    import json

    driver = {**segments.run_owner(), "host": segments.this_machine()["host"] + "-driver"}
    remote = ParameterStore(cfg, str(tmp_path / "run-a"), owner={**driver, "pid": 2 ** 22 + 12345})
    try:
        rec = json.loads((remote.dir / "owner.json").read_text())
        assert rec["host"] == driver["host"] and rec["pid"] == 2 ** 22 + 12345
        other = ParameterStore(cfg, str(tmp_path / "run-b"))  # sweeps the root on start
        try:
            assert remote.dir.is_dir() and (remote.dir / "layout.json").is_file()
        finally:
            other.close()
    finally:
        remote.close()
