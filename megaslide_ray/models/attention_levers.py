"""Dense attention beside the configured kind: the three levers of ``attention.dense_blocks``,
``attention.dense_above_t`` and ``attention.dense_warmup_steps``.

- **Dense blocks** are chosen when a block is built (``block_kind``): such a block's
  self-attention is dense and has no offset head.
- **Dense above a time** and **the dense-to-sparse curriculum** are chosen per sample at run
  time. Both come down to one number per sample, the weight of dense attention ``w`` in ``[0, 1]``
  (``dense_weight``): the self-attention output is ``w dense + (1 - w) kind``. Shard 0 appends
  it to the condition ``c`` as its last column (``attach_mix``), and every block and the head
  take it back off (``split_mix``); ``c`` is what every path already carries from shard 0 to the
  blocks (the compute actor's forward, its recomputing backward and its kept graphs, sampling, the
  whole model), so nothing else learns of it and no state lives outside the call. Shard 0
  computes ``w`` from ``t`` alone (``dense_above_t``: the schedule's end, what validation and
  sampling use) unless the trainer hands it the step's (``step_mix``: the curriculum's ``w`` at
  that step). It is data, not a constant of the code: a value that changes every step changes
  no graph and nothing compiled.

``blend`` runs each kind only on the samples that need it: a batch whose samples all share
one kind (every batch of one clip) runs that kind alone, exactly. Choosing needs the weights on
the host. The trainers know them there (``t`` is drawn on the host): they compute them
(``host_weights``) and call the blocks inside ``weights_on_host``, so a block reads nothing back
from the device. The whole model (sampling, validation) called outside one reads ``c``'s column
once per forward (``whole_model_weights``: one device sync on CUDA) and runs its blocks inside;
only a block called alone, outside both, reads it itself: a device sync per block call.
On a bf16 run ``c`` is bf16, so a curriculum weight between 0 and 1 is rounded to bf16 (0 and 1
are exact); ``blend`` rounds the host's weights the same way.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

import torch

from megaslide_ray.config import Config


def block_kind(cfg: Config, index: int) -> str:
    """The self-attention kind of block shard ``index`` (1 .. depth; block ``index - 1`` in
    ``attention.dense_blocks`` is dense)."""
    return "dense" if index - 1 in tuple(cfg.attention.dense_blocks) else cfg.attention.kind


def mixes(cfg: Config) -> bool:
    """Whether ``c`` carries the dense weight: ``attention.dense_above_t`` or
    ``attention.dense_warmup_steps`` on a kind other than dense."""
    a = cfg.attention
    return a.kind != "dense" and (a.dense_above_t > 0 or a.dense_warmup_steps > 0)


def dense_weight(cfg: Config, t: torch.Tensor, step: int | None = None) -> torch.Tensor:
    """``(B,)`` float32: each sample's weight of dense attention. 1 where ``t >=
    attention.dense_above_t`` (> 0); with ``step`` (training) below ``dense_warmup_steps`` N at
    least ``1 - step / N``; 0 otherwise. ``step = None``: the curriculum's end."""
    a = cfg.attention
    w = torch.zeros(t.shape[0], dtype=torch.float32, device=t.device)
    if a.dense_above_t > 0:
        w = (t.float() >= a.dense_above_t).float()
    if step is not None and 0 <= step < a.dense_warmup_steps:
        w = w.clamp(min=1.0 - step / a.dense_warmup_steps)
    return w


def step_mix(cfg: Config, t: torch.Tensor, step: int) -> dict:
    """What a trainer hands shard 0 at training step ``step`` (keyword arguments): the
    curriculum's dense weights while it lasts, else nothing (shard 0 computes them from ``t``)."""
    if not mixes(cfg) or step >= cfg.attention.dense_warmup_steps:
        return {}
    return {"dense_mix": dense_weight(cfg, t, step)}


def attach_mix(cfg: Config, c: torch.Tensor, t: torch.Tensor, mix: torch.Tensor | None = None) -> torch.Tensor:
    """``c`` with the dense weight of each sample as a last column (``mixes``), else ``c``.
    ``mix`` None: ``dense_weight(cfg, t)``."""
    if not mixes(cfg):
        return c
    w = dense_weight(cfg, t) if mix is None else mix
    return torch.cat([c, w.to(device=c.device, dtype=c.dtype).view(-1, 1)], dim=1)


