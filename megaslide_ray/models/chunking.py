"""Token-chunked transformer blocks (``runtime.token_chunk``).

With ``runtime.token_chunk = N > 0`` a block (``model.DiTBlock``, ``wan.WanBlock``) runs its
per-token parts over chunks of ``N`` tokens and its self-attention over query chunks, each chunk
under its own (non-reentrant) ``torch.utils.checkpoint``. A chunk's forward keeps only its
inputs; its backward recomputes that one chunk. So inside a block's forward + backward the
temporaries that scale with ``tokens x ffn_width`` (the MLP hidden), ``tokens x nh x K`` (DSA
offsets and samples) or ``tokens x width`` copies (normalised, modulated, projected) exist for
one chunk at a time; what stays whole is ``O(tokens x width)``: the block input, ``q, k, v``
(``3 x tokens x width``), the block's intermediate residual streams and their gradients.

The helpers here are architecture-neutral:

* ``token_map``: ``fn`` over chunks of ``N`` consecutive tokens (flattened ``T*H*W`` order),
  checkpointed per chunk, outputs concatenated.
* ``time_slabs``: the query slabs of windowed attention (whole time frames) and, per slab, the
  frames its keys and values come from (the slab plus the halo its windows and offsets reach).
* ``FrameRanges``: overlapping frame ranges of a whole tensor (a slab's queries, its held keys)
  whose gradients add into one buffer instead of one zero-filled whole-size tensor per slab.
* ``slabbed_attention``: the windowed self-attention driver both blocks call: the loop over
  slabs, each checkpointed, with the block's offset input (norm and modulation) and residual
  (projection, gate) passed in as functions.
* ``bind``: a module's forward on the parameter tensors it has *now*. The compute actor runs a
  block under ``torch.func.functional_call``; a checkpoint recomputes during the backward,
  after that call has returned and the module holds its ``meta`` parameters again, so a
  recomputed function must use the tensors captured during the forward.
* ``fp32_grad_params``: parameters whose gradient each use adds into an fp32 buffer (the compute
  actor's bf16 weights on a GPU): ``bind`` gives every chunk its own use, so the chunks'
  gradients are summed in fp32, not in the weights' dtype.

Windowed attention (``dsa``, ``neighborhood``) runs over slabs of whole time frames: a slab is
``token_chunk`` tokens rounded down to whole frames, at least one frame (a chunk smaller than a
frame is rounded up to one frame). The slab's queries and offsets go to the operator with only
the frames of k and v that its samples can reach (``kernels.deformable_slide_attention_slab``):
the frames its windows cover widened by ``ceil(attention.max_offset) + 1`` frames on either
side, clipped to the clip (``kernels.slab_kv_frames``: every trilinear corner is held). The operator computes window starts, sample positions and clamps
on the whole clip's grid and only looks keys up in the frames it holds, so a slab's rows are
exactly the unchunked operator's. The halo needs ``|offset| <= attention.max_offset``, which the
offset head's bound (``attention.offset_bound``: ``tanh`` or ``clamp``) guarantees; with ``max_offset = 0`` (offsets unbounded) a
slab's keys are the whole clip. The offset head itself (a 3x3x3 depthwise conv) reads the slab
plus one frame on either side. Dense attention runs query chunks of ``token_chunk`` tokens
against all keys; swin attention stays whole (its windows), with its projection chunked.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from kernels import deformable_slide_attention_slab
from kernels.dsa_reference import slab_kv_frames

__all__ = ["Chunked", "FrameRanges", "bind", "checkpointed", "fp32_grad_params", "slab_attention", "slab_frames",
           "slabbed_attention", "time_slabs", "token_map"]

FP32_GRAD = "_fp32_grad"
"""The attribute naming a parameter's fp32 gradient buffer (``fp32_grad_params``)."""


