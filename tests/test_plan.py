"""The memory planner: the paper's 105B accounting, fit logic, shape errors, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.model import param_count
from megaslide_ray.plan import config_for, main, plan, render


@pytest.fixture(scope="module")
def plan_105b():
    return plan(build_config("dit-105b"))


def _close(value: float, expected: float, rel: float = 0.01) -> bool:
    return abs(value - expected) <= rel * expected


def test_105b_matches_the_papers_accounting(plan_105b):
    p = plan_105b
    assert _close(p.params, 104.9e9, 0.001)
    assert p.host_state_bytes_per_param == 14
    assert _close(p.host_state_bytes, 1.47e12)          # w + master + m + v
    assert _close(p.moment_bytes, 840e9)                 # m + v
    assert _close(p.h2d_bytes, 420e9)                    # bf16 weights, forward and backward
    assert _close(p.d2h_bytes, 210e9)                    # bf16 gradients
    assert _close(p.adamw_dram_bytes, 2.9e12, 0.02)      # docs/architecture.md, "Traffic and floors": about 2.9 TB
    # the landing buffer is listed apart, outside the 14 B/param figure, but the store holds it
    assert p.grad_buffer_in_state is False
    assert p.grad_buffer_bytes == 2 * p.params
    assert p.host_total_bytes == p.host_state_bytes + p.grad_buffer_bytes
    # runtime.prefetch_depth (1 by default) staged + the one computing, each bf16 w + bf16 grad
    assert p.prefetch_depth == 1
    assert p.largest_shard_params * 2 * 4 == p.device_shard_bytes
    assert p.binding in p.time_terms and p.step_floor_s == max(p.time_terms.values())
    assert _close(p.time_terms["h2d"], 420e9 / 55e9)


def test_tiny_is_sane():
    cfg = build_config("tiny")
    p = plan(cfg, w_dtype="float32", ram_gb=24, gpu_gb=1)
    assert p.params == param_count(cfg)
    assert p.tokens_per_sample == cfg.tokens_per_sample
    assert p.tokens_per_step == cfg.tokens_per_sample * cfg.data.batch_size
    assert p.host_state_bytes_per_param == 16 and p.host_total_bytes == 20 * p.params
    assert p.adamw_bytes_per_param == 32
    assert p.fits is True and p.host_shortfall_bytes == 0 and p.device_shortfall_bytes == 0
    # every activation estimate is positive; materialising N^2 costs more than flash
    assert all(v > 0 for v in p.activation_bytes.values())
    assert p.activation_bytes["dense_materialised"] > p.activation_bytes["dense_flash"]
    assert p.activation_bytes["dsa_reference"] > p.activation_bytes["dsa_fused"]
    assert p.flops_executed > p.flops_linear > 0
    assert "tiny" in render(p)


def test_dense_attention_scales_quadratically_and_dsa_linearly():
    small = plan(config_for("dit-28b", frames=16, height=256, width=256))
    big = plan(config_for("dit-28b", frames=32, height=256, width=256))  # twice the tokens
    for name, factor in (("dense_materialised", 4), ("dsa_fused", 2), ("dsa_reference", 2), ("checkpoints", 2)):
        assert big.activation_parts[name] == pytest.approx(factor * small.activation_parts[name], rel=1e-9)
    d_small = plan(config_for("dit-28b", attention="dense"))
    d_big = plan(config_for("dit-28b", frames=32, attention="dense"))
    assert d_big.flops_attention == pytest.approx(4 * d_small.flops_attention)


def test_fit_and_shortfall(plan_105b):
    cfg = build_config("dit-105b")
    need_host = plan_105b.host_required_bytes
    need_dev = plan_105b.device_required_bytes
    roomy = plan(cfg, ram_gb=need_host / 1e9 + 1, gpu_gb=need_dev / 1e9 + 1)
    assert roomy.fits_host and roomy.fits_device and roomy.fits is True
    tight = plan(cfg, ram_gb=1024, gpu_gb=141)
    assert tight.fits_host is False and tight.fits_device is False and tight.fits is False
    assert tight.host_shortfall_bytes == need_host - 1024 * 10**9
    assert tight.device_shortfall_bytes == need_dev - 141 * 10**9
    assert need_host > plan_105b.host_total_bytes  # the margin is on top of the store
    unknown = plan(cfg)
    assert unknown.fits is None and unknown.fits_host is None


def test_bad_shape_names_the_value():
    with pytest.raises(ConfigError, match="height=1081"):
        config_for("dit-105b", frames=256, height=1081, width=1920)
    with pytest.raises(ConfigError, match="frames=15"):
        config_for("tiny", frames=15)  # tiny's temporal patch is 2
    assert main(["--preset", "dit-105b", "--width", "1921"]) == 2


def test_cli_json_parses(capsys):
    assert main(["--preset", "tiny", "--json", "--ram-gb", "24", "--gpu-gb", "80"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == "tiny" and doc["fits"] is True
    assert doc["host_bytes"]["g"] == 2 * doc["params"]


def test_module_runs_as_a_program():
    out = subprocess.run([sys.executable, "-m", "megaslide_ray.plan", "--preset", "dit-105b", "--frames", "256",
                          "--height", "1080", "--width", "1920", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["tokens_per_sample"] == 256 * 540 * 960


def test_device_shard_buffers_follow_runtime_prefetch_depth_and_overlap(capsys):
    cfg = build_config("dit-28b")
    one = plan(cfg)
    cfg.runtime.prefetch_depth = 3
    four = plan(cfg)
    cfg.runtime.overlap = False  # no overlap: each shard is fetched when it is needed
    alone = plan(cfg)
    assert four.device_shard_bytes == 2 * one.device_shard_bytes == 4 * alone.device_shard_bytes
    assert (one.prefetch_depth, four.prefetch_depth, alone.prefetch_depth) == (1, 3, 0)
    assert main(["--preset", "dit-28b", "--prefetch-depth", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_shard_bytes"] == four.device_shard_bytes


def test_offloaded_block_inputs_move_from_device_to_host_and_link():
    cfg = config_for("dit-28b", frames=32, height=256, width=256)
    kept = plan(cfg)
    cfg.runtime.offload_activations = True
    off = plan(cfg)
    m = cfg.model
    inputs = m.depth * cfg.data.batch_size * cfg.tokens_per_sample * m.hidden_size * 2  # bf16
    assert kept.activation_parts["checkpoints"] == inputs
    assert off.activation_parts["checkpoints"] == inputs * (off.prefetch_depth + 1) // m.depth
    assert off.activation_parts["offloaded_checkpoints"] == inputs - off.activation_parts["checkpoints"]
    assert off.device_required_bytes == kept.device_required_bytes - off.activation_parts["offloaded_checkpoints"]
    assert off.h2d_bytes == kept.h2d_bytes + inputs and off.d2h_bytes == kept.d2h_bytes + inputs
    assert off.host_required_bytes > kept.host_required_bytes
    assert "(offloaded)" in render(off) and "block inputs" in render(off)


def test_wan_plans_on_latents_with_text_tokens_and_offset_heads():
    cfg = config_for("wan2.1-t2v-14b", frames=81, height=720, width=1280)
    p = plan(cfg, ram_gb=1649, gpu_gb=141)
    assert p.token_grid == (21, 45, 80) and p.tokens_per_sample == 21 * 45 * 80  # 4x temporal, 8x spatial, 1x2x2
    assert p.params == param_count(cfg)
    D, L, K = cfg.model.hidden_size, cfg.model.depth, 3 * 7 * 7
    heads = cfg.model.num_heads
    assert p.params_offset_heads == L * (D * 27 + D + (D + 1) * heads * K * 3)  # depthwise conv3d + linear
    dense = plan(config_for("wan2.1-t2v-14b", frames=81, height=720, width=1280, attention="dense"))
    assert dense.params == 14_288_491_584 and dense.params_offset_heads == 0
    assert p.fits is True  # an H200 with a "1.5 TB" (24 x 64 GiB) server
    # The text tokens cost FLOPs of their own: per-text-token parameters x 512 per sample.
    cfg.model.text_len = 256
    assert plan(cfg).flops_linear < p.flops_linear
    # The inputs are latents (16 channels at 21 x 90 x 160), not pixels.
    assert p.activation_parts["pixels"] == 3 * 21 * 90 * 160 * 16 * 4
    cfg_groups = config_for("wan2.1-t2v-14b", frames=81, height=720, width=1280)
    cfg_groups.attention.offset_groups = 8
    assert plan(cfg_groups).params_offset_heads < p.params_offset_heads / 4
