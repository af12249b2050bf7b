"""The fused halo-dense algorithm's blocked PyTorch mirror (``kernels/dsa_halo_dense.py``) against
``dsa_reference``: forward and every gradient, in fp64 (the algebra, to rounding), fp32 (the fp32
rule) and bf16 (the flash rule), at borders, partial tiles, several tiles and bounds, both
identities, a broken bound promise, and the colour phases the backward adds dk, dv in."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import dsa_reference
from kernels.checks import (
    assert_bf16_flash_rule,
    assert_dense_identity,
    assert_grads_close,
    bounded_offsets,
    edge_offsets,
    grads,
    make_qkv,
    naive_neighborhood_attention,
)
from kernels.dsa_halo_dense import colour_counts, dsa_halo_dense, halo_dense_counts, halo_tiles

CASES = [  # grid, window, bound, tile: partial tiles on every axis, tiles smaller and larger than the window
    ((3, 9, 10), (3, 3, 3), 1.5, (1, 4, 4)),
    ((4, 7, 11), (3, 5, 5), 1.0, (2, 4, 4)),
    ((5, 6, 9), (3, 3, 5), 2.7, (1, 8, 8)),
    ((3, 5, 6), (1, 3, 3), 0.5, (3, 2, 3)),
]


def _run(dtype, grid, window, bound, tile, seed=0, offsets=None):
    shape = (2, *grid, 2, 8)
    q, k, v = make_qkv(shape, dtype, seed=seed)
    off = bounded_offsets(shape, window, bound, seed=seed + 1, dtype=dtype) if offsets is None else offsets
    dout = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 2))
    got = grads(lambda *a: dsa_halo_dense(*a, window, bound, tile=tile), [q, k, v, off], dout)
    return got, (q, k, v, off), dout


@pytest.mark.parametrize("grid,window,bound,tile", CASES)
def test_fp64_is_the_operator(grid, window, bound, tile):
    """In fp64 every step runs in fp64: the blocked algorithm equals the operator to rounding."""
    got, inputs, dout = _run(torch.float64, grid, window, bound, tile)
    want = grads(lambda *a: dsa_reference(*a, window), list(inputs), dout)
    assert_grads_close(got, want, f"{grid} {window} b{bound}", rtol=1e-10, atol=1e-11)


def test_fp64_clamps_kinks_and_borders():
    """Positions exactly on integers, on the grid's borders and clamped far outside (a bound that
    covers the far moves: the halo is the whole grid)."""
    grid, window = (3, 6, 7), (3, 3, 5)
    shape = (2, *grid, 2, 8)
    off = edge_offsets(shape, window)
    bound = float(off.abs().max())
    got, inputs, dout = _run(torch.float64, grid, window, bound, (1, 4, 4), offsets=off)
    want = grads(lambda *a: dsa_reference(*a, window), list(inputs), dout)
    assert_grads_close(got, want, "edges", rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("grid,window,bound,tile", CASES[:2])
def test_fp32_rule(grid, window, bound, tile):
    got, inputs, dout = _run(torch.float32, grid, window, bound, tile, seed=5)
    want = grads(lambda *a: dsa_reference(*a, window), list(inputs), dout)
    assert_grads_close(got, want, f"{grid} fp32")


@pytest.mark.parametrize("grid,window,bound,tile", CASES[:2])
def test_bf16_flash_rule(grid, window, bound, tile):
    """bf16 operands for the five products, P and dS cast to bf16 before theirs, as flash attention."""
    got, inputs, dout = _run(torch.bfloat16, grid, window, bound, tile, seed=9)
    assert_bf16_flash_rule(got, inputs, dout, window, f"halo-dense {grid}")


def test_zero_offsets_are_neighborhood_attention():
    grid, window = (3, 7, 9), (3, 3, 5)
    shape = (2, *grid, 2, 8)
    q, k, v = make_qkv(shape, torch.float64, seed=3)
    off = torch.zeros(*shape[:5], 45, 3, dtype=torch.float64)
    got = dsa_halo_dense(q, k, v, off, window, 0.0, tile=(1, 4, 4))
    torch.testing.assert_close(got, naive_neighborhood_attention(q, k, v, window), rtol=1e-10, atol=1e-11)


def test_whole_grid_window_is_dense_attention():
    assert_dense_identity(lambda q, k, v, off, win, scale: dsa_halo_dense(q, k, v, off, win, 0.0, scale, tile=(1, 2, 4)),
                          (3, 5, 5), torch.float64, 1e-10, seed=4)


def test_a_broken_bound_shows_as_nan_rows_only():
    """Offsets past the promised bound: exactly the queries whose corners leave their tile's halo get
    a NaN output row (and NaN dq); every other query is the operator's."""
    grid, window, bound = (3, 8, 16), (3, 3, 3), 1.0
    shape = (1, *grid, 1, 8)
    q, k, v = make_qkv(shape, torch.float64, seed=6)
    off = bounded_offsets(shape, window, bound, seed=7, dtype=torch.float64)
    # the last query along x of the tile x 4..7 (halo x 2..10): its sample (1, 1, 2), at x 8, moves 3.6
    # tokens to 11.6 (corners 11, 12: outside the halo)
    off[0, 1, 4, 7, 0, 14, 2] = 3.6
    got = dsa_halo_dense(q, k, v, off, window, bound, tile=(1, 4, 4))
    nan_rows = got.isnan().any(-1)[0, ..., 0]
    assert nan_rows.nonzero().tolist() == [[1, 4, 7]]
    want = dsa_reference(q, k, v, off, window)
    keep = ~got.isnan()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-10, atol=1e-11)


