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


def test_asynchronous_dots_hide_only_what_their_warps_issue_meanwhile():
    """``Cost.overlap``: a group of dots running while its warps issue other instructions hides the
    shorter of the two, group by group (the tensor cores' surplus in one group does not hide another's
    instructions); synchronous dots (no groups) hide nothing."""
    chip = CHIPS[0]
    lanes_s, flops_s = 1e-6, 3e-6  # one group: its instructions take a third of its dots' time
    base = dict(kernel="k", tokens=1, K=1, head_dim=128, fma_flops=0.0, tc_flops=4 * flops_s * chip.bf16_tc,
                dram_bytes=0.0, l1_bytes=0.0, atomic_bytes=0.0, issue=10e-6 * chip.issue, blocks_per_sm=1)
    sync = Cost(**base).seconds(chip)
    assert sync["seconds"] == pytest.approx(10e-6 + 12e-6) and "overlap_s" not in sync
    groups = ((3, lanes_s * chip.issue, flops_s * chip.bf16_tc), (1, 5e-6 * chip.issue, flops_s * chip.bf16_tc))
    t = Cost(**base, overlap=groups).seconds(chip)
    assert t["overlap_s"] == pytest.approx(3 * lanes_s + flops_s)  # the first groups' instructions, the last's dots
    assert t["seconds"] == pytest.approx(10e-6 + 12e-6 - 6e-6) and t["bound"] == "issue+tc"


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
    and, under ``fused``, what ``fused_compiled`` computes for the fused halo-dense kernels (their walks
    priced at offsets spread uniformly within the bound, and at zero offsets)."""
    pytest.importorskip("triton")
    from kernels.dsa_cost import call_breakdown, main
    from kernels.dsa_fused_cost import fused_compiled

    proc = subprocess.run([sys.executable, "-m", "kernels.dsa_cost", "--grid", "21x30x52", "--window", "3x7x7",
                           "--head-dim", "128", "--bound", "1.5", "--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    want = call_breakdown((21, 30, 52), (3, 7, 7), 128, 1.5)
    fused = got.pop("fused")
    zero = fused_compiled((21, 30, 52), (3, 7, 7), 128, 1.5, offsets="zero")
    assert fused.pop("at_zero_offsets") == json.loads(json.dumps({"dsa_ms": zero["dsa_ms"], "ratio": zero["ratio"]}))
    assert fused == json.loads(json.dumps(fused_compiled((21, 30, 52), (3, 7, 7), 128, 1.5)))
    assert fused["offsets"] == "uniform" and zero["ratio"] > fused["ratio"]  # fewer samples a walk at zero offsets
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


def _barriers_priced(entry, cost, tiles, grid, cx) -> None:
    """A fused kernel's block-wide barriers: the compile's counts per loop level walked as its instructions
    are (``_walked``), each holding its SM for ``BARRIER_CYCLES`` (one resident block), added to the dots
    and the issue."""
    from kernels.dsa_roofline import BARRIER_CYCLES

    bars = entry["barriers"]
    assert bars["depths"]["1"] > 0 and sum(bars["loops"]["2"]) > 0  # the frame loops and the walks both have some
    assert cost.barriers == _walked({**entry, **bars}, tiles, grid, cx)
    t = cost.seconds(CHIPS[0])
    assert t["barriers_s"] == pytest.approx(cost.barriers * BARRIER_CYCLES / (1.98e9 * 132))
    assert t["issue+tc_s"] == pytest.approx(t["issue_s"] + t["tc_s"] - t["overlap_s"] + t["barriers_s"])


def _walked(entry, tiles, grid, cx, bound=1.5) -> int:
    """What one thread of a fused kernel issues, walked tile by tile and frame by frame as the kernel runs:
    per tile the code outside the frame loops, per halo frame the frame loops' own code, and per window
    layer the frame can reach the walk's loop bodies (one per walk, in layer order) once per chunk of JC
    samples of the tile's longest run of samples touching the frame (offsets uniform within the bound,
    drawn as ``tile_trips`` draws them: its seed, group by group). The passes that build a frame's matrix
    while the previous frame's dots run (the last ones) walk their first frame before the frame loop
    (``outer_walks``, code at loop depth 1) and the others one frame ahead."""
    import torch

    T, KT, ELO, EHI, JC = grid[0], cx["KT"], cx["ELO"], cx["EHI"], cx["JC"]
    loops, outer = entry["loops"]["2"], entry["outer_walks"]
    assert len(loops) % KT == 0 and loops and len(outer) % KT == 0, (loops, outer)
    ahead = len(loops) - len(outer)
    gen = torch.Generator().manual_seed(0)
    groups = {}
    for tile in tiles:
        m = math.prod(h - lo + 1 for lo, h in zip(tile.q_lo, tile.q_hi))
        groups.setdefault((tile.q_lo[0], m), []).append(tile)
    total = 0
    for (t, m), members in sorted(groups.items()):
        st = min(max(t - KT // 2, 0), T - KT)
        lo_t = max(st - ELO, 0)
        ftn = min(st + KT - 1 + EHI, T - 1) - lo_t + 1
        assert all(tile.halo_shape[0] == ftn for tile in members)
        total += len(members) * (entry["depths"]["0"] + ftn * (entry["depths"]["1"] - sum(outer)))
        for jt in range(KT):
            ot = (torch.rand((len(members), m, cx["KH"] * cx["KW"]), generator=gen, dtype=torch.float64) * 2 - 1) * bound
            t0 = torch.floor((st + jt + ot.float()).clamp(0, T - 1)).long()
            t1 = (t0 + 1).clamp(max=T - 1)
            for i in range(len(members)):
                for f in range(lo_t, lo_t + ftn):
                    if st + jt - ELO <= f <= st + jt + EHI:
                        run = int(((t0[i] == f) | (t1[i] == f)).sum(-1).max())
                        walks = sum(loops[jt:ahead:KT]) + (sum(outer[jt::KT]) if f == lo_t else sum(loops[ahead + jt::KT]))
                        total += math.ceil(run / JC) * walks
    return total


def _spans_credited(entry, cost, grid, cx, tiles):
    """Each wgmma group that runs over sample walks is credited, per (tile, halo frame), with its walks' chunks
    of the frame they walk: the frame's own, or the next one's (none after the last frame) for the passes
    that walk a frame ahead (the last ``outer_walks`` passes); the per-tile sequences summed are the
    walks' totals."""
    from kernels.dsa_fused_cost import frame_trips, tile_trips

    items, loops = tuple(sorted(cx.items())), entry["loops"]["2"]
    ahead = len(loops) - len(entry["outer_walks"])
    frames = sum(t.halo_shape[0] for t in tiles)
    seqs = tile_trips(grid, items, 1.5)
    assert sum(n for _, n in seqs) == len(tiles) and sum(n * len(seq) for seq, n in seqs) == frames
    for _, between, flops, spans in (g for g in entry["mma_groups"] if g[3]):
        walks = frame_trips(grid, items, 1.5, ahead=spans[0] >= ahead)
        assert sum(walks.values()) == frames
        if spans[0] >= ahead:  # every frame but the first, once; nothing after the last
            assert walks[(0, 0, 0)] >= sum(n for _, n in seqs)
            assert [sum(n * t[jt] for t, n in walks.items()) for jt in range(3)] == [
                sum(n * sum(f[jt] for f in seq[1:]) for seq, n in seqs) for jt in range(3)]
        for trips, n in walks.items():
            assert (n, 256 * (between + sum(t * loops[i] for t, i in zip(trips, spans))), 2 * flops) in cost.overlap
    hidden = cost.hidden_seconds(CHIPS[0])
    assert 0 < hidden < min(cost.issue / CHIPS[0].issue, cost.tc_flops / CHIPS[0].bf16_tc)


