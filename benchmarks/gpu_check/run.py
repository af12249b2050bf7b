"""The run (parts with deadlines, the report rewritten after every part), its environment and the
markdown summary."""

from __future__ import annotations

import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import compile as compile_aot
from . import cost
from .common import RESERVE_S, Sizes, attn_line
from .common import fmt as _fmt


@dataclass
class Run:
    out: Path
    sizes: Sizes
    device: str
    budget_s: float
    parts: tuple[str, ...]
    start: float = field(default_factory=time.monotonic)
    deadline: float = 0.0
    report: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def device_kind(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def past_deadline(self) -> bool:
        return time.monotonic() > self.deadline

    def run_part(self, name: str, fn) -> dict:
        """Run one part before its deadline (the budget minus what later parts keep); record its
        result or its traceback; rewrite the report before and after."""
        later = self.parts[self.parts.index(name) + 1:]
        end = self.start + self.budget_s
        self.deadline = end - self.sizes.reserve_scale * sum(RESERVE_S[p] for p in later)
        part_start = time.monotonic()
        print(f"== {name}", flush=True)
        if self.sizes.reserve_scale and self.deadline - part_start < 0.5 * RESERVE_S[name]:
            info = {"ok": False, "status": "skipped: time budget (--budget-s)"}
        else:
            self.report["parts"][name] = {"status": "running"}
            self.write()
            try:
                info = fn(self)
            except Exception:
                info = {"ok": False, "error": traceback.format_exc()[-4000:]}
                print(info["error"], file=sys.stderr, flush=True)
        info["seconds"] = round(time.monotonic() - part_start, 1)
        self.report["parts"][name] = info
        self.write()
        return info

    def write(self) -> None:
        self.report["wall_s"] = round(time.monotonic() - self.start, 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=1, default=str))
        (self.out / "gpu_check.md").write_text("\n".join(markdown(self.report)) + "\n")


def environment(device: str) -> dict:

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": device, "cpus": os.cpu_count(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    try:
        import triton  # lazy: may be absent, and --smoke sets TRITON_INTERPRET before its import

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"import failed: {e}"
    if torch.cuda.is_available() and device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for path in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(path):
            env[f"free_gb {path}"] = round(shutil.disk_usage(path).free / 1e9, 1)
    try:

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        env["ulimit_l"] = "unlimited" if soft == resource.RLIM_INFINITY else soft
    except Exception:  # noqa: BLE001
        pass
    return env


