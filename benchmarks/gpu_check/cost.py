"""The kernels' cost model: a prediction, from the shapes and the compile, for the first GPU run.

Per kernel and shape (one batch item, one head; a layer multiplies by its heads): the FLOPs it
executes and on which units, the bytes it moves at each level, and the roofline time -- the
largest of (the CUDA cores' lanes -- issue slots counted from the sm_90 compile where the issue
table has the kernel, "issue", else estimated FMA work, "est." --, tensor-core FLOPs / their peak,
DRAM bytes / HBM bandwidth, L1 bytes / L1 bandwidth, atomic bytes / L2 bandwidth) -- on H100 SXM
and H200 figures. Against it: FlashAttention-3 on
the same tokens (dense, ``4 N^2 d`` forward, ``10 N^2 d`` backward, at the MFU its paper
reports: 75% forward, 55% backward of the bf16 peak), and the sparse-video anchors (sliding tile
attention, video sparse attention: block-sparse kernels reaching 58-85% of FA3's MFU), here a
block-sparse kernel attending K keys per query at that fraction of FA3's rate.

The per-kernel work (the gather kernels on CUDA cores, the key-side pass, the halo kernels on
tensor cores) and the chips' figures live in ``kernels/dsa_cost.py``: the dispatcher reads them too
(``dsa_cost.choose_halo``). This module sets them beside FlashAttention-3 and the anchors.

Everything here is a prediction until a GPU run measures it (``python -m benchmarks.gpu_check
--out DIR`` prints both).
"""

from __future__ import annotations

import math
from dataclasses import asdict

from kernels.dsa_cost import (  # noqa: F401 (re-exported)
    CHIPS,
    FA3_MFU,
    Chip,
    Cost,
    gather_costs,
    halo_costs,
    pull_costs,
)
from kernels.dsa_cost import fa3_seconds as flash_seconds

ANCHOR_OF_FA3 = (0.58, 0.85)


def anchor_seconds(tokens: int, K: int, head_dim: int, chip: Chip) -> dict:
    """A block-sparse kernel (sliding tile / video sparse attention) over K keys per query at
    58-85% of FA3's MFU: (best, worst) forward and backward seconds, one head."""
    f = 4.0 * tokens * K * head_dim
    out = {}
    for pass_, mult in (("fwd", 1.0), ("bwd", 2.5)):
        rate = chip.bf16_tc * FA3_MFU[pass_]
        out[pass_] = (mult * f / (rate * ANCHOR_OF_FA3[1]), mult * f / (rate * ANCHOR_OF_FA3[0]))
    return out


def predictions(shapes, heads: dict | None = None) -> list[dict]:
    """One row per (shape, chip, pass): the kernel's roofline time and what bounds it, FA3 dense,
    the anchors, per head and per layer (``heads``: the layer's head count per head dim)."""
    from kernels.dsa_triton_pull import PULL_MAX_OFFSET  # lazy: imports triton (pull_costs does too)

    rows = []
    for s in shapes:
        N = math.prod(s.grid)
        K = math.prod(s.window)
        nh = (heads or {}).get(s.head_dim, 1)
        e = 2 if s.dtype == "bf16" else 4
        costs = list(zip(gather_costs(N, s.window, s.head_dim, e), ("fwd", "bwd")))
        if s.max_offset is not None and s.max_offset <= PULL_MAX_OFFSET:  # the backward mode that runs there
            costs += [(c, "bwd") for c in pull_costs(s.grid, s.window, s.head_dim, s.max_offset, e)]
            if s.dtype != "fp32":  # the halo kernels, at the bound's worst case (every row a group can reach)
                halo = halo_costs(s.grid, s.window, s.head_dim, s.max_offset, dtype_bytes=e)
                costs += [(c, pass_) for pass_ in ("fwd", "bwd") for c in halo[pass_]]
        for chip in CHIPS:
            fl = flash_seconds(N, s.head_dim, chip)
            an = anchor_seconds(N, K, s.head_dim, chip)
            for c, pass_ in costs:
                t = c.seconds(chip)
                rows.append({"shape": s.label, "chip": chip.name, "kernel": c.kernel, "pass": pass_, "heads": nh,
                             "ms_per_layer": 1e3 * t["seconds"] * nh, "bound": t["bound"],
                             "flash_ms_per_layer": 1e3 * fl[pass_] * nh,
                             "anchor_ms_per_layer": [1e3 * x * nh for x in an[pass_]],
                             "vs_flash": fl[pass_] / t["seconds"], "cost": asdict(c),
                             "terms_ms": {k[:-2]: 1e3 * v * nh for k, v in t.items() if k.endswith("_s")}})
    return rows


