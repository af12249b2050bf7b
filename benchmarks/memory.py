"""Planned against measured memory: is ``python -m megaslide_ray.plan`` right?

    python -m benchmarks.memory [--json] [--shapes NAME ...] [--device cpu|cuda]

For each shape (width >= 512, >= 16k tokens per clip, token chunking on and off) this runs
one training step of the streamed trainer's own parts, the ``ParameterStore`` and the
``ComputeActor``, in a fresh process, and compares two measurements with what the planner says
for the same config:

* **host**: the bytes of the store's state (its segment files, as the kernel counts them)
  against the planner's host state;
* **device**: the compute actor's peak working memory during one step against the planner's
  device requirement (staged shards + kept block inputs + one block's working set + the
  inputs). On CUDA that is ``torch.cuda.max_memory_allocated`` (reset at the step's start).
  On the CPU the "device" is the process's anonymous memory: the peak of ``RssAnon`` sampled
  every millisecond during the step, minus its value at the step's start, with glibc told
  to serve allocations above 64 KiB with ``mmap`` (``MALLOC_MMAP_THRESHOLD_``) so freed
  tensors leave RSS at once. Weights are staged as on a GPU (``runtime.link_gbps`` set), so
  the staging buffers are in that memory too, as they are on a device.

A row reports planned, measured and ratio = measured / planned; the issue's bar is a ratio
within 0.8-1.2. ``--json`` prints one object per row with ``planned_bytes``,
``measured_bytes`` and ``ratio`` (plus the parts of the plan).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Shapes: videodit (pixel space, patch 1x8x8) and a latent-space DiT layout; >= 16k tokens,
# width >= 512. Each runs with token_chunk off and on.
SHAPES: dict[str, dict] = {
    "w512-16k-nbhd": {"model.hidden_size": 512, "model.num_heads": 8, "model.depth": 2,
                      "model.patch_size": "1,8,8", "data.num_frames": 16, "data.height": 256, "data.width": 256,
                      "attention.kind": "neighborhood", "attention.window": "3,3,3"},
    "w512-16k-dsa": {"model.hidden_size": 512, "model.num_heads": 8, "model.depth": 2,
                     "model.patch_size": "1,8,8", "data.num_frames": 16, "data.height": 256, "data.width": 256,
                     "attention.kind": "dsa", "attention.window": "3,3,3"},
    "w768-20k-dsa": {"model.hidden_size": 768, "model.num_heads": 12, "model.depth": 2,
                     "model.patch_size": "1,8,8", "data.num_frames": 20, "data.height": 256, "data.width": 256,
                     "attention.kind": "dsa", "attention.window": "3,3,3"},
}
COMMON = {"data.batch_size": 1, "model.caption_dim": 64, "runtime.link_gbps": 1000.0, "runtime.overlap": "true",
          "runtime.prefetch_depth": 1, "runtime.compute_threads": 0}
CHUNK_TOKENS = 4096


def config_for(shape: str, token_chunk: int, device: str):
    from megaslide_ray.config import build_config

    over = {**COMMON, **SHAPES[shape], "runtime.token_chunk": token_chunk, "runtime.device": device}
    return build_config("tiny", None, {k: str(v) for k, v in over.items()})


def measure_in_process(shape: str, token_chunk: int, device: str) -> dict:
    """One warm-up step, then one measured step (the store's update of the warm-up overlaps
    nothing: it is waited for first)."""
    import tempfile

    import torch

    from actors.compute import ComputeActor, LocalStoreClient
    from actors.param_store import ParameterStore
    from benchmarks.gpu_check import synthetic_batches
    from benchmarks.overlap import PeakSampler

    cfg = config_for(shape, token_chunk, device)
    state = tempfile.mkdtemp(prefix="megaslide-memory-")
    w_dtype = "bfloat16" if device == "cuda" else "float32"
    store = ParameterStore(cfg, state, w_dtype=w_dtype)
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    batches = synthetic_batches(cfg, 2)
    try:
        compute.train_step(batches[0], 0)
        store.wait_step(0)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            compute.train_step(batches[1], 1)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            device_bytes = torch.cuda.max_memory_allocated() - base
        else:
            with PeakSampler(period=0.001) as p:
                t0 = time.perf_counter()
                compute.train_step(batches[1], 1)
                seconds = time.perf_counter() - t0
            device_bytes = p.peak - p.base
        store.wait_step(1)
        host_bytes = sum(f.stat().st_size for f in store.dir.iterdir() if f.name.startswith("shard_"))
        scratch = store._grad32.numel() * 4 if store._grad32 is not None else 0
    finally:
        compute.close()
        store.close()
    return {"device_bytes": int(device_bytes), "host_bytes": int(host_bytes), "host_scratch_bytes": int(scratch),
            "step_seconds": seconds}


def measure(shape: str, token_chunk: int, device: str) -> dict:
    """``measure_in_process`` in a fresh process (an empty heap, nothing left by other shapes)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(ROOT)}
    code = ("import json, sys; from benchmarks.memory import measure_in_process; "
            "print(json.dumps(measure_in_process(sys.argv[1], int(sys.argv[2]), sys.argv[3])))")
    out = subprocess.run([sys.executable, "-c", code, shape, str(token_chunk), device], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"measuring {shape} (token_chunk {token_chunk}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned(shape: str, token_chunk: int, device: str) -> dict:
    from megaslide_ray.planning.estimate import plan

    cfg = config_for(shape, token_chunk, device)
    p = plan(cfg, w_dtype="bfloat16" if device == "cuda" else "float32")
    return {"device_bytes": int(p.device_required_bytes), "host_bytes": int(p.host_state_bytes),
            "tokens": p.tokens_per_sample, "params": p.params, "activation_parts": p.activation_parts,
            "device_shard_bytes": p.device_shard_bytes}


def run(shapes: list[str], device: str, chunks: tuple[int, ...] = (0, CHUNK_TOKENS)) -> list[dict]:
    rows = []
    for shape in shapes:
        for chunk in chunks:
            want, got = planned(shape, chunk, device), measure(shape, chunk, device)
            for what in ("device", "host"):
                rows.append({
                    "shape": shape, "token_chunk": chunk, "what": what, "device": device,
                    "tokens": want["tokens"], "params": want["params"],
                    "planned_bytes": want[f"{what}_bytes"], "measured_bytes": got[f"{what}_bytes"],
                    "ratio": got[f"{what}_bytes"] / want[f"{what}_bytes"],
                    "step_seconds": got["step_seconds"],
                })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--chunk", type=int, default=CHUNK_TOKENS, help=f"token_chunk of the 'on' rows (default {CHUNK_TOKENS})")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    a = p.parse_args(argv)
    if a.chunk <= 0:
        p.error(f"--chunk {a.chunk} must be > 0")
    rows = run(a.shapes, a.device, (0, a.chunk))
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'shape':<16}{'chunk':>6}{'what':>8}{'tokens':>8}{'planned MB':>12}{'measured MB':>13}{'ratio':>7}"
          f"{'step s':>8}")
    for r in rows:
        print(f"{r['shape']:<16}{r['token_chunk']:>6}{r['what']:>8}{r['tokens']:>8}{r['planned_bytes'] / 1e6:>12.1f}"
              f"{r['measured_bytes'] / 1e6:>13.1f}{r['ratio']:>7.2f}{r['step_seconds']:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
