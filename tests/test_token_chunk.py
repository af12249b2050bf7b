"""``runtime.token_chunk``: a chunked block is the same function as the whole-clip block.

Each test builds one block twice from the same weights (``token_chunk`` 0 and N), randomises
every parameter (adaLN gates, the DSA offset head with some offsets saturating at
``attention.max_offset``) and compares outputs and the gradients w.r.t. the block input, the
condition and every parameter, in fp32, to 1e-6 relative (norm of the difference over the
norm). Chunk sizes: dividing the token count, not dividing it, smaller than one frame (the
attention slab is then one whole frame) and larger than the clip. The Triton kernels run in a
child process under the CPU interpreter, as in tests/test_dsa.py.
"""

import os

import pytest
import torch
from torch.func import functional_call

from kernels.checks import assert_interpreter_tests_pass
from megaslide_ray.config import build_config
from megaslide_ray.models.chunking import time_slabs
from megaslide_ray.models.registry import build_shard
from megaslide_ray.models.shards import ShardLayout

GRID = (12, 3, 3)  # T, H, W: 108 tokens, 9 per frame; long enough for slabs away from both ends
CHUNKS = [36, 40, 7, 500]  # divides; does not; < one frame (9 tokens); > the clip
TOL = 1e-6


def _config(arch: str, kind: str, chunk: int, max_offset: float = 1.5, offset_kernel: str = "3,3,3",
            backend: str = "auto", bound: str = "tanh"):
    over = {"model.depth": 1, "model.hidden_size": 32, "model.num_heads": 2, "model.ffn_dim": 64,
            "attention.kind": kind, "attention.window": "3,3,3", "attention.max_offset": max_offset,
            "attention.offset_kernel": offset_kernel, "attention.backend": backend, "runtime.token_chunk": chunk,
            "attention.offset_bound": bound, "model.cross_attention": arch == "videodit"}  # videodit: the chunked cross-attention too
    if arch == "wan":
        over.update({"model.arch": "wan", "model.text_dim": 16, "model.text_len": 5, "model.in_channels": 4,
                     "model.patch_size": "1,2,2", "model.timestep_freq_dim": 16, "data.num_frames": 9,
                     "data.height": 48, "data.width": 80})
    return build_config("tiny", None, over)


def _blocks(arch, kind, chunk, max_offset=1.5, seed=0, offset_kernel="3,3,3", backend="auto", bound="tanh"):
    whole = build_shard(_config(arch, kind, 0, max_offset, offset_kernel, backend, bound), 1)
    chunked = build_shard(_config(arch, kind, chunk, max_offset, offset_kernel, backend, bound), 1)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        off = getattr(whole, "attn", None) or whole.attn1
        if off.offsets is not None:  # large raw offsets: many saturate at max_offset
            off.offsets.out.weight.normal_(0.0, 2.0, generator=g)
            off.offsets.out.bias.normal_(0.0, 2.0, generator=g)
    chunked.load_state_dict(whole.state_dict())
    return whole, chunked


def _inputs(arch, seed=1, B=2, grid=GRID):
    g = torch.Generator().manual_seed(seed)
    D = 32
    x = torch.randn(B, *grid, D, generator=g)
    if arch == "wan":
        return x, torch.randn(B, 7 * D + 5 * D, generator=g)
    # videodit: the condition, 6 caption tokens and their key mask (padding at the end of the
    # second caption; the null token is always a key)
    keys = torch.ones(B, 6)
    keys[-1, 3:] = 0.0
    return x, torch.cat([torch.randn(B, D + 6 * D, generator=g), keys], dim=1)


