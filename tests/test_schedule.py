"""The planner's step time (``planning/schedule.py``) against the compute actor's schedule and the
overlap benchmark's schedule model, and the benchmark's flags for micro-batches, resident shards
and several compute actors."""

import pytest

from actors.compute import ComputeActor, LocalStoreClient
from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from benchmarks.overlap import model_waits, parse_args, run, simulate
from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.planning.estimate import plan
from megaslide_ray.planning.schedule import schedule_seconds, schedule_waits, step_positions

SMALL = {"model.depth": 3, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32}


def actor_order(tmp_path, over: dict) -> tuple[list[int], dict[int, int], list[int]]:
    """The compute actor's own step order, reuse and shard sizes for ``over``."""
    cfg = build_config("tiny", None, {**SMALL, "runtime.state_dir": str(tmp_path), **over})
    store = ParameterStore(cfg, str(tmp_path / "run"))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        order, reuse = compute.step_order()
        return order, reuse, [info.numel for info in store.shard_infos()]
    finally:
        compute.close()
        store.close()


@pytest.mark.parametrize("resident_gb", [0.0, 0.00011, 1.0])
def test_planner_positions_are_the_compute_actors(tmp_path, resident_gb):
    """The planner fetches what the actor fetches, position by position: the turn's block and the
    resident shards (none, one block, every block and shard 0) are not fetched again."""
    order, reuse, numels = actor_order(tmp_path, {"runtime.resident_gb": resident_gb, "runtime.link_gbps": 5})
    pos = step_positions(build_config("tiny", None, {**SMALL, "runtime.resident_gb": resident_gb}), 4)
    assert pos.order == order
    assert pos.fetch_bytes == [0 if p in reuse else numels[s] * 4 for p, s in enumerate(order)]
    assert sum(b == 0 for b in pos.fetch_bytes) == {0.0: 1, 0.00011: 2, 1.0: 4}[resident_gb]


def pure_run_of(pos, seconds_per_flop: float) -> dict:
    """A pure run as ``benchmarks.overlap.run`` reports it, whose positions compute for the
    planner's FLOPs at ``seconds_per_flop`` (one step's timeline: each take returns at once)."""
    t, takes = 0.0, []
    for f in pos.flops:
        takes.append((t, t))
        t += f * seconds_per_flop
    n = len(pos.order) // 2 + 1  # forward positions 0..L+1
    return {"timelines": [(0.0, takes, t)], "fetch_bytes": pos.fetch_bytes, "n": n,
            "grad_bytes": [pos.grad_bytes.get(p, 0) if p >= n - 1 else 0 for p in range(len(pos.order))]}


@pytest.mark.parametrize("k,resident_gb,depth", [(1, 0.0, 1), (2, 0.0, 1), (4, 0.00011, 2), (2, 0.0, 0)])
def test_planner_step_time_matches_the_benchmarks_schedule_model(k, resident_gb, depth):
    """``plan``'s step time at a link speed and a compute rate equals the overlap benchmark's
    schedule model fed with the same per-position compute times, sizes and link; the model's
    compute grows with K and its bytes do not."""
    over = {**SMALL, "training.micro_batches": k, "runtime.resident_gb": resident_gb,
            "runtime.prefetch_depth": max(depth, 1), "runtime.overlap": str(depth > 0).lower()}
    cfg = build_config("tiny", None, over)
    gbps, tflops = 0.002, 3e-3
    p = plan(cfg, "float32", pcie_gbps=gbps, device_tflops=tflops, dram_gbps=1e3)
    pos = step_positions(cfg, 4)
    pure = pure_run_of(pos, 1 / (tflops * 1e12))
    assert p.step_s == pytest.approx(simulate(pure, gbps, depth, overlap=depth > 0), rel=1e-9)
    assert p.step_off_s == pytest.approx(simulate(pure, gbps, depth, overlap=False), rel=1e-9)
    one = step_positions(build_config("tiny", None, {**over, "training.micro_batches": 1}), 4)
    assert sum(pos.flops) == pytest.approx(k * sum(one.flops), rel=1e-6)  # (shard 0's per-sample work grows too)
    assert pos.fetch_bytes == one.fetch_bytes
    # each resource alone bounds the step from below, and with overlap it is below fetch + compute + return
    fetch, ret = sum(pos.fetch_bytes) / (gbps * 1e9), sum(pos.grad_bytes.values()) / (gbps * 1e9)
    assert max(fetch, p.time_terms["compute"]) <= p.step_s <= p.step_off_s == pytest.approx(
        fetch + ret + sum(pos.flops) / (tflops * 1e12), rel=1e-9)


def test_schedule_is_the_slower_resource_when_the_other_is_free():
    """A free link: the compute alone; free compute: the fetches in a row, then the last return."""
    assert schedule_seconds(0.0, [0.0] * 4, [1.0, 2.0, 3.0, 4.0], {3: 0.0}, 1) == 10.0
    assert schedule_seconds(0.5, [1.0, 2.0, 0.0, 3.0], [0.0] * 4, {3: 2.0}, 1) == 0.5 + 6.0 + 2.0
    # a fetch waits for its prefetch slot: position 2 is submitted when position 1 starts computing
    assert schedule_seconds(0.0, [1.0, 1.0, 1.0], [5.0, 0.0, 0.0], {}, 1) == 1.0 + 5.0 + 1.0


