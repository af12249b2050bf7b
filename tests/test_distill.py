"""Distillation from the dense teacher (``training.distill_weight``): the in-process trainer's term
equals a plain PyTorch computation, the streamed trainer equals the in-process trainer with it on,
a weight of 0 changes nothing, the config refuses what cannot work, the planner counts the teacher."""

import json
import math

import numpy as np
import pytest
import torch
from helpers import assert_streamed_equals_in_process, demo_batches, flat_shards, masters, streamed, train_steps
from safetensors.torch import load_file, save_file

from actors.decoder import VideoDecoder
from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.driver import Trainer
from megaslide_ray.models.registry import build_model, teacher_config
from megaslide_ray.planning.estimate import plan
from megaslide_ray.planning.schedule import step_positions, teacher_positions
from megaslide_ray.state.pretrained_io import PretrainedMismatchError
from megaslide_ray.state.teacher_io import check_teacher
from megaslide_ray.training.baseline import InProcessTrainer
from megaslide_ray.training.flow import batch_conditioning, batch_flow_inputs, caption_dropout

SMALL = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 4, "data.height": 32, "data.width": 32,
         "data.batch_size": 2, "attention.kind": "dsa", "attention.window": "1,3,3", "optim.grad_clip": 0.05,
         "optim.lr": 3e-3, "optim.weight_decay": 0.05, "training.steps": 2, "runtime.compute_threads": 1,
         "runtime.optimizer_threads": 1}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``(manifest, batches, path)``: the demo manifest, two decoded batches, and a dense model's
    weights (``path``, safetensors) drawn at random so that the teacher and the student differ
    (a fresh model's zero-initialised gates would make every block the identity)."""
    manifest, batches = demo_batches(tmp_path_factory, SMALL, 2)
    dense = build_model(build_config("tiny", None, {**SMALL, "attention.kind": "dense"}))
    g = torch.Generator().manual_seed(7)
    state = {k: (torch.randn(v.shape, generator=g) * 0.2).contiguous() for k, v in dense.state_dict().items()}
    path = tmp_path_factory.mktemp("distill") / "dense.safetensors"
    save_file(state, str(path))
    return manifest, batches, path


def config(setup, tmp_path, **over):
    manifest, _, path = setup
    return build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                       "training.init_from": str(path), **over})


def in_process(cfg, path) -> InProcessTrainer:
    """The in-process trainer started from ``path`` as ``--init-from`` starts the store (offset
    heads fresh, from the seeded initialisation)."""
    trainer = InProcessTrainer(cfg, threads=1)
    missing, unexpected = trainer.model.load_state_dict(load_file(str(path)), strict=False)
    assert not unexpected and missing and all(".offsets." in n for n in missing)
    return trainer


def streamed_run(cfg, batches, tmp_path, transport="shm"):
    """Steps of the store and the compute actor in one process: (results, masters, store files,
    the teacher's segments, its bytes)."""
    with streamed(cfg, tmp_path / "run", transport, init_from=cfg.training.init_from) as (store, compute):
        results = train_steps(store, compute, batches)
        files = sorted(p.name for p in store.dir.iterdir())
        streamed_run.pooled = {numel for numel, _, _ in compute.link.staging._free}  # staging buffers kept
        teacher = [t.clone() for t in store.teacher_seg]
        return results, masters(store), files, teacher, store.teacher_bytes()


