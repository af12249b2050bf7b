"""Fault injection across the actors: each run with one injected failure recovers and ends with
parameters bit-identical to the uninterrupted run, with one compute actor and with two. Plus NaN
steps, a full disk during a checkpoint, the restart limit, and the fault-spec parser. (The
uninterrupted two-actor run is also checked against the one-actor run of twice the batch here:
the two runs exist for the matrix anyway.)"""

import json
from pathlib import Path

import pytest
import torch

from megaslide_ray.driver import BadStepsError, Trainer
from megaslide_ray.runtime import faults
from megaslide_ray.state.checkpoint import CheckpointWriteError, latest_checkpoint, read_checkpoint_shards
from pipelines.streaming import RestartLimitError

# Recovery does not depend on the attention kind: the cheapest one keeps the matrix fast.
STEPS = {"training.steps": 4, "training.checkpoint_every": 2, "optim.grad_clip": 0.05, "attention.kind": "dense"}


def run(cfg, run_dir: Path, spec: str = "", monkeypatch=None):
    """Train ``cfg`` into ``run_dir`` with the faults ``spec``; (summary, final master weights)."""
    if spec:
        monkeypatch.setenv(faults.ENV_SPEC, spec)
        monkeypatch.setenv(faults.ENV_DIR, str(run_dir.parent / f"{run_dir.name}-faults"))
    trainer = Trainer(cfg, run_dir=str(run_dir), progress=False)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
        if monkeypatch is not None:
            monkeypatch.delenv(faults.ENV_SPEC, raising=False)
    return summary, read_checkpoint_shards(Path(summary.checkpoint))


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


STRAIGHT_DIRS: dict[str, Path] = {}
"""The run directory of each uninterrupted run made (tests copy it before changing anything)."""


@pytest.fixture(scope="module")
def straight(ray_session, small_config, tmp_path_factory):
    """The uninterrupted run: (final master weights, metrics rows)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    STRAIGHT_DIRS["one"] = run_dir
    return run(small_config(**STEPS), run_dir)[1], metrics_rows(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(straight):
    return straight[0]


TWO = {"runtime.compute_actors": 2, "data.batch_size": 1}
"""Two compute actors of batch 1: the same global batch as the one-actor runs' 2."""


@pytest.fixture(scope="module")
def straight_two(ray_session, small_config, tmp_path_factory):
    """The uninterrupted run with two compute actors: (final master weights, metrics rows)."""
    run_dir = tmp_path_factory.mktemp("straight-two") / "run"
    return run(small_config(**STEPS, **TWO), run_dir)[1], metrics_rows(run_dir)


