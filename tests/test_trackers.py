"""Experiment trackers (``training.tracker``): what TensorBoard's own reader and a W&B offline
run hold equals metrics.jsonl, row for row; a missing package is refused before Ray starts."""

import io
import json
import struct
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from actors.sample_writer import WrittenSample
from megaslide_ray.config import build_config, to_toml
from megaslide_ray.data.demo import write_video
from megaslide_ray.driver import trackers
from megaslide_ray.driver.components import MetricsLog
from megaslide_ray.driver.trackers import open_tracker, scalars


class _Pipeline:
    """What MetricsLog asks of a pipeline: the state's size and the decoders' counts."""

    def status(self):
        return types.SimpleNamespace(state_bytes=1 << 20)

    def decoder_stats(self):
        return [types.SimpleNamespace(frames_decoded=40, decode_seconds=2.0)]


def _rows(sample: Path) -> list[dict]:
    """Three steps with the fields of a real row (docs/metrics.md): two compute actors, a
    validation on step 2, a sample on step 3, a skipped update on step 3."""
    rows = []
    for step in (1, 2, 3):
        row = {"step": step, "loss": 1.0 / (step + 0.1), "lr": 1e-4 * step, "grad_norm": 0.3 + step,
               "clip_coef": 1.0, "update_skipped": step == 3, "bad_steps": int(step == 3), "restarts": 0,
               "tokens": 4096, "tokens_per_s": 1234.5 + step, "step_seconds": 3.3, "compute_seconds": 2.9,
               "h2d_bytes": 123456789 * step, "data_rows": [step, step + 7], "device": "cpu",
               "time": 1.7e9 + step + 0.25, "compute_actors": [
                   {"rank": r, "loss": 0.5 + r, "compute_seconds": 2.5 + r, "weight_wait_seconds": 0.1 * r,
                    "data_wait_seconds": 0.01, "grad_slot_wait_seconds": 0.0} for r in (0, 1)]}
        if step == 2:
            row.update({"val_loss": 0.81, "val_loss_t0": 0.9, "val_loss_t1": 0.72, "val_failures": 0})
        if step == 3:
            row.update({"sample": [str(sample)], "sample_seconds": 0.5, "sample_failures": 0})
        rows.append(row)
    return rows


def _sample_video(path: Path, frames: int = 5) -> Path:
    rng = np.random.default_rng(0)
    write_video(path, rng.integers(0, 255, (frames, 16, 24, 3), dtype=np.uint8))
    return path


PROMPT = "a red circle, moving right"
TAG = "sample/00_a-red-circle-moving-right"


def _written(path: Path, step: int) -> WrittenSample:
    """What the sample writer returns for the video ``path`` of step ``step``'s first prompt."""
    return WrittenSample(step, 0, PROMPT, 0, str(path), str(path.with_suffix(".png")), 5, 16, 24, 0.1, 0.1)


def _feed(cfg, run_dir: Path, rows: list[dict]) -> list[dict]:
    """``rows`` through the driver's MetricsLog with the config's tracker, the sample a row names
    handed over once written (after the row, as the Trainer does); metrics.jsonl read back."""
    log = MetricsLog(cfg, run_dir, _Pipeline(), open_tracker(cfg, run_dir))
    try:
        for i, row in enumerate(rows):
            log.record(row, first=i == 0)
            log.record_samples([_written(Path(p), row["step"]) for p in row.get("sample", ())])
    finally:
        log.close()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _expected(row: dict) -> dict[str, float]:
    """Every numeric field of a metrics.jsonl row, computed here (not by the module under test)."""
    out = {k: float(v) for k, v in row.items()
           if isinstance(v, (int, float)) and k not in ("step", "time")}
    for actor in row.get("compute_actors", ()):
        out.update({f"compute_actors/rank{actor['rank']}/{k}": float(v) for k, v in actor.items() if k != "rank"})
    return out


def test_scalars_are_every_numeric_field_of_a_row():
    row = {"step": 4, "time": 1.5, "loss": 0.25, "update_skipped": True, "tokens": 7, "device": "cpu",
           "data_rows": [1, 2], "sample": "samples/step_4.mp4", "val_loss_t1": 0.5,
           "compute_actors": [{"rank": 1, "loss": 0.3, "data_wait_seconds": 0.0}]}
    assert scalars(row) == {"loss": 0.25, "update_skipped": 1.0, "tokens": 7.0, "val_loss_t1": 0.5,
                            "compute_actors/rank1/loss": 0.3, "compute_actors/rank1/data_wait_seconds": 0.0}
    assert trackers.sample_tag(_written(Path("x.mp4"), 4)) == TAG