def test_in_process_distillation_term_is_plain_pytorch(setup, tmp_path):
    """One step of the in-process trainer against the student and the dense teacher run by hand:
    the term, and the parameters after AdamW on task + weight x term."""
    manifest, batches, path = setup
    cfg = config(setup, tmp_path, **{"training.distill_weight": 0.5})
    trainer = in_process(cfg, path)
    student = build_model(cfg)
    student.load_state_dict(trainer.model.state_dict())
    teacher = build_model(teacher_config(cfg))
    teacher.load_state_dict(load_file(str(path)))  # strict: every dense weight, nothing else
    got = trainer.train_step(batches[0])

    fx = batch_flow_inputs(batches[0], cfg.training.seed, 0, cfg.training.t_sampling, cfg.training.flow_shift)
    cap, cap_len = batch_conditioning(batches[0], cfg.training.seed, 0, caption_dropout(cfg))
    pred = student(fx.x_t, fx.t, cap, cap_len)
    with torch.no_grad():
        target = teacher(fx.x_t, fx.t, cap, cap_len)
    term = ((pred - target) ** 2).mean()
    task = ((pred - fx.target) ** 2).mean()
    assert got.distill_loss == pytest.approx(float(term.detach()), rel=1e-6)
    assert got.loss == pytest.approx(float(task.detach()), rel=1e-6)
    assert float(term.detach()) > 1e-3  # the student (neighborhood attention) really differs from the dense teacher
    (task + 0.5 * term).backward()
    torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.optim.grad_clip)
    opt = torch.optim.AdamW(student.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas, eps=cfg.optim.eps,
                            weight_decay=cfg.optim.weight_decay)
    for group in opt.param_groups:
        group["lr"] = trainer.opt.param_groups[0]["lr"]
    opt.step()
    for i, (a, b) in enumerate(zip(flat_shards(trainer.model), flat_shards(student))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"shard {i}")


@pytest.mark.parametrize("over, transport", [
    ({}, "shm"),
    ({"training.micro_batches": 2, "data.batch_size": 1}, "shm"),  # the term per micro-batch, then the mean
    ({"runtime.recompute_blocks": False}, "shm"),                  # kept graphs
    ({"runtime.link_gbps": 50.0}, "shm"),                          # staged copies of the teacher's shards
    ({}, "object_ref"),                                            # the teacher's bytes asked of the store
], ids=["plain", "micro_batches", "kept_graphs", "staged", "object_ref"])
def test_streamed_trainer_equals_in_process_with_distillation(setup, tmp_path, over, transport):
    """Two steps streamed (store + compute actor) and in process, distillation on: the same task
    losses, distillation terms and parameters; the store's teacher segments hold the source's
    dense weights."""
    manifest, batches, path = setup
    cfg = config(setup, tmp_path, **{"training.distill_weight": 2.0, **over})
    results, weights, files, teacher, teacher_bytes = streamed_run(cfg, batches, tmp_path, transport)
    base = in_process(cfg, path)
    reference = [base.train_step(b) for b in batches]
    assert_streamed_equals_in_process(results, weights, reference, base.model, distill=True)
    assert min(r.distill_loss for r in reference) > 1e-3
    dense = flat_shards(base.teacher)
    for i, (a, b) in enumerate(zip(teacher, dense)):
        assert torch.equal(a, b), f"teacher shard {i}"
    assert teacher_bytes == sum(t.numel() for t in dense) * 4
    assert sum(f.endswith(".teacher") for f in files) == cfg.model.depth + 2
    if "runtime.link_gbps" in over:  # staged: the pool keeps the student's sizes, not the teacher's blocks'
        student = {m.numel() for m in weights}
        assert student <= streamed_run.pooled and not streamed_run.pooled - student
        assert {t.numel() for t in teacher} - student  # (the teacher's blocks do have sizes of their own)


def test_reattached_store_keeps_the_teacher_and_a_bad_source_is_refused(setup, tmp_path):
    """A store that re-attaches to its state (a restart) maps the same teacher; a teacher source
    that lacks a dense weight, or is gone, is refused with what to do."""
    manifest, _, path = setup
    cfg = config(setup, tmp_path, **{"training.distill_weight": 1.0})
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(path))
    first = [t.clone() for t in store.teacher_seg]
    store.close(remove_state=False)
    again = ParameterStore(cfg, str(tmp_path / "run"), attach=True)
    try:
        assert all(torch.equal(a, b) for a, b in zip(first, again.teacher_seg))
        assert float(sum(t.abs().sum() for t in again.teacher_seg)) > 0
    finally:
        again.close()
    state = load_file(str(path))
    dropped = sorted(state)[0]
    del state[dropped]
    partial = tmp_path / "partial.safetensors"
    save_file(state, str(partial))
    with pytest.raises(PretrainedMismatchError) as e:
        check_teacher(cfg, partial)
    assert dropped in str(e.value) and "missing from the source (1)" in str(e.value)
    with pytest.raises(PretrainedMismatchError) as e:
        check_teacher(cfg, tmp_path / "gone.safetensors")
    assert "does not exist" in str(e.value) and "training.distill_weight=0" in str(e.value)


