"""runtime.device_shards: the forward's first shards kept and updated on the compute device.

On the CPU the device update runs the store's own fused AdamW on the same gradients with the same
global norm (an exactly rounded sum of the same squared norms), so the parameters and moments are
bit-identical to the store's update, with or without clipping, streamed or read in place; the
device shards cross the link never; a checkpoint taken after ``put_device_state`` resumes to the
uninterrupted run; bad combinations are refused before any work."""

import pytest
import torch
from helpers import assert_streamed_equals_in_process, demo_batches, streamed, train_steps
from test_overlap import SMALL  # the small model the streaming tests train (3 blocks, 3 steps)

from megaslide_ray.config import ConfigError, build_config


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    return demo_batches(tmp_path_factory, SMALL, 3)


def config(tmp_path, manifest, **over):
    return build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                       **over})


def state_after(cfg, run_dir, batches, first: int = 0, **store_kw):
    """Train ``batches`` streamed; the store's state (every segment but ``w``) after the device
    shards' state went back into it, the last step's result and the store's shard sizes."""
    with streamed(cfg, run_dir, **store_kw) as (store, compute):
        results = train_steps(store, compute, batches, first=first)
        if cfg.runtime.device_shards:
            version, states = compute.device_state()
            assert version == first + len(batches)
            store.put_device_state(version, states)
        state = [{k: s[k].clone() for k in ("master", "m", "v")} for s in store.seg]
        return state, results, [info.numel * 4 for info in store.shard_infos()]


@pytest.mark.parametrize("runtime", [{"runtime.link_gbps": 5, "runtime.prefetch_depth": 2},
                                     {"runtime.link_gbps": 5, "runtime.overlap": "false"},
                                     {"runtime.recompute_blocks": "false"},
                                     {"runtime.link_gbps": 5, "optim.grad_clip": 1e-3, "training.micro_batches": 2}])
def test_device_shards_are_bit_identical_to_the_stores_update(tmp_path, batches, runtime):
    manifest, bs = batches
    plain, _, sizes = state_after(config(tmp_path, manifest, **runtime), tmp_path / "plain", bs)
    dev, results, _ = state_after(config(tmp_path, manifest, **runtime, **{"runtime.device_shards": 2}),
                                  tmp_path / "dev", bs)
    for i, (a, b) in enumerate(zip(plain, dev)):
        for k in ("master", "m", "v"):
            assert torch.equal(a[k], b[k]), f"shard {i} {k}"
    assert not torch.equal(plain[0]["master"], plain[0]["m"])  # (they did train)
    if "runtime.link_gbps" in runtime:
        # shards 0 and 1 cross the link neither way: forward 2, 3, head; backward 2 (3 turns in place)
        assert results[-1].h2d_bytes == sizes[2] + sizes[3] + sizes[4] + sizes[2]
        assert results[-1].d2h_bytes == sizes[4] + sizes[3] + sizes[2]


def test_device_shards_train_as_the_in_process_trainer(tmp_path, batches):
    from megaslide_ray.training.baseline import InProcessTrainer

    manifest, bs = batches
    cfg = config(tmp_path, manifest, **{"runtime.device_shards": 3, "runtime.link_gbps": 5})
    state, results, _ = state_after(cfg, tmp_path / "run", bs)
    baseline = InProcessTrainer(cfg, threads=1)
    reference = [baseline.train_step(b) for b in bs]
    assert_streamed_equals_in_process(results, [s["master"] for s in state], reference, baseline.model)


def test_a_checkpoint_of_device_shards_resumes_to_the_uninterrupted_run(tmp_path, batches):
    manifest, bs = batches
    cfg = config(tmp_path, manifest, **{"runtime.device_shards": 2, "runtime.link_gbps": 5})
    whole, _, _ = state_after(cfg, tmp_path / "whole", bs)
    run = tmp_path / "cut"
    with streamed(cfg, run) as (store, compute):
        train_steps(store, compute, bs[:2])
        before_put = store.seg[0]["master"].clone()
        store.put_device_state(*compute.device_state())
        assert not torch.equal(before_put, store.seg[0]["master"])  # the store's copy was the initial one
        ckpt = store.save_checkpoint(str(run), 2, {})
    resumed, _, _ = state_after(cfg, tmp_path / "resumed", bs[2:], first=2, resume_checkpoint=ckpt)
    for i, (a, b) in enumerate(zip(whole, resumed)):
        for k in ("master", "m", "v"):
            assert torch.equal(a[k], b[k]), f"shard {i} {k}"