@pytest.mark.parametrize("kind", ["tensorboard", "wandb"])
def test_a_missing_tracker_package_is_refused_before_ray(kind, tmp_path, monkeypatch, capsys):
    from megaslide_ray.driver import launch as launch_module

    monkeypatch.setitem(trackers.PACKAGES, kind, "megaslide_no_such_package")
    monkeypatch.setattr(launch_module, "start_ray", lambda *a, **k: pytest.fail("Ray started"))
    cfg = build_config("tiny", None, {"training.tracker": kind, "training.run_dir": str(tmp_path / "run")})
    assert launch_module.launch(cfg) == 2
    err = capsys.readouterr().err
    assert f"training.tracker={kind} needs the megaslide_no_such_package package" in err
    assert "pip install megaslide_no_such_package" in err
    assert not (tmp_path / "run").exists()


def test_the_tracker_opens_before_ray_and_is_closed_on_a_ctrl_c_before_training(tmp_path, monkeypatch):
    from megaslide_ray.driver import launch as launch_module

    events = []

    class Recorder:
        def log(self, row):
            events.append("log")

        def close(self):
            events.append("close")

    def no_ray(*args, **kwargs):  # a Ctrl-C while Ray starts: the trainer never exists
        events.append("ray")
        raise KeyboardInterrupt("SIGINT")

    monkeypatch.setattr(launch_module, "check_data", lambda cfg: None)
    monkeypatch.setattr(launch_module, "check_tracker", lambda kind: None)  # tensorboard need not be installed
    monkeypatch.setattr(launch_module, "open_tracker", lambda cfg, run_dir: events.append("open") or Recorder())
    monkeypatch.setattr(launch_module, "start_ray", no_ray)
    cfg = build_config("tiny", None, {"training.tracker": "tensorboard", "training.run_dir": str(tmp_path / "run")})
    with pytest.raises(KeyboardInterrupt):
        launch_module.launch(cfg)
    assert events == ["open", "ray", "close"]


def test_an_unknown_tracker_is_refused():
    with pytest.raises(Exception, match="training.tracker='mlflow' is not one of"):
        build_config("tiny", None, {"training.tracker": "mlflow"})


def test_a_failing_tracker_never_ends_the_run(tmp_path, caplog):
    class Broken:
        closed = 0

        def log(self, row):
            raise OSError("disk full")

        def close(self):
            Broken.closed += 1

    safe = trackers.SafeTracker(Broken())
    safe.log({"step": 1, "loss": 1.0})
    safe.log({"step": 2, "loss": 1.0})
    safe.close()
    safe.close()
    assert caplog.text.count("tracker failed at step 1") == 1 and "disk full" in caplog.text
    assert Broken.closed == 1


def test_the_tensorboard_sample_is_a_gif_of_every_frame_at_most_256_pixels_wide(tmp_path):
    pytest.importorskip("PIL")
    from PIL import Image

    frames = np.random.default_rng(1).integers(0, 255, (6, 96, 512, 3), dtype=np.uint8)
    data, width, height = trackers.gif_bytes(frames, 16)
    gif = Image.open(io.BytesIO(data))
    assert (width, height) == gif.size == (256, 48) and gif.n_frames == 6
    assert gif.info["duration"] == 60  # 62.5 ms a frame, in the centiseconds GIF counts in


