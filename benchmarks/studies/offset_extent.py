"""The offsets' extent of a finished adaptation study's dsa models: what the GPU kernels would run.

    python -m benchmarks.studies.offset_extent DIR [--kinds dsa dsa+NAME ...] [--threads 1]

The GPU kernels take one bound per call: the offsets' largest |offset| over every token, head and
sample of the call (``kernels.dsa_triton_pull.offsets_extent``), or ``attention.max_offset`` where
the head bounds them. That bound picks the halo kernels (tensor cores, up to offsets of 1.5-2 at
Wan's 480p shape), the gather kernels, or, past 3 tokens, the backward's atomic mode. A head's
mean |offset| says little about it: a few large offsets set the bound for all of the call.

This reads ``DIR/runs.jsonl`` and the models ``--out`` saved (``DIR/models``), runs every dsa
model on the study's held-out inputs (``adaptation.evaluate``: each t-bucket's fixed noise) and
prints, per run, each offset head call's extent (median and max over calls, the share of calls
past 1.5, 2 and 3 tokens), the |offset| percentiles, and the share of (query, head) pairs with an
offset past 1, 1.5, 2, 2.5 and 3 (mean and largest over calls: past 3, the backward's split mode
takes atomics for the pairs past the bound it picks). Studies run since this was added record
the same in their runs (``offset_extent``); this gives it for the models of earlier ones.
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
        out.append({"kind": kind, "seed": seed, "offset_extent": A.evaluate(model, cfg, valset)["offset_extent"]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="a study's --out folder")
    p.add_argument("--kinds", nargs="*", default=None, help="run names (default every dsa run with a saved model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    a = p.parse_args(argv)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
