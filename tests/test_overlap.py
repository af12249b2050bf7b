"""Weight streaming on the CPU: overlap on/off and staging give identical parameters, the
simulated link really throttles, and staging buffers do not grow with model depth."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import assert_streamed_equals_in_process, demo_batches, masters, streamed, train_steps
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

from actors.compute import ComputeActor
from actors.pinned import (
    PINNED,
    HostPinning,
    copy_in_pieces,
    copy_pieces,
    pin_ranges,
    split_at_pieces,
    throttled_copy,
)
from megaslide_ray.config import build_config
from megaslide_ray.models.registry import build_model

SMALL = {"model.depth": 3, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
         "training.steps": 3}


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    return demo_batches(tmp_path_factory, SMALL, 3)


def train(tmp_path, manifest, batches, depth=3, **runtime):
    over = {f"runtime.{k}": v for k, v in runtime.items()}
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                      "model.depth": depth, **over})
    with streamed(cfg, tmp_path / f"run-{len(list(tmp_path.iterdir()))}") as (store, compute):
        train.last = train_steps(store, compute, batches)[-1]
        train.sizes = [info.numel * 4 for info in store.shard_infos()]
        stash = compute.stash  # the last step's: inputs on the device at most, host slots
        train.peak = stash.peak_device_inputs
        train.host_slots = 0 if stash._host is None else stash._host.numel() // stash._slot
        return masters(store), compute.link.staging.allocated


def test_overlap_on_off_and_staging_give_identical_parameters(tmp_path, batches):
    manifest, bs = batches
    plain, _ = train(tmp_path, manifest, bs)
    off, _ = train(tmp_path, manifest, bs, overlap="false", link_gbps=5)
    on, allocated = train(tmp_path, manifest, bs, overlap="true", link_gbps=5, prefetch_depth=2)
    for a, b, c in zip(plain, off, on):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert allocated > 0, "the staged path must have been used"
    # Every shard once forward, then the backward's: not the head (it turns in place) and not
    # the last block (its forward weights are kept for it).
    sizes = train.sizes
    assert train.last.h2d_bytes == sum(sizes) + sum(sizes[:-2])


def test_resident_shards_are_fetched_once_per_step_with_identical_parameters(tmp_path, batches):
    """runtime.resident_gb: the blocks nearest the turn (then shard 0) whose weights fit are kept
    from their forward fetch to their backward: one fetch per step each, the same parameters."""
    manifest, bs = batches
    streamed, _ = train(tmp_path, manifest, bs, link_gbps=50)
    sizes = train.sizes  # shards 0..L+1 (L = 3), fp32
    budget = (sizes[2] + sizes[1]) / 1e9  # blocks 2 and 1 fit (block 3 is the turn's anyway)
    two, _ = train(tmp_path, manifest, bs, link_gbps=50, resident_gb=budget)
    assert train.last.h2d_bytes == sum(sizes) + sizes[0]  # only shard 0 is fetched twice
    whole, allocated = train(tmp_path, manifest, bs, link_gbps=50, resident_gb=1)
    assert train.last.h2d_bytes == sum(sizes)  # the model fits: it streams once per step
    for a, b, c in zip(streamed, two, whole):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert allocated <= 5 + 1  # every shard's buffer at most, the head's and the prefetch's


@pytest.mark.parametrize("runtime", [{"overlap": "true", "link_gbps": 5, "prefetch_depth": 2},
                                     {"overlap": "false", "link_gbps": 5},
                                     {"overlap": "true"}])
def test_offloaded_activations_give_identical_parameters(tmp_path, batches, runtime):
    manifest, bs = batches
    kept, _ = train(tmp_path, manifest, bs, **runtime)
    before = train.last
    offloaded, _ = train(tmp_path, manifest, bs, offload_activations="true", **runtime)
    after = train.last
    for a, b in zip(kept, offloaded):
        assert torch.equal(a, b)
    # The 3 block inputs went out and came back: (batch, tokens, width) fp32 each way.
    inputs = 3 * len(bs[0]["caption_len"]) * 3 * 4 * 4 * 32 * 4
    assert after.d2h_bytes - before.d2h_bytes == inputs
    assert after.h2d_bytes - before.h2d_bytes == inputs
    assert not list(tmp_path.glob("megaslide-activations-*")), "the host segment's file must be unlinked"


@pytest.mark.parametrize("runtime", [{"overlap": "true", "link_gbps": 5, "prefetch_depth": 2},
                                     {"overlap": "false", "link_gbps": 5}])
def test_partial_offload_keeps_the_last_inputs_on_the_device_with_identical_parameters(tmp_path, batches, runtime):
    """runtime.offload_keep = k: the last k block inputs stay on the device, the other L - k go
    out and come back; the parameters are bit-identical to keeping all and to offloading all."""
    manifest, bs = batches
    L = 4
    staged = (runtime.get("prefetch_depth", 1) if runtime["overlap"] == "true" else 0) + 1
    one = len(bs[0]["caption_len"]) * 3 * 4 * 4 * 32 * 4  # (batch, tokens, width) fp32
    plain, _ = train(tmp_path, manifest, bs, depth=L, **runtime)
    base = train.last
    assert train.peak == L  # measurement is not blind: without offload every input is held
    full, _ = train(tmp_path, manifest, bs, depth=L, offload_activations="true", **runtime)
    assert train.last.d2h_bytes - base.d2h_bytes == L * one and train.host_slots == L
    assert train.peak <= staged
    for a, b in zip(plain, full):
        assert torch.equal(a, b)
    for keep in (1, L - 1, L):
        params, _ = train(tmp_path, manifest, bs, depth=L, offload_activations="true", offload_keep=keep, **runtime)
        for a, b in zip(plain, params):
            assert torch.equal(a, b), f"offload_keep={keep}"
        # only the L - keep offloaded inputs move, once each way; the host segment has their slots
        assert train.last.d2h_bytes - base.d2h_bytes == (L - keep) * one, f"offload_keep={keep}"
        assert train.last.h2d_bytes - base.h2d_bytes == (L - keep) * one, f"offload_keep={keep}"
        assert train.host_slots == L - keep
        assert train.peak <= staged + keep, f"offload_keep={keep}: {train.peak} inputs on the device"
    assert not list(tmp_path.glob("megaslide-activations-*")), "the host segment's file must be unlinked"


@pytest.mark.parametrize("extra", [{}, {"token_chunk": 16}])
def test_kept_block_graphs_give_identical_parameters_with_one_forward_per_block(tmp_path, batches, extra,
                                                                             monkeypatch):
    """runtime.recompute_blocks=false: the backward runs on the forward's graphs, so every shard
    runs forward once per step instead of twice, and the parameters are the same to the bit."""
    manifest, bs = batches
    calls = {"_run": 0, "_run_with_grad": 0}

    def counting(name):
        real = getattr(ComputeActor, name)

        def run(self, *args, **kw):
            calls[name] += 1
            return real(self, *args, **kw)
        return run

    for name in calls:
        monkeypatch.setattr(ComputeActor, name, counting(name))
    recomputed, _ = train(tmp_path, manifest, bs, **extra)
    with_recompute = dict(calls)
    calls.update(_run=0, _run_with_grad=0)
    kept, _ = train(tmp_path, manifest, bs, recompute_blocks="false", **extra)
    for a, b in zip(recomputed, kept):
        assert torch.equal(a, b)
    L, steps = 3, len(bs)
    # Recomputing: shards 0..L forward without gradients, then again with them, and the head.
    assert with_recompute == {"_run": steps * (L + 1), "_run_with_grad": steps * (L + 2)}
    # Kept graphs: every shard once, with gradients.
    assert calls == {"_run": 0, "_run_with_grad": steps * (L + 2)}
    assert train.last.h2d_bytes == 0  # weights still read in place


@pytest.mark.parametrize("runtime,needle", [({"runtime.link_gbps": "5"}, "runtime.link_gbps=5.0"),
                                            ({"runtime.offload_activations": "true"}, "offload_activations"),
                                            ({"runtime.device": "cuda"}, "runtime.device='cuda'")])
def test_kept_block_graphs_are_refused_where_weights_are_not_read_in_place(runtime, needle):
    from megaslide_ray.config import ConfigError

    with pytest.raises(ConfigError, match="recompute_blocks=false") as err:
        build_config("tiny", None, {"runtime.recompute_blocks": "false", **runtime})
    assert needle in str(err.value)


def test_staging_buffers_do_not_grow_with_depth(tmp_path, batches):
    manifest, bs = batches
    _, shallow = train(tmp_path, manifest, bs[:1], depth=3, link_gbps=50, prefetch_depth=1)
    _, deep = train(tmp_path, manifest, bs[:1], depth=9, link_gbps=50, prefetch_depth=1)
    # Block buffers: at most prefetch_depth + 1 in flight (+ one each for the two odd-sized
    # shards), for 3 blocks and for 9 alike.
    assert deep == shallow <= 2 + 2


MEMORY_CHILD = """
import sys
from actors.decoder import VideoDecoder
from benchmarks.overlap import run
from megaslide_ray.config import build_config
manifest, depth, offload = sys.argv[1:]
ov = {"data.manifest": manifest, "model.hidden_size": "32", "model.num_heads": "2", "model.caption_dim": "16",
      "attention.kind": "neighborhood", "attention.window": "1,3,3", "data.batch_size": "4",
      "model.depth": depth, "runtime.link_gbps": "100", "runtime.offload_activations": offload}
