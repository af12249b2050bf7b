"""Part 4, ``attention``: 3D-DSA forward and backward against flash SDPA and the neighborhood case at
paper-like shapes; TFLOP/s and the dense/DSA crossover. The fused kernels three ways, so each of
the cost model's predictions meets a measurement: ``dsa_gather`` (the gather kernels, dk/dv by the
key-side pass), ``dsa_gather_atomic`` (dk/dv by fp32 atomics), ``dsa_gather_split`` (unbounded
offsets, one sample of every 20th token 4 tokens out: the split mode, which ``auto`` runs for
unbounded offsets, the key-side pass for the rest) and ``dsa_halo`` (the halo kernels: the forward and the
backward's query side on tensor cores, forced with ``KernelModes(halo="halo")``)."""

from __future__ import annotations

import contextlib
import math
import statistics
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import KernelModes, deformable_slide_attention

from .common import Clock, attn_line, peak_since, reset_peak

if TYPE_CHECKING:
    from .run import Run


GATHER_KINDS = ("dsa_gather", "dsa_gather_atomic", "dsa_gather_split", "dsa_halo", "dsa_fused")
"""The DSA rows that force a kernel family (``KernelModes``); ``dsa_fused``: the fused halo-dense
forward where it can run (Triton >= 3.8, sm_90, d 128, 3x7x7; its first-use check passed), else auto's."""


def attention_flops(kind: str, tokens: int, K: int, nh: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs: dense ``4 N^2 d nh``; DSA / neighborhood ``36 N K d nh``
    (4 for the dot products and the weighted sum, 32 for the trilinear gathers of k and v);
    backward = 2.5 x forward for both (FlashAttention's 5 matmuls against 2; the convention of
    benchmarks/attention.py, whose fwd+bwd is 3.5 x forward)."""
    fwd = 4.0 * tokens * tokens * d * nh if kind == "dense" else 36.0 * tokens * K * d * nh
    return fwd, 2.5 * fwd


SPLIT_FAR_SHARE = 0.05
"""``dsa_gather_split``'s offsets: one sample of every 20th token past the key-side pass's cap."""


def predicted_ms(kind: str, grid, window, nh: int, d: int) -> tuple[float, float]:
    """The cost model's forward and backward ms for a row (``kernels.dsa_cost``, H100 figures, ``nh``
    heads): the kernels the row forces, or those ``auto`` runs (``dsa``, ``neighborhood``,
    ``dsa_gather_split``: ``call_breakdown``); ``dense``: FlashAttention-3's model (the row measures
    SDPA's flash kernel). Printed beside the measurement, so the first GPU run checks the model."""
    from kernels import dsa_cost as C  # lazy: imports triton
    from kernels import dsa_fused_cost as F  # lazy: as above

    chip, N, grid, window = C.CHIPS[0], math.prod(grid), tuple(grid), tuple(window)
    if kind == "dense":
        f = C.fa3_seconds(N, d, chip)
        return 1e3 * nh * f["fwd"], 1e3 * nh * f["bwd"]
    if kind in ("dsa", "neighborhood", "dsa_gather_split", "dsa_fused"):
        bound = {"dsa": 1.5, "neighborhood": 0.0, "dsa_gather_split": None, "dsa_fused": 1.5}[kind]
        b = C.call_breakdown(grid, window, d, bound, far_share=SPLIT_FAR_SHARE)
        fused = [F.fused_fwd_cost(grid, window, d, 1.5), F.fused_bwd_cost(grid, window, d, 1.5)] \
            if kind == "dsa_fused" else [None, None]
        return tuple(nh * (F.fused_pass(c, grid, window, d, 1.5, chip, p, nh)["ms"] if c is not None else b["dsa_ms"][p])
                     for c, p in zip(fused, ("fwd", "bwd")))  # the fused kernels with their order kernel
    gather_fwd, gather_atomic = C.gather_costs(N, window, d)
    query, key = C.pull_costs(grid, window, d, 1.5)
    fwd, bwd = [gather_fwd], {"dsa_gather": [query, key], "dsa_gather_atomic": [gather_atomic]}.get(kind)
    if kind == "dsa_halo":
        halo = C.halo_costs(grid, window, d, 1.5)
        fwd, bwd = halo["fwd"], [*halo["bwd"], key]
    return tuple(1e3 * nh * sum(c.seconds(chip)["seconds"] for c in cs) for cs in (fwd, bwd))


