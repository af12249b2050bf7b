"""The offsets' extent of a finished adaptation study's dsa models: what the GPU kernels would run.

    python -m benchmarks.studies.offset_extent DIR [--kinds dsa dsa+NAME ...] [--threads 1]
        [--predict [--grid 21x30x52] [--window 3x7x7] [--head-dim 128]]

A call's extent is its offsets' largest |offset| over every token, head and sample. The GPU kernels
run a call at its ``attention.max_offset`` (a bounded head's), never at a measured extent; for an
unbounded head (``max_offset`` 0) the backward's split mode scatters by atomics the (query, head)
pairs past 3 tokens, so their share sets its cost. A head's mean |offset| says little about
either: a few large offsets set the extent of the whole call.

This reads ``DIR/runs.jsonl`` and the models ``--out`` saved (``DIR/models``), runs every dsa
model on the study's held-out inputs (``adaptation.evaluate``: each t-bucket's fixed noise) and
prints, per run, each offset head call's extent (median and max over calls, the share of calls
past 1.5, 2 and 3 tokens), the |offset| percentiles, and the share of (query, head) pairs with an
offset past 1, 1.5, 2, 2.5 and 3 (mean and largest over calls: past 3, the backward's split mode
takes atomics for the pairs past the bound it picks). Studies run since this was added record
the same in their runs (``offset_extent``); this gives it for the models of earlier ones.

``--predict`` prices each call on a GPU preset's shape (default Wan 480p: the 21x30x52 token grid,
the 3x7x7 window, head dim 128, bf16) with the cost model (``kernels.dsa_cost.predict_call``): the
kernels "auto" runs at the run's ``attention.max_offset`` (or, unbounded, the gather forward and
the split backward at the key-side pass's cap) and the predicted forward and backward per head on
H100 figures, the split mode priced at the call's own share of (query, head) pairs past the cap. The study's calls
come from a small model (its grid and window), so this is what offsets distributed like these would
cost at the preset's shape, not a measurement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.studies import adaptation as A
from benchmarks.studies.harness import fresh_trainer, motion_manifests
from benchmarks.studies.wan_motion import wan_val_set
from megaslide_ray.evaluation.validation import load_val_set


def extents(folder: Path, kinds: list[str] | None = None, threads: int = 1) -> list[dict]:
    """``[{"kind", "seed", "offset_extent"}]`` for each dsa run of the study in ``folder`` (of
    ``kinds``) whose model it saved."""
    out, studies = [], {}  # per settings: the study's setup and held-out set
    for line in (folder / A.RUNS_FILE).read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        settings, run = rec["settings"], rec["run"]
        kind, seed = run["kind"], run["seed"]
        path = folder / "models" / f"{settings['arch']}_{kind}_seed{seed}.safetensors"
        if A.base_kind(kind) != "dsa" or (kinds and kind not in kinds) or not path.is_file():
            continue
        key = json.dumps(settings, sort_keys=True)
        if key not in studies:
            train, val = motion_manifests(settings["variant"])
            setup = {**{k: settings[k] for k in ("arch", "preset", "window", "overrides", "val_clips")},
                     "train": train, "val": val}
            valset = load_val_set(A.run_config(setup, "dense", seed, settings["steps"]))
            studies[key] = setup, wan_val_set(valset) if settings["arch"] == "wan" else valset
        setup, valset = studies[key]
        cfg = A.run_config(setup, kind, seed, settings["steps"], {**settings["adapt_overrides"], **run.get("spec", {})})
        model = fresh_trainer(cfg, seed, threads).model
        model.load_state_dict(load_file(path))
        out.append({"kind": kind, "seed": seed, "offset_extent": A.evaluate(model, cfg, valset)["offset_extent"],
                    "max_offset": float(cfg.attention.max_offset) or None})
    return out


def price(per_call: list[list[float]], grid, window, head_dim: int, max_offset: float | None) -> dict:
    """The calls of ``per_call`` (``[extent, share past each of adaptation.PAIR_MARKS]``) priced by
    ``kernels.dsa_cost.predict_call``: ``fwd_ms``/``bwd_ms`` (mean per head), ``fwd``/``bwd``
    (each kernel or mode's share of the calls) and, over the calls the key-side pass cannot take
    whole (no bound, or one past its cap: the split mode), ``far`` (their count) with
    ``far_atomic_ms``/``far_bwd_ms`` (the atomic mode's backward and the one auto runs, mean per head)."""
    from kernels.dsa_cost import predict_call  # lazy: imports triton

    fwd_ms, bwd_ms, fwd, bwd, far_atomic, far_auto = [], [], {}, {}, [], []
    for _extent, *shares in per_call:
        by_mark = dict(zip(A.PAIR_MARKS, shares))
        got = predict_call(grid, window, head_dim, by_mark, 2, max_offset)
        (fk, fs), (bk, bs) = got["fwd"], got["bwd"]
        fwd_ms.append(1e3 * fs)
        bwd_ms.append(1e3 * bs)
        fwd[fk] = fwd.get(fk, 0) + 1 / len(per_call)
        mode = bk.split(" at ")[0]
        bwd[mode] = bwd.get(mode, 0) + 1 / len(per_call)
        if "atomic" in got:  # past the key-side pass's cap
            far_atomic.append(1e3 * got["atomic"])
            far_auto.append(1e3 * bs)

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    return {"fwd_ms": mean(fwd_ms), "bwd_ms": mean(bwd_ms), "fwd": fwd, "bwd": bwd, "far": len(far_auto),
            "far_atomic_ms": mean(far_atomic), "far_bwd_ms": mean(far_auto)}


def price_line(priced: dict) -> str:
    """One line on ``price``'s result."""
    mix = "; ".join(f"{p}: " + ", ".join(f"{k} {v:.0%}" for k, v in sorted(priced[p].items())) for p in ("fwd", "bwd"))
    line = (f"predicted per head, forward {priced['fwd_ms']:.2f} ms + backward {priced['bwd_ms']:.2f} ms "
            f"= {priced['fwd_ms'] + priced['bwd_ms']:.2f} ms; calls by kernel, {mix}")
    if priced["far"]:
        line += (f"; the {priced['far']} calls past 3: backward {priced['far_bwd_ms']:.2f} ms against the atomic "
                 f"mode's {priced['far_atomic_ms']:.2f} ms")
    return line


def _dims(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give three positive integers as TxHxW, e.g. 21x30x52")
    return tuple(int(x) for x in parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a study's --out folder")
    p.add_argument("--kinds", nargs="*", default=None, help="run names (default every dsa run with a saved model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--predict", action="store_true",
                   help="price each call with the kernels' cost model at --grid, --window, --head-dim (bf16, H100)")
    p.add_argument("--grid", type=_dims, default=(21, 30, 52), help="token grid TxHxW (default 21x30x52: Wan 480p)")
    p.add_argument("--window", type=_dims, default=(3, 7, 7), help="window kt x kh x kw (default 3x7x7: Wan)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128)")
    a = p.parse_args(argv)
    if a.head_dim <= 0:
        p.error(f"--head-dim {a.head_dim} must be a positive integer (128: every GPU preset's)")
    if any(w % 2 == 0 or w > g for w, g in zip(a.window, a.grid)):
        p.error(f"--window {a.window} must be odd and within --grid {a.grid} on every axis")
    if not (a.folder / A.RUNS_FILE).is_file():
        p.error(f"{a.folder} holds no {A.RUNS_FILE}: give an adaptation study's --out folder")
    torch.set_num_threads(max(1, a.threads))
    found = extents(a.folder, a.kinds, a.threads)
    if not found:
        p.error(f"no dsa run of {a.folder} has a saved model (models/): run the study with --out")
    for r in found:
        print(f"{r['kind']} seed {r['seed']}: {A.extent_line([r['offset_extent']])}")
    for kind in dict.fromkeys(r["kind"] for r in found):
        print(f"{kind}: {A.extent_line([r['offset_extent'] for r in found if r['kind'] == kind])}")
    if a.predict:
        print(f"priced at {'x'.join(map(str, a.grid))}, window {'x'.join(map(str, a.window))}, head dim "
              f"{a.head_dim}, bf16, H100 (kernels.dsa_cost.predict_call):")
        for r in found:
            priced = price(r["offset_extent"]["per_call"], a.grid, a.window, a.head_dim, r["max_offset"])
            print(f"{r['kind']} seed {r['seed']}: {price_line(priced)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