def test_colour_phases_share_no_key():
    """Tiles of one colour have disjoint halos, so a phase adds its dk, dv without atomics."""
    for grid, window, bound, tile in CASES + [((21, 30, 52), (3, 7, 7), 1.5, (1, 8, 8))]:
        tiles = halo_tiles(grid, window, bound, tile)
        counts = colour_counts(tiles)
        phases = {}
        for t in tiles:
            phases.setdefault(tuple(i % c for i, c in zip(t.index, counts)), []).append(t)
        for members in phases.values():
            for a, b in itertools.combinations(members, 2):
                assert any(a.k_hi[x] < b.k_lo[x] or b.k_hi[x] < a.k_lo[x] for x in range(3)), (grid, a, b)
        assert sum(map(len, phases.values())) == len(tiles)


def test_every_reachable_corner_is_in_the_halo():
    """The halo box holds every corner of every sample of every query of its tile, for offsets at the
    bound (the extreme positions), and the 480p interior halo is 7 x 18 x 18 keys."""
    grid, window, bound, tile = (5, 11, 13), (3, 5, 5), 1.5, (1, 4, 4)
    for sign in (-1.0, 1.0):
        shape = (1, *grid, 1, 4)
        q, k, v = make_qkv(shape, torch.float64, seed=2)
        off = torch.full((*shape[:5], 75, 3), sign * bound, dtype=torch.float64)
        out = dsa_halo_dense(q, k, v, off, window, bound, tile=tile)
        assert not out.isnan().any()
        torch.testing.assert_close(out, dsa_reference(q, k, v, off, window), rtol=1e-10, atol=1e-11)
    interior = [t for t in halo_tiles((21, 30, 52), (3, 7, 7), 1.5) if t.index == (10, 1, 3)]
    assert interior[0].halo_shape == (7, 18, 18)


def test_work_counts_grow_with_tokens_not_with_their_square():
    small = halo_dense_counts((21, 30, 52), (3, 7, 7), 128, 1.5)
    large = halo_dense_counts((21, 45, 80), (3, 7, 7), 128, 1.5)
    tokens = (21 * 45 * 80) / (21 * 30 * 52)
    assert small["samples"] == 21 * 30 * 52 * 147
    assert 0.9 * tokens < large["fwd_macs"] / small["fwd_macs"] < 1.3 * tokens


def test_refuses_a_missing_bound():
    q, k, v = make_qkv((1, 3, 4, 4, 1, 4))
    off = torch.zeros(1, 3, 4, 4, 1, 27, 3)
    with pytest.raises(ValueError, match="bound"):
        dsa_halo_dense(q, k, v, off, (3, 3, 3), float("inf"))


# -----------------------------------------------------------------------------
# The fused forward as a backend choice: the first-use check and the fallback (no GPU needed)


