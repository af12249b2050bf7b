"""Weight streaming on the CPU: overlap on/off and staging give identical parameters, the
simulated link really throttles, and staging buffers do not grow with model depth."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from actors.transfer import pin_ranges, throttled_copy
from megaslide_ray.config import build_config
from megaslide_ray.demo_data import ensure_demo_dataset

SMALL = {"model.depth": 3, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
         "training.steps": 3}


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    manifest = str(ensure_demo_dataset(tmp_path_factory.mktemp("cache"), num_videos=4))
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest})
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
        return manifest, [dec.next_batch() for _ in range(3)]


def train(tmp_path, manifest, batches, depth=3, **runtime):
    over = {f"runtime.{k}": v for k, v in runtime.items()}
    cfg = build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                      "model.depth": depth, **over})
    store = ParameterStore(cfg, str(tmp_path / f"run-{len(list(tmp_path.iterdir()))}"))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        for step, b in enumerate(batches):
            result = compute.train_step(b, step)
            store.wait_step(step)
        train.last, train.sizes = result, [info.numel * 4 for info in store.shard_infos()]
        return [s["master"].clone() for s in store.seg], compute.link.staging.allocated
    finally:
        compute.close()
        store.close()


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
