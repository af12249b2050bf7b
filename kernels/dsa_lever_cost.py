"""What the dense-attention levers cost: ``attention.dense_blocks``, ``attention.dense_above_t`` and
the curriculum ``attention.dense_warmup_steps``, priced with the kernels' cost model
(``dsa_cost.call_breakdown``: DSA per call, and FlashAttention-3 dense on the same tokens).

Per training sample and step, self-attention over ``depth`` blocks costs, per head (a layer
multiplies every figure by its heads, so the ratios hold for any head count):

- pure DSA: ``depth x D`` and dense: ``depth x F``, where ``D`` and ``F`` are one block's call,
  forward + backward, plus the recomputed forward of activation checkpointing (``recompute``: a
  GPU step recomputes every block);
- ``n`` dense blocks: ``n F + (depth - n) D``;
- dense above ``t``: a sample at or above ``t`` runs ``depth x F``, the others the row above; in
  expectation ``p depth F + (1 - p)(n F + (depth - n) D)`` with ``p`` the share of samples the
  trainer draws there (``share_above``: its logit-normal or uniform t, shifted by
  ``training.flow_shift``);
- the curriculum: at steps ``0 < s < N`` every block that is not dense runs both (``F + D``), step
  0 only dense; after ``N``, the rows above.

The ratios say how much of DSA's saving a setting keeps: ``dense / setting`` is what the issue's
"DSA stays >= 5x cheaper than dense" asks of it, and ``budget`` how fast a DSA call must be
(against FA3's) for a setting to keep 5x: a setting whose dense part alone is a fifth of dense's
time (a fifth of the blocks, of the samples, or any curriculum step) never does.
"""

from __future__ import annotations

import json
import math

from .dsa_cost import CHIPS, call_breakdown
from .dsa_fused_cost import fused_compiled

WAN_GRIDS = {"480p": (21, 30, 52), "720p": (21, 45, 80)}
"""Wan's token grids: 81 frames of 480 x 832 and 720 x 1280 through the 4x8x8 VAE and 1x2x2 patches."""


def share_above(t: float, t_sampling: str = "logit_normal", shift: float = 1.0) -> float:
    """P(a training sample's t >= ``t``): ``t_sampling`` (``uniform``, or ``logit_normal``: the
    sigmoid of a standard normal) shifted by ``shift`` (``s u / (1 + (s - 1) u)``), as
    ``megaslide_ray.training.flow`` draws it (``1 - base_cdf(t)``; tests hold the two equal)."""
    if t <= 0.0:
        return 1.0
    if t >= 1.0:
        return 0.0
    u = t / (shift - (shift - 1.0) * t)  # the unshifted time that shifts to t
    if t_sampling == "uniform":
        return 1.0 - u
    if t_sampling != "logit_normal":
        raise ValueError(f"t_sampling={t_sampling!r} is not 'uniform' or 'logit_normal'")
    z = math.log(u / (1.0 - u))
    return 0.5 * math.erfc(z / math.sqrt(2.0))


def lever_ms(dsa_ms: float, fa3_ms: float, depth: int, dense_blocks: int = 0, dense_share: float = 0.0,
             warmup: bool = False) -> float:
    """One sample's self-attention per step over ``depth`` blocks (per head), from one block's DSA
    and FA3 call times: ``dense_blocks`` of them dense, a ``dense_share`` of samples dense in
    every block, and with ``warmup`` (a curriculum step ``0 < s < N``) both kinds in every other block."""
    if not 0 <= dense_blocks <= depth:
        raise ValueError(f"{dense_blocks} dense blocks of {depth}")
    if not 0.0 <= dense_share <= 1.0:
        raise ValueError(f"dense share {dense_share} is not in [0, 1]")
    other = dsa_ms + fa3_ms if warmup else dsa_ms
    mixed = dense_blocks * fa3_ms + (depth - dense_blocks) * other
    return dense_share * depth * fa3_ms + (1.0 - dense_share) * mixed


def budget(fa3_ms: float, depth: int, dense_blocks: int = 0, dense_share: float = 0.0, warmup: bool = False,
           times: float = 5.0) -> float | None:
    """The largest DSA call time, as a fraction of FA3's, at which a setting stays ``times`` cheaper
    than dense (None: not at any, its dense part alone costs more). ``lever_ms`` is linear in the
    DSA time, so this is where that line meets ``depth x FA3 / times``."""
    fixed = lever_ms(0.0, fa3_ms, depth, dense_blocks, dense_share, warmup)
    slope = lever_ms(1.0, fa3_ms, depth, dense_blocks, dense_share, warmup) - fixed
    room = depth * fa3_ms / times - fixed
    if room <= 0 or slope <= 0:
        return None
    return room / slope / fa3_ms