def test_distillation_moves_the_student_towards_the_teacher(setup, tmp_path):
    """The term's gradient is there: with a large weight, the parameters differ from those of the
    same steps without distillation (same losses at step 1: the term does not touch the task)."""
    manifest, batches, path = setup
    on = in_process(config(setup, tmp_path, **{"training.distill_weight": 10.0}), path)
    off = in_process(config(setup, tmp_path), path)
    a, b = on.train_step(batches[0]), off.train_step(batches[0])
    assert a.loss == pytest.approx(b.loss, rel=1e-6) and b.distill_loss == 0.0
    diff = max(float((x - y).abs().max()) for x, y in zip(flat_shards(on.model), flat_shards(off.model)))
    assert diff > 1e-5


def test_weight_zero_changes_nothing(setup, tmp_path):
    """distill_weight = 0: no teacher anywhere (no segment, no bytes, no forward), and the
    streamed run still equals the in-process one."""
    manifest, batches, path = setup
    cfg = config(setup, tmp_path)
    results, weights, files, teacher, teacher_bytes = streamed_run(cfg, batches, tmp_path)
    assert teacher == [] and teacher_bytes == 0 and not any(f.endswith(".teacher") for f in files)
    assert all(r.distill_loss == 0.0 and r.teacher_seconds == 0.0 for r in results)
    base = in_process(cfg, path)
    reference = [base.train_step(b) for b in batches]
    assert base.teacher is None
    assert_streamed_equals_in_process(results, weights, reference, base.model)


def trainer_run(cfg, run_dir, steps, **kw) -> list[dict]:
    """``steps`` steps of the Trainer (through Ray), then its metrics.jsonl rows."""
    trainer = Trainer(cfg, run_dir=str(run_dir), progress=False, **kw)
    try:
        for step in range(trainer.start_step, steps):
            trainer.train_step(step)
    finally:
        trainer.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def reference_rows(cfg, path, steps):
    """The in-process trainer's steps on the batches the Trainer's decoder serves."""
    base = in_process(cfg, path)
    with VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes) as dec:
        return [base.train_step(dec.next_batch()) for _ in range(steps)]


@pytest.mark.slow  # 45 s with its Ray session: the Ray drills run it
def test_through_ray_metrics_log_the_term(ray_session, setup, tmp_path):
    """The Trainer through Ray actors: metrics.jsonl logs distill_loss beside the task loss, both
    the in-process trainer's on the same batches."""
    manifest, _, path = setup
    cfg = config(setup, tmp_path, **{"training.distill_weight": 1.0})
    rows = trainer_run(cfg, tmp_path / "run", 2, init_from=str(path))
    reference = reference_rows(cfg, path, 2)
    assert [r["step"] for r in rows] == [1, 2]
    assert np.allclose([r["loss"] for r in rows], [r.loss for r in reference], rtol=1e-5)
    assert np.allclose([r["distill_loss"] for r in rows], [r.distill_loss for r in reference], rtol=1e-5)
    assert all(r["teacher_seconds"] > 0 for r in rows)


@pytest.mark.slow  # 30 s
def test_resume_reads_the_teacher_again(ray_session, setup, tmp_path):
    """A run resumed from its step-2 checkpoint (which holds no teacher) reads the teacher again
    from training.init_from: step 3 is the in-process trainer's."""
    manifest, _, path = setup
    cfg = config(setup, tmp_path, **{"training.distill_weight": 1.0, "training.steps": 3,
                                     "training.checkpoint_every": 2})
    trainer_run(cfg, tmp_path / "run", 2, init_from=str(path))
    rows = trainer_run(cfg, tmp_path / "run", 3, resume=True)
    reference = reference_rows(cfg, path, 3)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert np.allclose([r["loss"] for r in rows], [r.loss for r in reference], rtol=1e-5)
    assert np.allclose([r["distill_loss"] for r in rows], [r.distill_loss for r in reference], rtol=1e-5)