def markdown(report: dict) -> list[str]:
    env = report.get("environment", {})
    lines = ["# GPU check (`python -m benchmarks.gpu_check`)", "",
             "- " + ", ".join(f"{k}: {v}" for k, v in env.items()),
             f"- wall time: {report.get('wall_s', 0):.0f} s{' (smoke run, CPU)' if report.get('smoke') else ''}", ""]
    for part, info in report.get("parts", {}).items():
        status = info.get("status") or ("ok" if info.get("ok") else "FAILED")
        lines += [f"## {part}: {status} ({info.get('seconds', '?')} s)", ""]
        if "error" in info:
            lines += ["```", info["error"], "```", ""]
        if part == "correctness" and "results" in info:
            lines += ["| case | dtype | ok | max abs err (out dq dk dv doffsets) | problems |", "|---|---|---|---|---|"]
            for r in info["results"]:
                errs = " ".join(f"{v:.2g}" for v in r.get("max_err", {}).values())
                lines.append(f"| {r['case']} | {r['dtype']} | {'yes' if r['ok'] else 'NO'} | {errs} | "
                             f"{'; '.join(r.get('errors', []))} |")
            lines.append("")
        if part == "pinning" and "checks" in info:
            lines += [f"- {info['bytes'] / 2**30:.2f} GiB in {info['state_root']} ({info['filesystem']}), "
                      f"registered: {info['registered']} in {info['copy_pieces']} pieces "
                      f"({info['register_seconds']} s)",
                      "- H2D GB/s registered / pin_memory / pageable: "
                      f"{info['h2d_registered_gbps']} / {info['h2d_pin_memory_gbps']} / {info['h2d_pageable_gbps']}",
                      "- D2H GB/s registered / pin_memory / pageable: "
                      f"{info['d2h_registered_gbps']} / {info['d2h_pin_memory_gbps']} / {info['d2h_pageable_gbps']}",
                      f"- torch is_pinned() on registered memory: {info.get('torch_is_pinned_on_registered', '-')}",
                      "- checks: " + ", ".join(f"{k} {v}" for k, v in info["checks"].items()), ""]
        if part == "streaming" and "comparisons" in info:
            lines.append(f"Tolerance {info['tolerance']:.3g} ({info['tolerance_rule']}); run-to-run noise "
                         f"{info['noise_update_rel_l2']}.")
            lines += ["", "| variant | step [s] | device peak [MiB] | update rel L2 | step-0 |g|^2 rel | "
                      "loss rel | step-0 loss equal | ok |", "|---|---|---|---|---|---|---|---|"]
            for name, r in info["variants"].items():
                c = info["comparisons"].get(name, {})
                lines.append(f"| {name} | {_fmt(r.get('step_s'), '.3f')} | {r.get('device_peak_mib', '-')} | "
                             f"{_fmt(c.get('update_rel_l2_max'), '.3g')} | {_fmt(c.get('step0_sqnorm_rel_max'), '.3g')} | "
                             f"{_fmt(c.get('loss_rel_max'), '.3g')} | {c.get('step0_loss_bit_equal', '-')} | "
                             f"{c.get('ok', '-') if name != 'on' else 'reference'} |")
            lines.append("")
        if part == "attention" and "rows" in info:
            lines += [f"bf16, B=1, nh={info['heads']}, d={info['head_dim']}; {info['flops_rule']}.", "",
                      "`dsa` and `neighborhood`: the public `triton` path as `auto` runs it (halo or gather per pass "
                      "by the cost model, bound 1.5 and 0); `dsa_gather`: the gather kernel, same offsets, dk/dv by the key-side pass; "
                      "`dsa_gather_atomic`: the same with dk/dv by fp32 atomics; `dsa_gather_split`: unbounded offsets "
                      "with every 20th token's first sample 4 tokens out, dk/dv by the split mode (the key-side pass "
                      "for the rest, atomics for those); `dsa_halo`: the halo kernels "
                      "(the forward and the backward's query side on tensor cores), dk/dv by the key-side pass; "
                      "`dsa_fused` (GPU only): the fused halo-dense forward (Gluon, Triton >= 3.8, sm_90) where it "
                      "runs and passed its first-use check, else auto's; the backward auto's.", "",
                      "Predicted: the cost model (`kernels.dsa_cost`, H100 figures) for the same kernels and shape; "
                      "`dense`: FlashAttention-3's model beside SDPA's flash kernel.", "",
                      "| kind | tokens | window | fwd [ms] | bwd [ms] | predicted fwd [ms] | predicted bwd [ms] "
                      "| fwd TFLOP/s | bwd TFLOP/s | peak [MiB] | status | backend |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            lines += [attn_line(r) for r in info["rows"]]
            lines += ["", "Crossover (dense flash slower than DSA from):"]
            for K, c in info["crossover_tokens"].items():
                lines.append(f"- {K}: " + "; ".join(f"{k} {v['tokens']} ({v['how']})" for k, v in c.items()))
            lines.append("")
        if part == "model" and "runs" in info:
            lines += [f"{info['params'] / 1e9:.2f}B parameters, store {info['store_bytes'] / 1e9:.1f} GB in "
                      f"{info['state_root']} ({info['filesystem']}), init {info.get('store_init_s', '-')} s. "
                      + info.get("note", ""), "",
                      "| run | tokens | step [s] | busy h2d / d2h / compute [s] | H2D GB/s | overlap eff. | "
                      "peak / plan [GB] | TFLOP/s executed | MFU | HFU |", "|---|---|---|---|---|---|---|---|---|---|"]
            for name, r in info["runs"].items():
                if r.get("status") != "ok":
                    lines.append(f"| {name} | {r.get('status')} |||||||")
                    continue
                b = r["busy_s"]
                lines.append(f"| {name} | {r['tokens']} | {r['step_s']:.3f} | {b['h2d']:.3f} / {b['d2h']:.3f} / "
                             f"{b['compute']:.3f} | {_fmt(r['h2d_gbps'], '.1f')} | {_fmt(r['overlap_efficiency'], '.2f')} | "
                             f"{r['peak_bytes'] / 1e9:.1f} / {r['plan_device_bytes'] / 1e9:.1f} | {r['tflops']:.1f} | "
                             f"{_fmt(r['mfu'], '.3f')} | {_fmt(r['hfu'], '.3f')} |")
            lines.append("")
        if part == "compile" and "records" in info:
            recs = [compile_aot.Record(**r) for r in info["records"]]
            lines += [f"Every kernel config compiled ahead of time for {', '.join(info['archs'])} "
                      f"({info['wall_s']} s; `--compile-only`):", "", *compile_aot.table(recs), "",
                      "Predicted (cost model, benchmarks/gpu_check/cost.py) beside the `attention` part's "
                      "measurements:", "", *cost.table(info["predictions"]), ""]
        if part == "speedup" and "speedup" in info:
            lines += [f"fused dsa {info['fused']['seconds'] * 1e3:.2f} ms vs reference "
                      f"{info['reference']['seconds'] * 1e3:.2f} ms at {info['tokens']} tokens: "
                      f"**x{info['speedup']:.1f}** (goal >= x{info['goal']:.0f}).", ""]
    return lines