def test_the_fused_kernels_walk_a_layer_only_in_the_frames_it_reaches():
    """At bound 1.5 (ELO = EHI = 2) an inner tile's halo has 7 frames and each window layer's samples
    reach 5 of them: the 15 walks of 21 the frame loops would run without the kernels' guard."""
    from kernels.dsa_fused_cost import layer_frames
    from kernels.dsa_gluon_halo import gluon_halo_constexprs
    from kernels.dsa_halo_dense import halo_tiles

    cx = gluon_halo_constexprs(128, (3, 7, 7), 1.5)
    inner = [t for t in halo_tiles((21, 16, 16), (3, 7, 7), 1.5, (1, 8, 8)) if t.q_lo[0] == 10]
    assert [t.halo_shape[0] for t in inner] == [7] * 4 and layer_frames(inner, (21, 16, 16), cx) == [20, 20, 20]
    first = [t for t in halo_tiles((21, 16, 16), (3, 7, 7), 1.5, (1, 8, 8)) if t.q_lo[0] == 0]
    assert [t.halo_shape[0] for t in first] == [5] * 4  # frames 0-4: layer 0 reaches 0-2, 1 0-3, 2 0-4
    assert layer_frames(first, (21, 16, 16), cx) == [12, 16, 20]


def test_the_fused_walks_visit_only_the_samples_that_touch_a_frame():
    """``walk_trips``: at zero offsets a layer's 49 samples touch their own frame and the next, 7 chunks
    of 8 each, in every tile (2 x 7 = 14 a tile and layer, where the unsorted walks ran 5 x 7 = 35); spread
    uniformly within the bound 1.5 they touch 2 frames each but the longest run of a 64-query tile sets
    the chunks: between the 14 and the 35, the same for the same seed."""
    from kernels.dsa_fused_cost import walk_trips
    from kernels.dsa_gluon_halo import gluon_halo_constexprs

    grid = (9, 16, 16)  # 9 frames: tiles at t = 0..8, 4 a frame
    cx = tuple(sorted(gluon_halo_constexprs(128, (3, 7, 7), 1.5).items()))
    zero = walk_trips(grid, cx, 1.5, "zero")
    # every layer of every tile: its frame and the next, where the clip has it (layer 2 of the last tiles: none)
    assert zero == (9 * 4 * 14, 9 * 4 * 14, (7 * 14 + 2 * 7) * 4)
    spread = walk_trips(grid, cx, 1.5, "uniform")
    assert all(z < u < 9 * 4 * 35 for z, u in zip(zero, spread)) and spread == walk_trips(grid, cx, 1.5, "uniform")
    assert spread != walk_trips(grid, cx, 1.5, "uniform", seed=1)


