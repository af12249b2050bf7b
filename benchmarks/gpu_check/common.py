"""Shared pieces of the GPU check: the parts, their sizes (GPU run and CPU smoke run), timing and
memory helpers, synthetic batches."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megaslide_ray.data.captions import empty_captions, set_caption

PARTS = ("correctness", "pinning", "streaming", "attention", "model", "speedup", "compile")
RESERVE_S = {"correctness": 0, "pinning": 12, "streaming": 30, "attention": 70, "model": 80, "speedup": 8,
             "compile": 60}
"""Seconds kept for each part when the parts before it set their deadlines (GPU run)."""
FP32_RTOL, FP32_ATOL = 1e-4, 2e-5
BF16_REL_ATOL = 1e-4
SPEEDUP_GOAL = 3.0
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 peak by device-name substring (SXM figures, no sparsity), for MFU."""


@dataclass(frozen=True)
class Case:
    """One correctness case: q/k/v ``(B, T, H, W, nh, d)``, a window and an offset kind."""

    name: str
    shape: tuple[int, int, int, int, int, int]
    window: tuple[int, int, int]
    offsets: str  # "wild" (moves, whole tokens, far clamps), "edge" (kinks), "uniform", "small", "far_few"
    block_m: int | None = None  # None: the launcher's default


CASES = (
    Case("odd sizes, d=64, wild offsets", (2, 5, 9, 11, 3, 64), (3, 5, 5), "wild"),
    Case("d=40, 7x13 planes, block 16", (1, 3, 7, 13, 2, 40), (3, 3, 5), "wild", 16),
    Case("integer / zero / clamp-bound positions", (2, 4, 6, 5, 2, 8), (3, 3, 3), "edge", 32),
    Case("window spans T, d=6, block 64", (2, 5, 3, 7, 2, 6), (5, 1, 3), "wild", 64),
    Case("benchmark shape, uniform [-1.5, 1.5]", (1, 8, 32, 32, 2, 32), (3, 3, 3), "uniform"),
    Case("offsets within 0.9: the halo kernels at 0.9, uniform [-0.9, 0.9]", (2, 5, 24, 24, 3, 64), (3, 5, 5), "small"),
    Case("every 10th query 3.7 out, the rest [-0.9, 0.9]: the split backward", (1, 5, 12, 20, 2, 64), (3, 5, 5),
         "far_few"),
)
SMOKE_CASES = (  # small windows: the interpreter's time grows with K
    Case("smoke: odd sizes, wild offsets", (1, 3, 3, 5, 1, 8), (3, 1, 1), "wild", 16),
    Case("smoke: clamp bounds", (1, 3, 4, 3, 1, 8), (1, 3, 1), "edge", 16),
    Case("smoke: offsets within 0.9 (the halo kernels)", (1, 2, 3, 5, 1, 16), (1, 3, 3), "small"),
)


@dataclass(frozen=True)
class Sizes:
    """Everything a run's size depends on: the GPU run's, or the CPU smoke run's."""

    cases: tuple[Case, ...] = CASES
    dense_identity_grids: tuple = ((3, 1, 5), (5, 7, 9))
    neighborhood_identity: tuple = ((2, 4, 7, 6, 2, 16), (3, 5, 3))
    pin_bytes: int = 2 << 30
    pin_chunk: int = 256 << 20
    pin_reps: int = 5
    stream: dict = field(default_factory=lambda: {
        "model.hidden_size": 512, "model.num_heads": 8, "model.depth": 4, "data.num_frames": 16,
        "data.height": 64, "data.width": 64, "data.batch_size": 2})
    stream_steps: int = 3
    attn_grids: tuple = ((16, 32, 32), (16, 64, 64), (64, 64, 64))
    attn_windows: tuple = ((3, 3, 3), (3, 5, 5))
    attn_heads: int = 8
    attn_dim: int = 128
    attn_reps: int = 3
    attn_slow_s: float = 4.0
    attn_first_grid_only: tuple = ()  # kinds measured at the first grid only (the smoke: the slowest interpreted)
    model: dict = field(default_factory=lambda: {
        "model.hidden_size": 5120, "model.num_heads": 40, "model.depth": 2, "model.patch_size": "1,2,2",
        "model.caption_dim": 1024, "model.caption_max_bytes": 256, "attention.window": "3,5,5",
        "data.batch_size": 1})
    model_clips: tuple = (("short", (4, 64, 64)), ("long", (16, 128, 128)))
    model_steps: int = 3
    speedup_grid: tuple = (16, 64, 64)
    speedup_reps: int = 3
    reserve_scale: float = 1.0
    compile_shapes: int | None = None  # the compile part's shapes: None = every preset shape