def test_the_first_use_check_passes_a_right_kernel_and_catches_a_wrong_or_failing_one(monkeypatch):
    """``first_use_check`` holds the kernel to the reference by the flash rule on a small problem at
    the call's compile: the mirror (the kernel's algorithm) passes; a result off by a little, or a
    kernel that raises, is refused with the reason, so the caller falls back."""
    import kernels.dsa_gluon_halo as G

    def mirror(q, k, v, off, window, scale, bound):
        return dsa_halo_dense(q, k, v, off, window, bound, scale=scale), None

    def off_a_little(*a):
        out, _ = mirror(*a)
        return out * 1.02, None

    def broken(*a):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(G, "CHECK_SHAPE", (1, 3, 12, 12, 1, 128))  # two tiles a side: small enough for a CPU
    for fn, verdict in ((mirror, None), (off_a_little, "failed its first-use check"), (broken, "illegal memory")):
        monkeypatch.setattr(G, "halo_dense_forward", fn)
        monkeypatch.setattr(G, "_CHECKED", {})
        got = G.first_use_check("cpu", torch.bfloat16, (3, 7, 7), 1.5)
        assert (got is None) if verdict is None else (verdict in got), (fn.__name__, got)
    monkeypatch.setattr(G, "halo_dense_forward", broken)  # the verdict is kept: checked once per shape
    monkeypatch.setattr(G, "_CHECKED", {("cpu", torch.bfloat16, (3, 7, 7), 1.5): None})
    assert G.first_use_check("cpu", torch.bfloat16, (3, 7, 7), 1.5) is None


def test_fused_mode_takes_the_fused_forward_only_where_it_may(monkeypatch):
    """``KernelModes(halo="fused")``: the forward launcher runs the fused kernel where
    ``fused_refusal`` allows it, and otherwise what ``auto`` runs (here on a CPU: refused, sm_90 only)."""
    pytest.importorskip("triton")
    import kernels.dsa_gluon_halo as G
    import kernels.dsa_triton as DT
    from kernels import KernelModes

    shape = (1, 3, 8, 8, 1, 128)
    q = torch.zeros(shape, dtype=torch.bfloat16)
    off = torch.zeros(*shape[:5], 147, 3, dtype=torch.bfloat16)
    assert "sm_90" in G.fused_refusal(q, (3, 7, 7), 1.5)
    ran = []

    class Stub:  # stands in for a Triton kernel (``kernel[grid](...)``): records its name, runs nothing
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **k: ran.append(self.name)

    monkeypatch.setattr(DT, "halo_forward", lambda *a: ran.append("halo"))
    monkeypatch.setattr(DT, "_dsa_fwd_tuned", Stub("gather"))
    monkeypatch.setattr(DT, "_dsa_fwd", Stub("gather"))
    DT._dsa_fwd_launch(q, q, q, off, (3, 7, 7), 0.1, None, None, 1.5, KernelModes(halo="fused"))
    DT._dsa_fwd_launch(q, q, q, off, (3, 7, 7), 0.1, None, None, 1.5, KernelModes())
    assert len(ran) == 2 and ran[0] == ran[1]  # refused: what auto runs at this shape and bound
    monkeypatch.setattr(G, "fused_refusal", lambda *a: None)
    monkeypatch.setattr(G, "halo_dense_forward", lambda *a: ("fused", None, None))
    assert DT._dsa_fwd_launch(q, q, q, off, (3, 7, 7), 0.1, None, None, 1.5, KernelModes(halo="fused"))[0] == "fused"


def test_the_fused_kernels_refuse_a_call_past_their_32_bit_offset_index():
    """A call whose offsets have 2^31 elements or more is refused with the reason and what to do (the
    kernels would index them past int32), before anything else is asked of Triton or the device."""
    pytest.importorskip("triton")
    import kernels.dsa_gluon_halo as G

    big = torch.empty((4, 21, 30, 52, 40, 128), dtype=torch.bfloat16, device="meta")  # 4 clips of Wan 480p
    why = G.fused_refusal(big, (3, 7, 7), 1.5)
    assert "2^31" in why and "split the batch" in why
    assert "2^31" not in G.fused_refusal(big[:1], (3, 7, 7), 1.5)


# -----------------------------------------------------------------------------
# The fused backward (Gluon): its launches per colour phase, its first-use check and its fallback


