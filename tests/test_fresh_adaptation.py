"""The unmemorisable adaptation study (benchmarks/studies/fresh_adaptation.py and its parts): fresh
clips deterministic per (seed, step) and never repeated, held-out sets split from training the
right way, fixed evaluation inputs, the paired t-interval against known values, bad input refused,
and the study end to end at the smallest size."""

import hashlib
import json
import math

import numpy as np
import pytest
import torch

from benchmarks.studies import fresh_adaptation as FA
from benchmarks.studies import fresh_clips as F
from benchmarks.studies import fresh_report as R
from benchmarks.studies.paired import paired_interval, t975, verdict
from megaslide_ray.data import motion_set as M


def _source(clips: str = "simple", grid: str = "small", batch: int = 4) -> F.ClipSource:
    frames, height, width, _, _ = F.GRIDS[grid]
    return F.ClipSource(clips, frames, height, width, batch, 128)


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()


def _combo(p: dict) -> tuple[str, str, str, str]:
    return p["colour"], p["shape"], p["direction"], p["speed"]


# ---------------------------------------------------------------------------------------------
# Fresh clips
# ---------------------------------------------------------------------------------------------


def test_a_batch_repeats_for_its_seed_and_step_and_differs_for_any_other():
    src = _source()
    a = src.batch(0, 3)
    again = src.batch(0, 3)
    assert a["video"].shape == (4, 8, 16, 16, 3) and a["video"].dtype == np.uint8
    assert np.array_equal(a["video"], again["video"]) and np.array_equal(a["caption"], again["caption"])
    for other in (src.batch(0, 4), src.batch(1, 3)):
        assert not any(np.array_equal(x, y) for x in a["video"] for y in other["video"])


def test_the_training_stream_never_repeats_a_clip():
    src = _source(batch=8)
    plans = [F.plan("train", (0, n), width=16) for n in range(2000)]
    assert len({tuple(p["start"]) + _combo(p) for p in plans}) == len(plans)
    # every combination before any repeats, and each again at another start
    assert len({_combo(p) for p in plans[:len(F.combinations("trained", M.SIMPLE_SPEEDS))]}) == len(
        F.combinations("trained", M.SIMPLE_SPEEDS))
    pixels = [_digest(c) for step in range(60) for c in src.batch(0, step)["video"]]
    assert len(set(pixels)) == len(pixels)
    with pytest.raises(ValueError, match="used up"):
        F.plan("train", (0, 10 ** 7), width=16)


def test_training_draws_only_trained_combinations_and_the_unseen_set_only_unseen_ones():
    train = {_combo(F.plan("train", (0, n))) for n in range(1600)}
    unseen = {_combo(F.plan("unseen", (i,))) for i in range(96)}
    val = [F.plan("val", (i,)) for i in range(96)]
    seen = {_combo(F.plan("seen", (i,))) for i in range(96)}
    assert not any(M.is_held_out(*c) for c in train | seen)
    assert all(M.is_held_out(*c) and F.unseen_group(*c) == "unseen" for c in unseen)
    assert not unseen & train and not unseen & {_combo(p) for p in val}
    val_unseen = {_combo(p) for i, p in enumerate(val) if i % 2}
    assert all(M.is_held_out(*c) and F.unseen_group(*c) == "val" for c in val_unseen)
    assert not any(M.is_held_out(*_combo(p)) for i, p in enumerate(val) if i % 2 == 0)
    # both unseen halves are populated and the training stream covers many combinations
    assert len(unseen) > 20 and len(val_unseen) > 20 and len(train) > 200


def test_held_out_clips_of_trained_combinations_are_new_clips():
    src = _source()
    train = {_digest(c) for seed in (0, 1) for step in range(100) for c in src.batch(seed, step)["video"]}
    seen = F.eval_set(src, "seen", 96)
    assert not train & {_digest(((c + 1) * 127.5).round().to(torch.uint8).numpy()) for c in seen.x0}


