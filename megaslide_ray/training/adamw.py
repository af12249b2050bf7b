"""AdamW on a flat shard, as the parameter store runs it (``optim.adamw`` chooses the kernel).

``fused`` is torch's fused CPU AdamW on the flat shard plus a copy into ``w``; ``compiled`` is
one ``torch.compile``d pass that reads the gradient (in w), master, m, v and writes master, m, v,
w (28 B/param in bf16 instead of 40, see benchmarks/adamw.py), but compiling costs 4-13 s per
store process on 2 cores (warm / cold inductor cache); ``auto`` tries ``compiled`` with a
self-test against ``torch.optim.AdamW`` and falls back to ``fused``. Default (``optim.adamw``
empty): ``auto`` for models of at least ``COMPILE_MIN_PARAMS`` parameters (there the saved 12
B/param per step repays the compile within a few hundred steps), ``fused`` below (the tiny preset
and the tests would pay seconds of compile for nothing)."""

from __future__ import annotations

import logging
import math
import time

import torch
from torch.optim.adamw import adamw as adamw_functional

log = logging.getLogger(__name__)


ADAMW_KINDS = ("fused", "compiled", "auto")


COMPILE_MIN_PARAMS = 100_000_000


def adamw_single_pass(w: torch.Tensor, master: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                      coef: torch.Tensor, decay: torch.Tensor, step_size: torch.Tensor, bc2_sqrt: torch.Tensor,
                      beta1: float, beta2: float, eps: float) -> None:
    """AdamW with clipping, written as torch's single-tensor AdamW computes it; once compiled,
    one loop reads the gradient from ``w`` (bf16 or fp32), master, m, v and writes master, m, v
    and the new weights into ``w`` (a cast for bf16): the gradient's buffer is the compute
    copy's. Step-dependent scalars are 0-d tensors, so a new step or lr does not recompile."""
    g32 = w.float() * coef
    m_new = torch.lerp(m, g32, 1 - beta1)
    v_new = v * beta2 + g32 * g32 * (1 - beta2)
    denom = v_new.sqrt() / bc2_sqrt + eps
    p = master * decay - step_size * (m_new / denom)
    m.copy_(m_new)
    v.copy_(v_new)
    master.copy_(p)
    w.copy_(p)


def adamw_scalars(o, step: int, coef: float, lr: float) -> tuple:
    """The step-dependent arguments of ``adamw_single_pass`` for 0-based ``step``, computed in
    Python floats exactly as ``torch.optim.AdamW`` computes them."""
    k = step + 1
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    return (t(coef), t(1 - lr * o.weight_decay), t(lr / (1 - o.betas[0] ** k)),
            t(math.sqrt(1 - o.betas[1] ** k)), o.betas[0], o.betas[1], o.eps)


def adamw_fused(master: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, o, step: int,
                coef: float, lr: float) -> None:
    """One AdamW step of 0-based ``step`` on a flat fp32 shard: ``g`` (fp32, scaled in place by the
    clipping coefficient ``coef``), then torch's fused kernel over ``master``, ``m``, ``v`` (CPU or
    CUDA tensors alike). The parameter store's ``fused`` update and the device-side update of
    ``runtime.device_shards`` both run this."""
    if coef < 1.0:
        g.mul_(coef)
    st = torch.tensor(float(step), dtype=torch.float32, device=master.device)
    adamw_functional([master], [g], [m], [v], [], [st], fused=True, amsgrad=False, beta1=o.betas[0],
                     beta2=o.betas[1], lr=lr, weight_decay=o.weight_decay, eps=o.eps, maximize=False)


def compile_single_pass(o, w_dtype: torch.dtype, numel: int = 4099, steps: int = 3):
    """``torch.compile`` the single pass and check it against ``torch.optim.AdamW`` (clipped
    gradients, ``steps`` steps, an odd size). Returns the compiled function or raises."""
    fn = torch.compile(adamw_single_pass, dynamic=True, fullgraph=True)
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(master.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                            foreach=False)
    m, v = torch.zeros(numel), torch.zeros(numel)
    w = torch.empty(numel, dtype=w_dtype)
    for step in range(steps):
        g = torch.randn(numel, generator=gen).to(w_dtype)
        coef = 0.5
        w.copy_(g)  # the gradient arrives in w, as in the store
        fn(w, master, m, v, *adamw_scalars(o, step, coef, 1e-2))
        ref.grad = g.float().mul_(coef)
        opt.step()
    state = opt.state[ref]
    for name, got, want in (("master", master, ref.detach()), ("m", m, state["exp_avg"]),
                            ("v", v, state["exp_avg_sq"])):
        err = float((got - want).abs().max() / want.abs().max())
        if not err <= 1e-6:
            raise RuntimeError(f"compiled AdamW differs from torch.optim.AdamW in {name} by {err:.1e} (relative)")
    if not torch.equal(w, master.to(w_dtype)):
        raise RuntimeError("compiled AdamW wrote a compute copy w that is not master cast to its dtype")
    return fn


def choose_adamw(requested: str, numel: int, o, w_dtype: torch.dtype):
    """``(kind, single_pass)`` for a store of ``numel`` parameters: ``requested`` (``optim.adamw``;
    empty: by size, see above), with ``single_pass`` the compiled kernel or None for ``fused``. A
    ``compiled`` that cannot be built raises; ``auto`` falls back to ``fused`` with a warning."""
    kind = requested or ("auto" if numel >= COMPILE_MIN_PARAMS else "fused")
    if kind not in ADAMW_KINDS:
        raise ValueError(f"optim.adamw={kind!r} is not an AdamW kernel; use one of {list(ADAMW_KINDS)}")
    if kind == "fused":
        log.info("parameter store AdamW: fused (torch fused CPU AdamW + copy into w)")
        return "fused", None
    t0 = time.perf_counter()
    try:
        fn = compile_single_pass(o, w_dtype)
    except Exception as e:  # noqa: BLE001 - any compiler failure: fall back (auto) or report (compiled)
        if kind == "compiled":
            raise RuntimeError(f"AdamW kernel 'compiled' was requested but does not work here: {e}; "
                               f"use --optim.adamw fused") from e
        log.warning("parameter store AdamW: fused (torch.compile single pass unusable: %s)", e)
        return "fused", None
    log.info("parameter store AdamW: compiled single pass (compiled and checked in %.1f s)", time.perf_counter() - t0)
    return "compiled", fn