def host_weights(cfg: Config, t: torch.Tensor, step: int | None = None) -> torch.Tensor | None:
    """``(B,)`` float32 on the host: the dense weights the blocks find in ``c`` for times ``t`` at
    training step ``step`` (shard 0's: the curriculum's while it lasts, else ``t``'s), for
    ``weights_on_host``; None when ``c`` carries none (``mixes``). ``t`` on the host costs no sync."""
    if not mixes(cfg):
        return None
    return dense_weight(cfg, t.detach().float().cpu(), step)


_ON_HOST: ContextVar[list[float] | None] = ContextVar("dense_weights_on_host", default=None)


@contextmanager
def weights_on_host(weights: torch.Tensor | None) -> Iterator[None]:
    """Blocks called inside choose each sample's kind by ``weights`` (``host_weights`` of the batch
    they run on, on the host) instead of reading ``c``'s column back from the device; None: they
    read it."""
    token = _ON_HOST.set(None if weights is None else [float(w) for w in weights])
    try:
        yield
    finally:
        _ON_HOST.reset(token)


def _choice(mix: torch.Tensor) -> list[float]:
    """Each sample's weight on the host: ``weights_on_host``'s, rounded to ``c``'s dtype as its
    column is, else read from ``mix`` (a device sync on CUDA)."""
    host = _ON_HOST.get()
    if host is None:
        return read_weights(mix)
    if len(host) != mix.shape[0]:
        raise ValueError(f"weights_on_host gave {len(host)} dense weights for a batch of {mix.shape[0]} samples: "
                         f"hand the blocks the host_weights of the batch (the micro-batch) they run on")
    return torch.tensor(host, dtype=torch.float32).to(mix.dtype).float().tolist()


def read_weights(mix: torch.Tensor) -> list[float]:
    """``mix`` on the host (a device sync on CUDA): the blocks' choice without ``weights_on_host``."""
    return mix.float().tolist()


@contextmanager
def whole_model_weights(c: torch.Tensor, carried: bool) -> Iterator[None]:
    """The whole model's blocks run inside: when ``c`` carries the dense weights (``carried``) and
    no ``weights_on_host`` is in scope (a trainer's), ``c``'s column is read back once here (one
    device sync per forward on CUDA) and every block chooses by it, as it would by reading it."""
    if not carried or _ON_HOST.get() is not None:
        yield
        return
    token = _ON_HOST.set(read_weights(c[:, -1]))
    try:
        yield
    finally:
        _ON_HOST.reset(token)


def split_mix(c: torch.Tensor, carried: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(c without the weight column, the weights (B,))`` when ``carried``, else ``(c, None)``."""
    if not carried:
        return c, None
    return c[:, :-1], c[:, -1]


def blend(mix: torch.Tensor | None, run: Callable[[str | None, list | None], torch.Tensor]) -> torch.Tensor:
    """``w dense + (1 - w) kind`` per sample, for ``w = mix (B,)``. ``run(kind, rows)``: the
    attention (or what the caller computes from it) of samples ``rows`` (None: all) by ``kind``
    (``"dense"``, or None: the block's own). A sample of weight 0 gets the block's kind's output
    exactly, one of weight 1 dense's; each kind runs only on the samples that need it."""
    if mix is None:
        return run(None, None)
    host = _choice(mix)  # which samples need which kind
    dense = [i for i, w in enumerate(host) if w > 0]
    sparse = [i for i, w in enumerate(host) if w < 1]
    if not dense:
        return run(None, None)
    if not sparse:
        return run("dense", None)
    od, os = run("dense", dense), run(None, sparse)
    out = []
    for i, w in enumerate(host):
        if w >= 1:
            out.append(od[dense.index(i)])
        elif w <= 0:
            out.append(os[sparse.index(i)])
        else:
            wi = mix[i].to(od.dtype)
            out.append(wi * od[dense.index(i)] + (1 - wi) * os[sparse.index(i)])
    return torch.stack(out)


def rows_of(rows: list | None) -> Callable:
    """The selection of samples ``rows`` (None: all) from a batch-first tensor (None stays None)."""
    if rows is None:
        return lambda z: z
    return lambda z: None if z is None else z[rows]