# Several faults per run keep CI short; each one is a separate actor death the run recovers
# from (benchmarks/faults.py injects them one per run and times the recovery).
# Every row is slow (the compute row about 45 s, the store rows about 20 s each): the compute and
# store rows are core drills (CI runs them every time); test_store_restart's cut inside a shard
# kills the store in the default run.
MATRIX = [
    # compute actor: killed at every point of a step (steps 1-4; step 2 is queued ahead of step 1's update)
    pytest.param("compute.after_weights@1,compute.mid_forward@2,compute.mid_backward@3,compute.before_weights@4", 4, 0,
                 id="compute", marks=[pytest.mark.slow, pytest.mark.core]),
    # parameter store: killed between two shards' updates, and while writing the step-2 checkpoint
    pytest.param("store.mid_update@1,store.mid_checkpoint@2", 2, 0, id="store", marks=[pytest.mark.slow, pytest.mark.core]),
    # parameter store killed after it counted step 1's last gradient report but before it answered it:
    # the compute actor never hears back, the restarted store finishes the update (one store death)
    pytest.param("store.after_last_report@1:hang,store.mid_update@1", 1, 0, id="store-unanswered",
                 marks=pytest.mark.slow),
    # parameter store killed inside a shard's update: the state is half-written, the step-2 checkpoint restored
    pytest.param("store.mid_shard_update@3", 1, 1, id="store-rollback", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("spec,restarts,rollbacks", MATRIX)
def test_fault_matrix_recovers_bit_identical(spec, restarts, rollbacks, uninterrupted, small_config, tmp_path,
                                            monkeypatch):
    cfg = small_config(**STEPS, **{"runtime.max_restarts": 4})
    summary, got = run(cfg, tmp_path / "run", spec, monkeypatch)
    for one in spec.split(","):
        assert faults.fired(one, directory=tmp_path / "run-faults"), f"{one} never fired: the test proves nothing"
    assert summary.last_step == 4
    assert summary.restarts == restarts  # actor deaths: the hang dies with its process
    assert summary.rollbacks == rollbacks
    for i, (a, b) in enumerate(zip(got, uninterrupted)):
        assert torch.equal(a, b), f"{spec}: shard {i} differs from the uninterrupted run"


@pytest.mark.slow  # two uninterrupted runs; test_multinode and test_dataparallel_pipeline split a batch by default
def test_two_compute_actors_equal_one_with_twice_the_batch(straight, straight_two):
    (want, rows1), (got, rows2) = straight, straight_two
    for i, (a, b) in enumerate(zip(got, want)):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-6, f"shard {i}: relative difference {rel:.2e}"
    assert [r["data_rows"] for r in rows2] == [r["data_rows"] for r in rows1]  # the same clips, split in two
    for a, b in zip(rows1, rows2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["tokens"] == a["tokens"]
        assert b["reduce_seconds"] > 0 and a["reduce_seconds"] == 0
        assert [c["rank"] for c in b["compute_actors"]] == [0, 1] and "compute_actors" not in a
        assert b["loss"] == pytest.approx(sum(c["loss"] for c in b["compute_actors"]) / 2, rel=1e-6)


# Two compute actors: each compute spec kills one of them (whichever reaches the point first), and
# both are replaced; the store rows kill the store while it sums or applies their gradients.
MATRIX_TWO = [
    pytest.param("compute.mid_backward@2,compute.after_weights@3", 2, id="compute-x2", marks=pytest.mark.slow),
    pytest.param("store.mid_update@1,store.after_last_report@3", 2, id="store-x2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("spec,restarts", MATRIX_TWO)
def test_fault_matrix_with_two_compute_actors(spec, restarts, straight_two, small_config, tmp_path, monkeypatch):
    cfg = small_config(**STEPS, **TWO, **{"runtime.max_restarts": 4})
    summary, got = run(cfg, tmp_path / "run", spec, monkeypatch)
    for one in spec.split(","):
        assert faults.fired(one, directory=tmp_path / "run-faults"), f"{one} never fired: the test proves nothing"
    assert summary.last_step == 4 and summary.restarts == restarts
    for i, (a, b) in enumerate(zip(got, straight_two[0])):
        assert torch.equal(a, b), f"{spec}: shard {i} differs from the uninterrupted two-actor run"


@pytest.mark.slow  # 25 s of Ray drill: the default run keeps it under 10 minutes
def test_restart_limit_stops_with_a_clear_message(ray_session, small_config, tmp_path, monkeypatch):
    cfg = small_config(**STEPS, **{"runtime.max_restarts": 1})
    with pytest.raises(RestartLimitError, match=r"runtime.max_restarts=1.*--resume"):
        run(cfg, tmp_path / "run", "compute.mid_forward@2,compute.mid_backward@3", monkeypatch)
    # The checkpoint of step 2 (written before the second failure) is complete and loadable.
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and ckpt.name == "step_2"
    assert len(read_checkpoint_shards(ckpt)) == 4


@pytest.mark.slow  # about 20 s of Ray drill: the default run keeps it under 10 minutes
def test_nan_steps_are_skipped_then_too_many_stop(ray_session, small_config, tmp_path, monkeypatch):
    cfg = small_config(**{"training.steps": 4, "training.checkpoint_every": 1, "optim.max_bad_steps": 3,
                          "attention.kind": "dense"})
    # Steps 2 and 3 have a NaN loss: skipped on every shard, the run goes on.
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path / "f1"))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.loss@2-3:nan")
    trainer = Trainer(cfg, run_dir=str(tmp_path / "a"), progress=False)
    try:
        rows = [trainer.train_step(s) for s in range(3)]
        trainer.pipeline.save_checkpoint(str(tmp_path / "probe"), 3, {})  # the state after step 3, for the check
        rows.append(trainer.train_step(3))
        bad = trainer.bad_steps
    finally:
        trainer.close()
    assert [r["update_skipped"] for r in rows] == [False, True, True, False]
    assert [r["loss"] != r["loss"] for r in rows] == [False, True, True, False]  # NaN != NaN
    assert bad == 2 and rows[-1]["bad_steps"] == 2
    # The steps whose update was skipped wrote no checkpoint.
    root = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_4"]
    # A skipped update changes no weight and no moment: the state after step 3 is that after step 1.
    probe = tmp_path / "probe" / "checkpoints"
    for kind in ("master", "m", "v"):
        for a, b in zip(read_checkpoint_shards(root / "step_1", kind), read_checkpoint_shards(probe / "step_3", kind)):
            assert torch.equal(a, b), kind
    assert not all(torch.equal(a, b) for a, b in zip(read_checkpoint_shards(probe / "step_3"),
                                                      read_checkpoint_shards(root / "step_4")))

    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path / "f2"))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.loss@2-4:nan")
    trainer = Trainer(cfg, run_dir=str(tmp_path / "b"), progress=False)
    try:
        with pytest.raises(BadStepsError, match=r"3 steps in a row.*optim.max_bad_steps=3"):
            trainer.train()
    finally:
        trainer.close()

    # The last step not finite: no checkpoint of it, the run stops naming it and the last good one.
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path / "f3"))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.loss@4:nan")
    cfg = small_config(**{"training.steps": 4, "training.checkpoint_every": 2, "attention.kind": "dense"})
    trainer = Trainer(cfg, run_dir=str(tmp_path / "c"), progress=False)
    try:
        with pytest.raises(BadStepsError, match=r"step 4 had a NaN/Inf loss.*no checkpoint of it is written; the last "
                                                r"good checkpoint is .*step_2"):
            trainer.train()
    finally:
        trainer.close()
    assert sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir()) == ["latest", "step_2"]