cfg = build_config("tiny", None, ov)
with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
    batch = dec.next_batch()
print(run(ov, [batch], 1, measure_memory=True)["peak_anon_bytes"])
"""


@pytest.mark.slow
def test_offloaded_activations_keep_working_memory_flat_in_depth(batches):
    """Peak anonymous memory of one step in a fresh process, depth 2 vs 24. Each block input is
    4 x 2048 tokens x 32 x fp32 = 1 MiB, so keeping them adds 22 MiB at depth 24; offloaded,
    the growth must stay under 4 MiB (the tolerance). Large allocations go straight to mmap
    (fixed threshold), so RSS follows what is live rather than the heap's fragmentation."""
    manifest, _ = batches
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": str(root)}

    def peak(depth: int, offload: bool) -> int:
        out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, manifest, str(depth), str(offload).lower()],
                             capture_output=True, text=True, env=env, cwd=root, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return int(out.stdout.split()[-1])

    inputs = 22 * 4 * 2048 * 32 * 4
    kept = peak(24, False) - peak(2, False)
    offloaded = peak(24, True) - peak(2, True)
    assert kept >= 0.8 * inputs, f"kept inputs grew memory by {kept / 2**20:.1f} MiB only: measurement is blind"
    assert offloaded <= 4 * 2**20, f"with offload_activations memory still grew {offloaded / 2**20:.1f} MiB"


