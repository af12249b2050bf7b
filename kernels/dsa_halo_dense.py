"""The fused halo-dense algorithm of 3D-DSA, as a blocked PyTorch mirror.

This file is the executable definition of the fused kernels' algorithm (one program per 3D query
tile and (batch, head) pair): the same tiles, halo, order of operations and dtypes, written with
PyTorch tensors so that it runs, and is tested against ``dsa_reference``, on a CPU. A GPU kernel of
this algorithm must match it.

Per query tile (``TILE`` = (1, 8, 8) tokens by default) and (batch, head):

1. **Halo.** The box of keys every sample of the tile can touch, given the caller's bound ``b`` on
   ``|offsets|`` (``attention.max_offset``): per axis from ``floor(s_first - b)`` to
   ``floor(s_last + k - 1 + b) + 1``, clipped to the grid (``s`` the window start of the tile's
   first and last query). At Wan 480p (window 3x7x7, b = 1.5) a 1x8x8 tile's halo is 7 x 18 x 18
   keys (fewer at borders).
2. **Scores on tensor cores.** ``S = Q K_halo^T`` for the tile's queries against the whole halo, in
   fp32 from the inputs' dtype (bf16 operands, fp32 accumulation).
3. **Interpolated scores.** Trilinear interpolation is linear, so a sample's score is the weighted
   sum of its 8 corners' scores: ``s_j = sum_c w_jc S[:, h_jc]`` (8 weighted reads per sample, not
   8 x d). Positions and weights are fp32, clamped to the grid as the operator defines them.
4. **Softmax** over the window's samples in fp32 (max, exp, sum), and the log-sum-exp kept for the
   backward.
5. **Probabilities onto the halo.** ``P[:, h] = sum_{j, c: h_jc = h} p_j w_jc`` (a scatter-add of 8
   weighted values per sample), then ``O = P V_halo`` on tensor cores, P cast to the inputs' dtype
   as flash attention casts its probabilities.

The backward reruns 2-4 from the saved log-sum-exp and, per tile:
``dP = dO V_halo^T``; ``dp_j = sum_c w_jc dP[:, h_jc]``; ``ds_j = p_j (dp_j - D)`` with
``D = rowsum(dO * O)``; ``dS[:, h] = scale * sum ds_j w_jc`` (scatter-add); ``dQ = dS K_halo``;
``dK_halo = dS^T Q``; ``dV_halo = P^T dO``; and the offsets' gradient from the weights'
derivatives: ``dL/dw_jc = scale ds_j S[:, h_jc] + p_j dP[:, h_jc]`` times ``dw_jc/dpos`` per axis
(0 where the position was clamped), summed as ``p_j (d(dp_j)/dpos + scale (dp_j - D) dz_j/dpos)``
with ``dX_j/dpos = sum_c X[:, h_jc] dw_jc/dpos`` (X = dP, S): each derivative is taken beside the
sample's value, dp first, so the kernel computes S and dP once a frame. Halos of neighbouring tiles
overlap, so ``dK_halo`` and ``dV_halo`` are added into dk, dv **in colour phases**: tiles whose index along each axis agrees
modulo that axis's colour count (the number of tiles one halo spans) never share a key, so the
tiles of one phase add their halos without atomics and in a fixed order (deterministic); the
phases run one after another. No per-sample record goes to memory: everything per sample lives in
the tile's program.

The kernels walk the samples frame by frame (a frame's scores are in shared memory one frame at a
time), and a sample touches 2 of the 5 frames its window layer can reach (bound 1.5): the samples of
each query and layer are sorted by their lower time corner before the launch (``sample_order``), so
the samples touching a frame are one run of that order (``frame_range``) and a walk visits only them.
The sums are the same as over every sample (the others have weight 0 in that frame); this mirror
computes them over every sample at once, and ``tests/test_dsa_halo_dense.py`` holds the runs to the
frames' samples.

A query with a sample whose lower corner lies past its reach on some axis (an offset beyond the
promised bound: ``time_reach``) is not computed: its output row and its ``dq`` row are NaN, as in
the GPU kernels, so a broken promise shows instead of giving a wrong number (the kernels sort such
samples out of every walk and flag the query before the first frame).

``halo_dense_counts`` gives the algorithm's work per call (tensor-core MACs, weighted gathers and
scatters, phases): the inputs of the cost model's row for these kernels (``kernels/dsa_cost.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .dsa_reference import validate_dsa_inputs, window_base_positions, window_starts

__all__ = ["TILE", "Tile", "dsa_halo_dense", "halo_box", "halo_tiles", "colour_counts", "halo_dense_counts",
           "time_reach", "sample_order", "frame_range",
           "sample_limits", "halo_frame", "sample_records", "RECORD_BITS", "RECORD_PAD"]

TILE = (1, 8, 8)  # queries per tile (t, y, x): 64 rows, the M of one warpgroup's MMA


def halo_box(first: int, last: int, size: int, kwin: int, bound: float) -> tuple[int, int]:
    """The keys ``[lo, hi]`` (inclusive) along one axis that the samples of queries ``first..last``
    can touch when every offset is within ``bound``: corners ``floor(p)`` and ``floor(p) + 1`` of
    positions ``clamp(s + j + o, 0, size - 1)``."""
    s = window_starts(size, kwin)
    lo = math.floor(int(s[first]) - bound)
    hi = math.floor(int(s[last]) + kwin - 1 + bound) + 1
    return max(0, lo), min(size - 1, hi)


@dataclass(frozen=True)
class Tile:
    """One query tile: its query box ``q_lo..q_hi`` and key halo ``k_lo..k_hi`` (inclusive, per
    axis t, y, x), and its index along each axis (for the colour phases)."""

    index: tuple[int, int, int]
    q_lo: tuple[int, int, int]
    q_hi: tuple[int, int, int]
    k_lo: tuple[int, int, int]
    k_hi: tuple[int, int, int]

    @property
    def halo_shape(self) -> tuple[int, int, int]:
        return tuple(h - lo + 1 for lo, h in zip(self.k_lo, self.k_hi))


def halo_tiles(grid: Sequence[int], window: Sequence[int], bound: float, tile=TILE) -> list[Tile]:
    """Every query tile of ``grid`` with its halo, in (t, y, x) order; border tiles are partial."""
    per_axis = []
    for size, kwin, step in zip(grid, window, tile):
        per_axis.append([(i, a, min(a + step, size) - 1, *halo_box(a, min(a + step, size) - 1, size, kwin, bound))
                         for i, a in enumerate(range(0, size, step))])
    return [Tile(tuple(p[0] for p in c), tuple(p[1] for p in c), tuple(p[2] for p in c),
                 tuple(p[3] for p in c), tuple(p[4] for p in c)) for c in itertools.product(*per_axis)]


def colour_counts(tiles: list[Tile]) -> tuple[int, int, int]:
    """Per axis, the smallest ``c`` such that tiles whose indices differ by a multiple of ``c`` have
    disjoint halos along that axis: tiles of one colour never share a key."""
    counts = []
    for axis in range(3):
        spans = {(t.index[axis], t.k_lo[axis], t.k_hi[axis]) for t in tiles}
        c = 1
        while any(i != j and (i - j) % c == 0 and lo1 <= hi2 and lo2 <= hi1
                  for i, lo1, hi1 in spans for j, lo2, hi2 in spans):
            c += 1
        counts.append(c)
    return tuple(counts)


def _phases(tiles: list[Tile]) -> list[list[Tile]]:
    """The tiles grouped by colour (index modulo the colour counts), phases in a fixed order."""
    counts = colour_counts(tiles)
    phases: dict[tuple, list[Tile]] = {}
    for t in tiles:
        phases.setdefault(tuple(i % c for i, c in zip(t.index, counts)), []).append(t)
    return [phases[key] for key in sorted(phases)]


# -----------------------------------------------------------------------------
# The samples in frame order: which samples a kernel's walk over one frame visits


ORDER_WIDTH = 64  # int8 entries per (query, head, window layer): the order, then the bucket starts
STARTS_AT = 56  # where the bucket starts begin (a layer of at most 56 samples, at most 7 buckets)


def time_reach(bound: float) -> tuple[int, int]:
    """``(ELO, EHI)``: a sample of window layer ``jt`` at offset ``|o| <= bound`` has its lower time corner
    in frames ``st + jt - ELO .. st + jt + EHI - 1`` and touches ``st + jt - ELO .. st + jt + EHI``."""
    return math.ceil(bound), math.floor(bound) + 1


def sample_limits(window, bound: float, tile=TILE) -> None:
    """Refuse a window, bound or tile the sample order and records cannot hold (``ValueError`` naming
    them): a layer of at most ``STARTS_AT`` samples, ``kw <= 8`` and ``kh <= 15`` (the order's
    ``jy * 8 + jx``), a bound of at most 3 (its buckets), and a halo frame buffer of at most 512
    positions and 16 frames (the records' fields, ``RECORD_BITS``)."""
    kt, kh, kw = (int(w) for w in window)
    elo, ehi = time_reach(bound)
    sw = halo_frame(window, bound, tile)[3]
    if (kh * kw > STARTS_AT or kw > 8 or kh > 15 or elo + ehi + 1 > ORDER_WIDTH - STARTS_AT or sw > 512
            or tile[0] - 1 + kt + elo + ehi > 16):
        raise ValueError(f"window {tuple(window)}, bound {bound}, tile {tuple(tile)}: the sample order and records "
                         f"hold layers of at most {STARTS_AT} samples (kw <= 8, kh <= 15), bounds of at most 3 and "
                         f"halo frames of at most 512 positions; use a smaller window or bound")


def halo_frame(window, bound: float, tile=TILE) -> tuple[int, int, int, int]:
    """``(FY, FX, NCH, SW)``: the largest halo frame of a ``tile``'s queries (rows, columns), its chunks
    of 64 keys, and the width of the fused kernels' frame buffer (a power of two past them)."""
    _, kh, kw = (int(w) for w in window)
    elo, ehi = time_reach(bound)
    fy, fx = tile[1] - 1 + kh - 1 + elo + ehi + 1, tile[2] - 1 + kw - 1 + elo + ehi + 1
    nch = -(-fy * fx // 64)
    return fy, fx, nch, 1 << (nch * 64 - 1).bit_length()


def _sorted_samples(offsets: torch.Tensor, window, bound: float):
    """Per query, head and layer: each sample's sort key (its lower time corner's bucket, or past the
    reach), the stable order by key, and the fp32 positions per axis (raw and clamped) with their
    window bases (``(B, T, H, W, nh, kt, kh, kw)`` each)."""
    B, T, H, W, nh, K, _ = offsets.shape
    kt, kh, kw = (int(w) for w in window)
    elo, ehi = time_reach(bound)
    dev = offsets.device
    off = offsets.float().reshape(B, T, H, W, nh, kt, kh, kw, 3)
    rel, axes = [], []
    for axis, (size, k) in enumerate(zip((T, H, W), (kt, kh, kw))):
        view = [1] * 8
        view[1 + axis], view[5 + axis] = size, k
        base = (window_starts(size, k, dev)[:, None] + torch.arange(k, device=dev)).float().view(view)
        raw = base + off[..., axis]
        p = raw.clamp(0, size - 1)
        rel.append(torch.floor(p) - base)  # lower corner - base
        axes.append((raw, p))
    key = rel[0].reshape(B, T, H, W, nh, kt, kh * kw) + elo
    inside = torch.stack([(r >= -elo) & (r <= ehi - 1) for r in rel]).all(0).reshape(key.shape)
    key = torch.where(inside, key, torch.full_like(key, elo + ehi)).to(torch.int64)
    return key, torch.sort(key, dim=-1, stable=True).indices, axes


def sample_order(offsets: torch.Tensor, window, bound: float) -> torch.Tensor:
    """Each query's samples of each window layer sorted by their lower time corner: ``(B, T, H, W, nh, kt,
    ORDER_WIDTH)`` int8, entries ``[:kh*kw]`` the layer's samples as ``jy * 8 + jx`` (stable: ascending
    within a frame), entries ``STARTS_AT + b`` (``b = 0 .. ELO + EHI``) where bucket ``b`` starts, bucket
    ``b`` the samples whose lower time corner is frame ``st + jt - ELO + b``. A sample with a lower corner
    past its reach on any axis (``time_reach``: an offset past the bound) is sorted last, after
    ``STARTS_AT + ELO + EHI``'s count, and its query is broken (NaN rows). So the samples that touch a
    frame (lower corner there or one below) are one contiguous run of the order (``frame_range``), and
    a kernel's walk over a frame visits only them. Computed where the offsets are (no host sync),
    positions in fp32 as the kernels compute them."""
    sample_limits(window, bound)
    B, T, H, W, nh, K, _ = offsets.shape
    kt, kh, kw = (int(w) for w in window)
    nb = sum(time_reach(bound))
    key, order, _ = _sorted_samples(offsets, window, bound)
    starts = torch.stack([(key < b).sum(-1) for b in range(nb + 1)], dim=-1)
    out = torch.zeros((B, T, H, W, nh, kt, ORDER_WIDTH), dtype=torch.int8, device=offsets.device)
    out[..., :kh * kw] = (order // kw * 8 + order % kw).to(torch.int8)
    out[..., STARTS_AT:STARTS_AT + nb + 1] = starts.to(torch.int8)
    return out


RECORD_BITS = {"c00": (0, 9), "t0": (9, 4), "j": (13, 6), "lt": (19, 1), "ly": (20, 1), "lx": (21, 1)}
# field: (first bit, bits) of a record's word 0
RECORD_PAD = 64  # records past the last: a walk's chunk may read up to 56 past its query's (weight 0)


def sample_records(offsets: torch.Tensor, window, bound: float, tile=TILE) -> torch.Tensor:
    """Every sample as the fused kernels' walks read it, in ``sample_order``'s order: ``(B, T, H, W, nh,
    kt, kh*kw, 4)`` int32, record ``r`` of a query's layer the sample at position ``r`` of its order.
    Word 0 packs (``RECORD_BITS``) the lower corner's column in the kernels' frame buffer relative to the
    query's tile's halo (``c00 = y0 * FX + x0``, clamped to ``[0, SW - FX - 2]``; ``halo_frame``), the
    lower time corner's frame in the halo (``t0``), the sample's index in its layer (``j``), and per axis
    whether the weights' derivative along it is live (``lt, ly, lx``: the clamp passes the gradient,
    raw position within the grid, and the upper corner is not the lower one); words 1-3 the fractions
    ``fy, fx, ft`` (fp32 bits). The walks take the upper corners one step past the lower (``c00 + 1``,
    ``c00 + FX``, ``t0 + 1``): where the clamp makes them one (the grid's last row, column or frame)
    the fraction is exactly 0 and the axis not live, so the step reads a finite value that counts 0.
    So a walk reads 16 bytes per sample and computes no position: the positions, clamps and floors
    are this one pass's, in fp32 as the operator's. Fields of samples past their reach are clamped to
    their widths (never walked)."""
    sample_limits(window, bound, tile)
    B, T, H, W, nh, K, _ = offsets.shape
    kt, kh, kw = (int(w) for w in window)
    elo, _ = time_reach(bound)
    _, FX, _, SW = halo_frame(window, bound, tile)
    dev = offsets.device
    _, order, axes = _sorted_samples(offsets, window, bound)
    fields, frac = [], []
    for axis, (size, k, step) in enumerate(zip((T, H, W), (kt, kh, kw), tile)):
        raw, p = axes[axis]
        first = torch.arange(size, device=dev) // step * step  # each query's tile's first row on this axis
        lo = (window_starts(size, k, dev)[first] - elo).clamp(min=0)
        view = [1] * 8
        view[1 + axis] = size
        i0 = torch.floor(p)
        live = (raw >= 0) & (raw <= size - 1) & (i0 < size - 1)
        fields.append((i0.long() - lo.view(view), live.long()))
        frac.append(p - i0)
    (t0, lt), (y0, ly), (x0, lx) = fields
    c00 = (y0 * FX + x0).clamp(0, SW - FX - 2)
    j = torch.arange(kh * kw, device=dev).view(kh, kw).expand_as(c00)
    vals = {"c00": c00, "t0": t0.clamp(0, 15), "j": j, "lt": lt, "ly": ly, "lx": lx}
    w0 = sum(vals[name] << first for name, (first, _) in RECORD_BITS.items())
    words = [w0.to(torch.int32)] + [f.contiguous().view(torch.int32) for f in (frac[1], frac[2], frac[0])]
    rec = torch.stack([w.reshape(B, T, H, W, nh, kt, kh * kw) for w in words], dim=-1)
    return torch.gather(rec, 6, order[..., None].expand_as(rec))


def frame_range(starts: torch.Tensor, rel: int, bound: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The run ``[a, e)`` of a layer's order (``sample_order``) whose samples touch the frame ``rel`` frames
    from the layer's (``rel = f - st - jt``, in ``-ELO .. EHI``): lower corner there or one below.
    ``starts (..., ELO + EHI + 1)``: the bucket starts."""
    elo, ehi = time_reach(bound)
    nb = elo + ehi
    lo, hi = min(max(rel - 1 + elo, 0), nb), min(max(rel + elo + 1, 0), nb)
    return starts[..., lo], starts[..., hi]


# -----------------------------------------------------------------------------
# One tile's samples: corners as halo indices, weights and their derivatives


@dataclass
class _Samples:
    idx: list[torch.Tensor]  # 8 x (BH, M, K) int64: corner c's flat index into the tile's halo
    w: list[torch.Tensor]  # 8 x (BH, M, K) fp32: corner c's trilinear weight
    dw: list[torch.Tensor]  # 8 x (BH, M, K, 3) fp32: d w_c / d position per axis (0 where clamped)
    broken: torch.Tensor  # (BH, M) bool: a corner lies outside the halo (offset past the bound)


def _tile_samples(off: torch.Tensor, base: torch.Tensor, tile: Tile, grid, cd: torch.dtype, bound: float) -> _Samples:
    """Corners of the samples of one tile's queries. ``off (BH, M, K, 3)``, ``base (M, K, 3)``;
    positions and weights in ``cd`` (fp32, or fp64 for fp64 inputs). A sample is broken where a lower
    corner leaves its reach on some axis (``time_reach``: an offset past the bound; the kernels sort it
    out of every walk, ``sample_order``), which it must for a corner to leave the tile's halo."""
    raw = base.to(cd)[None] + off.to(cd)
    axes = []
    for a, size in enumerate(grid):
        r = raw[..., a]
        p = r.clamp(0, size - 1)
        i0 = torch.floor(p)
        f = p - i0
        i0 = i0.long()
        i1 = (i0 + 1).clamp(max=size - 1)
        live = ((r >= 0) & (r <= size - 1)).to(cd)  # clamp passes the gradient on [0, size - 1]
        out = (i0 < tile.k_lo[a]) | (i1 > tile.k_hi[a])
        axes.append((i0 - tile.k_lo[a], i1 - tile.k_lo[a], f, live, out))
    _, FY, FX = tile.halo_shape
    idx, w, dw = [], [], []
    for ct, cy, cx in itertools.product((0, 1), repeat=3):
        pick = [(ax[c], ax[2] if c else 1 - ax[2], (1.0 if c else -1.0) * ax[3])
                for ax, c in zip(axes, (ct, cy, cx))]
        (it, wt, gt), (iy, wy, gy), (ix, wx, gx) = pick
        flat = ((it * FY + iy) * FX + ix).clamp(0, tile.halo_shape[0] * FY * FX - 1)
        idx.append(flat)
        w.append(wt * wy * wx)
        dw.append(torch.stack((gt * wy * wx, wt * gy * wx, wt * wy * gx), dim=-1))
    elo, ehi = time_reach(bound)
    late = torch.zeros_like(axes[0][4])
    for a in range(3):  # a lower corner past its reach (``time_reach``, on every axis): implies ``out``
        rel = axes[a][0] + tile.k_lo[a] - base[None, ..., a]
        late = late | (rel < -elo) | (rel > ehi - 1)
    broken = (axes[0][4] | axes[1][4] | axes[2][4] | late).any(dim=-1)
    return _Samples(idx, w, dw, broken)


def _gather(mat: torch.Tensor, smp: _Samples) -> torch.Tensor:
    """``sum_c w_c mat[:, :, h_c]`` per sample: ``(BH, M, Nh) -> (BH, M, K)``, corners in order."""
    acc = None
    for idx, w in zip(smp.idx, smp.w):
        term = w * torch.gather(mat, 2, idx)
        acc = term if acc is None else acc + term
    return acc


def _scatter(vals: torch.Tensor, smp: _Samples, halo: int) -> torch.Tensor:
    """``out[:, :, h] = sum_{j, c: h_jc = h} vals_j w_jc``: ``(BH, M, K) -> (BH, M, Nh)`` fp32."""
    out = vals.new_zeros(*vals.shape[:2], halo)
    for idx, w in zip(smp.idx, smp.w):
        out.scatter_add_(2, idx, vals * w)
    return out


# -----------------------------------------------------------------------------
# The blocked forward and backward


def _mm(a: torch.Tensor, b: torch.Tensor, io: torch.dtype) -> torch.Tensor:
    """A tensor-core product: operands in the inputs' dtype ``io``, fp32 accumulation (fp64 for fp64)."""
    cd = torch.promote_types(io, torch.float32)
    return torch.matmul(a.to(io).to(cd), b.to(io).to(cd))


class _Layout:
    """The call's tensors as (BH, N, d) rows and the geometry shared by forward and backward."""

    def __init__(self, q, offsets, window, bound, tile):
        B, T, H, W, nh, d = q.shape
        self.grid, self.window, self.io = (T, H, W), tuple(window), q.dtype
        self.cd = torch.promote_types(q.dtype, torch.float32)  # positions, weights, softmax, sums
        self.B, self.nh, self.d, self.K = B, nh, d, window[0] * window[1] * window[2]
        self.tiles = halo_tiles(self.grid, self.window, bound, tile)
        self.bound = float(bound)
        self.base = window_base_positions(self.grid, self.window).to(q.device)  # (T, H, W, K, 3)
        self.off = offsets.permute(0, 4, 1, 2, 3, 5, 6).reshape(B * nh, T, H, W, self.K, 3)

    def rows(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, H, W, nh, d) -> (BH, T, H, W, d)
        B, T, H, W, nh, d = x.shape
        return x.permute(0, 4, 1, 2, 3, 5).reshape(B * nh, T, H, W, d)

    def unrows(self, x: torch.Tensor) -> torch.Tensor:
        T, H, W = self.grid
        return x.reshape(self.B, self.nh, T, H, W, -1).permute(0, 2, 3, 4, 1, 5)

    def box(self, x: torch.Tensor, lo, hi) -> torch.Tensor:  # (BH, T, H, W, ...) -> (BH, n, ...)
        part = x[:, lo[0]:hi[0] + 1, lo[1]:hi[1] + 1, lo[2]:hi[2] + 1]
        return part.reshape(part.shape[0], -1, *part.shape[4:])

    def samples(self, tile: Tile) -> _Samples:
        off = self.box(self.off, tile.q_lo, tile.q_hi)
        base = self.base[tile.q_lo[0]:tile.q_hi[0] + 1, tile.q_lo[1]:tile.q_hi[1] + 1,
                         tile.q_lo[2]:tile.q_hi[2] + 1].reshape(-1, self.K, 3)
        return _tile_samples(off, base, tile, self.grid, self.cd, self.bound)


def _tile_probs(qt, kh, smp: _Samples, scale: float, io, lse=None):
    """Steps 2-4: the tile's halo scores S, and the samples' probabilities (and log-sum-exp)."""
    S = _mm(qt, kh.transpose(1, 2), io)
    z = scale * _gather(S, smp)
    if lse is None:
        m = z.amax(dim=-1, keepdim=True)
        e = torch.exp(z - m)
        lsum = e.sum(dim=-1, keepdim=True)
        return S, e / lsum, (m + torch.log(lsum)).squeeze(-1)
    return S, torch.exp(z - lse.unsqueeze(-1)), lse


def _forward(L: _Layout, q, k, v, scale: float):
    qr, kr, vr = L.rows(q), L.rows(k), L.rows(v)
    out = torch.empty_like(qr, dtype=L.io)
    lse = torch.empty(qr.shape[:4], dtype=L.cd, device=q.device)
    for tile in L.tiles:
        smp = L.samples(tile)
        kh, vh = L.box(kr, tile.k_lo, tile.k_hi), L.box(vr, tile.k_lo, tile.k_hi)
        S, p, tl = _tile_probs(L.box(qr, tile.q_lo, tile.q_hi), kh, smp, scale, L.io)
        P = _scatter(p, smp, kh.shape[1])
        o = _mm(P, vh, L.io)
        o[smp.broken] = float("nan")
        sl = (slice(None), *(slice(a, b + 1) for a, b in zip(tile.q_lo, tile.q_hi)))
        out[sl] = o.reshape(out[sl].shape).to(L.io)
        lse[sl] = tl.reshape(lse[sl].shape)
    return out, lse


def _backward(L: _Layout, q, k, v, out, lse, dout, scale: float):
    qr, kr, vr, dor = (L.rows(x) for x in (q, k, v, dout))
    outr, lser = out, lse  # the forward's, already (BH, T, H, W, ...)
    dq = torch.empty_like(qr, dtype=L.cd)
    dk = torch.zeros_like(kr, dtype=L.cd)
    dv = torch.zeros_like(vr, dtype=L.cd)
    doff = torch.empty_like(L.off, dtype=L.cd)
    for phase in _phases(L.tiles):  # tiles of one phase share no key: plain adds, fixed order
        for tile in phase:
            smp = L.samples(tile)
            qt, dot = L.box(qr, tile.q_lo, tile.q_hi), L.box(dor, tile.q_lo, tile.q_hi)
            kh, vh = L.box(kr, tile.k_lo, tile.k_hi), L.box(vr, tile.k_lo, tile.k_hi)
            S, p, _ = _tile_probs(qt, kh, smp, scale, L.io, L.box(lser, tile.q_lo, tile.q_hi))
            D = (dot.to(L.io).to(L.cd) * L.box(outr, tile.q_lo, tile.q_hi).to(L.cd)).sum(-1, keepdim=True)
            dP = _mm(dot, vh.transpose(1, 2), L.io)
            dp = _gather(dP, smp)
            ds = p * (dp - D)
            dS = _scatter(scale * ds, smp, kh.shape[1])
            P = _scatter(p, smp, kh.shape[1])
            dqt = _mm(dS, kh, L.io)
            dqt[smp.broken] = float("nan")
            # dL/dpos = scale ds dz/dpos + p d(dp)/dpos = p (d(dp)/dpos + scale (dp - D) dz/dpos), each
            # derivative sum_c X_c dw_c/dpos (X = dP, S), in the kernel's order: d(dp)/dpos beside dp (its pass
            # 1), dz/dpos times scale (dp - D) beside z (pass 2), all times p once z gives p
            ddp, dz = (sum(torch.gather(X, 2, idx).unsqueeze(-1) * dw for idx, dw in zip(smp.idx, smp.dw))
                       for X in (dP, S))
            g = p.unsqueeze(-1) * (ddp + (scale * (dp - D)).unsqueeze(-1) * dz)
            _put(dq, tile, dqt)
            _put(doff, tile, g)
            _add(dk, tile, _mm(dS.transpose(1, 2), qt, L.io))
            _add(dv, tile, _mm(P.transpose(1, 2), dot, L.io))
    return dq, dk, dv, doff


def _put(dst: torch.Tensor, tile: Tile, val: torch.Tensor) -> None:
    sl = (slice(None), *(slice(a, b + 1) for a, b in zip(tile.q_lo, tile.q_hi)))
    dst[sl] = val.reshape(dst[sl].shape)


def _add(dst: torch.Tensor, tile: Tile, val: torch.Tensor) -> None:
    sl = (slice(None), *(slice(a, b + 1) for a, b in zip(tile.k_lo, tile.k_hi)))
    dst[sl] += val.reshape(dst[sl].shape)


class _DSAHaloDense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, window, scale, bound, tile):
        L = _Layout(q, offsets, window, bound, tile)
        out, lse = _forward(L, q, k, v, scale)
        ctx.save_for_backward(q, k, v, offsets, out, lse)
        ctx.args = (window, scale, bound, tile)
        return L.unrows(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, offsets, out, lse = ctx.saved_tensors
        window, scale, bound, tile = ctx.args
        L = _Layout(q, offsets, window, bound, tile)
        dq, dk, dv, doff = _backward(L, q, k, v, out, lse, dout, scale)
        B, T, H, W, nh, _ = q.shape
        doff = doff.reshape(B, nh, T, H, W, L.K, 3).permute(0, 2, 3, 4, 1, 5, 6)
        return (L.unrows(dq).to(q.dtype), L.unrows(dk).to(k.dtype), L.unrows(dv).to(v.dtype),
                doff.to(offsets.dtype), None, None, None, None)


def dsa_halo_dense(q, k, v, offsets, window, bound: float, scale: float | None = None, tile=TILE):
    """3D-DSA computed as the fused halo-dense kernels compute it (module docstring), for offsets the
    caller guarantees within ``bound``. Same shapes and dtypes as ``dsa_reference``."""
    win = validate_dsa_inputs(q, k, v, offsets, window)
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= 0):
        raise ValueError(f"bound={bound!r}: the halo-dense algorithm needs a finite bound >= 0 on |offsets| "
                         "(attention.max_offset)")
    tile = tuple(int(t) for t in tile)
    if len(tile) != 3 or min(tile) < 1:
        raise ValueError(f"tile={tile!r}: three positive ints (t, y, x)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _DSAHaloDense.apply(q, k, v, offsets, win, scale, float(bound), tile)


# -----------------------------------------------------------------------------
# Work per call, for the cost model


def halo_dense_counts(grid, window, head_dim: int, bound: float, tile=TILE) -> dict:
    """Work of one (batch, head) pair, forward and backward: tensor-core MACs at the MMA's padded
    sizes (M to 64, halo keys to a multiple of 64 per frame), weighted corner reads and writes
    (``gathers``/``scatters``, one per sample corner), samples, tiles and colour phases."""
    tiles = halo_tiles(grid, window, bound, tile)
    K = window[0] * window[1] * window[2]
    macs = 0
    halo_keys = 0
    samples = 0
    for t in tiles:
        ft, fy, fx = t.halo_shape
        m = math.prod(h - lo + 1 for lo, h in zip(t.q_lo, t.q_hi))
        keys_padded = ft * (-(-fy * fx // 64) * 64)
        macs += 64 * -(-max(m, 1) // 64) * keys_padded * head_dim
        halo_keys += ft * fy * fx
        samples += m * K
    return {
        "tiles": len(tiles), "phases": math.prod(colour_counts(tiles)),
        "mean_halo_keys": halo_keys / len(tiles), "samples": samples,
        # forward: S = Q K^T, O = P V; backward: S, dP = dO V^T, dQ = dS K, dK = dS^T Q, dV = P^T dO
        "fwd_macs": 2 * macs, "bwd_macs": 5 * macs,
        # forward: score gather + P scatter; backward: score gather, dP gather, dS scatter, P scatter,
        # and the offsets' S and dP reads
        "fwd_corner_ops": 2 * 8 * samples, "bwd_corner_ops": 6 * 8 * samples,
    }
