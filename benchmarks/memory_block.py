"""Working set of one block's forward + backward, with ``runtime.token_chunk`` off and on (CPU).

Each row runs in a fresh child process: it builds one block (``videodit`` or ``wan``, the
chosen attention), makes the input ``x (1, T, H, W, D)`` and a gradient for the output, reads
its resident memory, then runs what the compute actor runs for a block in the backward (the
block recomputed from its saved input with gradients on, then its backward) and reads its
peak resident memory (``ru_maxrss``). A warm-up on a small grid first takes the libraries'
first-call allocations out of the difference. The row reports the peak minus the resident memory
before: the block's working set, including the weights' gradients and the input's gradient.

    python -m benchmarks.memory_block                  # width 512, 16x32x32 = 16384 tokens
    python -m benchmarks.memory_block --chunks 0,4096,1024 --json

The whole-clip tensors that stay (block input, q/k/v, residual streams, their gradients) are
``O(tokens x width)``; what chunking removes is the MLP hidden (``tokens x ffn``), the DSA
offsets and samples and the normalised/modulated copies, which exist one chunk at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(arch: str, kind: str, chunk: int, grid: tuple[int, int, int], width: int, heads: int,
            backend: str, threads: int = 1) -> dict:
    """One row, in this process (call it in a fresh one: ``ru_maxrss`` is a process-wide peak)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)

    from megaslide_ray.config import build_config
    from megaslide_ray.models.registry import build_shard

    over = {"model.depth": 1, "model.hidden_size": width, "model.num_heads": heads, "attention.kind": kind,
            "attention.backend": backend, "attention.window": "3,3,3", "attention.max_offset": 2.0, "runtime.token_chunk": chunk}
    if arch == "wan":
        over.update({"model.arch": "wan", "model.text_dim": 64, "model.text_len": 16, "model.in_channels": 4,
                     "model.patch_size": "1,2,2", "model.timestep_freq_dim": 64, "data.num_frames": 9,
                     "data.height": 48, "data.width": 80})
    cfg = build_config("tiny", None, over)
    torch.manual_seed(0)
    block = build_shard(cfg, 1)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    D = width
    cw = (7 + 16) * D if arch == "wan" else D
    small = (min(grid[0], 4), min(grid[1], 8), min(grid[2], 8))  # warm-up: libraries' first-call memory
    xs = torch.randn(1, *small, D).requires_grad_(True)
    torch.autograd.backward(block(xs, torch.randn(1, cw, requires_grad=True)), torch.randn(1, *small, D))
    block.zero_grad(set_to_none=True)
    del xs
    x = torch.randn(1, *grid, D).requires_grad_(True)
    c = torch.randn(1, cw).requires_grad_(True)
    dy = torch.randn(1, *grid, D)
    before = _rss_bytes()
    t0 = time.perf_counter()
    y = block(x, c)
    torch.autograd.backward(y, dy)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tokens = grid[0] * grid[1] * grid[2]
    return {"arch": arch, "kind": kind, "token_chunk": chunk, "tokens": tokens, "grid": list(grid), "width": D,
            "ffn": cfg.model.ffn_dim or int(D * cfg.model.mlp_ratio), "backend": backend,
            "working_set_mib": round((peak - before) / 2**20, 1),
            "tokens_x_width_mib": round(tokens * D * 4 / 2**20, 1), "seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="videodit", choices=["videodit", "wan"])
    ap.add_argument("--kind", default="dsa", choices=["dsa", "neighborhood", "dense", "swin"])
    ap.add_argument("--grid", default="16,32,32", help="T,H,W tokens (default 16,32,32 = 16384)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--chunks", default="0,4096,1024", help="token_chunk values, 0 = off")
    ap.add_argument("--backend", default="cpu", help="DSA backend (attention.backend)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: steadier times on a shared machine; 0 = torch's default)")
    ap.add_argument("--json", action="store_true", help="print one JSON row per line instead of a table")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: measure one chunk
    a = ap.parse_args(argv)
    grid = tuple(int(v) for v in a.grid.split(","))
    if a.one is not None:
        print(json.dumps(measure(a.arch, a.kind, a.one, grid, a.width, a.heads, a.backend, a.threads)))
        return
    rows = []
    for chunk in (int(v) for v in a.chunks.split(",")):
        cmd = [sys.executable, "-m", "benchmarks.memory_block", "--arch", a.arch, "--kind", a.kind, "--grid", a.grid,
               "--width", str(a.width), "--heads", str(a.heads), "--backend", a.backend, "--threads", str(a.threads),
               "--one", str(chunk)]
        # every allocation from 64 KiB up its own mapping, returned to the system when freed: the
        # peak resident memory then follows the live tensors, not glibc's heap high-water mark
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if a.json:
            print(json.dumps(rows[-1]), flush=True)
    if a.json:
        return
    r0 = rows[0]
    print(f"{r0['arch']} block, {r0['kind']} attention, {r0['tokens']} tokens {tuple(r0['grid'])}, width {r0['width']}, "
          f"ffn {r0['ffn']}, fp32, DSA backend {r0['backend']}; tokens x width = {r0['tokens_x_width_mib']} MiB")
    print(f"{'token_chunk':>12} {'working set MiB':>16} {'x tokens*width':>15} {'fwd+bwd s':>10}")
    for r in rows:
        ratio = r["working_set_mib"] / r["tokens_x_width_mib"]
        print(f"{r['token_chunk'] or 'off':>12} {r['working_set_mib']:>16.1f} {ratio:>15.1f} {r['seconds']:>10.2f}")


if __name__ == "__main__":
    main()