SMOKE = Sizes(
    cases=SMOKE_CASES, dense_identity_grids=((3, 1, 1),), neighborhood_identity=((1, 3, 4, 3, 1, 8), (3, 1, 1)),
    pin_bytes=6 << 20, pin_chunk=1 << 20, pin_reps=2,
    stream={"model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.caption_dim": 16,
            "model.patch_size": "2,8,8", "data.num_frames": 4, "data.height": 16, "data.width": 16,
            "data.batch_size": 2, "attention.window": "1,1,1"},
    stream_steps=2, attn_grids=((3, 3, 3), (3, 3, 6)), attn_windows=((3, 1, 3),), attn_heads=1,
    # the interpreter runs the key-side pass in ~20 s and the halo passes in ~60 s at 48 tokens (2 cores)
    attn_dim=16, attn_reps=0, attn_slow_s=120.0,
    attn_first_grid_only=("dsa_gather", "dsa_gather_atomic", "dsa_gather_split", "dsa_halo", "neighborhood"),
    model={"model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.patch_size": "1,4,4",
           "model.caption_dim": 16, "model.caption_max_bytes": 32, "attention.window": "1,3,3",
           "data.batch_size": 1},
    model_clips=(("short", (1, 12, 12)), ("long", (2, 16, 16))), model_steps=2,
    speedup_grid=(3, 5, 5), speedup_reps=1, reserve_scale=0.0, compile_shapes=1,
)


# -----------------------------------------------------------------------------
# Shared helpers


class Clock:
    """Marks and durations: CUDA events on the current stream, or the wall clock on the CPU."""

    def __init__(self, device):

        self.torch = torch
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True, blocking=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def reset_peak(device) -> int:
    """Start a peak-memory measurement; returns the bytes allocated now (CUDA) or 0."""

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return 0


def peak_since(device, base: int) -> int | None:

    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated() - base)
    return None


def state_root(need_bytes: int) -> tuple[str, str]:
    """A directory for ``need_bytes`` of store segments: shared memory (/dev/shm) when it has
    room (with a 25% margin), else the temporary directory. Returns (path, filesystem type)."""
    candidates = ["/dev/shm", tempfile.gettempdir()]
    for path in candidates:
        if os.path.isdir(path) and os.access(path, os.W_OK) and shutil.disk_usage(path).free > 1.25 * need_bytes:
            return path, fs_type(path)
    return tempfile.gettempdir(), fs_type(tempfile.gettempdir())


def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts; '?' if unknown)."""
    try:
        best, kind = "", "?"
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best):
                    best, kind = mount, parts[2]
        return kind
    except OSError:
        return "?"


def synthetic_batches(cfg, n: int, seed: int = 0) -> list[dict]:
    """``n`` decoder-shaped batches: random uint8 clips and caption bytes (no decoder, no files)."""


    rng = np.random.default_rng(seed)
    d = cfg.data
    batches = []
    for i in range(n):
        video = rng.integers(0, 256, (d.batch_size, d.num_frames, d.height, d.width, cfg.model.in_channels),
                             dtype=np.uint8)
        caption, caption_len = empty_captions(d.batch_size, cfg.model.caption_max_bytes)
        for row in range(d.batch_size):
            set_caption(caption, caption_len, row, f"synthetic clip {i}.{row}: a red circle moving right")
        batches.append({"video": video, "caption": caption, "caption_len": caption_len, "position": i})
    return batches


def w_dtype_for(device) -> str:

    return "bfloat16" if torch.device(device).type == "cuda" else "float32"



def fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "-"


def attn_line(r: dict) -> str:
    """One row of the attention part's table (the console and summary.md print the same line)."""
    def f(key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else "-"

    window = "x".join(map(str, r["window"])) if r["kind"] != "dense" else "-"
    return (f"| {r['kind']} | {r['tokens']} | {window} | {f('fwd_ms', '.2f')} | {f('bwd_ms', '.2f')} | "
            f"{f('predicted_fwd_ms', '.2f')} | {f('predicted_bwd_ms', '.2f')} | "
            f"{f('fwd_tflops', '.1f')} | {f('bwd_tflops', '.1f')} | {f('peak_mib', '.0f')} | {r['status']} | "
            f"{r.get('backend', '-')} |")
