"""A Wan block at real width, streamed, against diffusers' WanTransformer3DModel in process.

    python -m benchmarks.wan [--depth 2] [--grid 3,16,16] [--steps 4] [--attention dense] [--clock wall|cpu] [--json]
    python -m benchmarks.wan --data-wait [--steps 8]

The model has the Wan2.1 T2V 1.3B widths (dim 1536, 12 heads, FFN 8960, text 4096, 16 latent
channels, patch 1x2x2) but ``--depth`` blocks and a small latent clip, so it runs on a CPU. Rows,
all fp32, forward + backward of one batch (B=1, 512 text tokens):

    diffusers      ``WanTransformer3DModel`` in process (the reference; no optimizer)
    diffusers + AdamW  the same and ``torch.optim.AdamW(fused=True)`` on its parameters: a whole
                   training step in process, as a user's own loop runs it
    ours           ``megaslide_ray.models.wan``'s model in process, the same weights (no optimizer)
    streamed       the compute actor over a parameter store in this process: each shard's flat
                   weights fetched per use, blocks recomputed in the backward (activation
                   checkpointing), every shard's gradient returned to the store, which runs
                   AdamW between the steps (not timed: ``StepResult.seconds`` is the compute);
                   the store holds its own seeded weights (the time does not depend on values)
    streamed, kept graphs  the same with ``runtime.recompute_blocks = false``: a CPU compute
                   reading the weights in place keeps each block's graph from the forward, so the
                   backward computes no forward again (what a CPU run does; a GPU recomputes)
    ... + AdamW    each streamed row again, timed to the end of the store's AdamW (``wait_step``):
                   the whole step, to hold against ``diffusers + AdamW`` (``ratio_vs_adamw``)

``--data-wait`` instead trains the same model through the main job's Ray actors on a latent
manifest of random clips (bf16 latents of ``--grid``, 120 valid text tokens each, padded to 512)
and reports the share of each step the compute actor waited for the decoder's latent batch.

Ratios are against ``diffusers`` in the same run (see docs/architecture.md, "Measuring"). Each
streamed row runs in its own phase, ``--steps`` steps with one store and compute actor alive, its
steps taking turns with the in-process rows' (a change in load hits them alike); its ratios are
against the in-process rows of its phase. The first step of each row in a phase is a warm-up and
not counted; the figure is the median of the rest (the in-process rows: of both phases).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time

import numpy as np
import torch

WIDTHS = dict(num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
              freq_dim=256, ffn_dim=8960, patch_size=(1, 2, 2))


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def _timed(fn, steps: int, clock: str = "wall") -> float:
    """Median seconds of ``fn`` over ``steps`` calls (the first a warm-up) on ``clock``: ``wall``, or
    ``cpu``, the process's CPU time over all its threads (for a machine others load too)."""
    now = CLOCKS[clock]
    times = []
    for _ in range(steps):
        t0 = now()
        fn()
        times.append(now() - t0)
    return statistics.median(times[1:] or times)