def _run(block, x, c, params=None):
    x = x.clone().requires_grad_(True)
    c = c.clone().requires_grad_(True)
    if params is None:
        y = block(x, c)
        names, leaves = zip(*block.named_parameters())
    else:  # as the compute actor calls it: functional_call on separate leaves
        y = functional_call(block, params, (x, c))
        names, leaves = zip(*params.items())
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(7), dtype=y.dtype)
    grads = torch.autograd.grad(y, (x, c, *leaves), dy, allow_unused=True)
    return {"out": y.detach(), "dx": grads[0], "dc": grads[1], **dict(zip(names, grads[2:]))}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def _assert_same(got, want, tol, exact=None):
    """Every output and gradient of ``got`` within ``tol`` (relative) of ``want``, or, for a
    gradient that fp32 itself cannot give to ``tol`` (sums that cancel, e.g. a cross-attention
    key bias), no farther from ``want`` than ``want`` is from the float64 result ``exact``."""
    for name, b in want.items():
        a = got[name]
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        err = _rel(a, b)
        if err > tol and exact is not None:
            if callable(exact):
                exact = exact()
            assert err <= _rel(b, exact[name]), f"{name}: chunked {err:.2e} from whole, whole {_rel(b, exact[name]):.2e} from fp64"
        else:
            assert err <= tol, f"{name}: relative error {err:.2e}"


def _compare(arch, kind, chunk, max_offset=1.5, functional=False, dtype=torch.float32, grid=GRID, B=2,
             offset_kernel="3,3,3", backend="auto", bound="tanh"):
    whole, chunked = _blocks(arch, kind, chunk, max_offset, offset_kernel=offset_kernel, backend=backend, bound=bound)
    whole, chunked = whole.to(dtype), chunked.to(dtype)
    x, c = _inputs(arch, grid=grid, B=B)
    x, c = x.to(dtype), c.to(dtype)
    want = _run(whole, x, c)
    if functional:  # fresh leaves, like the compute actor's views of a flat buffer
        params = {n: p.detach().clone().requires_grad_(True) for n, p in chunked.named_parameters()}
        with torch.device("meta"):
            meta = build_shard(_config(arch, kind, chunk, max_offset, backend=backend, bound=bound), 1)
        got = _run(meta, x, c, params)
    else:
        got = _run(chunked, x, c)
    def exact():  # the float64 result (on the reference path), only needed when a gradient misses TOL
        attn = getattr(whole, "attn", None) or whole.attn1
        attn.backend = "reference" if backend == "triton" else backend
        try:
            return _run(whole.double(), x.double(), c.double())
        finally:
            whole.float()
            attn.backend = backend

    _assert_same(got, want, TOL if dtype == torch.float32 else 1e-12, exact if dtype == torch.float32 else None)
    return whole


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_dsa_chunked_equals_whole_reference_and_cpu(arch, chunk):
    for backend in ("reference", "cpu"):
        whole = _compare(arch, "dsa", chunk, backend=backend)
    # the same function: equal to 1e-12 in float64 (CPU path; not the Wan block: its norms are
    # float32 whatever the dtype)
    if arch == "videodit":
        _compare(arch, "dsa", chunk, dtype=torch.float64, backend="cpu")
    # the offsets were non-trivial and some saturated at max_offset
    attn = getattr(whole, "attn", None) or whole.attn1
    h = torch.randn(1, *GRID, 32)
    off = attn.offsets(h)
    assert off.abs().max() == 1.5 and (off.abs() < 1.4).float().mean() > 0.1


@pytest.mark.parametrize("offset_kernel", ["5,3,3", "3,5,5"])
@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_a_wider_offset_head_chunked_equals_whole(arch, offset_kernel):
    # a 5-frame kernel reads two frames either side of a slab: the slab's x halo must follow
    whole = _compare(arch, "dsa", 7, offset_kernel=offset_kernel, backend="cpu")
    attn = getattr(whole, "attn", None) or whole.attn1
    assert tuple(attn.offsets.dwconv.kernel_size) == tuple(int(k) for k in offset_kernel.split(","))


@pytest.mark.parametrize("kind", ["dense", "swin", "neighborhood"])
@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_other_kinds_chunked_equal_whole(arch, kind):
    for chunk in (40, 7):
        _compare(arch, kind, chunk)
    if arch == "videodit":
        _compare(arch, kind, 40, dtype=torch.float64)