def table(rows: list[dict]) -> list[str]:
    out = ["| shape | chip | kernel | heads | predicted ms/layer | bound by | lanes / tc / l1 / dram / atomics ms | "
           "FA3 dense ms | anchors ms | dense/DSA |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tm = r["terms_ms"]
        lanes = f"{tm['issue']:.2f} (issue)" if "issue" in tm else f"{tm['fma']:.2f} (est.)"
        out.append(f"| {r['shape']} | {r['chip']} | {r['kernel']} | {r['heads']} | {r['ms_per_layer']:.2f} | "
                   f"{r['bound']} | {lanes} / {tm['tc']:.2f} / {tm['l1']:.2f} / {tm['dram']:.2f} / {tm['atomics']:.2f} | "
                   f"{r['flash_ms_per_layer']:.2f} | {r['anchor_ms_per_layer'][0]:.3g}-{r['anchor_ms_per_layer'][1]:.3g} | "
                   f"x{r['vs_flash']:.2f} |")
    return out


def preset_rows(chip_name: str = "H100") -> list[dict]:
    """The cost model's figure for every GPU preset's attention call (``kernels.dsa_cost.call_breakdown``
    at the preset's token grid, window, head dim and bound, one head): what ``auto`` runs and its
    forward + backward against FlashAttention-3 on the same tokens."""
    from kernels.dsa_cost import call_breakdown  # lazy: imports triton
    from kernels.dsa_fused_cost import halo_dense_design  # lazy: as above
    from megaslide_ray.config.presets import PRESETS

    from .compile import gpu_preset_shapes

    chip = next(c for c in CHIPS if c.name == chip_name)
    rows = []
    for (d, window, grid, bound), names in gpu_preset_shapes().items():
        b = call_breakdown(grid, window, d, bound, chip=chip)
        heads = sorted({PRESETS[n]().model.num_heads for n in names}, reverse=True)  # a call's pairs at batch 1
        g = {h: halo_dense_design(grid, window, d, bound, chip=chip, pairs=h) for h in heads}
        rows.append({"presets": list(names), **{k: b[k] for k in ("grid", "window", "head_dim", "bound", "chip", "how",
                                                                 "modes", "dsa_ms", "fa3_ms", "ratio")},
                     "design_ms": g[heads[0]]["dsa_ms"], "design_ratio": g[heads[0]]["ratio"],
                     "design_by_heads": {h: {"dsa_ms": g[h]["dsa_ms"], "ratio": g[h]["ratio"]} for h in heads}})
    return rows


def _by_heads(by_heads: dict) -> str:
    """``6.6x (40 heads), 5.0x (12 heads)``: the design's ratio per heads count of a row's presets."""
    return ", ".join(f"{v['ratio']:.1f}x ({h} heads)" for h, v in by_heads.items())


def main(argv=None) -> int:
    """``python -m benchmarks.gpu_check.cost [--chip H100|H200] [--json]``: the cost model's figure for
    every GPU preset (``preset_rows``)."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check.cost", description=main.__doc__)
    p.add_argument("--chip", choices=[c.name for c in CHIPS], default="H100")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    rows = preset_rows(a.chip)
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print("| presets | grid | window | bound | kernels (fwd; bwd) | DSA fwd + bwd ms | FA3 fwd + bwd ms | FA3 / DSA | "
          "halo-dense design ms | FA3 / design |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d, f = r["dsa_ms"], r["fa3_ms"]
        print(f"| {', '.join(r['presets'])} | {'x'.join(map(str, r['grid']))} | {'x'.join(map(str, r['window']))} | "
              f"{r['bound']:g} | {r['modes']['fwd']}; {r['modes']['bwd']} | {d['fwd']:.2f} + {d['bwd']:.2f} = "
              f"{d['total']:.2f} | {f['fwd']:.2f} + {f['bwd']:.2f} = {f['total']:.2f} | {r['ratio']:.2f}x | "
              f"{r['design_ms']['total']:.3f} | {_by_heads(r['design_by_heads'])} |")
    print(f"\n{a.chip} figures, one head, bf16; {rows[0]['how'] if rows else 'no GPU preset'}; the halo-dense "
          "columns: kernels.dsa_fused_cost.halo_dense_design, each pass from its Gluon kernel's sm_90 compile where it "
          "exists (d 128, 3x7x7), else the design's assumptions (no kernel of it has run), per head of a call of the "
          "presets' heads at batch 1 (the ms column: the most heads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