def measure_attention(kind: str, grid, window, nh: int, d: int, device, reps: int) -> dict:
    """Forward and backward timed apart (medians over ``reps`` after one warm-up) and the peak
    memory of a forward + backward over its inputs."""


    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, *grid, nh, d)
    N, K = math.prod(grid), math.prod(window)

    def rand(*s):
        return torch.randn(s, generator=gen, device=device, dtype=torch.float32).to(dtype)

    q, k, v = (rand(*shape).requires_grad_() for _ in range(3))
    dout = rand(*shape)
    offsets = None
    if kind in ("dsa", *GATHER_KINDS):
        u = torch.rand((*shape[:5], K, 3), generator=gen, device=device)
        offsets = ((2 * u - 1) * 1.5).to(dtype)
        if kind == "dsa_gather_split":  # 5% of the queries past the key-side pass's cap (an unbounded head's)
            offsets.view(-1, nh, K, 3)[::20, :, 0, 2] = 4.0
        offsets.requires_grad_()
    elif kind == "neighborhood":
        offsets = torch.zeros((*shape[:5], K, 3), device=device, dtype=dtype)
    leaves = [x for x in (q, k, v, offsets) if x is not None and x.requires_grad]

    def forward():
        if kind == "dense":
            flat = [x.reshape(1, N, nh, d).transpose(1, 2) for x in (q, k, v)]
            return F.scaled_dot_product_attention(*flat).transpose(1, 2)
        # the bound the offsets were drawn with, as a model passes attention.max_offset (none: an
        # unbounded head's, whose backward takes the split mode)
        return deformable_slide_attention(q, k, v, offsets, window, backend="triton", modes=modes,
                                          max_offset=None if kind == "dsa_gather_split" else
                                          0.0 if kind == "neighborhood" else 1.5)

    halo = {"dsa_halo": "halo", "dsa_fused": "fused"}.get(kind, "gather") if kind in GATHER_KINDS else "auto"
    modes = KernelModes(halo=halo, dkv="atomic" if kind == "dsa_gather_atomic" else "auto")
    clock = Clock(device)

    def once() -> tuple[float, float]:
        for x in leaves:
            x.grad = None
        with _flash_only() if kind == "dense" else contextlib.nullcontext():
            a = clock.mark()
            out = forward()
            b = clock.mark()
            out.backward(dout.reshape(out.shape))
            c = clock.mark()
        return clock.seconds(a, b), clock.seconds(b, c)

    base = reset_peak(device)
    warm = once()
    peak = peak_since(device, base)
    n = reps if sum(warm) < 1.0 else min(reps, 1)
    runs = [once() for _ in range(n)] or [warm]  # reps=0 (smoke): the warm-up is the measurement
    fwd_s, bwd_s = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    ff, fb = attention_flops(kind, N, K, nh, d)
    return {"kind": kind, "grid": list(grid), "tokens": N, "window": list(window), "K": K, "heads": nh, "head_dim": d,
            "fwd_ms": fwd_s * 1e3, "bwd_ms": bwd_s * 1e3, "fwd_tflops": ff / fwd_s / 1e12,
            "bwd_tflops": fb / bwd_s / 1e12, "peak_mib": peak / 2**20 if peak is not None else None,
            "reps": n, "status": "ok",
            "backend": {"dense": "sdpa-flash", "dsa_gather": "triton gather, dk/dv pulled",
                        "dsa_gather_atomic": "triton gather, dk/dv by atomics",
                        "dsa_gather_split": "triton gather, dk/dv split: pulled, 5% of queries by atomics",
                        "dsa_halo": "triton halo (tensor cores), dk/dv pulled",
                        "dsa_fused": "fused halo-dense forward and backward (Gluon) where they may run, else auto"}.get(
                kind, "triton auto (halo or gather per pass by the cost model), dk/dv pulled")}


