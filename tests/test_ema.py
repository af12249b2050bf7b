"""``training.ema_decay``: the moving average of the weights, kept by the parameter store.

The store's average after a few streamed steps equals a plain PyTorch average of the in-process
trainer's weights (same data, same seed) to the trainers' tolerance; the same run checks the
streamed trainer against the in-process one with ``attention.learn_temperature`` on. A resumed
store gives the uninterrupted run's average bit for bit; predictions, the checkpoint reader and
the export serve the average when asked; the planner and the store count its 4 B/param; bad
values are refused.
"""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import demo_batches, streamed, train_steps
from safetensors.torch import load_file

from actors.param_store import ParameterStore
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.driver.loop import Trainer
from megaslide_ray.evaluation.sampling import CheckpointWeights, use_average
from megaslide_ray.models.registry import param_count
from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.planning.estimate import plan
from megaslide_ray.state.checkpoint import CheckpointReader
from megaslide_ray.state.pretrained_io import export_state_dict
from megaslide_ray.training.baseline import InProcessTrainer

SMALL = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 6, "data.height": 32, "data.width": 32,
         "training.steps": 4, "optim.lr": 3e-3, "optim.grad_clip": 0.05, "optim.weight_decay": 0.05,
         "training.ema_decay": 0.8, "training.ema_start_step": 1, "attention.learn_temperature": True,
         "runtime.compute_threads": 1, "runtime.optimizer_threads": 1}
DECAY, START = 0.8, 1


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    return demo_batches(tmp_path_factory, SMALL, 4)


def _cfg(tmp_path, manifest, **extra):
    return build_config("tiny", None, {**SMALL, "data.manifest": manifest, "runtime.state_dir": str(tmp_path),
                                       **extra})


def _streamed(cfg, run_dir, bs, first=0, resume=None, save_at=None):
    """Train steps ``first..first + len(bs) - 1``; returns each shard's (master, ema) and the store's
    state bytes; ``save_at``: checkpoint after that many steps (its path in the result)."""
    saved = []
    with streamed(cfg, run_dir, resume_checkpoint=resume) as (store, compute):
        def save(step):
            if save_at == step + 1:
                saved.append(store.save_checkpoint(str(run_dir), step + 1, {}))
        train_steps(store, compute, bs, first, after=save)
        return ([(s["master"].clone(), s["ema"].clone()) for s in store.seg], store.state_bytes(),
                saved[0] if saved else None)


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def test_store_average_equals_plain_average_of_in_process_weights(tmp_path, batches):
    manifest, bs = batches
    cfg = _cfg(tmp_path, manifest)
    shards, _, _ = _streamed(cfg, tmp_path / "run", bs[:3])

    baseline = InProcessTrainer(cfg, threads=1)
    plain = [p.detach().clone() for p in baseline.model.parameters()]  # the average, written out plainly
    for step, b in enumerate(bs[:3]):
        baseline.train_step(b)
        with torch.no_grad():
            for e, p in zip(plain, baseline.model.parameters()):
                if step + 1 <= START:
                    e.copy_(p)
                else:
                    e.mul_(DECAY).add_(p, alpha=1 - DECAY)
    ema_in_process = iter(baseline.ema)
    start = 0
    for i, (shard, (master, ema)) in enumerate(zip(baseline.model.shards(), shards)):
        params = list(shard.parameters())
        want_ema = _flat(plain[start:start + len(params)])
        start += len(params)
        assert _rel(master, _flat(params)) < 1e-5, f"shard {i}: weights"
        assert _rel(ema, want_ema) < 1e-5, f"shard {i}: the store's average"
        assert _rel(_flat([next(ema_in_process) for _ in params]), want_ema) < 1e-6, f"shard {i}: in-process"
        if 0 < i < len(shards) - 1:  # the average lags the weights by a visible amount
            assert _rel(ema, master) > 10 * _rel(ema, want_ema)
    # the learned temperature moved, the same way streamed and in process
    for i, block in enumerate(baseline.model.blocks, start=1):
        streamed_tau = ShardLayout.of(block, i).views(shards[i][0])["attn.tau"]
        want = block.attn.tau.detach()
        assert float(want.abs().min()) > 1e-4, f"block {i}: tau did not move"
        assert _rel(streamed_tau, want) < 1e-5, f"block {i}: tau {streamed_tau.tolist()} != {want.tolist()}"