def test_the_fused_forward_is_priced_from_its_compile():
    """The Gluon forward's row: issue slots from its sm_90 compile (the issue table's counts at loop
    depths 0 and 1 times the tiles and their halo frames, the walks' loop bodies once per chunk of the
    samples that touch a frame, offsets uniform within the bound, 256 threads a tile), its dots two 64 x 64 x d
    products per chunk of 64 halo keys and frame and one more per tile, each asynchronous group credited
    with the instructions issued meanwhile (the walks' chunks of its frame where it spans them); the
    design row's forward is this row."""
    from kernels.dsa_cost import issue_key, issue_table
    from kernels.dsa_fused_cost import fused_fwd_cost, halo_dense_design, order_cost
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
    assert cost.issue == 256 * _walked(entry, tiles, grid, cx)
    _barriers_priced(entry, cost, tiles, grid, cx)
    # the compile's dots: two per chunk and frame, and each tile's first three chunks of S before its frame
    # loop (every frame starts the next frame's first three while it walks its samples: the last's unused)
    assert cost.tc_flops == 4 * 64 * cx["NCH"] * 64 * 128 * frames + 3 * 2 * 64 * 64 * 128 * len(tiles)
    # pass 1's first chunks run over its walks of the frame; pass 2's last chunk over the next frame's walks
    assert [g[3] for g in entry["mma_groups"] if g[3]] == [[0, 1, 2], [3, 4, 5]]
    _spans_credited(entry, cost, grid, cx, tiles)
    d = halo_dense_design(grid, window, 128, 1.5)
    order = order_cost(grid, window, 128, 1.5)
    roof = cost.seconds(CHIPS[0])["seconds"]
    assert d["passes"]["fwd"]["roofline_ms"] == pytest.approx(1e3 * roof)
    # one launch of every tile and head (40): whole waves of 132 programs, one program the roofline spread over the tiles
    waves = -(-len(tiles) * 40 // 132)
    assert d["passes"]["fwd"]["kernel_ms"] == pytest.approx(1e3 * (waves * roof * 132 / len(tiles) + 2e-6) / 40)
    assert d["passes"]["fwd"]["order_ms"] == pytest.approx(1e3 * order.seconds(CHIPS[0])["seconds"])
    assert d["passes"]["fwd"]["ms"] == pytest.approx(d["passes"]["fwd"]["kernel_ms"] + d["passes"]["fwd"]["order_ms"])
    assert fused_fwd_cost(grid, (3, 5, 5), 128, 1.5) is None  # compiled at the Wan shape only


# -- the dense-attention levers (kernels/dsa_lever_cost.py) ---------------------------------------


@pytest.mark.parametrize("sampling", ["logit_normal", "uniform"])
@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
def test_the_lever_cost_draws_t_as_the_trainer_does(sampling, shift):
    """``share_above`` is ``1 - base_cdf`` of the trainer's t distribution, and the share of t the
    trainer's own draws put at or above each time."""
    from kernels.dsa_lever_cost import share_above
    from megaslide_ray.training.flow import base_cdf, flow_inputs

    for t in (0.1, 0.5, 0.75, 0.9, 0.99):
        assert math.isclose(share_above(t, sampling, shift), 1.0 - base_cdf(t, sampling, shift), rel_tol=1e-9,
                            abs_tol=1e-12)
    import torch

    ts = flow_inputs(torch.zeros(4000, 1), seed=0, step=0, t_sampling=sampling, flow_shift=shift).t
    for t in (0.5, 0.9):
        drawn = float((ts >= t).float().mean())
        assert abs(drawn - share_above(t, sampling, shift)) < 0.03, (t, drawn)


def test_each_lever_is_priced_block_by_block():
    """``lever_ms`` against a sum over blocks and samples written out, and ``budget`` where the
    setting meets a fifth of dense's time (none where its dense part alone is a fifth: 2 of 10
    blocks, 20% of the samples, a curriculum step)."""
    from kernels.dsa_lever_cost import budget, lever_ms

    D, F, L = 3.0, 2.0, 10

    def by_hand(dense_blocks, share, warmup):
        sample_dense = L * F
        sample_mixed = sum(F if b < dense_blocks else (D + F if warmup else D) for b in range(L))
        return share * sample_dense + (1 - share) * sample_mixed

    for args in [(0, 0.0, False), (3, 0.0, False), (0, 0.25, False), (2, 0.25, False), (0, 0.0, True),
                 (2, 0.5, True), (L, 0.0, False)]:
        assert math.isclose(lever_ms(D, F, L, *args), by_hand(*args))
    assert lever_ms(D, F, L) == L * D and lever_ms(D, F, L, L) == L * F
    for args in [(0, 0.0, False), (1, 0.0, False), (0, 0.1, False)]:
        r = budget(F, L, *args)
        assert math.isclose(lever_ms(r * F, F, L, *args), L * F / 5)
    assert budget(F, L, 0, 0.2) is None and budget(F, L, 0, 0.0, True) is None and budget(F, L, 2) is None
    with pytest.raises(ValueError):
        lever_ms(D, F, L, L + 1)


def test_lever_cli_prices_both_wan_grids_against_the_cost_model():
    from kernels.dsa_cost import call_breakdown

    proc = subprocess.run([sys.executable, "-m", "kernels.dsa_lever_cost", "--json", "--dense-blocks", "2",
                           "--dense-above-t", "0.9"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    tables = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [t["name"] for t in tables] == ["480p", "720p"]
    for t in tables:
        b = call_breakdown(t["grid"], (3, 7, 7), 128, 1.5)
        assert math.isclose(t["block_dsa_ms"], b["dsa_ms"]["total"] + b["dsa_ms"]["fwd"])
        assert math.isclose(t["block_fa3_ms"], b["fa3_ms"]["total"] + b["fa3_ms"]["fwd"])
        rows = {json.dumps({k: v for k, v in r.items() if k in ("dense_blocks", "dense_above_t", "warmup")}): r
                for r in t["rows"]}
        assert set(rows) == {"{}", '{"dense_blocks": 2}', '{"dense_above_t": 0.9}', '{"warmup": true}'}
        assert rows["{}"]["vs_dsa"] == 1.0 and math.isclose(rows["{}"]["dense_over"], t["dense_ms"] / t["dsa_ms"])
        assert rows['{"warmup": true}']["ms"] > t["dsa_ms"] and rows['{"warmup": true}']["ms"] > t["dense_ms"]
    bad = subprocess.run([sys.executable, "-m", "kernels.dsa_lever_cost", "--grid", "21by30"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and "--grid '21by30'" in bad.stderr


def test_the_fused_backward_is_priced_from_its_compile(capsys):
    """The Gluon backward's row, as the forward's: issue slots from its sm_90 compile (depths 0 and 1
    times the tiles and their halo frames, a layer's walks where it reaches, 256 threads a tile), five 64 x 64 x d dots per chunk of 64
    halo keys and frame (and two more a tile); the design row's backward is this row, and the command line reports the
    compiled forward and backward against FA3 (JSON key ``fused``)."""
    from kernels.dsa_cost import issue_key, issue_table, main
    from kernels.dsa_fused_cost import (
        fused_bwd_cost,
        fused_compiled,
        halo_dense_design,
        launch_schedule,
        order_cost,
    )
    from kernels.dsa_gluon_halo import BWD_SAMPLE_CHUNK, gluon_halo_constexprs, phase_launches
    from kernels.dsa_halo_dense import halo_tiles

    grid, window = (5, 16, 24), (3, 7, 7)
    cx = dict(gluon_halo_constexprs(128, window, 1.5), JC=BWD_SAMPLE_CHUNK)
    entry = issue_table().get(issue_key("fused_bwd", 128, window, cx, 8))
    if entry is None:
        pytest.skip("the issue table has no fused backward (a Triton whose Gluon cannot build it)")
    tiles = halo_tiles(grid, window, 1.5, (1, 8, 8))
    frames = sum(t.halo_shape[0] for t in tiles)
    cost = fused_bwd_cost(grid, window, 128, 1.5)
    assert cost.issue == 256 * _walked(entry, tiles, grid, cx)
    _barriers_priced(entry, cost, tiles, grid, cx)
    # dP, S, dV, dQ, dK per chunk and frame, and each tile's first chunk of dP and of S before their frame loops
    assert cost.tc_flops == 5 * 2 * 64 * cx["NCH"] * 64 * 128 * frames + 2 * 2 * 64 * 64 * 128 * len(tiles)
    # passes 1 and 2: the next frame's first chunk over this frame's walks; 3 and 4: the last chunk's dots
    # over the next frame's walks (pass 4: dQ's product, after dK's is waited for alone)
    assert [g[3] for g in entry["mma_groups"] if g[3]] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    _spans_credited(entry, cost, grid, cx, tiles)
    from kernels.dsa_fused_cost import _overlap

    serial = _overlap({**entry, "mma_serialized": True}, len(tiles), frames,
                      {False: {(1, 1, 1): frames}, True: {(1, 1, 1): frames}}, 6, 3)
    assert all(lanes == 0 for _, lanes, _ in serial)  # ptxas serialized the dots: nothing overlaps them
    d = halo_dense_design(grid, window, 128, 1.5)
    order_ms = 1e3 * order_cost(grid, window, 128, 1.5).seconds(CHIPS[0])["seconds"]
    # the backward takes the forward's order and records: no order kernel before it; its colour phases, two
    # groups of 20 heads on two streams, as launch_schedule runs them
    bwd = d["passes"]["bwd"]
    roof = cost.seconds(CHIPS[0])["seconds"]
    assert bwd["roofline_ms"] == pytest.approx(1e3 * roof) and bwd["order_ms"] == 0 < order_ms
    phases = [n for *_, n in phase_launches(grid, window, 1.5)[1]]
    streams = [[20 * n for n in phases]] * 2
    assert bwd["ms"] == bwd["kernel_ms"] == pytest.approx(
        1e3 * launch_schedule(roof * 132 / len(tiles), streams, 132) / 40)
    assert bwd["launches"] == 2 * len(phases) and bwd["roofline_ms"] < bwd["ms"]
    assert fused_bwd_cost(grid, (3, 5, 5), 128, 1.5) is None  # compiled at the Wan shape only
    both = fused_compiled(grid, window, 128, 1.5)
    assert both["dsa_ms"]["total"] == pytest.approx(d["passes"]["fwd"]["ms"] + bwd["ms"])
    assert both["ratio"] == pytest.approx(both["fa3_ms"]["total"] / both["dsa_ms"]["total"])
    assert main(["--grid", "5x16x24", "--window", "3x7x7", "--bound", "1.5", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)["fused"]
    assert cli["dsa_ms"] == pytest.approx(both["dsa_ms"]) and cli["ratio"] == pytest.approx(both["ratio"])
    assert main(["--grid", "5x16x24", "--window", "3x7x7", "--bound", "1.5", "--heads", "4", "--json"]) == 0
    few = json.loads(capsys.readouterr().out)["fused"]  # 4 heads: one stream, its phases' programs leave slots idle
    assert few["pairs"] == 4 and few["passes"]["bwd"]["streams"] == 1 and few["ratio"] < both["ratio"]
    with pytest.raises(SystemExit):
        main(["--heads", "0"])


def test_the_launch_schedule_takes_whole_programs_and_overlaps_only_other_streams():
    """``launch_schedule``: one stream's launches end in whole waves (a launch of 5 programs on 4 slots takes
    two program times, the next starts after it and the gap); a second stream's programs take the slots a
    partial wave leaves; nothing starts before its stream's previous launch ended."""
    from kernels.dsa_fused_cost import launch_schedule

    assert launch_schedule(1.0, [[5, 5]], 4, gap=0.0) == 4.0  # 2 + 2 waves: 3 slot-times idle in each
    assert launch_schedule(1.0, [[5, 5]], 4, gap=0.5) == 5.0  # the gap before each launch
    assert launch_schedule(1.0, [[4, 4]], 4, gap=0.0) == 2.0
    # two streams of 5 + 5: the first launches share the 4 slots (the earlier-ready first), 20 programs in
    # 5 program times, as if one stream of 20
    assert launch_schedule(1.0, [[5, 5], [5, 5]], 4, gap=0.0) == 5.0
    assert launch_schedule(1.0, [[3], [3]], 4, gap=0.0) == 2.0  # 6 programs on 4 slots
    assert launch_schedule(2.0, [[1, 1, 1]], 8, gap=0.0) == 6.0  # a chain: slots to spare do not shorten it


def test_the_order_kernel_is_priced_from_its_compile_and_added_to_the_fused_forward():
    """``order_cost``: the sample order and records' kernel, a launch of its own before the fused forward:
    its issue slots from its sm_90 compile (straight-line code, 128 threads per ``ORDER_BLOCK_ROWS`` rows
    of one layer), its DRAM bytes the offsets read and the order and records written; the forward's
    time is the two added (nothing overlaps them); the backward takes the forward's (no order time)."""
    from kernels.dsa_cost import issue_key, issue_table
    from kernels.dsa_fused_cost import RECORD_BYTES, fused_compiled, fused_fwd_cost, order_bytes, order_cost, walk_trips
    from kernels.dsa_gluon_halo import gluon_halo_constexprs
    from kernels.dsa_order import ORDER_BLOCK_ROWS, ORDER_WARPS

    grid, window = (5, 16, 24), (3, 7, 7)
    cx = gluon_halo_constexprs(128, window, 1.5)
    if issue_table().get(issue_key("fused_fwd", 128, window, cx, 8)) is None:
        pytest.skip("the issue table has no fused pair (a Triton whose Gluon cannot build it)")
    entry = issue_table()[issue_key("fused_order", 128, window, {"ELO": 2, "EHI": 2}, ORDER_WARPS)]
    N = 5 * 16 * 24
    cost = order_cost(grid, window, 128, 1.5)
    assert cost.issue == -(-N // ORDER_BLOCK_ROWS) * 3 * 32 * ORDER_WARPS * entry["depths"]["0"]
    assert cost.dram_bytes == N * order_bytes(window) == N * (147 * (6 + RECORD_BYTES) + 2 * 3 * 64)
    fwd = fused_fwd_cost(grid, window, 128, 1.5)  # its two walks read a record per lane of every chunk, from L2
    assert fwd.l2_bytes == 2 * sum(walk_trips(grid, tuple(sorted(cx.items())), 1.5)) * 64 * cx["JC"] * RECORD_BYTES
    both = fused_compiled(grid, window, 128, 1.5)
    row = both["passes"]["fwd"]
    assert row["roofline_ms"] == pytest.approx(1e3 * fused_fwd_cost(grid, window, 128, 1.5).seconds(CHIPS[0])["seconds"])
    assert row["order_ms"] == pytest.approx(1e3 * cost.seconds(CHIPS[0])["seconds"]) and row["order_ms"] > 0
    assert row["ms"] == pytest.approx(row["kernel_ms"] + row["order_ms"])
    assert both["passes"]["bwd"]["order_ms"] == 0 and both["passes"]["bwd"]["ms"] == both["passes"]["bwd"]["kernel_ms"]


def test_the_levers_priced_with_the_fused_kernels_use_their_compiles():
    from kernels.dsa_fused_cost import fused_compiled
    from kernels.dsa_lever_cost import lever_table

    grid = (21, 45, 80)
    both = fused_compiled(grid, (3, 7, 7), 128, 1.5)
    if both is None:
        pytest.skip("the issue table has no fused kernels (a Triton whose Gluon cannot build them)")
    r = lever_table(grid, (3, 7, 7), 128, 1.5, 40, [{}, {"dense_blocks": 2}], kernels="fused")
    assert math.isclose(r["block_dsa_ms"], both["dsa_ms"]["total"] + both["dsa_ms"]["fwd"])
    assert math.isclose(r["block_fa3_ms"], both["fa3_ms"]["total"] + both["fa3_ms"]["fwd"])
    assert r["kernels"] == "fused" and r["rows"][1]["dense_over"] < r["rows"][0]["dense_over"]
    with pytest.raises(ValueError, match="--kernels auto"):
        lever_table(grid, (3, 5, 5), 128, 1.5, 40, [{}], kernels="fused")