def test_evaluation_inputs_are_fixed_and_spread_over_the_t_buckets():
    src = _source()
    a, b = F.eval_set(src, "unseen", 8), F.eval_set(src, "unseen", 8)
    assert torch.equal(a.x_t, b.x_t) and torch.equal(a.t, b.t) and a.captions == b.captions
    assert [int(t * F.BUCKETS) for t in a.t.tolist()] == [i % F.BUCKETS for i in range(8)]
    x_t, t, target = F.eval_inputs(a.x0[3], 3)
    torch.testing.assert_close(x_t, a.x_t[3], rtol=0, atol=0)
    noise = target + a.x0[3]
    torch.testing.assert_close(x_t, (1 - t) * a.x0[3] + t * noise)


def test_long_clips_are_fast_and_longer_than_the_window_reaches():
    p = F.plan("train", (0, 0), clips="long")
    assert p["num_frames"] == F.LONG_FRAMES and p["speed"] in F.LONG_SPEEDS
    clip = F.render(p, 16, 16, 16)
    assert clip.shape == (16, 16, 16, 3)
    frames, _, _, patch, window = F.GRIDS["long"]
    assert frames // int(patch.split(",")[0]) >= 4 * int(window.split(",")[0])
    with pytest.raises(ValueError, match="frames asked"):
        F.render(F.plan("train", (0, 0)), 9, 16, 16)


def test_the_2k_grid_has_about_two_thousand_tokens():
    assert F.grid_tokens("2k") == 2048 and F.grid_tokens("8k") == 8192
    assert F.GRIDS["2k"][4] == "3,7,7"


# ---------------------------------------------------------------------------------------------
# Paired intervals
# ---------------------------------------------------------------------------------------------


def test_t_quantiles_match_known_values():
    # Student's t 0.975 quantiles from the standard tables
    for df, q in ((1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (30, 2.042), (40, 2.021), (60, 2.000),
                  (120, 1.980)):
        assert abs(t975(df) - q) < 1.5e-3, (df, t975(df), q)
    with pytest.raises(ValueError, match="df=0"):
        t975(0)


def _t_quantile_by_quadrature(df: int, p: float = 0.975) -> float:
    """Student's t quantile found from its density alone (Simpson's rule, Newton steps)."""
    import numpy as np

    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x):
        return np.exp(log_c - (df + 1) / 2 * np.log1p(np.asarray(x, dtype=np.float64) ** 2 / df))

    def cdf(q):
        x = np.linspace(0.0, q, 40_001)
        y = density(x)
        return 0.5 + (x[1] - x[0]) / 3 * (y[0] + y[-1] + 4 * y[1:-1:2].sum() + 2 * y[2:-1:2].sum())

    q = 2.0
    for _ in range(30):
        step = (cdf(q) - p) / float(density(q))
        q = max(q - step, q / 2)
        if abs(step) < 1e-10:
            return q
    raise AssertionError(f"no convergence at df={df}")


def test_t_quantiles_match_the_density_integrated():
    """Independent of the tables and the expansion: the quantile the density integrates to."""
    for df in (*range(1, 41), 50, 80, 200, 1000):
        assert abs(t975(df) - _t_quantile_by_quadrature(df)) < 1e-4, df


