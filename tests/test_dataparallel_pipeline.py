"""Several compute actors through Ray, with the Trainer (the slow half): a checkpoint written with
two actors resumes with one or two, and three actors with micro-batches equal one actor with the
whole batch. The default run checks two actors on two nodes against one (test_multinode.py) and
the arithmetic on its own (N = 2, 3, micro-batches) in test_dataparallel.py; test_faults.py's
two-actor rows are slow too."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from megaslide_ray.driver import Trainer
from megaslide_ray.state.checkpoint import read_checkpoint_shards

pytestmark = pytest.mark.slow

STEPS = {"training.steps": 4, "training.checkpoint_every": 2, "optim.grad_clip": 0.05, "attention.kind": "dense"}
TWO = {"runtime.compute_actors": 2, "data.batch_size": 1}
ONE = {"data.batch_size": 2}


def run(cfg, run_dir: Path, steps=None, resume=False):
    """Train ``cfg`` into ``run_dir``, to the end or ``steps``; (summary, final weights, metrics rows)."""
    trainer = Trainer(cfg, run_dir=str(run_dir), progress=False, resume=resume)
    try:
        if steps is None:
            summary = trainer.train()
        else:
            for step in range(trainer.start_step, steps):
                trainer.train_step(step)
            summary = None
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shards = read_checkpoint_shards(Path(summary.checkpoint)) if summary else None
    return summary, shards, rows


@pytest.fixture(scope="module")
def one(ray_session, small_config, tmp_path_factory):
    return run(small_config(**STEPS, **ONE), tmp_path_factory.mktemp("one") / "run")


@pytest.fixture(scope="module")
def two(ray_session, small_config, tmp_path_factory):
    return run(small_config(**STEPS, **TWO), tmp_path_factory.mktemp("two") / "run")


def assert_close(got, want, rtol=1e-6):
    for i, (a, b) in enumerate(zip(got, want)):
        rel = float((a - b).norm() / b.norm())
        assert rel < rtol, f"shard {i}: relative difference {rel:.2e}"


def test_a_checkpoint_of_two_actors_resumes_with_one_or_two(one, two, small_config, tmp_path):
    run(small_config(**STEPS, **TWO), tmp_path / "a", steps=2)  # stopped after the step-2 checkpoint
    state = json.loads((tmp_path / "a" / "checkpoints" / "step_2" / "state.json").read_text())
    assert state["data_slot"] == 4  # two slots per step
    same = tmp_path / "b"
    shutil.copytree(tmp_path / "a", same)
    # Another N: the same clips continue (one decoder), grouped into steps of the new global batch.
    s1, w1, rows = run(small_config(**STEPS, **ONE), tmp_path / "a", resume=True)
    assert s1.first_step == 2
    assert [r["data_rows"] for r in rows[2:]] == [r["data_rows"] for r in one[2][2:]]
    assert_close(w1, one[1])
    # The same N: bit-identical to the uninterrupted run.
    _, w2, _ = run(small_config(**STEPS, **TWO), same, resume=True)
    for a, b in zip(w2, two[1]):
        assert torch.equal(a, b)


def test_three_compute_actors_and_micro_batches_through_ray(ray_session, small_config, tmp_path):
    cfg = {**STEPS, "training.steps": 2, "training.checkpoint_every": 0}
    _, want, _ = run(small_config(**cfg, **{"data.batch_size": 6}), tmp_path / "one")
    _, got, rows = run(small_config(**cfg, **{"runtime.compute_actors": 3, "data.batch_size": 1,
                                              "training.micro_batches": 2}), tmp_path / "three")
    # The whole model to 1e-6; shard by shard to 1e-5: the head starts at zero (adaLN-Zero), so its
    # weights are small and its gradients hold elements near AdamW's eps, where a rounding-level
    # difference in the gradient moves the update (one actor with 6 micro-batches of 1 differs from
    # one batch of 6 by as much: 2e-6 on the head after 2 steps, 1e-8 on the blocks).
    whole = float((torch.cat(got) - torch.cat(want)).norm() / torch.cat(want).norm())
    assert whole < 1e-6, whole
    assert_close(got, want, rtol=1e-5)
    assert len(rows[-1]["compute_actors"]) == 3


def test_two_actors_sending_gradients_in_pieces_through_ray_equal_one(one, small_config, tmp_path):
    """Gradient slots of 20 kB (5,000 fp32 values) against shards of tens of thousands: every shard
    goes through Ray in pieces (``runtime.grad_slot_mb``), and the run equals one actor with the
    whole batch, as whole-shard slots do."""
    summary, got, _ = run(small_config(**STEPS, **TWO, **{"runtime.grad_slot_mb": 0.02}), tmp_path / "pieces")
    assert summary.last_step == 4
    assert max(t.numel() for t in got) > 4 * 5000  # a shard of several pieces: the test means something
    assert_close(got, one[1])