def test_throttle_limits_copy_rate():
    src = torch.ones(10_000_000)  # 40 MB
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    throttled_copy(dst, src, gbps=0.5)
    seconds = time.perf_counter() - t0
    assert torch.equal(dst, src)
    rate = 40e6 / seconds / 1e9
    assert rate <= 0.5 * 1.1, f"copied at {rate:.2f} GB/s, limit 0.5"


def test_pin_ranges_cover_the_segment_in_page_aligned_bounded_pieces():

    page, chunk = 4096, 3 * 4096
    for ptr, nbytes in [(0, 1), (4096, 4096), (8192, 5 * 4096 + 7), (4096 * 7, 3 * 4096), (12288, 0)]:
        pieces = pin_ranges(ptr, nbytes, chunk, page)
        if nbytes == 0:
            assert pieces == []
            continue
        assert all(s % page == 0 and 0 < n <= chunk and n % page == 0 for s, n in pieces)
        assert all(a + n == b for (a, n), (b, _) in zip(pieces, pieces[1:]))  # contiguous, no overlap
        first, (last, last_n) = pieces[0][0], pieces[-1]
        assert first <= ptr < first + page and ptr + nbytes <= last + last_n < ptr + nbytes + page
    with pytest.raises(ValueError, match="multiple of the page size"):
        pin_ranges(0, 10, chunk=5000, page=4096)


