"""The cost model's command line (``python -m kernels.dsa_cost``) and its overlap rule.

The figures are predictions (H100/H200 datasheet peaks, issue slots from the sm_90 compile); these
tests check that the command reports what the model computes, that FlashAttention-3's baseline is
the stated formula, and that synchronous tensor-core dots are not credited with overlap they lack."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.dsa_cost import CHIPS, FA3_MFU, Cost, fa3_seconds

ROOT = Path(__file__).resolve().parents[1]


def test_synchronous_dots_overlap_only_across_resident_blocks():
    """A kernel whose dots are waited for by the warps that issue them: at one block per SM (or an
    unknown occupancy) its issue and tensor-core times add; at two blocks they overlap (the larger);
    a kernel without dots is its largest term as before."""
    chip = CHIPS[0]
    issue_s, tc_s = 1e-3, 0.6e-3
    base = dict(kernel="k", tokens=1, K=1, head_dim=128, fma_flops=0.0, tc_flops=tc_s * chip.bf16_tc,
                dram_bytes=0.0, l1_bytes=0.0, atomic_bytes=0.0, issue=issue_s * chip.issue)
    for blocks in (1, None):
        t = Cost(**base, blocks_per_sm=blocks).seconds(chip)
        assert t["bound"] == "issue+tc" and math.isclose(t["seconds"], issue_s + tc_s)
    t = Cost(**base, blocks_per_sm=2).seconds(chip)
    assert t["bound"] == "issue" and math.isclose(t["seconds"], issue_s)
    t = Cost(**{**base, "tc_flops": 0.0}).seconds(chip)
    assert t["bound"] == "issue" and "issue+tc" not in t


def test_fa3_is_the_stated_dense_model():
    chip = CHIPS[0]
    N, d = 21 * 30 * 52, 128
    f = fa3_seconds(N, d, chip)
    assert math.isclose(f["fwd"], 4 * N * N * d / (chip.bf16_tc * FA3_MFU["fwd"]))
    assert math.isclose(f["bwd"], 2.5 * 4 * N * N * d / (chip.bf16_tc * FA3_MFU["bwd"]))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kernels.dsa_cost", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_cli_json_reports_the_picked_kernels_against_fa3(capsys):
    """``python -m kernels.dsa_cost ... --json`` (a fresh process) prints what ``call_breakdown``
    computes: each kernel's time and terms summing to the pass, FA3 on the same tokens, the ratio;
    and, under ``fused``, what ``fused_compiled`` computes for the fused halo-dense kernels."""
    pytest.importorskip("triton")
    from kernels.dsa_cost import call_breakdown, fused_compiled, main

    proc = subprocess.run([sys.executable, "-m", "kernels.dsa_cost", "--grid", "21x30x52", "--window", "3x7x7",
                           "--head-dim", "128", "--bound", "1.5", "--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = call_breakdown((21, 30, 52), (3, 7, 7), 128, 1.5)
    assert got.pop("fused") == json.loads(json.dumps(fused_compiled((21, 30, 52), (3, 7, 7), 128, 1.5)))
    assert got == json.loads(json.dumps(want))  # what the model computes, nothing added
    assert got["how"] == "issue slots from the sm_90 compile"
    for p in ("fwd", "bwd"):
        assert math.isclose(got["dsa_ms"][p], sum(k["ms"] for k in got["kernels"] if k["pass"] == p))
        assert got["kernels"] and all({"ms", "bound_by", "terms_ms"} <= set(k) for k in got["kernels"])
    assert math.isclose(got["ratio"], got["fa3_ms"]["total"] / got["dsa_ms"]["total"])
    assert math.isclose(got["fa3_ms"]["fwd"], 1e3 * fa3_seconds(21 * 30 * 52, 128, CHIPS[0])["fwd"])
    assert main(["--bound", "1.5"]) == 0 and "FA3 / DSA" in capsys.readouterr().out


def test_cli_unbounded_needs_the_far_share_and_refuses_bad_shapes(capsys):
    pytest.importorskip("triton")
    from kernels.dsa_cost import main

    with pytest.raises(SystemExit):
        main(["--bound", "-1", "--json"])
    assert "far_share" in capsys.readouterr().err
    assert main(["--bound", "-1", "--far-share", "0.06", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["modes"] == {"fwd": "gather", "bwd": "split at 3"} and got["bound"] is None
    assert [k["kernel"] for k in got["kernels"]][-1] == "split scatter"
    for bad, word in ((("--grid", "21x30"), "--grid"), (("--window", "3x0x7"), "--window"),
                      (("--head-dim", "0"), "--head-dim"), (("--far-share", "2"), "--far-share")):
        with pytest.raises(SystemExit) as e:
            main(list(bad))
        err = capsys.readouterr().err + str(e.value)
        assert e.value.code != 0 and word in err, (bad, err)


def test_cli_design_prices_the_mirrors_work(capsys):
    """``--design``: the fused halo-dense design estimate, from the mirror's work counts (its tensor-core
    term is the counted MACs at FA3's efficiency; the pass time is its largest term). At window 3x5x5,
    where no Gluon kernel is compiled (at 3x7x7 the compiles replace both rows)."""
    from kernels.dsa_cost import main
    from kernels.dsa_halo_dense import halo_dense_counts

    assert main(["--grid", "5x16x24", "--window", "3x5x5", "--bound", "1.5", "--design", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["design"]
    counts = halo_dense_counts((5, 16, 24), (3, 5, 5), 128, 1.5)
    assert d["counts"] == counts
    tc = 1e3 * 2 * counts["bwd_macs"] / (CHIPS[0].bf16_tc * FA3_MFU["bwd"])
    bwd = d["passes"]["bwd"]
    assert bwd["terms_ms"]["tc"] == pytest.approx(tc) and "design" in bwd["how"]
    assert bwd["ms"] == pytest.approx(max(v for k, v in bwd["terms_ms"].items() if k not in ("tc", "issue")))
    assert d["ratio"] == pytest.approx(d["fa3_ms"]["total"] / d["dsa_ms"]["total"])
    with pytest.raises(SystemExit):
        main(["--bound", "-1", "--far-share", "0.06", "--design"])


def test_the_fused_forward_is_priced_from_its_compile():
    """The Gluon forward's row: issue slots from its sm_90 compile (the issue table's counts at loop
    depths 0 and 1, times the tiles and their halo frames, 256 threads a tile), its dots two 64 x 64 x d
    products per chunk of 64 halo keys and frame; the design row's forward is this row."""
    from kernels.dsa_cost import fused_fwd_cost, halo_dense_design, issue_key, issue_table
    from kernels.dsa_gluon_halo import gluon_halo_constexprs
    from kernels.dsa_halo_dense import halo_tiles

    grid, window = (5, 16, 24), (3, 7, 7)
    cx = gluon_halo_constexprs(128, window, 1.5)
    entry = issue_table().get(issue_key("fused_fwd", 128, window, cx, 8))
    if entry is None:
        pytest.skip("the issue table has no fused forward (a Triton whose Gluon cannot build it)")
    tiles = halo_tiles(grid, window, 1.5, (1, 8, 8))
    frames = sum(t.halo_shape[0] for t in tiles)
    cost = fused_fwd_cost(grid, window, 128, 1.5)
    assert cost.issue == 256 * (len(tiles) * entry["depths"]["0"] + frames * entry["depths"]["1"])
    assert cost.tc_flops == 4 * 64 * cx["NCH"] * 64 * 128 * frames
    d = halo_dense_design(grid, window, 128, 1.5)
    assert d["passes"]["fwd"]["ms"] == pytest.approx(1e3 * cost.seconds(CHIPS[0])["seconds"])
    assert fused_fwd_cost(grid, (3, 5, 5), 128, 1.5) is None  # compiled at the Wan shape only


