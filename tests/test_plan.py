"""The memory planner: the paper's 105B accounting, fit logic, shape errors, the CLI."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.models.registry import param_count
from megaslide_ray.plan import main
from megaslide_ray.planning.estimate import HOST_RESERVE_GB, plan
from megaslide_ray.planning.render import render
from megaslide_ray.planning.search import config_for, max_frames, plan_with_chunk, plan_with_keep


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
    # 14 B/param exactly: gradients land in w, so there is no gradient buffer; a bf16 run adds one
    # fp32 update scratch of the largest shard
    assert p.host_bytes == {"w": 2 * p.params, "master": 4 * p.params, "m": 4 * p.params, "v": 4 * p.params,
                            "scratch": 4 * p.largest_shard_params}
    assert p.host_state_bytes == 14 * p.params
    assert p.host_store_bytes == 14 * p.params + 4 * p.largest_shard_params
    assert p.scratch_bytes < 0.01 * p.host_state_bytes
    assert p.host_required_bytes == p.host_store_bytes + int(HOST_RESERVE_GB * 1e9)  # no offload: nothing else
    # runtime.prefetch_depth (1 by default) staged + the one computing, each bf16 w + its gradient,
    # summed in fp32 (4 B)
    assert p.prefetch_depth == 1
    assert p.largest_shard_params * 2 * (2 + 4) == p.device_shard_bytes
    assert p.binding in p.time_terms and p.step_floor_s == max(p.time_terms.values())
    assert _close(p.time_terms["h2d"], 420e9 / 55e9)


def test_tiny_is_sane():
    cfg = build_config("tiny")
    p = plan(cfg, w_dtype="float32", ram_gb=24, gpu_gb=1)
    assert p.params == param_count(cfg)
    assert p.tokens_per_sample == cfg.tokens_per_sample
    assert p.tokens_per_step == cfg.tokens_per_sample * cfg.data.batch_size
    assert p.host_state_bytes_per_param == 16 and p.host_store_bytes == 16 * p.params  # fp32: no scratch
    assert p.adamw_bytes_per_param == 32
    assert p.fits is True and p.host_shortfall_bytes == 0 and p.device_shortfall_bytes == 0
    # every activation estimate is positive; materialising N^2 costs more than flash
    assert all(v > 0 for v in p.activation_bytes.values())
    assert p.activation_bytes["dense_materialised"] > p.activation_bytes["dense_flash"]
    assert p.activation_bytes["dsa_reference"] > p.activation_bytes["dsa_fused"]
    assert p.flops_executed > p.flops_linear > 0
    assert "tiny" in render(p)


def test_the_gpu_kernels_scratch_is_counted_unless_the_run_is_on_the_cpu():
    """The fused kernels' scratch (halo scores, records, fp32 dk/dv) exists only on a GPU: a run
    pinned to the CPU plans none of it, ``cuda`` and ``auto`` (which may take a GPU) plan it, and
    the device requirement differs by exactly that term."""
    over = {"attention.kind": "dsa", "attention.max_offset": "1.5"}
    plans = {dev: plan(build_config("tiny", None, {**over, "runtime.device": dev}), w_dtype="float32", gpu_gb=1)
             for dev in ("cpu", "cuda", "auto")}
    term = "attention kernels' scratch (records, scores or fp32 dk/dv)"
    scratch = plans["cuda"].device_terms[term]
    assert scratch > 0 and plans["auto"].device_terms[term] == scratch
    assert term not in plans["cpu"].device_terms and "dsa_fused_scratch" not in plans["cpu"].activation_parts
    assert plans["cuda"].device_required_bytes - plans["cpu"].device_required_bytes == scratch


def test_dense_attention_scales_quadratically_and_dsa_linearly():
    small = plan(config_for("dit-28b", frames=17, height=256, width=256))
    big = plan(config_for("dit-28b", frames=17, height=256, width=512))  # twice the tokens
    assert big.tokens_per_sample == 2 * small.tokens_per_sample
    for name, factor in (("dense_materialised", 4), ("dsa_fused", 2), ("dsa_reference", 2), ("checkpoints", 2)):
        assert big.activation_parts[name] == pytest.approx(factor * small.activation_parts[name], rel=1e-9)
    d_small = plan(config_for("dit-28b", attention="dense"))
    d_big = plan(config_for("dit-28b", width=2 * 832, attention="dense"))
    assert d_big.flops_attention == pytest.approx(4 * d_small.flops_attention)


def test_fit_and_shortfall(plan_105b):
    cfg = build_config("dit-105b")
    need_host = plan_105b.host_required_bytes
    need_dev = plan_105b.device_required_bytes
    roomy = plan(cfg, ram_gb=need_host / 1e9 + 1, gpu_gb=need_dev / 1e9 + 1)
    assert roomy.fits_host and roomy.fits_device and roomy.fits is True
    tight = plan(cfg, ram_gb=1024, gpu_gb=40)
    assert tight.fits_host is False and tight.fits_device is False and tight.fits is False
    assert tight.host_shortfall_bytes == need_host - 1024 * 10**9
    assert tight.device_shortfall_bytes == need_dev - 40 * 10**9
    assert need_host > plan_105b.host_store_bytes  # the reserve is on top of the store
    assert tight.binding_memory[0] == "host"
    assert sum(tight.host_terms.values()) == need_host and sum(tight.device_terms.values()) == need_dev
    unknown = plan(cfg)
    assert unknown.fits is None and unknown.fits_host is None


def test_bad_shape_names_the_value_or_pads_a_latent_clip():
    # pixel space (tiny): refused, naming the value
    with pytest.raises(ConfigError, match="height=61"):
        config_for("tiny", height=61)
    with pytest.raises(ConfigError, match="frames=15"):
        config_for("tiny", frames=15)  # tiny's temporal patch is 2
    assert main(["--preset", "tiny", "--width", "63"]) == 2
    # latent space: padded up to 4k+1 frames and multiples of 16 pixels (VAE 8 x patch 2) ...
    cfg = config_for("dit-105b", frames=256, height=1081, width=1921)
    assert (cfg.data.num_frames, cfg.data.height, cfg.data.width) == (257, 1088, 1936)
    # ... or, without padding, refused as the trainer refuses it
    with pytest.raises(ConfigError, match="num_frames=256: the VAE encodes 4k\\+1 frames"):
        config_for("dit-105b", frames=256, height=1088, width=1920, pad=False)


def test_cli_json_parses(capsys):
    assert main(["--preset", "tiny", "--json", "--ram-gb", "24", "--gpu-gb", "80"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["preset"] == "tiny" and doc["fits"] is True
    assert "g" not in doc["host_bytes"] and sum(doc["host_bytes"].values()) == doc["host_store_bytes"]
    assert doc["host_state_bytes"] == 14 * doc["params"]


def test_module_runs_as_a_program():
    out = subprocess.run([sys.executable, "-m", "megaslide_ray.plan", "--preset", "dit-105b", "--frames", "256",
                          "--height", "1080", "--width", "1920", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["requested_clip"] == [256, 1080, 1920] and doc["latent_grid"] == [65, 136, 240]
    assert doc["tokens_per_sample"] == 65 * 68 * 120


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
    cfg = config_for("dit-28b", frames=33, height=256, width=256)
    kept = plan(cfg)
    cfg.runtime.offload_activations = True
    off = plan(cfg)
    m = cfg.model
    inputs = m.depth * cfg.data.batch_size * cfg.tokens_per_sample * m.hidden_size * 2  # bf16
    assert kept.activation_parts["checkpoints"] == inputs
    assert off.activation_parts["checkpoints"] == inputs * (off.prefetch_depth + 1) // m.depth
    # the host segment has one slot per block
    assert off.activation_parts["offloaded_checkpoints"] == off.host_offloaded_bytes == inputs
    assert off.device_required_bytes == kept.device_required_bytes - inputs + off.activation_parts["checkpoints"]
    assert off.host_required_bytes == kept.host_required_bytes + inputs
    assert off.h2d_bytes == kept.h2d_bytes + inputs and off.d2h_bytes == kept.d2h_bytes + inputs
    assert off.host_required_bytes > kept.host_required_bytes
    assert "(offloaded)" in render(off) and "block inputs" in render(off)


def test_offload_keep_moves_the_last_block_inputs_back_to_the_device():
    cfg = config_for("dit-28b", frames=33, height=256, width=256)
    cfg.runtime.offload_activations = True
    off = plan(cfg)
    m = cfg.model
    ND = cfg.data.batch_size * cfg.tokens_per_sample * m.hidden_size * 2  # bf16
    staged = off.prefetch_depth + 1
    for k in (1, 5, m.depth - staged, m.depth, m.depth + 7):
        cfg.runtime.offload_keep = k
        kept = plan(cfg)
        assert kept.offload_keep == min(k, m.depth)
        # the device holds the inputs in flight plus the last k (at most all L); the host the others
        assert kept.activation_parts["checkpoints"] == min(m.depth, staged + k) * ND
        assert kept.host_offloaded_bytes == kept.activation_parts["offloaded_checkpoints"] == (m.depth - kept.offload_keep) * ND
        assert kept.host_required_bytes == off.host_required_bytes - kept.offload_keep * ND
        assert kept.device_required_bytes == off.device_required_bytes + (min(m.depth, staged + k) - staged) * ND
        # the kept inputs make no round trip
        assert kept.h2d_bytes == off.h2d_bytes - kept.offload_keep * ND
        assert kept.d2h_bytes == off.d2h_bytes - kept.offload_keep * ND
    assert "kept" in render(plan(cfg)) and "offloaded block inputs" not in render(plan(cfg))  # k >= L: none
    cfg.runtime.offload_activations = False  # offload_keep means nothing without offload
    assert plan(cfg).offload_keep == 0 and plan(cfg).host_offloaded_bytes == 0


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


def test_videodit_cross_attention_costs_caption_tokens():
    """``model.cross_attention``: the per-block cross-attention FLOPs (4 B N Lt D, Lt =
    caption_max_bytes + 1), parameters applied per caption token, the caption's keys and values
    in the block's working set; the dit-* presets keep it off (the paper's counts)."""
    from megaslide_ray.config import build_config

    on = build_config("tiny", None, {"attention.kind": "swin", "model.cross_attention": True})
    off = build_config("tiny", None, {"attention.kind": "swin", "model.cross_attention": False})
    p_on, p_off = plan(on), plan(off)
    m = on.model
    B, N, D, L, Lt = on.data.batch_size, on.tokens_per_sample, m.hidden_size, m.depth, m.caption_max_bytes + 1
    assert p_on.params - p_off.params == param_count(on) - param_count(off) == L * (4 * D * D + 6 * D) + 64 * D + 2 * D
    assert p_on.flops_attention - p_off.flops_attention == 3.0 * L * 4.0 * B * N * Lt * D
    per_text = L * (2 * D * D + 2 * D) + 64 * D + D  # keys and values, the token projection
    per_token = L * (2 * D * D + 4 * D)  # norm, query, output projection
    per_sample = D  # the null token
    assert p_on.flops_linear - p_off.flops_linear == 6.0 * (per_text * B * Lt + per_token * B * N + per_sample * B)
    assert p_on.activation_parts["block_linear"] > p_off.activation_parts["block_linear"]
    assert not build_config("dit-105b").model.cross_attention


# ---------------------------------------------------------------------------------------------
# Latent presets, generation, token chunks, searches (issue #15)
# ---------------------------------------------------------------------------------------------


def test_latent_and_token_grids_of_a_1080p_256_frame_clip():
    cfg = config_for("dit-105b", frames=256, height=1080, width=1920)
    p = plan(cfg, requested_clip=(256, 1080, 1920))
    assert cfg.latent_space and cfg.model.in_channels == 16
    assert p.latent_grid == (65, 136, 240) and p.token_grid == (65, 68, 120)
    text = render(p)
    assert "clip 256 x 1080 x 1920 pixels padded to 257 x 1088 x 1920" in text
    assert "latent grid 65 x 136 x 240 x 16 -> token grid 65 x 68 x 120 = 530,400 tokens/sample" in text
    # tiny stays in pixel space
    tiny = plan(build_config("tiny"))
    assert not tiny.latent_space and tiny.latent_grid == (16, 64, 64) and "latent grid" not in render(tiny)


def test_generate_keeps_no_block_inputs_and_streams_weights_once():
    cfg = config_for("dit-28b", frames=33, height=256, width=256)
    cfg.runtime.offload_activations = True  # irrelevant to sampling
    gen = plan(cfg, generate=True)
    train = plan(cfg)
    assert gen.mode == "generate"
    assert gen.activation_parts["checkpoints"] == 0 and gen.activation_parts["offloaded_checkpoints"] == 0
    assert gen.host_bytes == {"w": 2 * gen.params} and gen.host_offloaded_bytes == 0
    assert gen.h2d_bytes == 2 * gen.params and gen.d2h_bytes == 0 and gen.adamw_dram_bytes == 0
    assert gen.device_shard_bytes * 3 == train.device_shard_bytes  # weights only, no fp32 gradients
    assert gen.flops_recompute == 0 and gen.flops_executed < train.flops_executed / 2.5
    assert gen.device_required_bytes < train.device_required_bytes
    assert "forward only" in render(gen)


def test_token_chunk_splits_the_block_into_whole_clip_and_per_chunk_terms():
    cfg = config_for("dit-105b", frames=81, height=1080, width=1920)
    whole = plan(cfg)
    chunked = plan_with_chunk(cfg, 8160)
    bigger = plan_with_chunk(cfg, 4 * 8160)
    D, N = cfg.model.hidden_size, cfg.tokens_per_sample
    ND = N * D * 2
    assert chunked.token_chunk == 8160 and chunked.attention_chunk_tokens == 8160  # one 68 x 120 time slice
    whole_clip = sum(v for k, v in chunked.block_terms.items() if k.startswith("whole clip"))
    assert whole_clip == 9 * ND
    assert chunked.activation_parts["block_linear"] < whole.activation_parts["block_linear"] / 2
    assert chunked.device_required_bytes < bigger.device_required_bytes < whole.device_required_bytes
    assert chunked.flops_recompute > whole.flops_recompute  # the nested per-chunk checkpoint
    gen = plan_with_chunk(cfg, 8160, generate=True)
    assert sum(v for k, v in gen.block_terms.items() if k.startswith("whole clip")) == 5 * ND


GOAL = dict(gpu_gb=141.0, ram_gb=1649.0)


def test_goal_generation_256_frames_1080p_fits_one_h200(capsys):
    assert main(["--preset", "dit-105b", "--generate", "--frames", "256", "--height", "1080", "--width", "1920",
                 "--gpu-gb", "141"]) == 0
    out = capsys.readouterr().out
    assert "fits: this machine can run it" in out and "the planner chose token_chunk" in out
    cfg = config_for("dit-105b", frames=256, height=1080, width=1920)
    p = plan_with_chunk(cfg, None, generate=True, gpu_gb=141)
    assert p.fits and p.token_chunk > 0 and p.device_required_bytes <= 141e9


def test_goal_training_1080p_on_an_h200_and_1649_gb():
    cfg = config_for("dit-105b", frames=81, height=1080, width=1920)
    cfg.runtime.offload_activations = True
    p = plan_with_chunk(cfg, "auto", **GOAL)
    # 81 frames: the device fits with a token chunk; the host is short by a few GB, and the
    # offloaded block inputs are the term the clip adds there
    assert p.fits_device and p.token_chunk > 0
    assert p.fits_host is False and 0 < p.host_shortfall_bytes < 20e9
    assert p.binding_memory[:2] == ("host", "offloaded block inputs (L x ND)")
    assert any("disk tier" in n for n in p.notes) and any("bf16 AdamW moments" in n for n in p.notes)
    # partial offload (runtime.offload_keep) would close the gap with a smaller chunk: the note says how
    keep = [n for n in p.notes if "block inputs on the device instead of offloading" in n]
    assert len(keep) == 1 and "runtime.offload_keep = 3 (--offload-keep 3, or auto)" in keep[0]
    assert "token_chunk 57,120" in keep[0] and "not implemented" not in keep[0]
    # the longest clip that fits is well past the 33-frame floor
    s = max_frames(cfg, "auto", **GOAL)
    assert s.best_frames >= 33 and s.best.fits
    assert s.next_frames == s.best_frames + 4 and s.next.fits is False


def test_goal_training_81_frames_1080p_fits_with_the_last_block_inputs_kept_on_the_device(capsys):
    """The paper's target by the planner's own terms (reserve and margins untouched): with
    --offload-keep auto the fewest inputs kept on the device that close the host gap, and the
    largest token chunk that then fits the device."""
    cfg = config_for("dit-105b", frames=81, height=1080, width=1920)
    cfg.runtime.offload_activations = True
    p = plan_with_keep(cfg, "auto", "auto", **GOAL)
    L = cfg.model.depth
    ND = cfg.tokens_per_sample * cfg.model.hidden_size * 2
    assert p.fits and p.fits_host and p.fits_device
    assert p.offload_keep == 3 and p.token_chunk == 57_120
    assert p.host_offloaded_bytes == (L - 3) * ND and p.host_required_bytes <= 1649e9
    assert p.device_terms["block-input checkpoints"] == (p.prefetch_depth + 1 + 3) * ND
    # the fused kernels' scratch (the key-side pass's records, in chunks within 1 GiB) is counted
    scratch = p.device_terms["attention kernels' scratch (records, scores or fp32 dk/dv)"]
    assert scratch == p.activation_parts["dsa_fused_scratch"] and 0.5e9 < scratch <= 1 << 30
    assert p.device_required_bytes <= 141e9
    # one fewer kept does not fit the host; the next larger chunk does not fit the device with 3
    assert plan_with_chunk(_keep(cfg, 2), 57_120, **GOAL).fits_host is False
    assert plan_with_chunk(_keep(cfg, 3), 65_280, **GOAL).fits_device is False
    assert p.notes[0].startswith("--offload-keep auto: k = 3, the fewest")
    assert main(["--preset", "dit-105b", "--frames", "81", "--height", "1080", "--width", "1920", "--gpu-gb", "141",
                 "--ram-gb", "1649", "--offload-activations", "--token-chunk", "auto", "--offload-keep", "auto"]) == 0
    assert "fits: this machine can run it" in capsys.readouterr().out
    # the longest training clip at 1080p then: k and the chunk re-picked at every length
    s = max_frames(cfg, "auto", keep="auto", **GOAL)
    assert s.best_frames == 97 and s.best.fits and s.best.offload_keep == 8
    assert s.next_frames == 101 and s.next.fits is False and s.next.binding_memory[0] == "device"


def _keep(cfg, k):
    return dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, offload_keep=k))


def test_max_frames_returns_a_length_that_fits_and_four_more_does_not():
    cfg = config_for("dit-105b", height=1080, width=1920)
    s = max_frames(cfg, None, generate=True, gpu_gb=141)
    assert s.best_frames >= 257 and s.best.fits and s.best.frames == s.best_frames
    for frames, fits in ((s.best_frames, True), (s.best_frames + 4, False)):
        c = config_for("dit-105b", frames=frames, height=1080, width=1920)
        assert plan_with_chunk(c, None, generate=True, gpu_gb=141).fits is fits
    # pixel space steps by the temporal patch
    tiny = max_frames(build_config("tiny"), 0, gpu_gb=0.05, ram_gb=1)
    assert tiny.best_frames % 2 == 0 and tiny.next_frames == tiny.best_frames + 2 and not tiny.next.fits


def test_kept_block_graphs_are_named_with_their_memory():
    cfg = build_config("tiny-motion", None, {})
    assert not cfg.runtime.recompute_blocks
    got = plan(cfg, w_dtype="float32")
    note = next(n for n in got.notes if n.startswith("runtime.recompute_blocks = false"))
    assert "keeps every block's autograd graph" in note
    assert not any(n.startswith("runtime.recompute_blocks") for n in plan(build_config("tiny", None, {})).notes)


def test_cli_help_and_refusals(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--generate", "--max-frames", "--token-chunk", "--host-reserve-gb", "--guidance", "--sample-steps",
                 "--ram-gb", "--gpu-gb", "--offload-activations", "--offload-keep"):
        assert flag in out
    for argv in (["--token-chunk", "-1"], ["--token-chunk", "lots"], ["--ram-gb", "0"], ["--gpu-gb", "-3"],
                 ["--frames", "0"], ["--host-reserve-gb", "-1"], ["--sample-steps", "0"], ["--offload-keep", "-1"],
                 ["--offload-keep", "some"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
    capsys.readouterr()
    for argv in (["--max-frames"], ["--preset", "dit-28b", "--max-frames", "--gpu-gb", "141"],
                 ["--guidance"], ["--token-chunk", "auto"], ["--max-frames", "--frames", "16", "--gpu-gb", "1"],
                 ["--prefetch-depth", "0"], ["--offload-keep", "2"],
                 ["--offload-activations", "--offload-keep", "auto", "--gpu-gb", "141"],
                 ["--offload-activations", "--offload-keep", "1", "--generate"]):
        assert main(argv) == 2, argv
        assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("argv,rule", [
    (["--ema-decay", "1"], "training.ema_decay=1.0 must lie in [0, 1)"),
    (["--ema-decay", "nan"], "training.ema_decay=nan must lie in [0, 1)"),
    (["--distill-weight", "-1"], "training.distill_weight=-1.0 must be a finite number >= 0"),
    (["--distill-weight", "inf"], "training.distill_weight=inf must be a finite number >= 0"),
    (["--distill-weight", "1", "--attention", "dense"], "training.distill_weight=1.0 with attention.kind='dense'"),
    (["--grad-slot-mb", "-1"], "runtime.grad_slot_mb=-1.0 must be >= 0"),
    (["--grad-slot-mb", "nan"], "runtime.grad_slot_mb=nan must be >= 0"),
    (["--prefetch-depth", "0"], "runtime.prefetch_depth=0 must be >= 1"),
    (["--device-shards", "9"], "runtime.device_shards=9 must be an integer from 0 to model.depth"),
    (["--offload-activations", "--preset", "tiny-motion"], "runtime.recompute_blocks=false with "
                                                            "runtime.offload_activations=true"),
])
def test_cli_runtime_flags_meet_the_configs_own_rules(capsys, argv, rule):
    """The flags that set a config field are checked by ``validate``'s rules, with their messages
    and the flag that set the field."""
    code = main(argv + ["--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {rule}"), err
    flag = argv[0] if argv[0] == "--offload-activations" else f"{argv[0]} {float(argv[1])}" \
        if argv[0] not in ("--prefetch-depth", "--device-shards") else f"{argv[0]} {argv[1]}"
    assert f"(set by {flag})" in err, err


def test_plan_of_distillation_needs_no_teacher_weights(capsys):
    """A plan counts the teacher without reading it: no ``training.init_from`` needed."""
    assert main(["--preset", "tiny", "--distill-weight", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)


# -- several GPUs, nodes, micro-batches (planning/scaleout.py) ---------------------------------------


def test_micro_batches_keep_the_weight_traffic_and_divide_the_transfer_to_compute_ratio():
    cfg = config_for("wan2.1-t2v-14b", 81, 480, 832)
    one = plan(cfg)
    cfg.training.micro_batches = 4
    four = plan(cfg)
    assert four.h2d_bytes == one.h2d_bytes and four.d2h_bytes == one.d2h_bytes
    assert _close(four.flops_executed, 4 * one.flops_executed, 1e-9)
    assert _close(four.transfer_compute_ratio, one.transfer_compute_ratio / 4, 1e-9)
    assert four.activation_parts["checkpoints"] == 4 * one.activation_parts["checkpoints"]  # k inputs per block
    assert four.activation_parts["block_linear"] == one.activation_parts["block_linear"]  # a block runs one at a time
    assert four.global_batch == 4 and four.tokens_per_step == 4 * one.tokens_per_step


def test_gpus_per_node_add_gradient_slots_and_draw_on_the_same_dram():
    cfg = config_for("wan2.1-t2v-14b", 81, 480, 832)
    one, eight = plan(cfg, ram_gb=2000), plan(cfg, ram_gb=2000, gpus_per_node=8)
    smax, wb = eight.largest_shard_params, 2
    slot = 512_000_000 // wb  # runtime.grad_slot_mb: Wan 14B's largest shard (0.7 GB) goes in pieces
    assert slot < smax
    slots = 8 * cfg.runtime.grad_slots * slot * wb
    assert eight.scale.host_terms["gradient slots (8 GPUs x 2 x 512 MB)"] == slots
    assert eight.host_required_bytes == one.host_required_bytes + slots + 4 * slot  # + the fp32 sum of a piece
    assert "adamw" in one.time_terms and "host_dram" not in one.time_terms  # one GPU: as before
    dram = 8 * (one.h2d_bytes + one.d2h_bytes) + 10 * one.params * wb + one.adamw_dram_bytes
    assert eight.scale.host_dram_bytes == dram and _close(eight.time_terms["host_dram"], dram / 300e9)
    assert eight.device_required_bytes == one.device_required_bytes and eight.global_batch == 8
    cfg.runtime.compute_actors = 8  # the config's compute actors are the default GPU count
    assert plan(cfg).gpus_per_node == 8


def test_nodes_shard_the_optimizer_state_and_count_the_network(plan_105b):
    cfg = config_for("dit-105b")
    P, wb = plan_105b.params, 2
    two = plan(cfg, ram_gb=1000, gpus_per_node=8, nodes=2, network_gbps=25)
    own = two.scale.owner_params
    assert P / 2 <= own < P / 2 + plan_105b.largest_shard_params  # whole shards, round robin
    terms = two.scale.host_terms
    assert terms["weights w (every node)"] == wb * P
    assert terms["optimizer state master + m + v (this node's shards, about 1/2)"] == 12 * own
    assert two.scale.network_bytes == wb * ((P - own) + own)  # about 2 x 2 B x P x (M - 1) / M
    assert _close(two.time_terms["network"], two.scale.network_bytes / 25e9)
    four = plan(cfg, gpus_per_node=8, nodes=4)
    assert _close(four.scale.network_bytes, 2 * wb * P * 3 / 4, 0.03)
    assert any("2 nodes (runtime.nodes = 2): one store per node" in n for n in two.notes)
    assert not any("not implemented" in n for n in two.notes)
    # 105B on two nodes of 1 TB: whole-block slots fit with one gradient slot per GPU, not with two
    # (the note says so); slots of 512 MB (the default) fit with two.
    cfg.runtime.grad_slot_mb = 0
    cfg.runtime.grad_slots = 1
    assert plan(cfg, ram_gb=1000, gpu_gb=141, gpus_per_node=8, nodes=2).fits
    cfg.runtime.grad_slots = 2
    short = plan(cfg, ram_gb=1000, gpu_gb=141, gpus_per_node=8, nodes=2)
    assert short.fits_host is False and any("--grad-slots 1" in n for n in short.notes)
    cfg.runtime.grad_slot_mb = 512
    assert plan(cfg, ram_gb=1000, gpu_gb=141, gpus_per_node=8, nodes=2).fits


def test_105b_on_four_nodes_of_eight_gpus_fits_640_gb_with_sub_block_gradient_slots(capsys):
    assert main(["--preset", "dit-105b", "--nodes", "4", "--gpus-per-node", "8", "--ram-gb", "640"]) == 0
    out = capsys.readouterr().out
    assert "=> fits: this machine can run it" in out and "gradient slots (8 GPUs x 2 x 512 MB)" in out
    cfg = config_for("dit-105b")
    cfg.runtime.grad_slot_mb = 0  # whole-block slots: 95 GB of them per node, 719 GB in all
    whole = plan(cfg, ram_gb=640, gpus_per_node=8, nodes=4)
    assert whole.fits_host is False and 700e9 < whole.host_required_bytes < 740e9
    assert main(["--preset", "dit-105b", "--nodes", "4", "--gpus-per-node", "8", "--ram-gb", "640",
                 "--grad-slot-mb", "0"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_cli_scale_out_flags(capsys):
    assert main(["--preset", "wan2.1-t2v-14b", "--frames", "81", "--height", "480", "--width", "832",
                 "--gpus-per-node", "8", "--micro-batches", "2", "--ram-gb", "2000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpus_per_node"] == 8 and d["micro_batches"] == 2 and d["global_batch"] == 16
    assert "host_dram" in d["time_terms"] and d["scale"]["host_dram_bytes"] > 0
    assert main(["--preset", "dit-105b", "--nodes", "2", "--gpus-per-node", "8", "--grad-slots", "1"]) == 0
    out = capsys.readouterr().out
    assert "network per node, each way" in out and "host memory per node" in out and "transfer / compute" in out


def test_resident_shards_cross_the_link_once_and_auto_fills_the_device():
    from megaslide_ray.planning.search import plan_with_resident

    cfg = config_for("wan2.1-t2v-1.3b")
    base = plan(cfg, gpu_gb=80)
    cfg.runtime.resident_gb = 1.0
    some = plan(cfg, gpu_gb=80)
    block = some.largest_shard_params * 2
    assert len(some.resident_shards) == int(1e9 // block) and some.resident_shards[0] == cfg.model.depth - 1
    assert some.h2d_bytes == base.h2d_bytes - some.resident_bytes
    assert some.device_required_bytes == base.device_required_bytes + some.resident_bytes
    cfg.runtime.resident_gb = 0.0
    auto = plan_with_resident(cfg, None, None, "auto", gpu_gb=80)
    # every shard the backward fetches: blocks L-1..1 and shard 0 (block L, the turn's, is kept anyway;
    # the planner counts it and the head twice, as it always has: "slightly less than 2 P")
    assert auto.fits_device and auto.resident_shards == tuple(range(cfg.model.depth - 1, -1, -1))
    assert auto.h2d_bytes == 2 * auto.params * 2 - auto.resident_bytes
    assert any("--resident-gb auto" in n for n in auto.notes)


def test_unbounded_dsa_offsets_get_a_note_on_which_gpu_kernels_run():
    """A dsa plan with unbounded offsets says what that costs on a GPU and which settings keep every
    pass on tensor cores (the presets' own); bounded (the presets), on the CPU, or another kind: no
    such note."""
    def noted(over: dict) -> bool:
        return any("leaves dsa's offsets unbounded" in n and "attention.max_offset 1.5" in n
                   for n in plan(build_config("wan2.1-t2v-1.3b", None, over)).notes)

    unbounded = {"attention.max_offset": "0"}
    assert noted(unbounded)
    for over in ({}, {**unbounded, "runtime.device": "cpu"}, {**unbounded, "attention.kind": "neighborhood"}):
        assert not noted(over), over
    for name in ("dit-105b", "wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b"):
        a = build_config(name, None, {}).attention
        assert (a.max_offset, a.offset_bound) == (1.5, "clamp"), name


def _host_rows(p) -> dict[str, int]:
    """The host rows ``render`` prints (the state's parts once: their sum is the state row)."""
    if p.scale is not None and (p.gpus_per_node > 1 or p.nodes > 1):
        rows = dict(p.scale.host_terms)
    elif p.mode == "generate":
        rows = {"w": p.host_bytes["w"], "offloaded": p.host_offloaded_bytes}
    else:
        rows = {"state": p.host_state_bytes, "fp32 update scratch": p.scratch_bytes,
                "offloaded": p.host_offloaded_bytes}
    return {**rows, "reserve": p.host_reserve_bytes}


@pytest.mark.parametrize("preset", ["tiny", "dit-105b", "dit-28b", "wan2.1-t2v-14b", "wan2.2-ti2v-5b"])
@pytest.mark.parametrize("gpus,nodes,generate", [(1, 1, False), (1, 1, True), (8, 1, False), (8, 4, False)])
def test_the_host_rows_add_up_to_the_host_total(preset, gpus, nodes, generate):
    cfg = build_config(preset, None, {"runtime.offload_activations": True} if preset == "dit-105b" else {})
    p = plan(cfg, gpus_per_node=gpus, nodes=nodes, generate=generate)
    assert sum(_host_rows(p).values()) == p.host_required_bytes
    if not generate:  # the scratch row is the store's: the gradient upcast into fp32 for AdamW
        assert p.scratch_bytes == 4 * p.largest_shard_params
        text = render(p)
        if gpus == nodes == 1:
            assert f"fp32 update scratch: 4 B x shard {p.largest_shard}" in text
    assert p.device_required_bytes == sum(p.device_terms.values())


def test_both_experts_hold_twice_the_host_state_and_stream_one():
    """wan2.2-t2v-a14b: two experts of the Wan2.1 14B shape in the store (twice its host state), one
    streamed and updated per step (the same traffic and compute); several GPUs are refused."""
    both, one = (plan(build_config(name), ram_gb=1649, gpu_gb=141) for name in ("wan2.2-t2v-a14b", "wan2.1-t2v-14b"))
    assert both.experts == 2 and both.params == one.params
    assert both.host_state_bytes == 2 * one.host_state_bytes
    assert both.host_required_bytes - one.host_required_bytes == one.host_state_bytes
    assert (both.h2d_bytes, both.d2h_bytes, both.device_required_bytes) == (
        one.h2d_bytes, one.d2h_bytes, one.device_required_bytes)
    assert both.fits
    with pytest.raises(ConfigError, match="training.expert='both' trains with one compute actor"):
        plan(build_config("wan2.2-t2v-a14b"), gpus_per_node=8)