def run(depth: int, grid: tuple[int, int, int], steps: int, attention: str, clock: str = "wall") -> list[dict]:
    from diffusers import WanTransformer3DModel

    from megaslide_ray.config import Config, apply_overrides
    from megaslide_ray.models.wan_diffusers import DiffusersWanTransformer, wan_config_from_diffusers

    torch.manual_seed(0)
    ref = WanTransformer3DModel(num_layers=depth, **WIDTHS).eval()
    F_, H_, W_ = grid
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, F_, H_, W_, generator=g)
    text = torch.randn(1, 512, 4096, generator=g)
    timestep = torch.tensor([500.0])
    weight = torch.randn(1, 16, F_, H_, W_, generator=g)

    def diffusers_step():
        ref.zero_grad(set_to_none=True)
        (ref(latents, timestep, text, return_dict=False)[0] * weight).sum().backward()

    cfg = Config()
    apply_overrides(cfg, wan_config_from_diffusers(dict(ref.config)))
    apply_overrides(cfg, {"attention.kind": attention, "attention.window": "3,7,7" if attention != "dense" else "3,3,3",
                          "data.num_frames": 4 * (F_ - 1) + 1, "data.height": 8 * H_, "data.width": 8 * W_,
                          "data.batch_size": 1, "training.steps": steps, "optim.lr": 1e-5})
    ours = DiffusersWanTransformer(cfg)
    ours.load_state_dict(ref.state_dict(), strict=attention != "dsa")

    ref_opt = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref_opt.parameters(), lr=1e-5, fused=True)

    def diffusers_adamw_step():
        opt.zero_grad(set_to_none=True)
        (ref_opt(latents, timestep, text, return_dict=False)[0] * weight).sum().backward()
        opt.step()

    def ours_step():
        ours.zero_grad(set_to_none=True)
        (ours(latents, timestep, text) * weight).sum().backward()

    batch = {"latents": latents[0].permute(1, 2, 3, 0).numpy()[None], "text": text.numpy(),
             "text_len": np.array([512], dtype=np.int32), "position": 0}
    in_process = {"diffusers": diffusers_step, "diffusers + AdamW": diffusers_adamw_step, "ours": ours_step}
    times: dict[str, list[float]] = {name: [] for name in in_process}
    rows = []
    with tempfile.TemporaryDirectory(prefix="megaslide-wan-bench-") as tmp:
        for name, recompute in (("streamed", True), ("streamed, kept graphs", False)):
            c = copy.deepcopy(cfg)
            c.runtime.recompute_blocks, c.runtime.state_dir = recompute, f"{tmp}/{len(rows)}"
            phase = _phase(c, name, steps, clock, batch, in_process)
            mid = {k: statistics.median(ts[1:] or ts) for k, ts in phase.items()}
            for k in in_process:
                times[k] += phase[k][1:] or phase[k]
            rows += [{"row": name, "seconds": mid[name], "ratio": mid[name] / mid["diffusers"]},
                     {"row": f"{name} + AdamW", "seconds": mid[f"{name} + AdamW"],
                      "ratio": mid[f"{name} + AdamW"] / mid["diffusers"],
                      "ratio_vs_adamw": mid[f"{name} + AdamW"] / mid["diffusers + AdamW"]}]
    mid = {k: statistics.median(ts) for k, ts in times.items()}
    rows = [{"row": k, "seconds": mid[k], "ratio": mid[k] / mid["diffusers"]} for k in in_process] + rows
    rows[1]["ratio_vs_adamw"] = 1.0
    tokens = F_ * (H_ // 2) * (W_ // 2)
    for r in rows:
        r.update(depth=depth, tokens=tokens, attention=attention, clock=clock,
                 params=sum(p.numel() for p in ref.parameters()))
    return rows


def _phase(cfg, name: str, steps: int, clock: str, batch: dict, in_process: dict) -> dict[str, list[float]]:
    """One streamed row: a parameter store and a compute actor in this process for ``steps`` steps,
    each step taking turns with the ``in_process`` rows (a change in load hits them alike). One
    pair alive at a time: with a second pair training beside it (in turns) the first's compute
    took 2x and its AdamW 15x here, which the product, each actor its own process, never sees.
    Returns each row's times: ``name`` the compute, ``name + AdamW`` to the end of the update."""
    from actors.compute import ComputeActor, LocalStoreClient  # lazy: like run's imports, loaded only when a row runs
    from actors.param_store import ParameterStore  # lazy: like run's imports, loaded only when a row runs

    times: dict[str, list[float]] = {k: [] for k in (*in_process, name, f"{name} + AdamW")}
    store = ParameterStore(cfg, f"{cfg.runtime.state_dir}/run")
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        for step in range(steps):
            for k, fn in in_process.items():
                times[k].append(_timed(fn, 1, clock))
            t0 = CLOCKS[clock]()
            r = compute.train_step(batch, step)
            times[name].append(r.seconds if clock == "wall" else CLOCKS[clock]() - t0)
            store.wait_step(step)  # the store's AdamW: outside the compute row, inside the step row
            times[f"{name} + AdamW"].append(CLOCKS[clock]() - t0)
    finally:
        compute.close()
        store.close()
    return times


def data_wait(depth: int, grid: tuple[int, int, int], steps: int, clips: int = 16) -> dict:
    """Mean data wait / step time of the main job (Ray actors) training on latents."""
    import ray
    from diffusers import WanTransformer3DModel

    from megaslide_ray.config import build_config
    from megaslide_ray.data.latents import save_tensor_file, write_latent_manifest
    from megaslide_ray.driver import Trainer
    from megaslide_ray.models.wan_diffusers import wan_config_from_diffusers

    with torch.device("meta"):
        model = wan_config_from_diffusers(dict(WanTransformer3DModel(num_layers=depth, **WIDTHS).config))
    F_, H_, W_ = grid
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="megaslide-wan-data-") as tmp:
        rows = []
        for i in range(clips):
            save_tensor_file(f"{tmp}/latents/{i}.safetensors", "latents",
                             torch.randn(F_, H_, W_, 16, generator=g).to(torch.bfloat16))
            save_tensor_file(f"{tmp}/text/{i}.safetensors", "text", torch.randn(120, 4096, generator=g).to(torch.bfloat16))
            rows.append({"latent_path": f"latents/{i}.safetensors", "text_path": f"text/{i}.safetensors",
                         "caption": f"clip {i}", "latent_shape": [F_, H_, W_, 16], "text_len": 120,
                         "dtype": "bfloat16"})
        manifest = write_latent_manifest(rows, {"latents_mean": [0.0] * 16, "latents_std": [1.0] * 16,
                                                "compression": [4, 8, 8], "latent_channels": 16, "text_dim": 4096},
                                         f"{tmp}/manifest.parquet")
        cfg = build_config("wan2.1-t2v-1.3b", None, {
            **model, "data.manifest": str(manifest), "data.num_frames": 4 * (F_ - 1) + 1, "data.height": 8 * H_,
            "data.width": 8 * W_, "data.batch_size": 1, "attention.kind": "dense", "training.steps": steps,
            "training.log_every": steps, "runtime.state_dir": tmp})
        ray.init(address="local", include_dashboard=False, namespace="megaslide", logging_level="ERROR")
        try:
            trainer = Trainer(cfg, run_dir=f"{tmp}/run", progress=False)
            try:
                trainer.train()
            finally:
                trainer.close()
            metrics = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
        finally:
            ray.shutdown()
    timed = metrics[1:] or metrics  # the first step includes start-up
    wait = sum(r["data_wait_seconds"] for r in timed)
    total = sum(r["step_seconds"] for r in timed)
    return {"row": "data_wait", "steps": len(timed), "data_wait_fraction": wait / total,
            "step_seconds": total / len(timed), "depth": depth, "grid": list(grid)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wan", description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--grid", default="3,16,16", help="latent frames,height,width (patch 1x2x2 halves H and W)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--attention", default="dense", choices=["dense", "neighborhood", "dsa"],
                   help="our self-attention in the ours/streamed rows (diffusers is always dense)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--data-wait", action="store_true", help="measure the data wait of training on latents instead")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or the process's CPU time (every thread; for a machine others load too)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.data_wait:
        r = data_wait(a.depth, tuple(int(x) for x in a.grid.split(",")), a.steps)
        print(json.dumps(r) if a.json else f"training on latents through the Ray actors: data wait "
              f"{100 * r['data_wait_fraction']:.1f}% of {r['step_seconds']:.2f} s/step over {r['steps']} steps")
        return 0
    rows = run(a.depth, tuple(int(x) for x in a.grid.split(",")), a.steps, a.attention, a.clock)
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    r0 = rows[0]
    print(f"Wan 1.3B widths, {r0['depth']} blocks ({r0['params'] / 1e6:.0f}M parameters), {r0['tokens']} video "
          f"tokens + 512 text tokens, fp32, attention {a.attention} (ours/streamed)")
    print(f"{'row':<32}{'s/step':>10}{'vs diffusers':>15}{'vs diffusers + AdamW':>23}")
    for r in rows:
        step = f"{r['ratio_vs_adamw']:>22.2f}x" if "ratio_vs_adamw" in r else ""
        print(f"{r['row']:<32}{r['seconds']:>10.3f}{r['ratio']:>14.2f}x{step}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
