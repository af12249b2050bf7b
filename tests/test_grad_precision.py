"""Gradient sums are fp32 whatever the weights' dtype: the compute actor's micro-batches and a
chunked block's token chunks each add their gradient into an fp32 buffer (bf16 weights here, on
the CPU, as a GPU run has them), and prediction=sample's velocity is computed in fp32."""

from types import SimpleNamespace

import torch
import torch.nn as nn

from actors.compute import ComputeActor, grad_views, round_in_place
from megaslide_ray.models.chunking import bind, token_map
from megaslide_ray.models.prediction import as_velocity
from megaslide_ray.models.shards import ShardLayout


def _bf16_linear(seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(16, 8).to(torch.bfloat16)


def _flat(module: nn.Module):
    lay = ShardLayout.of(module, 0)
    w = torch.empty(lay.numel, dtype=torch.bfloat16)
    lay.flatten_into(module, w)
    return lay, w


def _use_grad(module: nn.Module, w: torch.Tensor, lay: ShardLayout, fn) -> torch.Tensor:
    """The bf16 gradient of one use (``fn(params)``'s sum), flat, as autograd computes it alone."""
    leaves = {k: v.detach().requires_grad_(True) for k, v in lay.views(w.clone()).items()}
    grads = torch.autograd.grad(fn(leaves).sum(), list(leaves.values()))
    return torch.cat([g.reshape(-1) for g in grads])


def test_micro_batch_gradients_are_summed_in_fp32():
    module = _bf16_linear()
    lay, w = _flat(module)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 16, generator=gen).to(torch.bfloat16) for _ in range(256)]
    actor = SimpleNamespace(modules=[module])
    params, grad = grad_views(lay, w)
    for x in xs:  # the compute actor's loop over micro-batches, each one call
        ComputeActor._run_with_grad(actor, 0, params, x).sum().backward()
    want = torch.zeros(lay.numel, dtype=torch.float32)
    for x in xs:
        want += _use_grad(module, w, lay, lambda p, x=x: torch.func.functional_call(module, p, (x,))).float()
    assert grad.dtype == torch.float32
    assert torch.equal(grad, want)
    # What summing in bf16 loses here, so the check above means something.
    drift = torch.zeros(lay.numel, dtype=torch.bfloat16)
    for x in xs:
        drift += _use_grad(module, w, lay, lambda p, x=x: torch.func.functional_call(module, p, (x,)))
    assert ((drift.float() - want).abs() / want.abs().clamp(min=1)).max() > 1e-2


class _Chunked(nn.Module):
    """A linear layer run over chunks of ``chunk`` tokens, each chunk one use (``bind``), as a
    token-chunked block runs its per-token parts."""

    def __init__(self, chunk: int):
        super().__init__()
        self.lin = _bf16_linear(3)
        self.chunk = chunk

    def forward(self, x):
        f = bind(self.lin)
        return token_map(lambda xc: f(xc), x, self.chunk)


def test_token_chunk_gradients_are_summed_in_fp32():
    block = _Chunked(chunk=2)
    lay, w = _flat(block)
    x = torch.randn(1, 8, 8, 8, 16, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)  # 512 tokens
    actor = SimpleNamespace(modules=[block])
    params, grad = grad_views(lay, w)
    ComputeActor._run_with_grad(actor, 0, params, x).sum().backward()
    want = torch.zeros(lay.numel, dtype=torch.float32)
    for xc in x.reshape(1, -1, 16).split(2, dim=1):  # each chunk's gradient alone, added in fp32
        want += _use_grad(block, w, lay, lambda p, xc=xc: torch.func.functional_call(block.lin, {
            k.removeprefix("lin."): v for k, v in p.items()}, (xc,))).float()
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-6 * want.abs().max().item())


def test_sample_prediction_divides_in_fp32():
    gen = torch.Generator().manual_seed(4)
    out = torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16)
    x_t = torch.randn(2, 3, 4, generator=gen).to(torch.bfloat16)
    t = torch.tensor([0.3, 0.07])
    v = as_velocity(out, x_t, t, "sample")
    want = (x_t.double() - out.double()) / t.double().clamp(min=0.05).view(-1, 1, 1)
    assert v.dtype == torch.float32
    torch.testing.assert_close(v.double(), want, rtol=1e-6, atol=0)


def test_the_fp32_sum_is_rounded_once_in_its_own_buffer():
    for n in (1, 4095, 4096, 4097, 10_000, 123_457):
        acc = torch.randn(n, generator=torch.Generator().manual_seed(n))
        want = acc.to(torch.bfloat16)
        got = round_in_place(acc, torch.bfloat16)
        assert got.untyped_storage().data_ptr() == acc.untyped_storage().data_ptr()
        assert torch.equal(got, want), n