def lever_table(grid, window, head_dim: int, bound: float, depth: int, settings: list[dict],
                chip=CHIPS[0], t_sampling: str = "logit_normal", shift: float = 1.0, recompute: bool = True,
                kernels: str = "auto") -> dict:
    """Each setting (``{"dense_blocks": n, "dense_above_t": t, "warmup": bool}``, any omitted: off)
    priced at ``grid``: its attention ms per sample and step (per head) and its ratio to pure DSA
    and to dense (``dense / setting``: how many times cheaper than dense it stays). ``kernels``:
    ``auto``, the kernels ``auto`` picks today; ``fused``, the compiled fused halo-dense pair
    (``dsa_fused_cost.fused_compiled``: priced from their sm_90 compiles, never run; opt-in)."""
    b = call_breakdown(grid, window, head_dim, bound, chip=chip)
    if kernels == "fused":
        b = fused_compiled(grid, window, head_dim, bound, chip)
        if b is None:
            raise ValueError(f"the fused kernels were compiled at window 3x7x7 only (issue table); --window "
                             f"{'x'.join(map(str, window))} has no price for them: use --kernels auto")
    again = 1.0 if recompute else 0.0  # activation checkpointing runs each forward twice
    dsa = b["dsa_ms"]["total"] + again * b["dsa_ms"]["fwd"]
    fa3 = b["fa3_ms"]["total"] + again * b["fa3_ms"]["fwd"]
    pure, dense = depth * dsa, depth * fa3
    rows = []
    for s in settings:
        t = s.get("dense_above_t", 0.0)
        share = share_above(t, t_sampling, shift) if t > 0 else 0.0
        args = (depth, s.get("dense_blocks", 0), share, s.get("warmup", False))
        ms = lever_ms(dsa, fa3, *args)
        rows.append({**s, "dense_share": share, "ms": ms, "vs_dsa": ms / pure, "dense_over": dense / ms,
                     "budget_5x": budget(fa3, *args)})
    return {"grid": list(grid), "window": list(window), "head_dim": head_dim, "bound": bound, "depth": depth,
            "chip": chip.name, "t_sampling": t_sampling, "flow_shift": shift, "recompute": recompute, "kernels": kernels,
            "block_dsa_ms": dsa, "block_fa3_ms": fa3, "dsa_ms": pure, "dense_ms": dense, "rows": rows}


def _settings(dense_blocks: str, dense_above_t: str, warmup: bool) -> list[dict]:
    """The table's rows: pure DSA, each dense-block count, each time, and the curriculum."""
    rows = [{}]
    rows += [{"dense_blocks": int(n)} for n in dense_blocks.split(",") if n.strip()]
    rows += [{"dense_above_t": float(t)} for t in dense_above_t.split(",") if t.strip()]
    if warmup:
        rows.append({"warmup": True})
    return rows


def _label(row: dict) -> str:
    parts = [f"{row['dense_blocks']} dense blocks" if "dense_blocks" in row else "",
             f"dense above t={row['dense_above_t']:g} ({row['dense_share']:.1%} of samples)"
             if "dense_above_t" in row else "", "curriculum, 0 < s < N" if row.get("warmup") else ""]
    return ", ".join(p for p in parts if p) or "pure DSA"


def main(argv=None) -> int:
    """Print each lever's self-attention time per training sample and step (per head), relative to
    pure DSA and to dense (FlashAttention-3), at Wan's 480p and 720p grids (or ``--grid``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kernels.dsa_lever_cost", description=main.__doc__)
    p.add_argument("--grid", default="", help="a token grid TxHxW (default: Wan 480p 21x30x52 and 720p 21x45x80)")
    p.add_argument("--window", default="3x7x7", help="DSA window kt x kh x kw (default 3x7x7)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bound", type=float, default=1.5, help="attention.max_offset (default 1.5, the GPU presets')")
    p.add_argument("--depth", type=int, default=40, help="blocks (default 40: Wan 14B)")
    p.add_argument("--dense-blocks", default="1,2,4", help="dense block counts to price, comma-separated")
    p.add_argument("--dense-above-t", default="0.9,0.75", help="times to price, comma-separated")
    p.add_argument("--no-warmup", action="store_true", help="leave out the curriculum's row")
    p.add_argument("--flow-shift", type=float, default=5.0, help="training.flow_shift (default 5: Wan2.2 A14B's)")
    p.add_argument("--t-sampling", choices=("logit_normal", "uniform"), default="logit_normal")
    p.add_argument("--no-recompute", action="store_true", help="without the recomputed forward (kept graphs)")
    p.add_argument("--chip", choices=[c.name for c in CHIPS], default=CHIPS[0].name)
    p.add_argument("--kernels", choices=("auto", "fused"), default="auto",
                   help="DSA's price: the kernels auto picks (default) or the compiled fused pair (never run)")
    p.add_argument("--json", action="store_true", help="one JSON object per grid instead of the table")
    a = p.parse_args(argv)
    try:
        grids = {a.grid: tuple(int(x) for x in a.grid.split("x"))} if a.grid else WAN_GRIDS
        window = tuple(int(x) for x in a.window.split("x"))
        settings = _settings(a.dense_blocks, a.dense_above_t, not a.no_warmup)
    except ValueError:
        p.error(f"--grid {a.grid!r} / --window {a.window!r} / --dense-blocks {a.dense_blocks!r} / --dense-above-t "
                f"{a.dense_above_t!r}: give integers joined by x, and comma-separated counts and times")
    chip = next(c for c in CHIPS if c.name == a.chip)
    for name, grid in grids.items():
        try:
            r = lever_table(grid, window, a.head_dim, a.bound, a.depth, settings, chip, a.t_sampling, a.flow_shift,
                            not a.no_recompute, a.kernels)
        except ValueError as e:
            p.error(str(e))
        if a.json:
            print(json.dumps({"name": name, **r}))
            continue
        print(f"{name} (grid {'x'.join(map(str, grid))}), {a.depth} blocks, per head and sample: DSA ({a.kernels}) "
              f"{r['block_dsa_ms']:.2f} ms, FA3 {r['block_fa3_ms']:.2f} ms per block call; t {a.t_sampling}, "
              f"shift {a.flow_shift:g}")
        for row in r["rows"]:
            need = "never" if row["budget_5x"] is None else f"DSA <= {row['budget_5x']:.3f} FA3"
            print(f"  {_label(row):<52} {row['ms']:9.1f} ms  {row['vs_dsa']:5.2f}x pure DSA  "
                  f"dense / this {row['dense_over']:5.2f}x  5x needs {need}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