@pytest.mark.parametrize("over, words", [
    ({"training.distill_weight": -1.0}, ["training.distill_weight=-1.0", ">= 0"]),
    ({"training.distill_weight": math.nan}, ["training.distill_weight=nan", "finite"]),
    ({"training.distill_weight": 1.0, "training.init_from": ""}, ["training.init_from is empty", "--init-from"]),
    ({"training.distill_weight": 1.0, "attention.kind": "dense"}, ["attention.kind='dense'", "nothing to distil"]),
    ({"training.distill_target": "blocks"}, ["training.distill_target='blocks'", "output"]),
])
def test_config_refuses(setup, tmp_path, over, words):
    with pytest.raises(ConfigError) as e:
        config(setup, tmp_path, **over)
    for w in words:
        assert w in str(e.value)


def test_plan_counts_the_teacher(setup, tmp_path):
    """The planner adds the teacher's frozen bf16 weights to the host and one more crossing of
    them plus one dense forward to the step: each equal to the teacher's own parameter count."""
    cfg_off = config(setup, tmp_path)
    cfg_on = config(setup, tmp_path, **{"training.distill_weight": 1.0})
    off, on = plan(cfg_off), plan(cfg_on)
    p_teacher = sum(p.numel() for p in build_model(teacher_config(cfg_on)).parameters())
    assert on.host_terms["dense teacher (distillation, frozen w)"] == 2 * p_teacher
    assert on.host_required_bytes - off.host_required_bytes == 2 * p_teacher
    assert on.h2d_bytes - off.h2d_bytes == 2 * p_teacher
    assert on.flops_executed == pytest.approx(off.flops_executed + on.flops_teacher, rel=1e-12)
    # the schedule prices the same forward, position by position, with the teacher's fetches first
    fetch, flops = teacher_positions(cfg_on, 2)
    assert sum(flops) == pytest.approx(on.flops_teacher, rel=1e-9) and sum(fetch) == 2 * p_teacher
    assert step_positions(cfg_on, 2).fetch_bytes[:len(fetch)] == fetch
    # a dense run's forward: a third of its linear and attention FLOPs (forward + backward = 3 forwards)
    dense = plan(build_config("tiny", None, {**SMALL, "attention.kind": "dense"}))
    assert on.flops_teacher == pytest.approx((dense.flops_linear + dense.flops_attention) / 3, rel=1e-9)


WAN = {"model.arch": "wan", "model.hidden_size": 32, "model.num_heads": 2, "model.depth": 2, "model.ffn_dim": 48,
       "model.in_channels": 4, "model.patch_size": "1,2,2", "model.text_dim": 12, "model.text_len": 8,
       "model.timestep_freq_dim": 16, "data.num_frames": 9, "data.height": 48, "data.width": 80,
       "data.batch_size": 2, "attention.kind": "dsa", "attention.window": "3,3,3", "optim.grad_clip": 0.05,
       "optim.lr": 3e-3, "training.steps": 2, "runtime.compute_threads": 1, "runtime.optimizer_threads": 1}


def test_wan_streamed_equals_in_process_with_distillation(tmp_path):
    """The same comparison for a small Wan model (diffusers' names, latents and text embeddings),
    on synthetic latent batches: its dense teacher read from a safetensors file of those names."""
    dense_cfg = build_config("tiny", None, {**WAN, "attention.kind": "dense"})
    g = torch.Generator().manual_seed(3)
    state = {k: (torch.randn(v.shape, generator=g) * 0.2).contiguous()
             for k, v in build_model(dense_cfg).state_dict().items()}
    path = tmp_path / "wan-dense.safetensors"
    save_file(state, str(path))
    cfg = build_config("tiny", None, {**WAN, "runtime.state_dir": str(tmp_path), "training.init_from": str(path),
                                      "training.distill_weight": 1.0})
    (F, H, W), B = cfg.latent_grid, cfg.data.batch_size
    batches = [{"latents": torch.randn(B, F, H, W, 4, generator=g).numpy(),
                "text": torch.randn(B, 8, 12, generator=g).numpy(), "text_len": np.array([3, 8])} for _ in range(2)]
    results, weights, _, _, _ = streamed_run(cfg, batches, tmp_path)
    base = in_process(cfg, path)
    reference = [base.train_step(b) for b in batches]
    assert_streamed_equals_in_process(results, weights, reference, base.model, distill=True)
    assert min(r.distill_loss for r in reference) > 1e-4