@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_clamped_offsets_chunked_equal_whole(arch):
    """``attention.offset_bound = clamp``: many offsets sit exactly on the bound (a corner at the
    slab's held frames' edge); the chunked block is still the whole block's function."""
    whole = _compare(arch, "dsa", 16, bound="clamp", backend="cpu")
    off = (getattr(whole, "attn", None) or whole.attn1).offsets(torch.randn(1, *GRID, 32))
    assert off.abs().max() == 1.5 and (off.abs() == 1.5).float().mean() > 0.1 and (off.abs() < 1.4).float().mean() > 0.1


@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_unbounded_offsets_use_whole_clip_keys(arch):
    _compare(arch, "dsa", 16, max_offset=0.0, backend="cpu")


@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_functional_call_like_the_compute_actor(arch):
    """Recomputation in the backward happens after ``functional_call`` returned: the chunks
    must use the tensors given to the call, not the module's (here ``meta``) parameters."""
    _compare(arch, "dsa", 40, functional=True, backend="cpu")


def test_no_grad_forward_equals_whole():
    whole, chunked = _blocks("videodit", "dsa", 7)
    x, c = _inputs("videodit")
    with torch.no_grad():
        torch.testing.assert_close(chunked(x, c), whole(x, c), rtol=1e-6, atol=1e-6)


def test_time_slabs_cover_the_clip_with_halo():
    # 9 tokens per frame: a chunk of 7 is one frame, 40 is four frames
    assert [s[:2] for s in time_slabs(7, GRID, 3, 1.5)] == [(t, t + 1) for t in range(12)]
    slabs = time_slabs(40, GRID, 3, 1.5)
    assert [s[:2] for s in slabs] == [(0, 4), (4, 8), (8, 12)]
    # frames 4..7: windows cover 3..8, widened by ceil(1.5) + 1 on either side (clipped)
    assert slabs[1][2:] == (0, 12)
    assert time_slabs(7, GRID, 3, 1.5)[6] == (6, 7, 2, 11)
    assert time_slabs(16, (20, 4, 4), 3, 0.0)[10] == (10, 11, 8, 13)
    assert time_slabs(16, (20, 4, 4), 3, None)[10] == (10, 11, 0, 20)


def test_config_reaches_the_whole_model():
    from megaslide_ray.models.registry import build_model

    cfg = build_config("tiny", None, {"model.depth": 2, "runtime.token_chunk": 64})
    assert all(b.token_chunk == 64 for b in build_model(cfg).blocks)


# -----------------------------------------------------------------------------
# Triton kernels under the CPU interpreter

INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") == "1"
interpreter_only = pytest.mark.skipif(
    not INTERPRETER_ACTIVE, reason="runs in the child started by test_token_chunk_under_interpreter"
)