class _Fp32GradSum(torch.autograd.Function):
    """Identity on a parameter; its backward adds the gradient of this one use into the
    parameter's fp32 buffer (``acc += g``, computed in fp32) and passes nothing on, so uses are
    never summed in the parameter's own dtype."""

    @staticmethod
    def forward(ctx, w, acc):
        ctx.acc = acc
        ctx.set_materialize_grads(False)
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        if g is not None:
            ctx.acc.add_(g)
        return None, None


def _fp32_use(t: torch.Tensor) -> torch.Tensor:
    """One use of ``t``: through its own ``_Fp32GradSum`` where ``t`` has an fp32 gradient buffer."""
    acc = getattr(t, FP32_GRAD, None)
    if acc is None or not torch.is_grad_enabled():
        return t
    out = _Fp32GradSum.apply(t, acc)
    setattr(out, FP32_GRAD, acc)  # a ``bind`` inside the call gives each chunk its own use again
    return out


def fp32_grad_params(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` for one call of ``functional_call``: every tensor carrying an fp32 gradient
    buffer (attribute ``FP32_GRAD``) passed through its own identity node, whose backward adds
    this call's gradient into the buffer in fp32. Call it once per use (each micro-batch's call;
    ``bind`` does it per chunk), so autograd never sums two uses' gradients in bf16 first."""
    return {k: _fp32_use(v) for k, v in params.items()}


def bind(module: nn.Module) -> Callable:
    """``module``'s forward on the parameters it holds now (see the module docstring). Each call
    is one use of the parameters (``fp32_grad_params``): a chunk's gradient goes into the fp32
    buffer on its own."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    tensors = {**params, **buffers}
    return lambda *args: functional_call(module, fp32_grad_params(tensors), args)


def checkpointed(fn: Callable, *args):
    """``fn(*args)`` under a non-reentrant checkpoint when gradients are on, else plainly."""
    if torch.is_grad_enabled():
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return fn(*args)


def token_map(fn: Callable, x: torch.Tensor, chunk: int, *extra) -> torch.Tensor:
    """``fn(x_chunk (B, n, C), *extra) -> (B, n, C')`` over chunks of ``chunk`` tokens of
    ``x (B, T, H, W, C)``, each under its own checkpoint; returns ``(B, T, H, W, C')``. An
    ``extra`` wrapped as ``Chunked`` is another tensor of the token grid, chunked alike; the
    others are passed whole to every chunk."""
    B, T, H, W = x.shape[:4]
    N = T * H * W
    xs = x.reshape(B, N, *x.shape[4:]).split(chunk, dim=1)
    split_extra = [e.split(xs) if isinstance(e, Chunked) else None for e in extra]
    outs = []
    for i, xc in enumerate(xs):
        args = [se[i] if se is not None else e for se, e in zip(split_extra, extra)]
        outs.append(checkpointed(fn, xc, *args))
    y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return y.reshape(B, T, H, W, *y.shape[2:])


class Chunked:
    """Marks a token-grid tensor ``(B, T, H, W, *)`` (or a table ``(T, H, W, *)`` shared by the
    batch, ``batched=False``) that ``token_map`` chunks along with ``x``."""

    def __init__(self, tensor: torch.Tensor, batched: bool = True):
        self.tensor = tensor
        self.batched = batched

    def split(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        t = self.tensor
        sizes = [c.shape[1] for c in like]
        if self.batched:
            return list(t.reshape(t.shape[0], -1, *t.shape[4:]).split(sizes, dim=1))
        return list(t.reshape(-1, *t.shape[3:]).split(sizes, dim=0))


def slab_frames(chunk: int, grid: Sequence[int]) -> int:
    """Frames per attention slab: ``chunk`` tokens as whole frames, at least one (a chunk
    smaller than a frame is rounded up to one frame)."""
    T, H, W = grid
    return max(1, min(T, chunk // (H * W)))


def time_slabs(chunk: int, grid: Sequence[int], window_t: int, max_offset: float | None,
               ) -> list[tuple[int, int, int, int]]:
    """Slabs ``(t0, t1, a, b)``: queries in frames ``[t0, t1)`` (``slab_frames`` frames each),
    keys and values in ``[a, b)``: the frames the slab's windows cover, widened by what offsets
    of at most ``max_offset`` reach (``kernels.slab_kv_frames``; None: offsets unbounded, the
    whole clip)."""
    T = grid[0]
    step = slab_frames(chunk, grid)
    return [(t0, min(T, t0 + step), *slab_kv_frames(t0, min(T, t0 + step), T, window_t, max_offset))
            for t0 in range(0, T, step)]


def slab_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, off: torch.Tensor | None,
                   t0: int, a: int, frames: int, window: tuple[int, int, int], scale: float | None,
                   backend: str = "auto", max_offset: float | None = None) -> torch.Tensor:
    """3D-DSA of the slab's queries ``q (B, Ts, H, W, nh, d)`` (frames ``[t0, t0 + Ts)``) against
    ``k, v`` holding frames ``[a, a + Tk)`` of a ``frames``-frame clip; ``off``: the slab's
    offsets, or None for zero offsets (neighborhood); ``backend``: the DSA kernel
    (``attention.backend``); ``max_offset``: the offsets' bound where known (the Triton
    backward then does not measure it)."""
    if off is None:
        B, Ts, H, W, nh, _ = q.shape
        off = q.new_zeros(B, Ts, H, W, nh, window[0] * window[1] * window[2], 3)
    return deformable_slide_attention_slab(q, k, v, off, window, t0, a, frames, scale=scale, backend=backend,
                                           max_offset=max_offset)


# ---------------------------------------------------------------------------------------------
# Frame ranges of one tensor whose gradients land in one buffer
# ---------------------------------------------------------------------------------------------


class _Sink:
    """The gradient of a tensor, summed over its frame ranges as their backwards run."""

    def __init__(self, like: torch.Tensor):
        self.like = like
        self.grad: torch.Tensor | None = None

    def add(self, lo: int, hi: int, g: torch.Tensor) -> None:
        if self.grad is None:
            self.grad = torch.zeros_like(self.like)
        self.grad[:, lo:hi] += g

    def take(self) -> torch.Tensor | None:
        grad, self.grad, self.like = self.grad, None, None
        return grad


class _Tap(torch.autograd.Function):
    """Identity; its backward (run after every range's) hands on the sink's sum."""

    @staticmethod
    def forward(ctx, x, sink):
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        grad = ctx.sink.take()
        if grad is None:
            return g, None
        if g is not None:
            grad += g
        return grad, None


class _Range(torch.autograd.Function):
    """``x[:, lo:hi]``; its backward adds the range's gradient into the sink."""

    @staticmethod
    def forward(ctx, x, sink, lo, hi):
        ctx.sink, ctx.lo, ctx.hi = sink, lo, hi
        ctx.set_materialize_grads(False)
        return x[:, lo:hi]

    @staticmethod
    def backward(ctx, g):
        if g is not None:
            ctx.sink.add(ctx.lo, ctx.hi, g)
        return None, None, None, None


class FrameRanges:
    """Views ``x[:, lo:hi]`` of one tensor (``ranges(lo, hi)``; ranges may overlap) whose
    gradients are added into one buffer the size of ``x`` as each range's backward runs, instead
    of each becoming a zero-filled tensor the size of ``x`` (what slicing does): the slabs'
    backward then holds one whole-size gradient, not one per slab. Make each range just before
    the slab that uses it: autograd runs a range's backward right after that slab's (nodes run
    newest first), so a slab's range gradients do not wait for the other slabs."""

    def __init__(self, x: torch.Tensor):
        self.track = torch.is_grad_enabled() and x.requires_grad
        self.sink = _Sink(x) if self.track else None
        self.x = _Tap.apply(x, self.sink) if self.track else x

    def __call__(self, lo: int, hi: int) -> torch.Tensor:
        return _Range.apply(self.x, self.sink, lo, hi) if self.track else self.x[:, lo:hi]


# ---------------------------------------------------------------------------------------------
# Windowed attention over slabs of frames (both blocks' driver)
# ---------------------------------------------------------------------------------------------


def slabbed_attention(x: torch.Tensor, qkv: torch.Tensor, chunk: int, heads: int, head_dim: int,
                      window: tuple[int, int, int], scale: float | None, max_offset: float,
                      offsets: Callable | None, residual: Callable,
                      offset_args: Sequence = (), residual_args: Sequence = (), offset_halo: int = 1,
                      backend: str = "auto", q_gain: torch.Tensor | None = None) -> torch.Tensor:
    """A chunked block's windowed self-attention (``dsa``, ``neighborhood``) and the residual
    stream after it, over slabs of whole frames (``time_slabs``), each slab checkpointed; the
    driver ``model.DiTBlock`` and ``wan.WanBlock`` share.

    ``x (B, T, H, W, D)``: the block input; ``qkv (B, T, H, W, 3 D)``: q, k, v of every token
    (heads ``(3, heads, head_dim)`` in the last axis; Wan's q and k rotated), whole. A slab
    ``[t0, t1)`` sees its queries, the key/value frames ``[a, b)`` its samples reach and ``x`` on
    ``[e0, e1)``: the slab plus ``offset_halo`` frames either side, clipped (what the offset
    head's convolution reads: 1 for its default 3x3x3 kernel). ``offsets(xe, *offset_args)``: the offsets ``(B, e1 - e0, H, W, heads, K, 3)``
    on those frames; None: zero offsets (``neighborhood``). ``residual(xs, o, *residual_args)``:
    the block's stream after attention on the slab's frames, from ``xs = x[:, t0:t1]`` and the
    attention output ``o (B, t1 - t0, H, W, D)`` (heads merged, before the output projection).
    ``max_offset``: ``attention.max_offset``; 0 with an offset head: offsets unbounded, every
    slab's keys are the whole clip. ``offset_args`` / ``residual_args`` (tensors, e.g. the
    modulations) go through each slab's checkpoint. ``backend``: the DSA kernel
    (``attention.backend``). ``q_gain (heads,)``: each head's queries are multiplied by it before
    the operator (a learned temperature, ``attention.learn_temperature``; None: not scaled); it goes
    through each slab's checkpoint too. Returns ``(B, T, H, W, D)``."""
    B, T, H, W, D = x.shape
    n_off = len(offset_args)
    gain_args = () if q_gain is None else (q_gain,)
    n_res = n_off + len(residual_args)
    bound = max_offset if max_offset > 0 or offsets is None else None
    x_ranges, qkv_ranges = FrameRanges(x), FrameRanges(qkv)
    outs = []
    for t0, t1, a, b in time_slabs(chunk, (T, H, W), window[0], bound):
        e0, e1 = max(0, t0 - offset_halo), min(T, t1 + offset_halo)  # what the offset head's conv reads

        def slab(xe, qs, kvh, *args, t0=t0, t1=t1, a=a, e0=e0):
            q = qs.unflatten(-1, (3, heads, head_dim))[..., 0, :, :]
            if len(args) > n_res:  # the query scale of a temperature, in fp32
                q = (q.to(torch.promote_types(q.dtype, args[n_res].dtype)) * args[n_res][:, None]).to(q.dtype)
            _, k, v = kvh.unflatten(-1, (3, heads, head_dim)).unbind(4)
            off = None
            if offsets is not None:
                off = offsets(xe, *args[:n_off])[:, t0 - e0:t1 - e0]
            o = slab_attention(q, k, v, off, t0, a, T, window, scale, backend, bound)
            return residual(xe[:, t0 - e0:t1 - e0], o.reshape(B, t1 - t0, H, W, D), *args[n_off:n_res])

        outs.append(checkpointed(slab, x_ranges(e0, e1), qkv_ranges(t0, t1), qkv_ranges(a, b),
                                 *offset_args, *residual_args, *gain_args))
    return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]

