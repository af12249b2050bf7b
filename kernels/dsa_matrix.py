"""3D-DSA on the CPU for small token grids: ``dsa_matrix``.

The same function as ``dsa_reference`` (docs/dsa.md), written
for grids small enough that an N x N matrix per batch item and head is cheap (N = T*H*W tokens,
a few hundred): per (batch item, head), with the reference's corner tokens ``r[m, j, c]`` and
trilinear weights ``W[m, j, c]`` of query m, sample j, corner c,

    QK[m, n] = <q_m, k_n>                                      (one matmul)
    s[m, j]  = scale * sum_c W[m, j, c] QK[m, r[m, j, c]]      (= scale * <q_m, k_j>: k_j is linear in the corners)
    a        = softmax_j(s)
    P[m, n]  = sum_{(j, c) : r[m, j, c] = n} a[m, j] W[m, j, c]  (the attention spread onto the corners)
    out      = P v                                             (one matmul)

Gradients are autograd's through ``gather``, ``scatter_add`` and the two matmuls: the same
function as the reference, so the same gradients for q, k, v and offsets up to summation order
(the offsets' through ``W``, computed by ``dsa_reference.trilinear_corners`` exactly as the
reference computes it).

Why: the linear paths (``dsa_cpu``, the reference) gather 8 corner rows per sample, element by
element; at a few hundred tokens that gather costs far more than two dense matmuls, which the CPU
runs at full speed. The cost here is O(B * nh * N^2 * d) time and O(B * nh * N^2) memory (``P`` is
kept for the backward), so ``kernels.deformable_slide_attention`` takes this path only for grids
of at most ``MATRIX_MAX_TOKENS`` tokens; above that the linear ``dsa_cpu`` is faster and its memory stays linear.

Caution: quadratic in N by construction; ``dsa_matrix`` refuses grids above
``MATRIX_LIMIT_TOKENS`` rather than allocate gigabytes.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .dsa_reference import trilinear_corners, validate_dsa_inputs, window_base_positions

__all__ = ["dsa_matrix", "matrix_path_fits", "MATRIX_MAX_TOKENS", "MATRIX_MAX_ELEMENTS", "MATRIX_LIMIT_TOKENS"]

MATRIX_MAX_TOKENS = 1024
"""``deformable_slide_attention`` on CPU tensors uses ``dsa_matrix`` up to this many tokens per
clip and ``dsa_cpu`` above: the matrix path is 1.5x faster at 1,024 tokens and the linear one
1.6x faster at 2,048 (``benchmarks/attention.py`` measures both)."""
MATRIX_MAX_ELEMENTS = 2**26
"""... and only while one N x N matrix for every batch item and head (``B * nh * N^2`` values)
stays within this many (256 MiB in fp32; the forward keeps one such matrix per call for the
backward)."""
MATRIX_LIMIT_TOKENS = 4096
"""``dsa_matrix`` refuses larger grids: its N x N matrices would take gigabytes."""


def matrix_path_fits(q: torch.Tensor, max_tokens: int = MATRIX_MAX_TOKENS) -> bool:
    """Whether ``q`` ``(B, T, H, W, nh, d)`` is small enough for ``dsa_matrix`` to be the faster
    CPU path: at most ``max_tokens`` tokens per clip and ``MATRIX_MAX_ELEMENTS`` matrix values."""
    B, T, H, W, nh = q.shape[:5]
    N = T * H * W
    return N <= max_tokens and B * nh * N * N <= MATRIX_MAX_ELEMENTS


def dsa_matrix(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets: torch.Tensor,
    window: Sequence[int],
    scale: float | None = None,
) -> torch.Tensor:
    """3D-DSA through N x N matrices: args and result as ``dsa_reference`` (computed in fp32, or
    fp64 for fp64 inputs; returned in q's dtype)."""
    win = validate_dsa_inputs(q, k, v, offsets, window)
    B, T, H, W, nh, d = q.shape
    N, K = T * H * W, win[0] * win[1] * win[2]
    if N > MATRIX_LIMIT_TOKENS:
        raise ValueError(f"dsa_matrix: a grid of {N} tokens ({T}x{H}x{W}) needs {B * nh} matrices of {N}x{N}; "
                         f"it takes at most {MATRIX_LIMIT_TOKENS} tokens. Use dsa_cpu (linear memory) instead")
    cdtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    pdtype = torch.promote_types(cdtype, torch.float32)
    scale = d ** -0.5 if scale is None else float(scale)

    # -- corner tokens and weights, (B, N, nh, K) each -> (B, nh, N, K * 8)
    base = window_base_positions((T, H, W), win, q.device).reshape(N, K, 3)
    corners = trilinear_corners(offsets.reshape(B, N, nh, K, 3), base, (T, H, W), cdtype, pdtype)
    idx = torch.stack([tok for tok, _ in corners], dim=-1).permute(0, 2, 1, 3, 4).reshape(B, nh, N, K * 8)
    wts = torch.stack([w for _, w in corners], dim=-1).permute(0, 2, 1, 3, 4).reshape(B, nh, N, K, 8)

    def heads_first(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, W, nh, d) -> (B, nh, N, d)
        return x.reshape(B, N, nh, d).transpose(1, 2).to(cdtype)

    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)

    # -- scores of the samples: the corners' dot products, trilinearly weighted
    qk = qh @ kh.transpose(-1, -2)                                      # (B, nh, N, N)
    s = (qk.gather(-1, idx).view(B, nh, N, K, 8) * wts).sum(-1) * scale  # (B, nh, N, K)
    a = torch.softmax(s, dim=-1)

    # -- the attention spread onto the corner tokens, then one matmul with v
    p = torch.zeros(B, nh, N, N, dtype=cdtype, device=q.device)
    p = p.scatter_add(-1, idx, (a.unsqueeze(-1) * wts).reshape(B, nh, N, K * 8))
    out = p @ vh                                                        # (B, nh, N, d)
    return out.transpose(1, 2).reshape(B, T, H, W, nh, d).to(q.dtype)
