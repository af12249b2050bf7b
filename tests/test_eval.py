"""The validation loss: fixed inputs drawn from the seed alone, logged during training with the
weights after each step's update, and the same to the last bit from ``megaslide_ray.evaluate``
on the checkpoint of that step (function and CLI), for video and latent manifests."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from megaslide_ray import evaluate as evaluate_cli
from megaslide_ray.config import ConfigError, build_config
from megaslide_ray.driver import Trainer
from megaslide_ray.evaluation import validation as ev
from megaslide_ray.evaluation.run_report import VAL_PLOT, report

VAL = {"training.val_clips": 2, "training.val_t_buckets": 2}


def test_val_inputs_are_a_pure_function_of_seed_clip_and_bucket():
    x0 = torch.rand(4, 8, 8, 3) * 2 - 1
    a, ta, ya = ev.val_inputs(x0, 7, 1, 2, 4)
    b, tb, yb = ev.val_inputs(x0.clone(), 7, 1, 2, 4)
    assert torch.equal(a, b) and ta == tb and torch.equal(ya, yb)
    assert 0.5 <= ta < 0.75  # bucket 2 of 4
    for other in ((8, 1, 2), (7, 0, 2), (7, 1, 3)):
        c, tc, _ = ev.val_inputs(x0, *other, 4)
        assert not torch.equal(a, c) and tc != ta
    ts = [ev.val_inputs(x0, 0, i, b, 4)[1] for i in range(3) for b in range(4)]
    assert all(b / 4 <= t < (b + 1) / 4 for t, b in zip(ts, [0, 1, 2, 3] * 3))


def test_config_refuses_a_missing_val_manifest_and_eval_without_one(tmp_path, capsys):
    missing = str(tmp_path / "nowhere.parquet")
    with pytest.raises(ConfigError, match=r"data\.val_manifest='.*nowhere\.parquet' does not exist"):
        build_config("tiny", None, {"data.val_manifest": missing})
    with pytest.raises(ConfigError, match=r"training\.eval_every=5 needs data\.val_manifest"):
        build_config("tiny", None, {"training.eval_every": 5})
    with pytest.raises(ConfigError, match=r"training\.val_clips=0"):
        build_config("tiny", None, {"training.val_clips": 0})
    from megaslide_ray.train import main

    assert main(["--data.val_manifest", missing, "--training.eval_every", "2"]) == 2  # before Ray starts
    assert "nowhere.parquet" in capsys.readouterr().err


def test_unfitting_or_unreadable_val_manifests_are_refused_before_ray(tmp_path, manifest, capsys):
    from megaslide_ray.data.manifest import write_manifest
    from megaslide_ray.train import main

    path = _latent_manifest(tmp_path, n=1)
    assert main(["--data", manifest, "--data.val_manifest", str(path)]) == 2
    assert "data.val_manifest=" in capsys.readouterr().err
    (tmp_path / "empty.mp4").write_bytes(b"")
    bad = write_manifest([{"path": "empty.mp4", "caption": "x"}], tmp_path / "bad.parquet")
    assert main(["--data", manifest, "--data.val_manifest", str(bad), "--training.eval_every", "1"]) == 2
    assert "data error: validation manifest" in capsys.readouterr().err


@pytest.fixture(scope="module")
def evaluated_run(ray_session, small_config, manifest, tmp_path_factory):
    """Two steps with a checkpoint and an evaluation after each."""
    cfg = small_config(**{"training.steps": 2, "training.checkpoint_every": 1, "training.eval_every": 1,
                          "data.val_manifest": manifest, **VAL})
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    trainer = Trainer(cfg, run_dir=str(run_dir), progress=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def test_val_loss_is_logged_per_bucket(evaluated_run):
    _, rows = evaluated_run
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        buckets = [r["val_loss_t0"], r["val_loss_t1"]]
        assert "val_loss_t2" not in r and all(np.isfinite(buckets))
        assert r["val_loss"] == pytest.approx(sum(buckets) / 2, rel=1e-12)
    assert rows[0]["val_loss"] != rows[1]["val_loss"]  # the weights changed in between


def test_evaluate_equals_training_to_the_last_bit(evaluated_run, capsys):
    run_dir, rows = evaluated_run
    for step, row in zip((1, 2), rows):
        ckpt = run_dir / "checkpoints" / f"step_{step}"
        r = ev.evaluate_checkpoint(ckpt, device="cpu")
        assert r.version == step
        # Bit-identical: the logged value was read after step `step`'s update, like the checkpoint.
        assert r.val_loss == row["val_loss"] and list(r.bucket_losses) == [row["val_loss_t0"], row["val_loss_t1"]]
    again = ev.evaluate_checkpoint(run_dir, device="cpu")  # a run dir: its latest checkpoint
    assert again.val_loss == rows[1]["val_loss"]
    assert evaluate_cli.main(["--checkpoint", str(run_dir), "--json", "--device", "cpu"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["val_loss"] == rows[1]["val_loss"] and out["step"] == 2
    assert out["buckets"] == {"val_loss_t0": rows[1]["val_loss_t0"], "val_loss_t1": rows[1]["val_loss_t1"]}
    assert evaluate_cli.main(["--checkpoint", str(run_dir), "--clips", "1", "--buckets", "3", "--seed", "5"]) == 0
    text = capsys.readouterr().out
    assert "validation loss" in text and "1 clips x 3 t-buckets" in text and "t in [0.67, 1.00)" in text
    # As a module (its summary printer defined before it runs).
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.evaluate", "--checkpoint", str(run_dir), "--clips", "1",
                           "--buckets", "3", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "t in [0.67, 1.00)" in proc.stdout, proc.stderr[-2000:]


def test_evaluate_cli_refusals(evaluated_run, tmp_path, capsys):
    run_dir, _ = evaluated_run
    assert evaluate_cli.main(["--checkpoint", str(run_dir), "--data", str(tmp_path / "none.parquet")]) == 2
    assert "--data" in capsys.readouterr().err
    assert evaluate_cli.main(["--checkpoint", str(tmp_path / "nothing")]) == 2
    assert evaluate_cli.main(["--checkpoint", str(run_dir), "--clips", "0"]) == 2


def test_report_plots_the_val_loss(evaluated_run, tmp_path):
    run_dir, rows = evaluated_run
    summary, plots = report(run_dir, tmp_path / "plots")
    assert VAL_PLOT in [p.name for p in plots] and (tmp_path / "plots" / VAL_PLOT).stat().st_size > 1000
    assert summary.val_evals == 2 and summary.val_last == rows[1]["val_loss"]


# ---------------------------------------------------------------------------------------------
# wan: a latent validation manifest
# ---------------------------------------------------------------------------------------------

WAN = {"model.arch": "wan", "model.hidden_size": 32, "model.num_heads": 2, "model.depth": 1, "model.ffn_dim": 48,
       "model.in_channels": 4, "model.patch_size": "1,2,2", "model.text_dim": 12, "model.text_len": 8,
       "model.timestep_freq_dim": 16, "data.num_frames": 9, "data.height": 32, "data.width": 32,
       "data.batch_size": 2, "attention.window": "3,1,1"}


def _latent_manifest(folder, n=3):
    from megaslide_ray.data import latents as L

    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        length = 3 + i
        L.save_tensor_file(folder / f"lat{i}.safetensors", L.LATENT_KEY, torch.randn(3, 4, 4, 4, generator=g))
        L.save_tensor_file(folder / f"txt{i}.safetensors", L.TEXT_KEY, torch.randn(length, 12, generator=g))
        rows.append({"latent_path": f"lat{i}.safetensors", "text_path": f"txt{i}.safetensors", "caption": f"c{i}",
                     "latent_shape": [3, 4, 4, 4], "text_len": length, "dtype": "float32"})
    meta = {"latents_mean": [0.0] * 4, "latents_std": [1.0] * 4, "compression": [4, 8, 8], "latent_channels": 4,
            "text_dim": 12, "text_len": 8}
    return L.write_latent_manifest(rows, meta, folder / "val.parquet")


def test_wan_latent_val_manifest(tmp_path):
    from actors.param_store import ParameterStore

    val = _latent_manifest(tmp_path)
    (tmp_path / "state").mkdir()
    cfg = build_config("tiny", None, {**WAN, "runtime.state_dir": str(tmp_path / "state"), **VAL})
    loaded = ev.load_val_set(cfg, str(val))
    assert loaded.x0.shape == (2, 3, 4, 4, 4) and loaded.cond.shape == (2, 8, 12)
    assert loaded.cond_len.tolist() == [3, 4] and loaded.rows == (0, 1)
    run = tmp_path / "run"
    store = ParameterStore(cfg, str(run))
    try:
        store.save_checkpoint(str(run), 0, {"data_position": 0})
    finally:
        store.close()
    a = ev.evaluate_checkpoint(run, str(val), device="cpu")
    b = ev.evaluate_checkpoint(run, str(val), device="cpu")
    assert a.val_loss == b.val_loss and np.isfinite(a.val_loss) and len(a.bucket_losses) == 2
    assert a.clips == 3  # a manifest given with no --clips is scored whole
    c = ev.evaluate_checkpoint(run, str(val), clips=2, device="cpu")
    assert c.clips == 2 and c.val_loss != a.val_loss
    with pytest.raises(ValueError, match="val_clips=4"):
        ev.evaluate_checkpoint(run, str(val), clips=4, device="cpu")