def test_copies_are_cut_where_registrations_meet():
    """A copy to or from registered host memory is one asynchronous copy per registration
    piece it crosses (CUDA does DMA within one registration only); memory that is not wholly
    registered gets no asynchronous copy at all (None)."""
    page, chunk = 4096, 3 * 4096
    seg = pin_ranges(8 * page, 10 * page, chunk, page)  # 4 pieces: 3, 3, 3, 1 pages
    assert split_at_pieces(8 * page, 10 * page, seg) == [(0, chunk), (chunk, chunk), (2 * chunk, chunk), (3 * chunk, page)]
    assert split_at_pieces(9 * page, page, seg) == [(0, page)]                        # inside one piece
    assert split_at_pieces(10 * page + 8, 2 * page, seg) == [(0, page - 8), (page - 8, page + 8)]  # across one edge
    assert split_at_pieces(8 * page, 0, seg) == []
    assert split_at_pieces(7 * page, 2 * page, seg) is None                           # starts before it
    assert split_at_pieces(17 * page, 2 * page, seg) is None                          # runs past its end
    holed = [r for i, r in enumerate(seg) if i != 1]                                  # a piece missing
    assert split_at_pieces(8 * page, 10 * page, holed) is None
    other = pin_ranges(30 * page, page, chunk, page)                                  # a second segment
    assert split_at_pieces(30 * page, page, sorted(seg + other)) == [(0, page)]
    for ptr, n in [(8 * page + 4, 5 * page), (8 * page, 10 * page), (12 * page + 12, 3)]:
        pieces = split_at_pieces(ptr, n, seg)
        assert sum(length for _, length in pieces) == n
        assert all(a + la == b for (a, la), (b, _) in zip(pieces, pieces[1:]))    # contiguous


class FakeCudart:
    """cudaHostRegister that refuses piece ``fail_at`` (1-based); records what is registered."""

    def __init__(self, fail_at=None):
        self.fail_at, self.calls, self.live = fail_at, 0, set()

    def cudaHostRegister(self, ptr, n, flags):
        self.calls += 1
        if self.fail_at is not None and self.calls >= self.fail_at:
            return 2  # cudaErrorMemoryAllocation
        self.live.add(ptr)
        return 0

    def cudaHostUnregister(self, ptr):
        self.live.discard(ptr)
        return 0


def test_pinned_registry_drives_the_copy_pieces(caplog):
    """HostPinning records its pieces in the process registry; copy_pieces cuts a tensor there
    (in elements); a refused registration leaves nothing registered and warns once."""
    chunk = 64 << 10
    buf = torch.zeros(5 * chunk // 4, dtype=torch.float32)  # 5 pieces of 64 KiB (if page-aligned)
    fake = FakeCudart()
    pin = HostPinning(cudart=fake, chunk=chunk)
    before = PINNED.total()
    try:
        assert pin.register(buf)
        pieces = copy_pieces(buf)
        assert pieces is not None and sum(n for _, n in pieces) == buf.numel()
        assert all(n <= chunk // 4 for _, n in pieces) and len(pieces) >= 5
        inner = buf[10:20]
        assert copy_pieces(inner) == [(0, 10)]
        dst = torch.empty_like(buf)
        copy_in_pieces(dst, torch.arange(buf.numel(), dtype=torch.float32), pieces)
        assert torch.equal(dst, torch.arange(buf.numel(), dtype=torch.float32))
        assert copy_pieces(torch.zeros(100)) is None  # not registered, no CUDA: not pinned
    finally:
        pin.release()
    assert PINNED.total() == before and not fake.live

    import actors.pinned as pinned

    pinned._REGISTER_FAILED_LOGGED = False
    refusing = FakeCudart(fail_at=3)
    pin = HostPinning(cudart=refusing, chunk=chunk)
    with caplog.at_level("WARNING", logger="actors.pinned"):
        assert not pin.register(buf)
        assert not HostPinning(cudart=FakeCudart(fail_at=1), chunk=chunk).register(buf)
    assert not refusing.live and not pin.ranges and PINNED.total() == before
    assert copy_pieces(buf) is None
    assert sum("could not register" in r.message for r in caplog.records) == 1, "the refusal warns once"
    pinned._REGISTER_FAILED_LOGGED = False


class ZeroFills(TorchDispatchMode):
    """Counts the ops that create (or fill) a zero tensor of one of ``sizes`` elements, and every
    ``slice_backward`` (which builds a zero tensor the size of the sliced input)."""

    NAMES = ("zeros", "new_zeros", "zeros_like", "zero_", "fill_", "full", "new_full", "full_like")

    def __init__(self, sizes):
        super().__init__()
        self.sizes, self.fills, self.slice_backward = set(sizes), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name == "slice_backward":
            self.slice_backward += 1
        elif name in self.NAMES and isinstance(out, torch.Tensor) and out.numel() in self.sizes:
            self.fills += 1
        return out


def test_a_shards_backward_makes_one_zero_fill_not_one_per_parameter(tmp_path, batches):
    """Gradients land in one flat buffer per shard (each parameter's .grad a view of it): one
    zero fill of the shard's size per shard backward. Before, the parameters were slices of a
    flat leaf and autograd's slice_backward built a zero tensor of the whole shard for every
    parameter (14 per block of this model; the counter sees them: checked below)."""
    manifest, bs = batches
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                      "runtime.overlap": False})
    with streamed(cfg, tmp_path / "run") as (store, compute):
        sizes = [info.numel for info in store.shard_infos()]
        with ZeroFills(sizes) as count:
            compute.train_step(bs[0], 0)
        store.wait_step(0)
        # The old way, on one block: a flat leaf, the parameters sliced out of it.
        layout = store.shard_infos()[1].layout
        flat = store.seg[1]["w"].clone().requires_grad_(True)
        x = torch.randn(2, 3, 4, 4, 32, requires_grad=True)
        y = functional_call(compute.modules[1], layout.views(flat), (x, torch.randn(2, 32)))
        with ZeroFills(sizes) as old:
            y.sum().backward()
    assert old.slice_backward == len(layout.names) == 14, "the counter must see the old per-parameter fills"
    assert count.slice_backward == 0
    assert count.fills == len(sizes), f"{count.fills} shard-sized zero fills for {len(sizes)} shard backwards"