@pytest.mark.slow  # about 3 min; the reference and CPU paths of the same checks run by default
@pytest.mark.child_process
@pytest.mark.skipif(INTERPRETER_ACTIVE, reason="already inside the interpreter run")
def test_token_chunk_under_interpreter():
    """Run the ``test_interp_*`` tests below in a child process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    assert_interpreter_tests_pass(__file__)


def _atomic_dkv(monkeypatch):
    """dk, dv by the atomic mode: the interpreter runs the key-side pass about 8x slower, and the
    slab and chunk arithmetic under test is the same in every mode (each has its own tests)."""
    from kernels import dsa_triton
    from kernels.dsa_modes import KernelModes

    monkeypatch.setattr(dsa_triton, "AUTO", KernelModes(dkv="atomic"))


@interpreter_only
def test_interp_dsa_chunked_equals_whole_triton(monkeypatch, arch="videodit"):
    """Tiny: 8 x 3 x 3 tokens, one clip; slabs of 3 frames (27 tokens): the first holds keys
    up to frame 6 of 8, the last from frame 3 (max_offset 0.5). The videodit block only (the
    interpreter is slow): the Wan block calls the same slab operator, and the slab test below
    checks the operator itself."""
    _atomic_dkv(monkeypatch)
    assert time_slabs(27, (8, 3, 3), 3, 0.5) == [(0, 3, 0, 6), (3, 6, 0, 8), (6, 8, 3, 8)]
    _compare(arch, "dsa", 27, max_offset=0.5, grid=(8, 3, 3), B=1, backend="triton")


# -----------------------------------------------------------------------------
# The slab operator: a slab's rows of the whole-grid operator


def _slab_case(seed=3, grid=(9, 3, 4), window=(3, 3, 3), max_offset=1.5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    B, nh, d = 2, 2, 4
    K = window[0] * window[1] * window[2]
    q, k, v = (torch.randn(B, *grid, nh, d, generator=g, dtype=dtype) for _ in range(3))
    raw = torch.randn(B, *grid, nh, K, 3, generator=g, dtype=dtype) * 3
    off = max_offset * torch.tanh(raw)
    off[..., 0, 0] = max_offset  # exactly at the bound
    return q, k, v, off


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_slab_rows_equal_the_whole_grid_operator(backend):
    from kernels import deformable_slide_attention, deformable_slide_attention_slab
    from kernels.dsa_reference import slab_kv_frames

    q, k, v, off = _slab_case()
    T = q.shape[1]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=q.dtype)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, off)]
    y = deformable_slide_attention(*leaves, (3, 3, 3), backend=backend)
    want = [y.detach(), *torch.autograd.grad(y, leaves, dout)]
    for t0, t1 in ((0, 1), (4, 5), (3, 6), (7, 9), (0, 9)):
        a, b = slab_kv_frames(t0, t1, T, 3, 1.5)
        leaves = [t.clone().requires_grad_(True) for t in (q[:, t0:t1], k[:, a:b], v[:, a:b], off[:, t0:t1])]
        y = deformable_slide_attention_slab(*leaves, (3, 3, 3), t0, a, T, backend=backend)
        got = [y.detach(), *torch.autograd.grad(y, leaves, dout[:, t0:t1])]
        torch.testing.assert_close(got[0], want[0][:, t0:t1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], want[1][:, t0:t1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[4], want[4][:, t0:t1], rtol=1e-12, atol=1e-12)
        # k and v: the slab's contribution, held frames only (other slabs add the rest)
        assert got[2].shape[1] == b - a and torch.isfinite(got[2]).all() and torch.isfinite(got[3]).all()
    assert slab_kv_frames(4, 5, T, 3, 1.5) == (0, 9) and slab_kv_frames(6, 7, 20, 3, 1.5) == (2, 11)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_slab_kv_gradients_sum_to_the_whole(backend):
    from kernels import deformable_slide_attention, deformable_slide_attention_slab
    from kernels.dsa_reference import slab_kv_frames

    q, k, v, off = _slab_case(grid=(8, 3, 3))
    T = q.shape[1]
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, off)]
    y = deformable_slide_attention(*leaves, (3, 3, 3), backend=backend)
    _, dk, dv, _ = torch.autograd.grad(y.square().sum(), leaves)
    kk, vv = k.clone().requires_grad_(True), v.clone().requires_grad_(True)
    total = 0
    for t0 in range(0, T, 3):
        t1 = min(T, t0 + 3)
        a, b = slab_kv_frames(t0, t1, T, 3, 1.5)
        total = total + deformable_slide_attention_slab(
            q[:, t0:t1], kk[:, a:b], vv[:, a:b], off[:, t0:t1], (3, 3, 3), t0, a, T, backend=backend).square().sum()
    gk, gv = torch.autograd.grad(total, (kk, vv))
    torch.testing.assert_close(gk, dk, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gv, dv, rtol=1e-12, atol=1e-12)


@interpreter_only
def test_interp_slab_rows_equal_the_whole_grid_triton(monkeypatch):
    _atomic_dkv(monkeypatch)
    from kernels import deformable_slide_attention, deformable_slide_attention_slab
    from kernels.dsa_reference import slab_kv_frames

    q, k, v, off = (t.float() for t in _slab_case(grid=(9, 3, 3), max_offset=0.5))
    T = q.shape[1]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, off)]
    y = deformable_slide_attention(*leaves, (3, 3, 3), backend="triton")
    want = [y.detach(), *torch.autograd.grad(y, leaves, dout)]
    t0, t1 = 4, 5
    a, b = slab_kv_frames(t0, t1, T, 3, 0.5)
    assert 0 < a and b < T
    leaves = [t.clone().requires_grad_(True) for t in (q[:, t0:t1], k[:, a:b], v[:, a:b], off[:, t0:t1])]
    y = deformable_slide_attention_slab(*leaves, (3, 3, 3), t0, a, T, backend="triton")
    got = [y.detach(), *torch.autograd.grad(y, leaves, dout[:, t0:t1])]
    for g_, w_ in ((got[0], want[0]), (got[1], want[1]), (got[4], want[4])):
        torch.testing.assert_close(g_, w_[:, t0:t1], rtol=1e-6, atol=1e-6)


# -----------------------------------------------------------------------------
# The streamed trainer: the compute actor's blocks honour runtime.token_chunk


@pytest.mark.parametrize("temperature", [False, True])
def test_streamed_training_with_token_chunk_matches_whole_blocks(tmp_path, temperature):
    """Two steps of the compute actor and the parameter store (plain classes, one process) with
    ``token_chunk`` 0 and 16 (one frame of the 3 x 4 x 4 token grid): the same parameters; also with
    a learned per-head temperature (``attention.learn_temperature``), which the third step moves (the
    adaLN-Zero gates and the head start at zero, so before that no gradient reaches it)."""
    from actors.compute import ComputeActor, LocalStoreClient
    from actors.decoder import VideoDecoder
    from actors.param_store import ParameterStore
    from megaslide_ray.data.demo import ensure_demo_dataset

    manifest = str(ensure_demo_dataset(tmp_path / "cache", num_videos=2))
    small = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
             "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
             "data.manifest": manifest, "runtime.state_dir": str(tmp_path), "attention.max_offset": 1.5,
             "attention.learn_temperature": temperature}
    with VideoDecoder(build_config("tiny", None, small).data, 0, 64) as dec:
        batches = [dec.next_batch() for _ in range(3 if temperature else 2)]  # tau's gradient is 0 until step 3
    masters = []
    for chunk in (0, 16):
        cfg = build_config("tiny", None, {**small, "runtime.token_chunk": chunk})
        store = ParameterStore(cfg, str(tmp_path / f"run-{chunk}"))
        compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
        try:
            assert all(getattr(m, "token_chunk", chunk) == chunk for m in compute.modules)
            for step, b in enumerate(batches):
                compute.train_step(b, step)
                store.wait_step(step)
            masters.append([s["master"].clone() for s in store.seg])
        finally:
            compute.close()
            store.close()
    for i, (a, b) in enumerate(zip(*masters)):
        if not temperature:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:  # three AdamW steps: a weight whose gradient is ~0 moves by about lr whatever its sign, so a few
            # elements differ by more than their rounding (without the lever too); the trainers' shard tolerance
            assert float((b - a).norm() / a.norm()) < 1e-5, f"shard {i}"
    if temperature:  # tau (the last parameter of each block's attention) moved, the same in both
        for i, (a, b) in enumerate(zip(*masters)):
            if 0 < i < len(masters[0]) - 1:
                lay = ShardLayout.of(build_shard(cfg, i, "meta"), i)
                tau_whole, tau_chunked = lay.views(a)["attn.tau"], lay.views(b)["attn.tau"]
                assert float(tau_whole.abs().min()) > 1e-5
                torch.testing.assert_close(tau_chunked, tau_whole, rtol=1e-5, atol=1e-7)
