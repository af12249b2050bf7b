"""Part 3, ``streaming``: the compute actor with overlap on, on again, off, offloaded and with two
device shards (``runtime.device_shards``: shard 0 and block 1 updated by CUDA's fused AdamW on the
device, the rest by the store's on the host), compared within the tolerance derived in the package
docstring (``benchmarks/gpu_check/__main__.py``)."""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING

import torch

from actors.compute import ComputeActor, LocalStoreClient
from actors.param_store import ParameterStore
from megaslide_ray.config import build_config

from .common import state_root, synthetic_batches, w_dtype_for

if TYPE_CHECKING:
    from .run import Run


def streaming_tolerance(depth: int) -> float:
    """The relative L2 bound of the module docstring: 2 (L + 2) 2^-7."""
    return 2 * (depth + 2) * 2.0 ** -7


def part_streaming(ctx: Run) -> dict:


    sz, dev = ctx.sizes, ctx.device
    steps = sz.stream_steps

    class Recorder(LocalStoreClient):
        """The in-process client, keeping every reported squared norm: (shard, step) -> value."""

        def __init__(self, store):
            super().__init__(store)
            self.sqnorms: dict[tuple[int, int], float] = {}

        def report_grad(self, shard, step, sqnorm, grad):
            self.sqnorms[(shard, step)] = sqnorm
            super().report_grad(shard, step, sqnorm, grad)

    # (name, overlap, offloaded block inputs, device shards: shard 0 and block 1 updated on the device)
    variants = (("on", True, False, 0), ("on_again", True, False, 0), ("off", False, False, 0),
                ("on_offload", True, True, 0), ("on_device_shards", True, False, 2))
    results, masters, init, norms = {}, {}, None, {}
    tmp = tempfile.mkdtemp(prefix="megaslide-gpu-stream-", dir=state_root(1 << 30)[0])
    try:
        for name, overlap, offload, on_device in variants:
            if ctx.past_deadline():
                results[name] = {"status": "skipped: time budget (--budget-s)"}
                continue
            cfg = build_config("tiny", None, {
                **sz.stream, "training.steps": 100, "runtime.overlap": overlap,
                "runtime.offload_activations": offload, "runtime.prefetch_depth": 2, "runtime.state_dir": tmp,
                "runtime.device_shards": on_device,
                "runtime.device": ctx.device_kind, "optim.lr": 0.1, "optim.eps": 1.0, "optim.weight_decay": 0.0,
                "optim.schedule": "constant", "optim.warmup_steps": 0, "optim.grad_clip": 1.0})
            batches = synthetic_batches(cfg, steps, seed=1)
            store = ParameterStore(cfg, f"{tmp}/run-{name}", w_dtype_for(dev), adamw="fused")
            client = Recorder(store)
            rows = []
            try:
                compute = ComputeActor(cfg, store.shard_infos(), client, "shm")
                try:
                    if init is None:
                        init = [seg["master"].clone() for seg in store.seg]
                    for k in range(steps):
                        t0 = time.perf_counter()
                        r = compute.train_step(batches[k], k)
                        store.wait_step(k)
                        rows.append((time.perf_counter() - t0, r))
                    if on_device:  # the device shards' state back into the store, as before a checkpoint
                        store.put_device_state(*compute.device_state())
                    masters[name] = [seg["master"].clone() for seg in store.seg]
                    norms[name] = dict(client.sqnorms)
                finally:
                    compute.close()
            except Exception as e:  # noqa: BLE001 - one variant's failure must not hide the others'
                results[name] = {"status": f"error: {type(e).__name__}: {e}"[:300],
                                 "traceback": traceback.format_exc()[-2000:]}
                print(results[name]["traceback"], file=sys.stderr, flush=True)
                continue
            finally:
                store.close()
            timed = rows[1:] or rows
            results[name] = {"status": "ok", "step_s": statistics.median(t for t, _ in timed),
                             "losses": [r.loss for _, r in rows],
                             "device_peak_mib": round(max(r.device_memory_peak_bytes for _, r in rows) / 2**20, 1)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    depth = int(sz.stream["model.depth"])
    tol = streaming_tolerance(depth)
    out = {"tolerance": tol, "tolerance_rule": "2 (L + 2) 2^-7 relative L2 of each shard's update (module docstring)",
           "variants": results}
    if "on" not in masters:
        return {**out, "ok": False, "error": "the reference run (overlap on) did not finish"}
    ref = masters["on"]
    comparisons = {}
    for name in ("on_again", "off", "on_offload", "on_device_shards"):
        if name not in masters:
            comparisons[name] = {"ok": False, "status": results.get(name, {}).get("status", "missing")}
            continue
        update_rel = max(_rel(a, b, i) for a, b, i in zip(masters[name], ref, init))
        norm_rel = max(abs(norms[name][key] - norms["on"][key]) / max(norms["on"][key], 1e-30)
                       for key in norms["on"] if key[1] == 0)
        loss0_equal = results[name]["losses"][0] == results["on"]["losses"][0]
        loss_rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(results[name]["losses"], results["on"]["losses"]))
        finite = all(math.isfinite(x) for x in results[name]["losses"])
        comparisons[name] = {"update_rel_l2_max": update_rel, "step0_sqnorm_rel_max": norm_rel,
                             "loss_rel_max": loss_rel, "step0_loss_bit_equal": loss0_equal,
                             "params_bit_equal": all(torch.equal(a, b) for a, b in zip(masters[name], ref)),
                             "ok": finite and update_rel <= tol and norm_rel <= tol and loss_rel <= tol}
    noise = comparisons.get("on_again", {}).get("update_rel_l2_max")
    for name, c in comparisons.items():
        if noise and "update_rel_l2_max" in c and name != "on_again":
            c["vs_noise"] = c["update_rel_l2_max"] / noise
    out.update(comparisons=comparisons, noise_update_rel_l2=noise,
               speedup_on_vs_off=(results["off"]["step_s"] / results["on"]["step_s"]
                                  if "step_s" in results.get("off", {}) else None),
               ok=all(c["ok"] for c in comparisons.values()))
    return out


def _rel(a, b, init) -> float:
    """||a - b|| / ||b - init||: the difference of two runs relative to the update b made."""

    moved = torch.linalg.vector_norm((b - init).double()).item()
    diff = torch.linalg.vector_norm((a - b).double()).item()
    return diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf)


