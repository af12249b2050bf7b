"""The prepared GPU check runs on a bare machine: ``python -m benchmarks.gpu_check --smoke`` in a
child process where ray, decord, av and diffusers cannot be imported (the GPU machine has none
of them), every part on the CPU at tiny sizes, the Triton kernels interpreted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "decord", "av", "diffusers")

CHILD = """
import runpy, sys

BLOCKED = {blocked!r}

class Unimportable:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed on the GPU machine")
        return None

sys.meta_path.insert(0, Unimportable())
for name in list(sys.modules):
    if name.split(".")[0] in BLOCKED:
        del sys.modules[name]
sys.argv = ["benchmarks.gpu_check", "--smoke", "--out", sys.argv[1]]
try:
    runpy.run_module("benchmarks.gpu_check", run_name="__main__", alter_sys=True)
finally:
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    print("LEAKED", leaked, flush=True)
"""


@pytest.mark.core  # CI runs it every time: the script a lent GPU runs
@pytest.mark.slow  # about 3 min on 2 cores: a fresh process of the GPU script on CPU, its kernels interpreted
@pytest.mark.child_process
def test_gpu_check_smoke_runs_without_ray_decord_av_diffusers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD.format(blocked=BLOCKED), str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "LEAKED []" in proc.stdout
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert (tmp_path / "out" / "gpu_check.md").is_file()
    parts = report["parts"]
    assert list(parts) == ["correctness", "pinning", "streaming", "attention", "model", "speedup", "compile"]
    assert report["smoke"] and report["ok"] and all(p["ok"] for p in parts.values())
    assert "skipped" not in json.dumps(parts)  # the smoke has no time budget: every part and row ran

    assert any("identity" in r["case"] for r in parts["correctness"]["results"])
    halo = [r for r in parts["correctness"]["results"] if r["case"].endswith("[halo]")]
    bounded = [r for r in halo if "within 0.9" in r["case"]]
    assert bounded and all(r["kernel"] == "halo" for r in bounded)  # a bound: the halo kernels ran
    assert all(r["kernel"].startswith("gather (no bound") for r in halo if r not in bounded)
    pin = parts["pinning"]
    assert pin["copy_pieces"] == pin["bytes"] // pin["piece_bytes"] > 1
    assert all(pin["checks"].values())
    for key in ("h2d_registered_gbps", "h2d_pin_memory_gbps", "h2d_pageable_gbps", "d2h_registered_gbps"):
        assert pin[key] > 0

    stream = parts["streaming"]
    assert set(stream["comparisons"]) == {"on_again", "off", "on_offload", "on_device_shards"}
    for c in stream["comparisons"].values():  # the CPU is deterministic: equal, well inside the tolerance
        assert c["params_bit_equal"] and c["update_rel_l2_max"] == 0.0 and c["step0_loss_bit_equal"]
    assert 0 < stream["tolerance"] < 0.2

    attn = parts["attention"]
    kinds = {(r["kind"], r["tokens"]) for r in attn["rows"]}
    assert {"dense", "dsa", "dsa_gather", "dsa_gather_atomic", "dsa_gather_split", "dsa_halo", "neighborhood"} == {k for k, _ in kinds} and len({n for _, n in kinds}) == 2
    for kind in ("dsa_gather", "dsa_gather_atomic", "dsa_gather_split", "dsa_halo", "neighborhood"):
        assert {n for k, n in kinds if k == kind} == {27}  # the smoke: the second grid only for the crossover
    for r in attn["rows"]:
        assert r["status"] == "ok" and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwd_tflops"] > 0
        assert r["predicted_fwd_ms"] > 0 and r["predicted_bwd_ms"] > 0  # the cost model beside each measurement
    assert all({"fwd_ms", "bwd_ms", "total_ms"} == set(c) for c in attn["crossover_tokens"].values())

    model = parts["model"]
    assert set(model["runs"]) == {"long_on", "long_off", "short_on", "short_off"}
    for r in model["runs"].values():
        for key in ("step_s", "busy_s", "peak_bytes", "plan_device_bytes", "peak_vs_plan", "plan_flops", "tflops",
                    "mfu", "hfu", "setup_s", "h2d_gbps", "overlap_efficiency"):
            assert key in r
        assert r["step_s"] > 0 and r["plan_flops"] > 0
    assert parts["speedup"]["speedup"] > 0

    aot = parts["compile"]  # the compile-only table beside the measurements (smoke: the first shape)
    assert aot["archs"] == ["sm_90"] and aot["records"] and all(r["ok"] for r in aot["records"])
    assert {r["kernel"] for r in aot["records"]} == {"gather_fwd", "gather_bwd_pull", "gather_bwd_atomic", "gather_bwd_split",
                                                      "pull_dk", "pull_dv", "halo_scores", "halo_out", "halo_bwd_v",
                                                      "halo_bwd_k", "halo_dq"}
    assert aot["predictions"] and "Predicted (cost model" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_the_gpu_check_names_everything_it_lacks_up_front(monkeypatch, capsys):
    from benchmarks.gpu_check import requirements

    installed = {"torch": "2.13.0+cpu", "triton": "3.1.0", "numpy": "2.4.6", "safetensors": None}
    monkeypatch.setattr(requirements, "_version", installed.get)
    monkeypatch.setattr(requirements.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert requirements.missing(["--out", "x"]) == [
        "triton >= 3.2 (tl.gather, in the DSA kernels): 3.1.0 is installed",
        "safetensors >= 0.4 (the checkpoint format): not installed",
        "a C compiler (Triton builds its CUDA launcher with it): none of cc, gcc, clang is on PATH and CC is not set",
    ]
    # The interpreter (--smoke) and --compile-only need no C compiler.
    assert len(requirements.missing(["--smoke", "--out", "x"])) == 2
    assert len(requirements.missing(["--compile-only"])) == 2
    with pytest.raises(SystemExit) as exit_:
        requirements.exit_if_missing(["--out", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "nothing was run" in err and "safetensors >= 0.4" in err and "C compiler" in err


def test_the_gpu_check_finds_what_this_machine_has():
    from benchmarks.gpu_check import requirements

    assert requirements.missing(["--smoke"]) == []  # the test environment has all four packages
    assert requirements._numbers("2.13.0+cpu") == (2, 13, 0) and requirements._numbers("3.2") == (3, 2)
