"""The run report: PNGs and a summary from metrics.jsonl (a real run of the main job, and
hand-made rows where the arithmetic must be checked exactly), tolerant of missing fields."""

import json
import subprocess
import sys

import pytest

from megaslide_ray.evaluation.run_report import (
    COMPARE_PLOT,
    OFFSETS_PLOT,
    PLOTS,
    format_summary,
    read_metrics,
    report,
    run_label,
    summarize,
)
from megaslide_ray.report import main


def _rows(n=12):
    rows = []
    for i in range(n):
        fwd, bwd, wait = 0.3 + 0.01 * i, 0.9, 0.04
        rows.append({"step": i + 1, "loss": 1.5 * 0.95 ** i, "lr": 5e-3, "grad_norm": 1.2, "tokens": 1024,
                     "tokens_per_s": 1024 / 1.5, "step_seconds": 1.5, "compute_seconds": fwd + bwd,
                     "forward_seconds": fwd, "backward_seconds": bwd, "weight_wait_seconds": wait,
                     "optimizer_seconds": 0.01, "data_position": 2 * (i + 1), "skipped_files": 0})
    return rows


def _write(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_arithmetic_on_known_rows(tmp_path, capsys):
    _write(tmp_path / "run", _rows())
    assert main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    for png in PLOTS:
        data = (tmp_path / "run" / "report" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert "1..12 (12 rows)" in out and "1.5000 /" in out and "tokens/s" in out and "683" in out
    # 2..12: step 1.5 s, forward 0.31..0.41, backward 0.9, other = 1.5 - compute
    split = {line.rsplit(None, 1)[0].strip(): line.rsplit(None, 1)[1] for line in out.splitlines()
             if line.startswith("  ") and line.rstrip().endswith("%")}
    assert split == {"forward": "24.0%", "backward": "60.0%", "other (data, driver)": "16.0%"}
    assert "weight wait              2.7%  (inside forward/backward)" in out


def test_report_tolerates_missing_fields_and_custom_out(tmp_path):
    rows = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0, "tokens_per_s": 500.0}, {"step": 3}]
    _write(tmp_path / "run", rows)
    summary, plots = report(tmp_path / "run", tmp_path / "plots")
    assert [p.name for p in plots] == list(PLOTS) and all(p.is_file() for p in plots)
    assert summary.first_loss == 2.0 and summary.min_loss == 1.0 and summary.min_loss_step == 2
    assert summary.split == {}
    assert "time split" not in format_summary(summary)


def test_report_of_a_real_run(cli_run, tmp_path, capsys):
    run_dir, _, _ = cli_run  # the main job's own metrics.jsonl (2 steps), read-only here
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert main([str(run_dir), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    for png in PLOTS + (OFFSETS_PLOT,):  # the main job trains dsa: its offset field is drawn too
        data = (tmp_path / "plots" / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    s = summarize(rows)
    assert (s.first_loss, s.last_loss) == (rows[0]["loss"], rows[1]["loss"])
    assert s.mean_step_seconds == rows[1]["step_seconds"]  # the first step (start-up) is left out
    assert "1..2 (2 rows)" in out and f"{rows[0]['loss']:.4f} / {rows[1]['loss']:.4f}" in out
    # A real row has every part of the split; forward + backward + the rest is the whole step.
    assert set(s.split) == {"forward", "backward", "other (data, driver)", "weight wait", "optimizer"}
    assert all(v >= 0 for v in s.split.values())
    # (a step queued ahead may have computed for longer than the driver's step; the rest is then 0)
    r = rows[1]
    assert r["compute_seconds"] == pytest.approx(r["forward_seconds"] + r["backward_seconds"])
    whole = s.split["forward"] + s.split["backward"] + s.split["other (data, driver)"]
    assert whole == pytest.approx(max(r["compute_seconds"], r["step_seconds"]) / r["step_seconds"])


def test_report_missing_or_empty_metrics_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.report", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "metrics.jsonl does not exist" in proc.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no metrics rows"):
        report(tmp_path / "empty")


def test_several_runs_are_compared_by_validation_loss(tmp_path, capsys):
    for kind, scale in (("dsa", 1.0), ("neighborhood", 1.1)):
        rows = _rows()
        for r in rows[3::4]:
            r["val_loss"], r["val_loss_t0"] = scale * r["loss"], 0.5 * scale * r["loss"]
        _write(tmp_path / kind, rows)
        (tmp_path / kind / "config.toml").write_text(f'[attention]\nkind = "{kind}"\n')
    assert run_label(tmp_path / "dsa") == "dsa (dsa)"
    assert main([str(tmp_path / "dsa"), str(tmp_path / "neighborhood"), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert out.count("run ") == 2 and f"comparison: {tmp_path / 'cmp' / COMPARE_PLOT}" in out
    assert (tmp_path / "cmp" / COMPARE_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "cmp" / "neighborhood" / "val_loss.png").is_file()
    _write(tmp_path / "noval", _rows())
    assert main([str(tmp_path / "noval"), str(tmp_path / "noval"), "--out", str(tmp_path / "x")]) == 2
    assert "logged a val_loss" in capsys.readouterr().err


def test_the_report_lists_the_samples_taken_during_training(tmp_path, capsys):
    run = tmp_path / "run"
    rows = _rows(4)
    rows[1].update({"sample": ["x"], "sample_seconds": 0.25})
    rows[3].update({"sample": ["y"], "sample_seconds": 0.75, "step_seconds": 9.0})
    _write(run, rows)
    (run / "samples").mkdir()
    entries = [{"step": s, "index": i, "prompt": p, "seed": i, "video": str(run / "samples" / f"step_{s}_{i}.mp4"),
                "decode_seconds": d} for s, d in ((4, 3.0), (2, 1.0)) for i, p in enumerate(("red circle", "blue"))]
    (run / "samples" / "samples.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries) + '{"step": 6, "ind')
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    section = out[out.index("samples:"):].splitlines()
    assert section == ["samples: 4 videos of 2 prompts",
                       "  sampling held its step up by 0.500 s on average (2 times), a step without it took 1.500 s",
                       "  decoding a sample took 2.000 s on average (the sample writer, off the step)",
                       "  step      2 [00] 'red circle': samples/step_2_0.mp4",
                       "  step      2 [01] 'blue': samples/step_2_1.mp4",
                       "  step      4 [00] 'red circle': samples/step_4_0.mp4",
                       "  step      4 [01] 'blue': samples/step_4_1.mp4"]
    _write(tmp_path / "plain", _rows(2))
    assert main([str(tmp_path / "plain")]) == 0
    assert "samples:" not in capsys.readouterr().out