@pytest.mark.parametrize("grid,bound", [((5, 20, 27), 1.5), ((4, 15, 26), 0.5), ((6, 9, 17), 2.5)])
def test_the_backward_launches_every_tile_once_and_no_phase_shares_a_key(grid, bound):
    """``phase_launches`` and the kernel's tile arithmetic (``phase_tile``): every tile of the mirror
    (``halo_tiles``) is launched exactly once, and the tiles of one launch (a colour phase) have
    pairwise disjoint halos, so their dk, dv rows are added without atomics."""
    from kernels.dsa_gluon_halo import phase_launches, phase_tile

    window = (3, 7, 7)
    tiles = {t.index: t for t in halo_tiles(grid, window, bound, (1, 8, 8))}
    counts, phases = phase_launches(grid, window, bound)
    assert counts == colour_counts(list(tiles.values()))
    launched = []
    for pt, py, px, n in phases:
        group = [tiles[phase_tile(i, (pt, py, px), counts, grid)] for i in range(n)]
        launched += [t.index for t in group]
        for a, b in itertools.combinations(group, 2):
            assert any(a.k_hi[ax] < b.k_lo[ax] or b.k_hi[ax] < a.k_lo[ax] for ax in range(3)), (a, b)
    assert sorted(launched) == sorted(tiles)


def _mirror_backward(q, k, v, off, out, dout, lse, window, scale, bound, walks=None):
    """The mirror's gradients, standing in for the Gluon backward on a CPU (``walks``: ignored, the mirror
    finds each tile's samples itself)."""
    got = grads(lambda *a: dsa_halo_dense(*a, window, bound, scale=scale), [q, k, v, off], dout)
    return got[1:]


def test_the_backward_first_use_check_passes_a_right_kernel_and_catches_a_wrong_or_failing_one(monkeypatch):
    """``first_use_check_bwd`` holds the backward's four gradients to the reference's by the flash rule
    on a small problem: the mirror (the kernel's algorithm) passes; a dk 10% off, or a kernel
    that raises, is refused with the reason, so the caller falls back; the verdict is kept per shape."""
    import kernels.dsa_gluon_halo as G

    def dk_off(*a, **kw):
        dq, dk, dv, doff = _mirror_backward(*a, **kw)
        return dq, dk * 1.1, dv, doff

    def broken(*a, **kw):
        raise RuntimeError("illegal memory access")

    monkeypatch.setattr(G, "CHECK_SHAPE", (1, 3, 12, 12, 1, 128))  # two tiles a side: small enough for a CPU
    monkeypatch.setattr(G, "sample_walks", lambda *a: None)  # the order kernel is a GPU kernel (the check passes its walks)
    monkeypatch.setattr(G, "CHECK_BWD_HEADS", 1)
    for fn, verdict in ((_mirror_backward, None), (dk_off, "dk: err"), (broken, "illegal memory")):
        monkeypatch.setattr(G, "halo_dense_backward", fn)
        monkeypatch.setattr(G, "_CHECKED_BWD", {})
        got = G.first_use_check_bwd("cpu", torch.bfloat16, (3, 7, 7), 1.5)
        assert (got is None) if verdict is None else (verdict in got), (fn.__name__, got)
    monkeypatch.setattr(G, "halo_dense_backward", broken)
    monkeypatch.setattr(G, "_CHECKED_BWD", {("cpu", torch.bfloat16, (3, 7, 7), 1.5): None})
    assert G.first_use_check_bwd("cpu", torch.bfloat16, (3, 7, 7), 1.5) is None


def test_fused_mode_takes_the_fused_backward_only_where_it_may(monkeypatch):
    """``KernelModes(halo="fused")``: the backward launcher runs the fused backward where
    ``fused_refusal(..., "backward")`` allows it (its first-use check passed), else auto's kernels
    (here on a CPU: refused, sm_90 only, and the refusal names the backward)."""
    pytest.importorskip("triton")
    import kernels.dsa_gluon_halo as G
    import kernels.dsa_triton as DT
    from kernels import KernelModes

    shape = (1, 3, 8, 8, 1, 128)
    q = torch.zeros(shape, dtype=torch.bfloat16)
    off = torch.zeros(*shape[:5], 147, 3, dtype=torch.bfloat16)
    why = G.fused_refusal(q, (3, 7, 7), 1.5, None, "backward")
    assert "sm_90" in why and "backward" in why
    asked = []
    monkeypatch.setattr(G, "fused_refusal", lambda *a: asked.append(a[-1]))
    monkeypatch.setattr(G, "halo_dense_backward", lambda *a, **kw: "fused")
    assert DT._dsa_bwd_launch(q, q, q, off, q, q, None, (3, 7, 7), 0.1, None, None, 1.5,
                              KernelModes(halo="fused")) == "fused"
    assert asked == ["backward"]