def test_predict_refuses_weights_that_gradients_replaced(tmp_path, batches):
    """After a training step's backward, the shards at that version hold its gradients in w:
    predicting with that version is refused; the next version (after the update) serves."""
    manifest, bs = batches
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path)})
    b = bs[0]
    x = torch.zeros((1, 6, 32, 32, 3))
    args = (x, torch.full((1,), 0.5), torch.from_numpy(b["caption"][:1]), torch.from_numpy(b["caption_len"][:1]))
    with streamed(cfg, tmp_path / "run") as (store, compute):
        before = compute.predict(*args, step=0)
        compute.train_step(b, 0)
        with pytest.raises(RuntimeError, match="replaced by its gradients"):
            compute.predict(*args, step=0)
        store.wait_step(0)
        after = compute.predict(*args, step=1)
        assert torch.isfinite(after).all() and not torch.equal(before, after)


def test_sample_prediction_streams_like_the_whole_model(tmp_path, batches):
    """``model.prediction = sample``: the compute actor turns the head's clean-clip estimate into
    the velocity before the loss and in ``predict``, as the whole model does: two streamed steps
    give the in-process trainer's losses and parameters, and a prediction equals the model's."""
    from megaslide_ray.training.baseline import InProcessTrainer

    manifest, bs = batches
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                      "model.prediction": "sample"})
    baseline = InProcessTrainer(cfg, threads=1)
    b = bs[0]
    args = (torch.randn((1, 6, 32, 32, 3), generator=torch.Generator().manual_seed(5)), torch.full((1,), 0.3),
            torch.from_numpy(b["caption"][:1]), torch.from_numpy(b["caption_len"][:1]))
    with streamed(cfg, tmp_path / "run") as (store, compute):
        results = train_steps(store, compute, bs[:2])
        reference = [baseline.train_step(batch) for batch in bs[:2]]
        got = compute.predict(*args, step=2)
        weights = masters(store)
    assert_streamed_equals_in_process(results, weights, reference, baseline.model)
    with torch.no_grad():
        want = baseline.model(*args)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the conversion really happened: the same weights read as a velocity model give the head's
    # raw output, and the prediction is (x_t - that) / t
    raw = build_model(build_config("tiny", None, {**SMALL, "data.manifest": manifest}))
    raw.load_state_dict(baseline.model.state_dict())
    with torch.no_grad():
        head_out = raw(*args)
    torch.testing.assert_close(want, (args[0] - head_out) / 0.3, rtol=1e-4, atol=1e-5)
    assert float((want - head_out).abs().mean()) > 0.1