@contextlib.contextmanager
def _flash_only():
    """Restrict SDPA to the FlashAttention backend (an error if it cannot run)."""

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        yield


def crossover(rows: list[dict], window, key: str) -> dict:
    """Tokens where dense (flash) becomes slower than DSA, by ``key`` (``fwd_ms``, ``bwd_ms`` or
    ``total_ms``): log-log interpolation of time(dense)/time(dsa) between measured grids;
    past the largest grid extrapolated with the ratio growing like N (dense N^2, DSA N)."""
    def t(r):
        return r["fwd_ms"] + r["bwd_ms"] if key == "total_ms" else r[key]

    dense = {r["tokens"]: t(r) for r in rows if r["kind"] == "dense" and r["status"] == "ok"}
    dsa = {r["tokens"]: t(r) for r in rows if r["kind"] == "dsa" and r["status"] == "ok" and r["window"] == list(window)}
    pts = sorted((n, dense[n] / dsa[n]) for n in dense.keys() & dsa.keys())
    if not pts:
        return {"tokens": None, "how": "not measured"}
    if pts[0][1] >= 1:
        return {"tokens": pts[0][0], "how": f"dense already slower at the smallest grid (x{pts[0][1]:.2f})"}
    for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
        if r1 >= 1:
            f = math.log(1 / r0) / math.log(r1 / r0)
            return {"tokens": round(math.exp(math.log(n0) + f * math.log(n1 / n0))), "how": "interpolated"}
    n, r = pts[-1]
    return {"tokens": round(n / r), "how": f"extrapolated from {n} tokens (dense/dsa x{r:.2f})"}


def part_attention(ctx: Run) -> dict:

    sz, dev = ctx.sizes, ctx.device
    rows: list[dict] = []
    slow: set[tuple] = set()
    plan = []
    for g, grid in enumerate(sz.attn_grids):
        plan.append(("dense", grid, sz.attn_windows[0]))
        for window in sz.attn_windows:
            plan += [(kind, grid, window) for kind in ("dsa", *GATHER_KINDS, "neighborhood")
                     if (g == 0 or kind not in sz.attn_first_grid_only)
                     and (kind != "dsa_fused" or str(dev).startswith("cuda"))]  # the fused kernel: a GPU's
    for kind, grid, window in plan:
        key = (kind, tuple(window) if kind != "dense" else None)
        base = {"kind": kind, "grid": list(grid), "tokens": math.prod(grid), "window": list(window),
                "K": math.prod(window)}
        if ctx.past_deadline():
            rows.append({**base, "status": "skipped: time budget (--budget-s)"})
            continue
        if key in slow:
            rows.append({**base, "status": f"skipped: a smaller grid took over {sz.attn_slow_s} s"})
            continue
        try:
            r = measure_attention(kind, grid, window, sz.attn_heads, sz.attn_dim, dev, sz.attn_reps)
            r["predicted_fwd_ms"], r["predicted_bwd_ms"] = predicted_ms(kind, grid, window, sz.attn_heads, sz.attn_dim)
            if (r["fwd_ms"] + r["bwd_ms"]) / 1e3 > sz.attn_slow_s:
                slow.add(key)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: the other rows still run
            r = {**base, "status": f"error: {type(e).__name__}: {e}"[:300]}
            if ctx.cuda:
                torch.cuda.empty_cache()
        rows.append(r)
        print(attn_line(r), flush=True)
    cross = {f"window {'x'.join(map(str, w))} (K={math.prod(w)})":
             {k: crossover(rows, w, k) for k in ("fwd_ms", "bwd_ms", "total_ms")} for w in sz.attn_windows}
    return {"ok": all(r["status"] == "ok" for r in rows), "heads": sz.attn_heads, "head_dim": sz.attn_dim,
            "dtype": "bfloat16", "rows": rows, "crossover_tokens": cross,
            "flops_rule": "fwd: dense 4 N^2 d nh, dsa/neighborhood 36 N K d nh; bwd = 2.5 x fwd"}