def test_tensorboard_event_files_hold_the_metrics_jsonl_rows(tmp_path):
    pytest.importorskip("tensorboard")
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = build_config("tiny", None, {"training.tracker": "tensorboard"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = _feed(cfg, run_dir, _rows(_sample_video(tmp_path / "step_3.mp4")))
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert tags == set().union(*(_expected(r) for r in written))
    for row in written:
        for tag, value in _expected(row).items():
            (event,) = [e for e in acc.Scalars(tag) if e.step == row["step"]]
            assert event.value == np.float32(value), tag  # TensorBoard keeps scalars in float32
            assert event.wall_time == row["time"]
    (config_event,) = acc.Tensors("config/text_summary")
    text = config_event.tensor_proto.string_val[0].decode()
    assert text.splitlines() == ["    " + line for line in to_toml(cfg).splitlines()]
    assert acc.Tags()["images"] == [TAG]
    (image,) = acc.Images(TAG)
    assert image.step == 3 and (image.width, image.height) == (24, 16)
    gif = Image.open(io.BytesIO(image.encoded_image_string))
    assert gif.format == "GIF" and gif.n_frames == 5


def _wandb_records(path: Path):
    """The records of a W&B run file: a 7-byte header, then LevelDB log records (7-byte header:
    CRC, length, type full/first/middle/last) in 32 KiB blocks, each a ``Record`` protobuf."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def test_wandb_offline_run_holds_the_metrics_jsonl_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR"):
        monkeypatch.delenv(var, raising=False)  # offline is the default: no network, no login
    monkeypatch.setenv("WANDB_API_KEY", "")
    cfg = build_config("tiny", None, {"training.tracker": "wandb"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = _feed(cfg, run_dir, _rows(_sample_video(tmp_path / "step_3.mp4")))
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (run_file,) = offline.glob("run-*.wandb")
    history, config = [], {}
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":  # a media value's fields come as nested keys: sample/_type, sample/path, ...
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    assert [h["_step"] for h in history] == [r["step"] for r in written]
    for h, row in zip(history, written):
        assert {k: v for k, v in h.items() if not k.startswith(("_", "sample/"))} == _expected(row)
    assert config["training"]["tracker"] == "wandb"
    assert config["model"] == json.loads(json.dumps(vars(cfg.model)))  # tuples as lists
    assert not any(k.startswith("sample/") for h in history[:2] for k in h)
    assert history[2][f"{TAG}/_type"] == "video-file"
    assert history[2][f"{TAG}/caption"] == f"step 3: {PROMPT}"
    assert (offline / "files" / history[2][f"{TAG}/path"]).read_bytes() == (tmp_path / "step_3.mp4").read_bytes()


def test_the_wandb_tracker_logs_each_video_at_the_step_of_the_last_row(tmp_path, monkeypatch):
    """Without wandb installed (its offline test above then skips): a stand-in module records
    the calls. W&B drops a step lower than one it has, so a video written after its row is logged
    at the last row's step (merged into that row), captioned with its own step and prompt."""
    calls = []

    class Video:
        def __init__(self, path, caption=None, format=None):
            self.args = (path, caption, format)

    class Run:
        def log(self, data, step=None):
            calls.append(({k: getattr(v, "args", v) for k, v in data.items()}, step))

        def finish(self):
            calls.append("finish")

    fake = types.SimpleNamespace(Video=Video, Settings=lambda **kw: kw, init=lambda **kw: Run(),
                                 teardown=lambda: calls.append("teardown"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(trackers, "check_tracker", lambda kind: None)
    cfg = build_config("tiny", None, {"training.tracker": "wandb"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = MetricsLog(cfg, run_dir, _Pipeline(), open_tracker(cfg, run_dir))
    rows = _rows(_sample_video(tmp_path / "step_3.mp4"))
    log.record(rows[0], first=True)
    log.record(rows[1], first=False)
    log.record_samples([])  # nothing written yet: nothing logged
    log.record_samples([_written(tmp_path / "step_1.mp4", 1)])  # step 1's video, written during step 2
    log.close()
    assert calls == [(_expected(rows[0]), 1), (_expected(rows[1]), 2),
                     ({TAG: (str(tmp_path / "step_1.mp4"), f"step 1: {PROMPT}", "mp4")}, 2), "finish", "teardown"]


@pytest.mark.slow  # a 2-step Ray run with a sample: about 20 s
def test_a_run_with_tensorboard_logs_its_metrics_jsonl_and_sample(ray_session, small_config, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megaslide_ray.driver import Trainer
    from megaslide_ray.evaluation.sampling import prompt_slug, sample_path

    cfg = small_config(**{"training.steps": 2, "training.sample_every": 2, "training.sample_steps": 1,
                          "training.tracker": "tensorboard"})
    trainer = Trainer(cfg, run_dir=str(tmp_path / "run"), progress=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set().union(*(_expected(r) for r in rows))
    for row in rows:
        for tag, value in _expected(row).items():
            (event,) = [e for e in acc.Scalars(tag) if e.step == row["step"]]
            assert event.value == np.float32(value) and event.wall_time == row["time"], tag
    tag = f"sample/00_{prompt_slug(cfg.training.sample_prompt)}"
    (image,) = acc.Images(tag)
    assert image.step == 2 and rows[1]["sample"] == [str(sample_path(tmp_path / "run", 2, 0, cfg.training.sample_prompt))]
    assert (image.width, image.height) == (cfg.data.width, cfg.data.height)