def test_predict_reads_the_device_shards(tmp_path, batches):
    """Sampling between steps: the prediction takes the device shards' new weights (the store's
    copies of them are still the initial ones) and equals the prediction of a run without them."""
    manifest, bs = batches
    b = bs[0]
    args = (torch.randn((1, 6, 32, 32, 3), generator=torch.Generator().manual_seed(5)), torch.full((1,), 0.3),
            torch.from_numpy(b["caption"][:1]), torch.from_numpy(b["caption_len"][:1]))
    cfg = config(tmp_path, manifest, **{"runtime.device_shards": 2})
    plain_cfg = config(tmp_path, manifest)
    with streamed(plain_cfg, tmp_path / "plain") as (store, compute):
        train_steps(store, compute, bs[:2])
        want = compute.predict(*args, step=2)
    with streamed(cfg, tmp_path / "dev") as (store, compute):
        train_steps(store, compute, bs[:2])
        got = compute.predict(*args, step=2)
    assert torch.equal(got, want)


@pytest.mark.parametrize("over,match", [
    ({"runtime.device_shards": 4}, "from 0 to model.depth=3"),
    ({"runtime.device_shards": -1}, "from 0 to model.depth"),
    ({"runtime.device_shards": 1, "runtime.compute_actors": 2}, "runtime.compute_actors=2"),
    ({"runtime.device_shards": 1, "runtime.nodes": 2}, "runtime.nodes=2"),
    ({"runtime.device_shards": 2, "training.ema_decay": 0.99}, "training.ema_decay=0.99"),
])
def test_device_shards_refuse_what_they_cannot_serve(over, match):
    with pytest.raises(ConfigError, match=match):
        build_config("tiny", None, {**SMALL, **over})


def test_the_prefetch_window_passes_over_device_positions():
    """The feed's staging rule, which the planner's replay shares: the next ``depth`` positions
    that fetch; a step whose first positions are device shards starts its first fetch at once."""
    from megaslide_ray.models.shards import prefetch_window
    from megaslide_ray.planning.schedule import schedule_seconds

    device = [True, True, False, False, False]
    assert prefetch_window(device, 0, 1) == [2]
    assert prefetch_window(device, 2, 2) == [3, 4]
    assert prefetch_window([False] * 4, 0, 2) == [1, 2]
    # two device positions computing 1 s each, then a position whose fetch takes 1.5 s: fetched from
    # the step's start, it waits 0 s; without the device positions the same fetch would wait 1.5 s
    assert schedule_seconds(0.0, [0.0, 0.0, 1.5], [1.0, 1.0, 1.0], {}, 1, device={0, 1}) == 3.0
    assert schedule_seconds(0.0, [1.5, 0.0, 0.0], [1.0, 1.0, 1.0], {}, 1) == 4.5


def test_the_planner_counts_device_shards(tmp_path):
    """``plan``: the device shards cross the link neither way and are not updated in host DRAM;
    the device holds their w and fp32 master, m, v and gradient; the step's positions fetch and
    return nothing at theirs."""
    from megaslide_ray.planning.estimate import plan
    from megaslide_ray.planning.schedule import step_positions

    base, dev = (build_config("tiny", None, {**SMALL, "runtime.device_shards": d}) for d in (0, 2))
    p0, p2 = (plan(c, "float32", pcie_gbps=1.0, device_tflops=1.0, dram_gbps=10.0) for c in (base, dev))
    pos = step_positions(dev, 4)
    numels = [n // 4 for n in step_positions(base, 4).fetch_bytes[:2]]  # shards 0 and 1, fp32
    moved = 4 * sum(numels)
    assert p0.h2d_bytes - p2.h2d_bytes == 2 * moved and p0.d2h_bytes - p2.d2h_bytes == moved
    assert p2.device_state_bytes == sum(numels) * (4 + 16)
    assert p2.device_required_bytes - p0.device_required_bytes == p2.device_state_bytes
    assert p0.adamw_dram_bytes - p2.adamw_dram_bytes == sum(numels) * p0.adamw_bytes_per_param
    assert sorted(pos.device) == [0, 1, len(pos.order) - 2, len(pos.order) - 1]
    assert all(pos.fetch_bytes[p] == 0 and p not in pos.grad_bytes for p in pos.device)
    assert p2.step_boundary_s < p0.step_boundary_s