def test_resume_gives_the_uninterrupted_average(tmp_path, batches):
    manifest, bs = batches
    cfg = _cfg(tmp_path, manifest)
    straight, _, _ = _streamed(cfg, tmp_path / "a", bs)
    _, _, ckpt = _streamed(cfg, tmp_path / "b", bs[:2], save_at=2)
    with CheckpointReader(ckpt) as reader:
        assert reader.has(0, "ema")
    resumed, _, _ = _streamed(cfg, tmp_path / "c", bs[2:], first=2, resume=ckpt)
    for i, ((m1, e1), (m2, e2)) in enumerate(zip(straight, resumed)):
        assert torch.equal(m1, m2), f"shard {i}: weights"
        assert torch.equal(e1, e2), f"shard {i}: average"


def test_predictions_read_the_average_when_asked(tmp_path, batches):
    manifest, bs = batches
    cfg = _cfg(tmp_path, manifest)
    baseline = InProcessTrainer(cfg, threads=1)
    b = bs[0]
    args = (torch.randn((1, 6, 32, 32, 3), generator=torch.Generator().manual_seed(5)), torch.full((1,), 0.3),
            torch.from_numpy(b["caption"][:1]), torch.from_numpy(b["caption_len"][:1]))
    with streamed(cfg, tmp_path / "run") as (store, compute):
        for step, batch in enumerate(bs[:2]):
            compute.train_step(batch, step)
            store.wait_step(step)
            baseline.train_step(batch)
        trained = compute.predict(*args, step=2)
        store.use_weights("ema")
        averaged = compute.predict(*args, step=2)
        store.use_weights("master")
        again = compute.predict(*args, step=2)
    with torch.no_grad():
        want_trained = baseline.model(*args)
        baseline.load_average()
        want_averaged = baseline.model(*args)
    torch.testing.assert_close(trained, want_trained, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(averaged, want_averaged, rtol=1e-4, atol=1e-5)
    assert torch.equal(again, trained)
    assert float((want_averaged - want_trained).abs().max()) > 1e-3  # the two weights really differ


class _Pipeline:
    def __init__(self):
        self.weights, self.seen = "master", []

    def use_weights(self, kind):
        self.weights = kind


@pytest.mark.parametrize("ema_eval", [True, False])
def test_the_trainer_evaluates_and_samples_with_the_chosen_weights(ema_eval):
    pipe = _Pipeline()
    cfg = build_config("tiny", None, {"training.ema_decay": 0.9, "training.ema_eval": ema_eval})
    run = SimpleNamespace(cfg=cfg, pipeline=pipe,
                          validator=SimpleNamespace(run=lambda done: pipe.seen.append(("val", pipe.weights)) or {}),
                          sampler=SimpleNamespace(run=lambda done: pipe.seen.append(("sample", pipe.weights)) or {}))
    Trainer._evaluate_and_sample(run, 3, True, True)
    want = "ema" if ema_eval else "master"
    assert pipe.seen == [("val", want), ("sample", want)]
    assert pipe.weights == "master"  # the next step trains the trained weights


def test_checkpoint_reader_and_export_serve_the_average(tmp_path, batches):
    manifest, bs = batches
    cfg = _cfg(tmp_path, manifest)
    shards, _, ckpt = _streamed(cfg, tmp_path / "run", bs[:2], save_at=2)
    source = CheckpointWeights(ckpt, cfg, "master", average=True)
    try:
        for i, (_, ema) in enumerate(shards):
            got = torch.frombuffer(bytearray(source.get_weights(i, 2)), dtype=torch.float32)
            assert torch.equal(got, ema), f"shard {i}"
    finally:
        source.close()
    state = {"config": {"training": {"ema_decay": 0.8, "ema_eval": True}}}
    assert use_average(state, "auto") and not use_average(state, "trained") and use_average(state, "ema")
    assert not use_average({"config": {"training": {"ema_decay": 0.0}}}, "auto")
    out = export_state_dict(ckpt, tmp_path / "ema.safetensors", kind="ema")
    exported = load_file(out[0])
    with CheckpointReader(ckpt) as reader:
        for i in range(reader.num_shards):
            prefix = "embed." if i == 0 else ("head." if i == reader.num_shards - 1 else f"blocks.{i - 1}.")
            for name, t in reader.tensors(i, "ema").items():
                assert torch.equal(exported[prefix + name], t)


def test_the_store_and_the_planner_count_four_bytes_per_parameter(tmp_path, batches):
    manifest, _ = batches
    with_ema = _cfg(tmp_path, manifest)
    without = _cfg(tmp_path, manifest, **{"training.ema_decay": 0.0})
    n = param_count(with_ema)
    stores = []
    for cfg, name in ((with_ema, "a"), (without, "b")):
        store = ParameterStore(cfg, str(tmp_path / name))
        stores.append(store.state_bytes())
        store.close()
    assert stores[0] - stores[1] == 4 * n
    p_with, p_without = plan(with_ema, w_dtype="float32"), plan(without, w_dtype="float32")
    assert p_with.host_state_bytes - p_without.host_state_bytes == 4 * n
    assert p_with.host_required_bytes - p_without.host_required_bytes == 4 * n
    assert p_with.host_state_bytes_per_param == 20 and p_with.host_bytes["ema"] == 4 * n


@pytest.mark.parametrize("over,needle", [({"training.ema_decay": 1.0}, "training.ema_decay=1.0"),
                                         ({"training.ema_decay": -0.1}, "training.ema_decay=-0.1"),
                                         ({"training.ema_decay": float("nan")}, "training.ema_decay=nan"),
                                         ({"training.ema_start_step": -1}, "training.ema_start_step=-1"),
                                         ({"training.ema_decay": 0.99, "runtime.nodes": 2}, "runtime.nodes=2")])
def test_bad_averages_are_refused(over, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        build_config("tiny", None, over)


def test_a_checkpoint_without_the_average_is_refused_for_ema(tmp_path, batches):
    manifest, bs = batches
    cfg = _cfg(tmp_path, manifest, **{"training.ema_decay": 0.0})
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        ckpt = store.save_checkpoint(str(tmp_path / "run"), 0, {})
    finally:
        store.close()
    with pytest.raises(ValueError, match="no moving average"):
        CheckpointWeights(ckpt, cfg, "w", average=True)
    with pytest.raises(ValueError, match="no 'ema' weights"):
        export_state_dict(ckpt, tmp_path / "x.safetensors", kind="ema")
    assert Path(ckpt).is_dir()


def test_plan_command_counts_the_average(capsys):
    import json

    from megaslide_ray.plan import main

    assert main(["--preset", "tiny", "--json"]) == 0
    without = json.loads(capsys.readouterr().out)
    assert main(["--preset", "tiny", "--json", "--ema-decay", "0.999"]) == 0
    with_ema = json.loads(capsys.readouterr().out)
    n = without["params"]
    assert with_ema["host_bytes"]["ema"] == 4 * n and "ema" not in without["host_bytes"]
    assert with_ema["host_state_bytes"] - without["host_state_bytes"] == 4 * n
    assert main(["--preset", "tiny", "--ema-decay", "1"]) == 2  # refused, naming the value
    assert "--ema-decay 1.0" in capsys.readouterr().err


def test_evaluate_takes_the_weights_asked_for(tmp_path, batches):
    from megaslide_ray.evaluation.validation import evaluate_checkpoint

    manifest, bs = batches
    cfg = _cfg(tmp_path, manifest)
    _, _, ckpt = _streamed(cfg, tmp_path / "run", bs[:3], save_at=3)
    loss = {w: evaluate_checkpoint(ckpt, manifest, clips=2, buckets=2, device="cpu", weights=w).val_loss
            for w in ("auto", "trained", "ema")}
    assert loss["auto"] == loss["ema"]  # the run evaluated with the average (training.ema_eval)
    assert loss["trained"] != loss["ema"]