@pytest.mark.slow  # 24 s of Ray: test_store_restart's cut inside a shard keeps a crash's saved state in the default run
def test_disk_full_during_checkpoint_keeps_the_previous_one(ray_session, small_config, tmp_path, monkeypatch):
    cfg = small_config(**STEPS)
    with pytest.raises(CheckpointWriteError, match=r"(?s)step-4 checkpoint.*No space left.*step_2.*--resume"):
        run(cfg, tmp_path / "run", "store.mid_checkpoint@4:enospc", monkeypatch)
    root = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(tmp_path / "run") == root / "step_2"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".step_")], "temporary files left behind"
    assert len(read_checkpoint_shards(root / "step_2")) == 4


def test_parse_faults_refuses_unknown_points_and_actions():
    with pytest.raises(ValueError, match="compute.nowhere.*use one of"):
        faults.parse_faults("compute.nowhere@2")
    with pytest.raises(ValueError, match="'explode'"):
        faults.parse_faults("compute.loss@2:explode")
    with pytest.raises(ValueError, match="range"):
        faults.parse_faults("compute.loss@3-2")
    spec, = faults.parse_faults("store.mid_update@4-6:hang")
    assert (spec.first, spec.last, spec.action) == (4, 6, "hang")
    assert spec.matches("store.mid_update", 4) and not spec.matches("store.mid_update", 6)


def test_a_fault_spec_with_a_node_fires_only_in_that_nodes_actors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="node index"):
        faults.parse_faults("store.mid_update@3/x:exit")
    spec, = faults.parse_faults("store.mid_update@3/1:lose_node")
    assert (spec.first, spec.node, spec.action, spec.text) == (3, 1, "lose_node", "store.mid_update@3/1:lose_node")
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.mid_forward@2/1:raise")
    monkeypatch.setattr(faults, "_node", 0)
    faults.fault_point("compute.mid_forward", 1)  # node 0: not this one
    assert not faults.fired("compute.mid_forward@2/1:raise", directory=tmp_path)
    monkeypatch.setattr(faults, "_node", 1)
    with pytest.raises(faults.FaultInjected):
        faults.fault_point("compute.mid_forward", 1)


def test_lose_node_refuses_a_process_whose_parent_is_not_a_raylet():
    with pytest.raises(RuntimeError, match="not a Ray raylet"):
        faults.lose_node()  # pytest's parent is a shell, never killed


def test_fault_fires_once(tmp_path, monkeypatch):
    monkeypatch.setenv(faults.ENV_DIR, str(tmp_path))
    monkeypatch.setenv(faults.ENV_SPEC, "compute.mid_forward@2:raise")
    faults.fault_point("compute.mid_forward", 0)  # step 1: not this one
    with pytest.raises(faults.FaultInjected):
        faults.fault_point("compute.mid_forward", 1)
    faults.fault_point("compute.mid_forward", 1)  # already fired: a restarted actor goes on
    assert faults.fired("compute.mid_forward@2:raise", directory=tmp_path)


@pytest.mark.slow  # about 15 s of Ray: a resume and two steps
def test_resume_falls_back_past_a_rotten_checkpoint_and_ends_bit_identical(uninterrupted, small_config, tmp_path,
                                                                           caplog):
    """Bit rot in the newest checkpoint (its size and header intact, its tensor bytes random): the
    store finds the checksum wrong, --resume falls back to the step-2 checkpoint with one warning
    and redoes steps 3 and 4; every step count agrees and the weights are the uninterrupted run's."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(STRAIGHT_DIRS["one"], run_dir)
    file = run_dir / "checkpoints" / "step_4" / "shard_0001.safetensors"
    raw = bytearray(file.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")
    raw[start:] = torch.randint(0, 256, (len(raw) - start,), dtype=torch.uint8,
                                generator=torch.Generator().manual_seed(1)).numpy().tobytes()
    file.write_bytes(bytes(raw))
    with caplog.at_level("WARNING"):
        trainer = Trainer(small_config(**STEPS), run_dir=str(run_dir), resume=True, progress=False)
    try:
        assert trainer.start_step == 2
        summary = trainer.train()
        versions = trainer.pipeline.status().versions
    finally:
        trainer.close()
    warnings = [r.getMessage() for r in caplog.records if "step_4 is damaged" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "shard_0001.safetensors tensor master has checksum" in warnings[0] and "falling back to" in warnings[0]
    assert summary.first_step == 2 and summary.last_step == 4 and versions == (4,) * len(versions)
    assert [r["step"] for r in metrics_rows(run_dir)][-2:] == [3, 4]
    assert summary.checkpoint.endswith("step_4")
    for i, (a, b) in enumerate(zip(read_checkpoint_shards(Path(summary.checkpoint)), uninterrupted)):
        assert torch.equal(a, b), f"shard {i} differs from the uninterrupted run"