def _stub_fused_pair(monkeypatch, read: list, written: list):
    """The fused pair's Gluon kernels and the order kernel stood in for (a CPU runs none of them): each kernel
    launch notes its grid and where its q, records and order views start; the order kernel notes its bound
    and returns zeros of the real shapes."""
    import kernels.dsa_gluon_halo as G
    import kernels.dsa_order as O
    import kernels.dsa_triton as DT

    def order_kernel(offsets, window, bound, tile):
        written.append(bound)
        B, T, H, W, nh, K, _ = offsets.shape
        return (torch.zeros((B, T, H, W, nh, 3, 64), dtype=torch.int8),
                torch.zeros((B, T, H, W, nh, 3, K // 3, 4), dtype=torch.int32))

    class Stub:  # stands in for a Gluon kernel (``kernel[grid](...)``)
        def __getitem__(self, grid):
            return lambda q, k, v, rec, order, *a, **kw: read.append((grid, q.data_ptr(), rec.data_ptr(),
                                                                      order.data_ptr(), a[-6:-3] if len(a) > 12 else ()))

    monkeypatch.setattr(O, "sample_order_kernel", order_kernel)
    monkeypatch.setattr(G, "fused_refusal", lambda *a: None)
    monkeypatch.setattr(G, "halo_dense_kernel", Stub)
    monkeypatch.setattr(G, "halo_dense_bwd_kernel", Stub)
    monkeypatch.setattr(DT, "_check_launch", lambda *a: None)  # CUDA tensors, compiled: stood in for here


def test_the_fused_backward_takes_the_forwards_sample_order_and_records(monkeypatch):
    """A training step through ``dsa_triton`` in fused mode writes the walks' order and records once: the
    forward's, kept for the backward (its kernel launches read the very memory the forward's did), unless
    ``keep_walks`` is False; a backward handed walks written for another bound (or none) writes its own."""
    pytest.importorskip("triton")
    import kernels.dsa_gluon_halo as G
    import kernels.dsa_triton as DT
    from kernels import KernelModes

    written, read = [], []
    _stub_fused_pair(monkeypatch, read, written)
    shape = (1, 3, 8, 8, 1, 128)
    q, k, v = (torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    off = torch.zeros(*shape[:5], 147, 3, dtype=torch.bfloat16, requires_grad=True)
    out = DT.dsa_triton(q, k, v, off, (3, 7, 7), max_offset=1.5, modes=KernelModes(halo="fused"))
    out.float().sum().backward()
    assert written == [1.5]  # once, by the forward
    phases = len(G.phase_launches(shape[1:4], (3, 7, 7), 1.5)[1])
    assert len(read) == 1 + phases and len({r[2:4] for r in read}) == 1  # every launch reads the forward's
    assert off.grad is not None and off.grad.shape == off.shape
    out = DT.dsa_triton(q, k, v, off, (3, 7, 7), max_offset=1.5, modes=KernelModes(halo="fused", keep_walks=False))
    out.float().sum().backward()
    assert written == [1.5, 1.5, 1.5]  # not kept: the backward writes its own
    with pytest.raises(ValueError, match="keep_walks"):
        KernelModes(keep_walks="yes")

    written.clear()
    walks = G.sample_walks(off.detach(), (3, 7, 7), 1.0)  # written for another bound: not taken
    x = q.detach()
    G.halo_dense_backward(x, x, x, off.detach(), x, x, torch.zeros(1, 1, 192), (3, 7, 7), 0.1, 1.5, walks=walks)
    assert written == [1.0, 1.5]


@pytest.mark.parametrize("heads", [1, 8, 12, 40])
def test_the_backward_launches_each_group_of_heads_through_every_phase_in_order(monkeypatch, heads):
    """The backward's launches with its heads in groups (``head_groups``: one stream each on a GPU): the
    groups split the heads at multiples of 4 (views as aligned as the tensors), each group goes through
    every colour phase once and in order, and every (head, phase) is launched once."""
    pytest.importorskip("triton")
    import kernels.dsa_gluon_halo as G

    groups = G.head_groups(heads)
    assert [h for g in groups for h in range(*g)] == list(range(heads))
    assert all(h0 % 4 == 0 for h0, _ in groups) and len(groups) == (2 if heads >= 8 else 1)
    read = []
    _stub_fused_pair(monkeypatch, read, [])
    grid, shape = (3, 9, 17), (1, 3, 9, 17, heads, 128)
    x = torch.zeros(shape, dtype=torch.bfloat16)
    off = torch.zeros(*shape[:5], 147, 3, dtype=torch.bfloat16)
    G.halo_dense_backward(x, x, x, off, x, x, torch.zeros(1, heads, 3 * 9 * 17), (3, 7, 7), 0.1, 1.5)
    phases = G.phase_launches(grid, (3, 7, 7), 1.5)[1]
    seen = {}
    for (tiles, n), q_ptr, *_, phase in read:
        h0 = (q_ptr - x.data_ptr()) // (128 * 2)
        seen.setdefault((h0, n), []).append((*phase, tiles))
    assert sorted(seen) == sorted((h0, h1 - h0) for h0, h1 in groups)
    assert all(got == [tuple(p) for p in phases] for got in seen.values())


def test_the_sample_order_puts_each_frames_samples_in_one_run():
    """``sample_order``: for every query, window layer and frame of the clip its layer reaches, the run
    ``frame_range`` gives holds exactly the samples whose time corners touch that frame (lower corner
    there or one below, clamped at the clip's ends as the operator clamps), each layer's order is a
    permutation (as ``jy * 8 + jx``), and a sample with a lower corner past its reach on any axis (an
    offset past the bound) is in no run."""
    from kernels.dsa_halo_dense import STARTS_AT, frame_range, sample_order, time_reach
    from kernels.dsa_reference import window_starts

    grid, window, bound = (6, 4, 5), (3, 2, 3), 1.5
    B, nh, kt, kh, kw = 2, 2, *window
    kk = kh * kw
    g = torch.Generator().manual_seed(11)
    off = (torch.rand((B, *grid, nh, kt * kk, 3), generator=g) * 2 - 1) * bound
    off[0, 2, 1, 1, 0, kk + 1, 0] = 2.7  # past the bound in time: 2 frames past layer 1's reach
    off[1, 3, 2, 4, 1, 2 * kk + 4, 2] = -2.2  # past the bound in x (base 3 -> 0.8: lower corner 3 columns back)
    off[1, 0, 0, 0, 1, 0, 0] = -1.5  # exactly at the bound, clamped at the clip's start
    off = off.to(torch.bfloat16)
    order = sample_order(off, window, bound)
    elo, ehi = time_reach(bound)
    starts_of = [window_starts(n, k) for n, k in zip(grid, window)]
    T = grid[0]
    late = 0
    for b, t, y, x, h, jt in itertools.product(range(B), range(T), range(grid[1]), range(grid[2]), range(nh), range(kt)):
        row = order[b, t, y, x, h, jt].long()
        packed = row[:kk]
        js = (packed >> 3) * kw + (packed & 7)
        assert sorted(js.tolist()) == list(range(kk)) and ((packed & 7) < kw).all()
        starts = row[STARTS_AT:STARTS_AT + elo + ehi + 1]
        o = off[b, t, y, x, h, jt * kk:(jt + 1) * kk].float()
        jy, jx = torch.arange(kk) // kw, torch.arange(kk) % kw
        bases = (int(starts_of[0][t]) + jt, int(starts_of[1][y]) + jy, int(starts_of[2][x]) + jx)
        ok = torch.ones(kk, dtype=torch.bool)
        for a, (size, base) in enumerate(zip(grid, bases)):
            rel = torch.floor((base + o[:, a]).clamp(0, size - 1)) - base
            ok &= (rel >= -elo) & (rel <= ehi - 1)
        late += int((~ok).sum())
        assert int(starts[-1]) == int(ok.sum())  # the samples past their reach: after every bucket
        layer = bases[0]
        t0 = torch.floor((layer + o[:, 0]).clamp(0, T - 1)).long()
        t1 = (t0 + 1).clamp(max=T - 1)
        for rel in range(-elo, ehi + 1):
            f = layer + rel
            if not 0 <= f < T:
                continue  # no such frame: no walk
            a, e = (int(v) for v in frame_range(starts, rel, bound))
            want = {j for j in range(kk) if ok[j] and (t0[j] == f or t1[j] == f)}
            assert set(js[a:e].tolist()) == want, (b, t, y, x, h, jt, rel)
    assert late == 2


def test_a_sample_past_its_layers_reach_is_broken_though_inside_the_halo():
    """A sample whose lower time corner leaves its window layer's reach (the frames the kernels walk that
    layer in) gives a NaN row even where its corners stay inside the tile's halo (another layer's
    reach): never a silently missing corner."""
    grid, window, bound = (5, 4, 4), (3, 3, 3), 1.0
    shape = (1, *grid, 1, 8)
    q, k, v = make_qkv(shape, torch.float64, seed=8)
    off = bounded_offsets(shape, window, bound, seed=9, dtype=torch.float64)
    off[0, 2, 1, 1, 0, 4, 0] = 2.6  # query t = 2 (window frames 1..3), layer 0 at frame 1 -> 3.6: corners 3, 4
    got = dsa_halo_dense(q, k, v, off, window, bound, tile=(1, 4, 4))
    assert got.isnan().any(-1)[0, ..., 0].nonzero().tolist() == [[2, 1, 1]]


def test_the_gluon_kernels_read_the_order_and_records_as_they_are_written():
    """The Gluon kernels' layout of the sample order (entries per query and layer, where the bucket
    starts begin) is ``sample_order``'s, and their fields of a record's word 0 are ``RECORD_BITS``."""
    from kernels.dsa_gluon_halo import gluon_halo_refusal
    from kernels.dsa_halo_dense import ORDER_WIDTH, RECORD_BITS, RECORD_PAD, STARTS_AT

    if gluon_halo_refusal() is not None:
        pytest.skip(gluon_halo_refusal())
    from kernels import dsa_gluon_halo_jit as jit

    assert (jit.ORDER_WIDTH.value, jit.STARTS_AT.value) == (ORDER_WIDTH, STARTS_AT)
    fields = {"c00": 0, "t0": jit._T0.value, "j": jit._J.value, "lt": jit._LT.value, "ly": jit._LY.value,
              "lx": jit._LX.value}
    assert fields == {name: first for name, (first, _) in RECORD_BITS.items()}
    assert RECORD_BITS["c00"][1] == 9 and RECORD_BITS["t0"][1] == 4 and RECORD_BITS["j"][1] == 6  # the masks
    from kernels.dsa_gluon_halo import BWD_SAMPLE_CHUNK, SAMPLE_CHUNK

    for jc in (SAMPLE_CHUNK, BWD_SAMPLE_CHUNK):  # a walk's last chunk reads at most this far past a query's records:
        assert -(-49 // jc) * jc <= RECORD_PAD  # a run starts at most at 49 and the tile's longest is at most 49


@pytest.mark.parametrize("grid,window,bound,tile", [
    ((4, 10, 11), (3, 7, 7), 1.5, (1, 8, 8)),  # the Wan window: partial tiles, every border
    ((5, 9, 10), (3, 3, 3), 2.7, (1, 4, 4)),
])
def test_the_sample_records_are_the_mirrors_samples(grid, window, bound, tile):
    """``sample_records``: decoded as the fused kernels' walks decode them (upper corners one step past
    the lower), each record gives its sample's corners in the tile's halo and their trilinear weights
    exactly (fp32) as the mirror's ``_tile_samples`` (every corner of nonzero weight), and, with the
    records' live bits, the kernels' formulas for a sample's value and its derivatives along each axis
    over a matrix on the halo give the mirror's (fp64 sums), for every query the mirror does not flag
    as broken; the records follow ``sample_order``; every field fits its width."""
    from kernels.dsa_halo_dense import RECORD_BITS, _tile_samples, halo_frame, sample_order, sample_records
    from kernels.dsa_reference import window_base_positions

    B, nh = 2, 2
    kt, kh, kw = window
    kk = kh * kw
    off = bounded_offsets((B, *grid, nh, 8), window, bound, seed=5, dtype=torch.bfloat16)
    off[1, 1, 2, 3, 0, kk + 3, 1] = 2 * bound + 1  # past the bound: the mirror's broken, sorted last here
    off[0, 1, -1, -1, 1, kk - 1] = torch.tensor([1.0, 0.0, -0.0])  # on the last row and column, exactly
    rec = sample_records(off, window, bound, tile)
    order = sample_order(off, window, bound)
    assert rec.shape == (B, *grid, nh, kt, kk, 4) and rec.dtype == torch.int32
    w0 = rec[..., 0].long()
    field = {n: (w0 >> first) & ((1 << bits) - 1) for n, (first, bits) in RECORD_BITS.items()}
    assert (w0 >> sum(RECORD_BITS["lx"]) == 0).all()
    packed = order[..., :kk].long()
    assert torch.equal(field["j"], (packed >> 3) * kw + (packed & 7))
    inv = torch.argsort(field["j"], dim=-1)  # back to the layer's sample order
    field = {n: torch.gather(v, -1, inv) for n, v in field.items()}
    fy, fx, ft = (torch.gather(rec[..., i], -1, inv).contiguous().view(torch.float32) for i in (1, 2, 3))
    _, FXk, _, _ = halo_frame(window, bound, tile)
    base = window_base_positions(grid, window)
    g = torch.Generator().manual_seed(6)
    checked = 0
    for t in halo_tiles(grid, window, bound, tile):
        sl = tuple(slice(lo, hi + 1) for lo, hi in zip(t.q_lo, t.q_hi))
        o = off[(slice(None), *sl)].movedim(4, 1).reshape(B * nh, -1, kt * kk, 3)
        smp = _tile_samples(o, base[sl].reshape(-1, kt * kk, 3), t, grid, torch.float32, bound)

        def per_query(x):  # (B, qt, qy, qx, nh, kt, kk) -> (B * nh, M, K), as the mirror's
            return x[(slice(None), *sl)].movedim(4, 1).reshape(B * nh, -1, kt * kk)

        f = {n: per_query(v) for n, v in field.items()}
        fr = {"t": per_query(ft), "y": per_query(fy), "x": per_query(fx)}
        ht, hy, hx = t.halo_shape
        ok = ~smp.broken[..., None].expand_as(f["j"])
        L = (ht + 1) * (hy + 1) * (hx + 1)
        X = torch.randn((B * nh, L), generator=g, dtype=torch.float64)

        def at(i, y, x):  # X at halo positions (t, y, x) of the wider halo, per sample
            return torch.gather(X, 1, ((i * (hy + 1) + y) * (hx + 1) + x).clamp(0, L - 1).flatten(1)).view(i.shape)

        Xk = {}  # the matrix at each corner as the kernels read it, on a halo one step wider per axis
        want_val, want_d = 0, 0
        for c, (ct, cy, cx) in enumerate(itertools.product((0, 1), repeat=3)):
            it, iy, ix = f["t0"] + ct, f["c00"] // FXk + cy, f["c00"] % FXk + cx
            wt, wy, wx = (fr[a] if on else 1 - fr[a] for a, on in zip("tyx", (ct, cy, cx)))
            w = wt * wy * wx
            assert torch.equal(w[ok], smp.w[c][ok]), (t, c)
            mine = ((it * hy + iy) * hx + ix).clamp(0, ht * hy * hx - 1)
            used = ok & (w != 0)
            assert torch.equal(mine[used], smp.idx[c][used]), (t, c)
            Xk[ct, cy, cx] = at(it, iy, ix)
            Xm = at(smp.idx[c] // (hy * hx), (smp.idx[c] // hx) % hy, smp.idx[c] % hx)  # the mirror's corner c
            want_val = want_val + smp.w[c].double() * Xm
            want_d = want_d + smp.dw[c].double() * Xm[..., None]
        ty, tx, tt = (fr[a].double() for a in "yxt")
        bil = {ct: (1 - ty) * ((1 - tx) * Xk[ct, 0, 0] + tx * Xk[ct, 0, 1]) + ty * ((1 - tx) * Xk[ct, 1, 0]
                                                                                    + tx * Xk[ct, 1, 1])
               for ct in (0, 1)}
        gy = {ct: (1 - tx) * (Xk[ct, 1, 0] - Xk[ct, 0, 0]) + tx * (Xk[ct, 1, 1] - Xk[ct, 0, 1]) for ct in (0, 1)}
        gx = {ct: (1 - ty) * (Xk[ct, 0, 1] - Xk[ct, 0, 0]) + ty * (Xk[ct, 1, 1] - Xk[ct, 1, 0]) for ct in (0, 1)}
        wts = {0: 1 - tt, 1: tt}
        got_val = wts[0] * bil[0] + wts[1] * bil[1]
        live = {a: f["l" + a].double() for a in "tyx"}
        got_d = torch.stack((live["t"] * (bil[1] - bil[0]), live["y"] * (wts[0] * gy[0] + wts[1] * gy[1]),
                             live["x"] * (wts[0] * gx[0] + wts[1] * gx[1])), dim=-1)
        torch.testing.assert_close(got_val[ok], want_val[ok], rtol=1e-6, atol=1e-6)  # weights: fp32 products
        torch.testing.assert_close(got_d[ok], want_d[ok], rtol=1e-6, atol=1e-6)
        checked += int((~smp.broken).sum())
    assert checked == B * nh * grid[0] * grid[1] * grid[2] - 1  # every query but the one past the bound