def test_the_paired_interval_of_known_differences():
    ref = [10.0, 10.0, 10.0, 10.0, 10.0]
    ci = paired_interval([11.0, 12.0, 13.0, 14.0, 15.0], ref)
    # differences 1..5: mean 3, sd sqrt(2.5), half width t(0.975, 4) sd / sqrt(5)
    half = 2.7764 * math.sqrt(2.5) / math.sqrt(5)
    assert ci["n"] == 5 and ci["mean"] == pytest.approx(3.0) and ci["sd"] == pytest.approx(math.sqrt(2.5))
    assert ci["lo"] == pytest.approx(3 - half) and ci["hi"] == pytest.approx(3 + half)
    assert ci["rel_mean"] == pytest.approx(30.0) and verdict(ci) == "above"
    assert verdict(paired_interval([1.0, 3.0], [2.0, 2.0])) == "overlaps 0"
    nan = paired_interval([1.0, math.nan, 2.0], [1.5, 1.0, 2.5])
    assert nan["n"] == 2 and nan["mean"] == pytest.approx(-0.5) and verdict(nan) == "below"
    one = paired_interval([1.0], [0.0])
    assert one["mean"] == 1.0 and math.isnan(one["lo"]) and verdict(one) == "no interval"
    with pytest.raises(ValueError, match="pair them"):
        paired_interval([1.0, 2.0], [1.0])


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--evals", "5", "--steps", "2"], "--evals 5 exceeds --steps 2"),
    (["--lr", "flash", "1e-4"], "--lr flash"),
    (["--lr", "dsa", "fast"], "the rate must be a number"),
    (["--eval-clips", "2"], "--eval-clips 2"),
    (["--grid", "long"], "--grid long"),
    (["--resume"], "--resume needs --out"),
    (["--arm", "dsa", "dsa", "attention.max_offset=1"], "--arm dsa: the name is a kind"),
    (["--arm", "x", "flash", "attention.max_offset=1"], "--arm x flash: the kind must be one of"),
    (["--arm", "x", "dsa"], "--arm x dsa: give NAME KIND FIELD=VALUE"),
    (["--arm", "x", "dsa", "attention.max_offset"], "'attention.max_offset' is not FIELD=VALUE"),
    (["--arm", "x", "dsa", "attention.no_such_field=1"], "--arm x:"),
    (["--arm", "x", "dsa", "attention.max_offset=-3"], "--arm x:"),
])
def test_bad_input_is_refused_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit):
        FA.main(args)
    assert message in capsys.readouterr().err


TINY = ["--grid", "small", "--teacher-steps", "2", "--steps", "2", "--evals", "2", "--seeds", "0", "1",
        "--kinds", "dense", "neighborhood", "dsa", "--rates", "1e-4", "1e-3", "--lr", "neighborhood", "3e-4",
        "--eval-clips", "4", "--samples", "1", "--set", "model.depth", "1", "--threads", "1"]


def test_an_arm_runs_its_kind_with_its_overrides_and_is_compared_with_dense_and_its_kind():
    p = FA.parser()
    a = p.parse_args(["--grid", "small", "--kinds", "dense", "dsa", "--arm", "dsa-b1", "dsa",
                      "attention.max_offset=1.5", "attention.offset_bound=clamp", "--set", "model.depth", "1",
                      "--arm", "dsa-kd", "dsa", "training.distill_weight=0.5"])
    setup = FA.checked_setup(p, a)
    assert setup["kinds"] == ["dense", "dsa", "dsa-b1", "dsa-kd"]
    kd = FA.run_config(setup, "dsa-kd", 0, 5, lr=1e-4)  # distils from the teacher the adaptation starts from
    assert kd.training.distill_weight == 0.5 and "teacher" in kd.training.init_from
    arm, dsa = (FA.run_config(setup, k, 0, 5) for k in ("dsa-b1", "dsa"))
    assert arm.attention.kind == "dsa" and arm.attention.max_offset == 1.5 and arm.attention.offset_bound == "clamp"
    assert dsa.attention.max_offset != 1.5 and arm.model.depth == dsa.model.depth == 1
    assert R.comparisons(setup["kinds"], setup["arms"]) == [("dsa", "dense"), ("dsa-b1", "dense"), ("dsa-kd", "dense"),
                                                            ("dsa-b1", "dsa"), ("dsa-kd", "dsa")]
    # an arm of dense is compared with dense once
    assert R.comparisons(["dense", "ema"], {"ema": ("dense", {})}) == [("ema", "dense")]


def test_an_ema_arm_starts_its_average_at_the_teacher_and_is_measured_with_it():
    p = FA.parser()
    a = p.parse_args(["--grid", "small", "--kinds", "dense", "--arm", "ema", "dense", "training.ema_decay=0.5",
                      "--set", "model.depth", "1", "--threads", "1"])
    setup = FA.checked_setup(p, a)
    setup["source"] = F.ClipSource.of(FA.run_config(setup, "dense", 0, 2), "simple")
    trainer = FA.fresh_trainer(FA.run_config(setup, "ema", 0, 2), 0, 1)
    teacher = {k: v + 0.01 for k, v in trainer.model.state_dict().items()}  # weights loaded after __init__
    trainer.model.load_state_dict(teacher)
    start = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train_step(FA.train_batch(setup, 0, 0))
    after = [p.detach().clone() for p in trainer.model.parameters()]
    for e, s0, s1 in zip(trainer.ema, start, after):  # the average of the teacher and the step's weights
        torch.testing.assert_close(e, 0.5 * s0 + 0.5 * s1, rtol=0, atol=1e-7)
    with FA.measured_weights(trainer):
        for p_, e in zip(trainer.model.parameters(), trainer.ema):
            assert torch.equal(p_.detach(), e)
    for p_, s1 in zip(trainer.model.parameters(), after):  # trained weights back
        assert torch.equal(p_.detach(), s1)