def test_schedule_waits_split_the_step_beyond_its_compute():
    """The compute's waits: the first fetches (fill), the stalls between, the gradients still on the
    link after the last compute (drain); they add up to the step minus the compute."""
    # fetch 1, 2 before positions 0 and 1 compute (fill 1 + 1); position 2's fetch (4) is submitted
    # when position 1 starts (t=3) and ends at 7, one after position 1's compute (stall 1); its
    # gradient (3) returns after it computes (7-8): 8-11 (drain 3)
    fetch, comp, grads = [1.0, 2.0, 4.0], [1.0, 3.0, 1.0], {2: 3.0}
    w = schedule_waits(fetch, comp, grads, 1)
    assert w == {"fill": 2.0, "stalls": 1.0, "drain": 3.0}
    assert sum(w.values()) == schedule_seconds(0.0, fetch, comp, grads, 1) - sum(comp) == 6.0
    assert schedule_waits([0.0] * 3, comp, {}, 1) == {"fill": 0.0, "stalls": 0.0, "drain": 0.0}


@pytest.mark.parametrize("k", [1, 2])
def test_plan_reports_the_step_boundary_the_benchmark_models(k):
    """``plan``'s boundary (fill + drain) is the benchmark model's for the same positions, and it
    does not grow with K while the compute does; a floor above the schedule hides it."""
    cfg = build_config("tiny", None, {**SMALL, "training.micro_batches": k})
    gbps, tflops = 0.002, 3e-3
    p = plan(cfg, "float32", pcie_gbps=gbps, device_tflops=tflops, dram_gbps=1e3)
    w = model_waits(pure_run_of(step_positions(cfg, 4), 1 / (tflops * 1e12)), gbps, 1)
    assert p.step_boundary_s == pytest.approx(w["fill"] + w["drain"], rel=1e-9) and p.step_boundary_s > 0
    one = plan(build_config("tiny", None, {**SMALL, "training.micro_batches": 1}), "float32", pcie_gbps=gbps,
               device_tflops=tflops, dram_gbps=1e3)
    assert p.step_boundary_s <= one.step_boundary_s * (1 + 1e-9)
    assert plan(cfg, "float32", pcie_gbps=gbps, device_tflops=tflops, dram_gbps=1e-6).step_boundary_s == 0.0


def test_plan_binding_follows_the_busiest_resource():
    cfg = build_config("tiny", None, {**SMALL, "training.micro_batches": 4})
    link_bound = plan(cfg, "float32", pcie_gbps=1e-4, device_tflops=1e3, dram_gbps=1e3)
    compute_bound = plan(cfg, "float32", pcie_gbps=1e3, device_tflops=1e-6, dram_gbps=1e3)
    dram_bound = plan(cfg, "float32", pcie_gbps=1e3, device_tflops=1e3, dram_gbps=1e-6)
    assert (link_bound.step_binding, compute_bound.step_binding, dram_bound.step_binding) == \
        ("link", "compute", "host DRAM")
    assert dram_bound.step_s == pytest.approx(dram_bound.time_terms["adamw"], rel=1e-9)  # it overlaps the step


@pytest.mark.parametrize("argv,needle", [(["--micro-batches", "0"], "--micro-batches '0'"),
                                         (["--actors", "two"], "--actors 'two'"),
                                         (["--resident-gb", "-1"], "--resident-gb '-1'"),
                                         (["--models", "huge"], "unknown ['huge']")])
def test_benchmark_refuses_bad_flags(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert needle in str(e.value)


def test_benchmark_parses_lists():
    a = parse_args(["--micro-batches", "1,2,4", "--resident-gb", "0,0.5", "--actors", "2"])
    assert (a.ks, a.residents, a.ns) == ([1, 2, 4], [0.0, 0.5], [2])


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return str(ensure_demo_dataset(tmp_path_factory.mktemp("cache"), num_videos=4))


def test_benchmark_run_trains_several_actors_with_micro_batches_and_resident_shards(manifest):
    """Two compute actors on one store, two micro-batches each, shard 0 and the blocks resident:
    every step completes (the store needs both actors' gradients), the staged bytes are the
    planner's, and each actor's timeline has one take per position."""
    over = {**SMALL, "data.manifest": manifest, "model.depth": 2, "training.micro_batches": 2,
            "runtime.resident_gb": 1.0, "runtime.link_gbps": 1.0, "runtime.compute_actors": 2,
            "runtime.compute_threads": 1}
    cfg = build_config("tiny", None, {**over, "data.batch_size": 2 * cfg_batch(over)})
    with VideoDecoder(cfg.data, 0, cfg.model.caption_max_bytes) as dec:
        batches = [dec.next_batch() for _ in range(2)]
    r = run(over, batches, 2, actors=2)
    pos = step_positions(build_config("tiny", None, over), 4)
    assert r["staged_bytes"] == sum(pos.fetch_bytes) == r["h2d_bytes"]
    assert all(len(takes) == len(pos.order) for _, takes, _ in r["timelines"])


def cfg_batch(over: dict) -> int:
    return build_config("tiny", None, over).data.batch_size
