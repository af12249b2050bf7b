"""Part 5, ``model``: a paper-width model streamed with overlap on and off (step time, per-stream busy
time, peak memory against the planner, MFU); part 6, ``speedup``: Triton against the reference."""

from __future__ import annotations

import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from actors.compute import ComputeActor, LocalStoreClient
from actors.param_store import ParameterStore
from benchmarks.attention import make_row, measure
from megaslide_ray.config import build_config
from megaslide_ray.planning.estimate import plan

from .common import (
    PEAK_BF16_FLOPS,
    SPEEDUP_GOAL,
    state_root,
    synthetic_batches,
    w_dtype_for,
)

if TYPE_CHECKING:
    from .run import Run


def peak_flops(device) -> float | None:

    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def part_model(ctx: Run) -> dict:

    sz, dev = ctx.sizes, ctx.device
    w_dtype = w_dtype_for(dev)

    def config(clip, overlap: bool, root: str):
        frames, height, width = clip
        return build_config("tiny", None, {
            **sz.model, "data.num_frames": frames, "data.height": height, "data.width": width,
            "runtime.overlap": overlap, "runtime.prefetch_depth": 1, "runtime.state_dir": root,
            "runtime.device": ctx.device_kind, "training.steps": 1000})

    probe = plan(config(sz.model_clips[0][1], True, ""), w_dtype)
    root, fs = state_root(probe.host_store_bytes)
    info: dict = {"params": probe.params, "largest_shard_params": probe.largest_shard_params,
                  "store_bytes": probe.host_store_bytes, "state_root": root, "filesystem": fs,
                  "w_dtype": w_dtype, "peak_flops": peak_flops(dev), "config": dict(sz.model)}
    if fs not in ("tmpfs", "ramfs", "?") and ctx.cuda:
        info["note"] = (f"no shared memory with {probe.host_store_bytes / 1e9:.1f} GB free: the store lives on {fs}; "
                        "AdamW and pinning then run at that filesystem's pace")
    tmp = tempfile.mkdtemp(prefix="megaslide-gpu-model-", dir=root)
    runs = {}
    try:
        t0 = time.perf_counter()
        store = ParameterStore(config(sz.model_clips[0][1], True, tmp), f"{tmp}/run", w_dtype, adamw="fused")
        info["store_init_s"] = round(time.perf_counter() - t0, 1)
        step, broken = 0, False
        try:
            for clip_name, clip in sz.model_clips:
                for overlap in (True, False):
                    name = f"{clip_name}_{'on' if overlap else 'off'}"
                    if ctx.past_deadline() or broken:
                        runs[name] = {"status": "skipped: " + ("an earlier run failed" if broken
                                                               else "time budget (--budget-s)")}
                        continue
                    cfg = config(clip, overlap, tmp)
                    p = plan(cfg, w_dtype)
                    batches = synthetic_batches(cfg, sz.model_steps, seed=2)
                    _release_device_memory(dev)  # the last variant's buffers must not count in this one's peak
                    t0 = time.perf_counter()
                    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
                    setup_s = time.perf_counter() - t0  # CUDA: mostly registering the store's w and g segments
                    steps = []
                    try:
                        for k in range(sz.model_steps):
                            if k > 0 and ctx.past_deadline():
                                break
                            r = compute.train_step(batches[k], step)
                            busy = compute.link.stream_seconds()
                            store.wait_step(step)  # AdamW on the host, outside the timed step
                            step += 1
                            steps.append((r, busy))
                        pinned = sum(n for _, n in compute.link.pinning.ranges)
                        runs[name] = {**_model_row(steps, p, info["peak_flops"], pinned, clip),
                                      "setup_s": round(setup_s, 2)}
                    except Exception as e:  # noqa: BLE001 - e.g. out of memory at the long clip: keep what ran
                        runs[name] = {"status": f"error: {type(e).__name__}: {e}"[:300],
                                      "traceback": traceback.format_exc()[-2000:]}
                        print(runs[name]["traceback"], file=sys.stderr, flush=True)
                        broken = True  # the store may hold half a step's reports: no later step can run
                    finally:
                        compute.close()
                        del compute
                    print(f"{name}: {json.dumps({k: v for k, v in runs[name].items() if k != 'steps'})}", flush=True)
        finally:
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for clip_name, _ in sz.model_clips:
        on, off = runs.get(f"{clip_name}_on", {}), runs.get(f"{clip_name}_off", {})
        if "step_s" in on and "step_s" in off:
            info[f"{clip_name}_speedup_on_vs_off"] = off["step_s"] / on["step_s"]
    info["runs"] = runs
    info["ok"] = bool(runs) and all(r.get("status") == "ok" for r in runs.values())
    return info


def _release_device_memory(device) -> None:


    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _model_row(steps: list, p, peak: float | None, pinned: int, clip) -> dict:
    """One variant's numbers: medians over the steps after the first (warm-up)."""
    timed = steps[1:] or steps
    step_s = statistics.median(r.seconds for r, _ in timed)
    busy = {k: statistics.median(b[k] for _, b in timed) for k in ("h2d", "d2h", "compute")}
    h2d = statistics.median(r.h2d_bytes for r, _ in timed)
    peak_mem = max(r.device_memory_peak_bytes for r, _ in timed)
    model_flops = p.flops_linear + p.flops_attention  # MFU counts the model's FLOPs, not the recompute
    row = {"status": "ok", "clip": list(clip), "tokens": p.tokens_per_sample, "steps_timed": len(timed),
           "step_s": step_s, "busy_s": busy, "h2d_bytes": h2d,
           "h2d_gbps": h2d / busy["h2d"] / 1e9 if busy["h2d"] else None,
           "overlap_efficiency": max(busy.values()) / step_s if step_s else None,
           "peak_bytes": peak_mem, "plan_device_bytes": p.device_required_bytes,
           "peak_vs_plan": peak_mem / p.device_required_bytes if p.device_required_bytes else None,
           "plan_flops": p.flops_executed, "plan_model_flops": model_flops,
           "tflops": p.flops_executed / step_s / 1e12,
           "mfu": model_flops / step_s / peak if peak else None,
           "hfu": p.flops_executed / step_s / peak if peak else None, "pinned_bytes": pinned,
           "losses": [r.loss for r, _ in steps]}
    return row


# -----------------------------------------------------------------------------
# Part 6: Triton against the reference


def part_speedup(ctx: Run) -> dict:
    grid, reps = ctx.sizes.speedup_grid, ctx.sizes.speedup_reps
    kind = "cpu" if not ctx.cuda else "cuda"
    tri = make_row("dsa", grid, kind, {"status": "ok", **measure("dsa", grid, kind, reps, 5.0, 0)})
    ref = make_row("dsa_ref", grid, kind, {"status": "ok", **measure("dsa_ref", grid, kind, reps, 5.0, 0)})
    speedup = ref.seconds / tri.seconds
    return {"grid": grid, "tokens": math.prod(grid), "fused": asdict(tri), "reference": asdict(ref),
            "speedup": speedup, "goal": SPEEDUP_GOAL, "ok": speedup >= SPEEDUP_GOAL or not ctx.cuda}