def test_the_fused_backward_is_priced_from_its_compile(capsys):
    """The Gluon backward's row, as the forward's: issue slots from its sm_90 compile (depths 0 and 1
    times the tiles and their halo frames, 256 threads a tile), seven 64 x 64 x d dots per chunk of 64
    halo keys and frame; the design row's backward is this row, and the command line reports the
    compiled forward and backward against FA3 (JSON key ``fused``)."""
    from kernels.dsa_cost import (
        fused_bwd_cost,
        fused_compiled,
        fused_fwd_cost,
        halo_dense_design,
        issue_key,
        issue_table,
        main,
    )
    from kernels.dsa_gluon_halo import BWD_SAMPLE_CHUNK, gluon_halo_constexprs
    from kernels.dsa_halo_dense import halo_tiles

    grid, window = (5, 16, 24), (3, 7, 7)
    cx = dict(gluon_halo_constexprs(128, window, 1.5), JC=BWD_SAMPLE_CHUNK)
    entry = issue_table().get(issue_key("fused_bwd", 128, window, cx, 8))
    if entry is None:
        pytest.skip("the issue table has no fused backward (a Triton whose Gluon cannot build it)")
    tiles = halo_tiles(grid, window, 1.5, (1, 8, 8))
    frames = sum(t.halo_shape[0] for t in tiles)
    cost = fused_bwd_cost(grid, window, 128, 1.5)
    assert cost.issue == 256 * (len(tiles) * entry["depths"]["0"] + frames * entry["depths"]["1"])
    assert cost.tc_flops == 7 * 2 * 64 * cx["NCH"] * 64 * 128 * frames
    d = halo_dense_design(grid, window, 128, 1.5)
    assert d["passes"]["bwd"]["ms"] == pytest.approx(1e3 * cost.seconds(CHIPS[0])["seconds"])
    assert fused_bwd_cost(grid, (3, 5, 5), 128, 1.5) is None  # compiled at the Wan shape only
    both = fused_compiled(grid, window, 128, 1.5)
    fwd_ms = 1e3 * fused_fwd_cost(grid, window, 128, 1.5).seconds(CHIPS[0])["seconds"]
    assert both["dsa_ms"]["total"] == pytest.approx(fwd_ms + d["passes"]["bwd"]["ms"])
    assert both["ratio"] == pytest.approx(both["fa3_ms"]["total"] / both["dsa_ms"]["total"])
    assert main(["--grid", "5x16x24", "--window", "3x7x7", "--bound", "1.5", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["fused"]
    assert cli["dsa_ms"] == pytest.approx(both["dsa_ms"]) and cli["ratio"] == pytest.approx(both["ratio"])