@pytest.mark.slow
def test_the_study_end_to_end_writes_curves_sweep_and_intervals(tmp_path):
    assert FA.main([*TINY, "--out", str(tmp_path), "--json"]) == 0
    report = json.loads((tmp_path / "fresh_adaptation.json").read_text())
    assert report["picked_lr"]["neighborhood"] == 3e-4 and report["picked_lr"]["dense"] in (1e-4, 1e-3)
    assert {(r["kind"], r["lr"]) for r in report["sweep"]} == {(k, r) for k in ("dense", "dsa") for r in (1e-4, 1e-3)}
    assert len(report["runs"]) == 6
    for run in report["runs"]:
        assert [p["step"] for p in run["curve"]] == [0, 1, 2] and run["lr"] == report["picked_lr"][run["kind"]]
        assert all(set(F.EVAL_SETS) <= set(p) for p in run["curve"])
        assert len(run["samples"]) == 1 and len(run["train_samples"]) == 1
    # dsa starts as neighborhood (offset heads zero), whatever the rates
    by = {(r["kind"], r["seed"]): r for r in report["runs"]}
    assert by["dsa", 0]["curve"][0]["seen"]["loss"] == by["neighborhood", 0]["curve"][0]["seen"]["loss"]
    assert set(report["intervals"]) == {"neighborhood-dense", "dsa-dense", "dsa-neighborhood"}
    ci = report["intervals"]["dsa-dense"]
    diffs = [by["dsa", s]["curve"][-1]["unseen"]["loss_ge25"] - by["dense", s]["curve"][-1]["unseen"]["loss_ge25"]
             for s in (0, 1)]
    assert ci["unseen_loss_ge25"]["diffs"] == pytest.approx(diffs) and ci["seeds"] == [0, 1]
    assert [p["step"] for p in ci["curve_seen"]] == [0, 1, 2]
    assert (tmp_path / "fresh_adaptation_videodit_simple_curves.png").is_file()
    assert "Paired differences" in (tmp_path / "fresh_adaptation.md").read_text()
    # resumed with the same settings: every run is read back, none run again
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert FA.main([*TINY, "--out", str(tmp_path), "--resume", "--json"]) == 0
    assert (tmp_path / "runs.jsonl").read_text().splitlines() == lines


@pytest.mark.slow
def test_the_long_clip_row_on_wan_compares_dsa_with_neighborhood_and_swin(tmp_path):
    args = ["--arch", "wan", "--clips", "long", "--grid", "long-small", "--teacher-steps", "1", "--steps", "1",
            "--evals", "1", "--seeds", "0", "1", "--kinds", "swin", "neighborhood", "dsa", "--rates", "1e-4",
            "--eval-clips", "4", "--samples", "1", "--set", "model.depth", "1", "--threads", "1",
            "--arm", "dsa-slow", "dsa", "attention.offset_scale=0.5", "--out", str(tmp_path)]
    assert FA.main(args) == 0
    report = json.loads((tmp_path / "fresh_adaptation.json").read_text())
    assert report["sweep"] == [] and report["picked_lr"] == {"swin": 1e-4, "neighborhood": 1e-4, "dsa": 1e-4,
                                                             "dsa-slow": 1e-4}
    assert set(report["intervals"]) == {"dsa-neighborhood", "dsa-swin", "dsa-slow-dsa"}
    assert "train_temporal_consistency" in report["intervals"]["dsa-swin"]
    run = report["runs"][0]
    assert "bouncing" in run["train_samples"][0]["caption"] or run["train_samples"][0]["caption"].split()[4] in (
        "fast", "very")
    assert (tmp_path / "fresh_adaptation_wan_long_curves.png").is_file()
