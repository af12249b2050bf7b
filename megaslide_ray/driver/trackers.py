"""Experiment trackers (``training.tracker``): TensorBoard or Weights & Biases, fed the rows the
driver writes to ``metrics.jsonl`` and nothing else, so the tracker and the file hold the same
numbers (the file is the source of truth).

- ``scalars(row)``: what a tracker logs of one row: every numeric field under its own name (a
  bool as 0/1; several compute actors' fields as ``compute_actors/rank{R}/{field}``), not
  ``step`` (the x axis) nor ``time`` (the event's wall time); lists and strings are left out.
- ``sample_tag(sample)``: the name a sample video is logged under, ``sample/{index:02d}_{prompt slug}``
  (one series per prompt). The videos come to ``log_samples`` once the sample writer has written
  them (``driver.components.Sampler.collect``), which is after the row of the step that sampled.
- ``check_tracker``: the tracker's package is installed (ConfigError naming the pip command
  otherwise); run before Ray starts.
- ``open_tracker``: the tracker of ``training.tracker`` (None for ``none``), its config logged
  once. ``log(row)`` each row, ``log_samples(samples, step)`` the videos written since (``step``:
  the last row's), ``close()`` once (twice is harmless).

The packages are optional extras (``pip install 'megaslide-ray[tensorboard]'`` or ``[wandb]``):
each is imported only when its tracker is opened.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import logging
import os
from pathlib import Path

import numpy as np

from megaslide_ray.config import Config, ConfigError, to_toml
from megaslide_ray.evaluation.sampling import prompt_slug

log = logging.getLogger(__name__)

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""``training.tracker`` -> the package it needs (the import name, which is also the pip name)."""

NOT_SCALARS = ("step", "time")
"""Numeric fields of a row that are not logged as scalars: the x axis and the wall time."""


def check_tracker(kind: str) -> None:
    """ConfigError when ``training.tracker`` ``kind`` needs a package that is not installed."""
    package = PACKAGES.get(kind)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"training.tracker={kind} needs the {package} package, which is not installed: "
                          f"pip install {package} (or pip install 'megaslide-ray[{kind}]'), or use "
                          f"--training.tracker none")


def _number(value) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def scalars(row: dict) -> dict[str, float]:
    """The scalars a tracker logs of ``row`` (a metrics.jsonl row): see the module docstring."""
    out = {}
    for key, value in row.items():
        if key in NOT_SCALARS:
            continue
        if key == "compute_actors":
            for actor in value:
                for field, v in actor.items():
                    if field != "rank" and _number(v) is not None:
                        out[f"compute_actors/rank{actor['rank']}/{field}"] = _number(v)
        elif _number(value) is not None:
            out[key] = _number(value)
    return out


def sample_tag(sample) -> str:
    """The tag of a ``WrittenSample`` (``actors.sample_writer``): ``sample/{index:02d}_{slug}``."""
    return f"sample/{sample.index:02d}_{prompt_slug(sample.prompt)}"


def sample_caption(sample) -> str:
    return f"step {sample.step}: {sample.prompt}"


def read_video(path: Path) -> tuple[np.ndarray, float]:
    """The uint8 ``(F, H, W, 3)`` RGB frames of the video ``path`` and its frame rate."""
    import av  # lazy: only a tracker that logs a sample decodes one

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.base_rate or 8)
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)]), fps


GIF_SIDE = 256
"""TensorBoard's sample GIF is at most this many pixels on its longer side (a 480p Wan sample as
a full-size GIF takes tens of MB in the event file and over a second to encode)."""


def gif_bytes(frames: np.ndarray, fps: float) -> tuple[bytes, int, int]:
    """``frames`` as an animated GIF (what TensorBoard's image view plays), scaled down to at most
    ``GIF_SIDE`` pixels on the longer side; returns it with its width and height."""
    from PIL import Image  # lazy: only TensorBoard's sample videos need it

    h, w = frames.shape[1:3]
    scale = min(1.0, GIF_SIDE / max(h, w))
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    images = [Image.fromarray(f) for f in frames]
    if size != (w, h):
        images = [im.resize(size, Image.Resampling.BILINEAR) for im in images]
    images = [im.quantize(256, method=Image.Quantize.FASTOCTREE) for im in images]  # fast, per frame
    buf = io.BytesIO()
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:],
                   duration=10 * round(100 / fps), loop=0)  # GIF counts in centiseconds
    return buf.getvalue(), size[0], size[1]


class TensorBoardTracker:
    """Event files in ``RUN_DIR/tensorboard`` (a resumed run adds a file beside the old ones):
    each scalar under its metrics.jsonl name at the row's step and wall time, the config as the
    text ``config``, each sample video as an animated image (scaled down: ``GIF_SIDE``) at the step
    whose weights made it, one tag per prompt (``sample_tag``)."""

    def __init__(self, cfg: Config, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # lazy: an optional extra

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))
        # Four spaces: a code block in TensorBoard's markdown, so the TOML shows as written.
        self.writer.add_text("config", "\n".join("    " + line for line in to_toml(cfg).splitlines()))
        self.writer.flush()

    def log(self, row: dict) -> None:
        step, walltime = row["step"], row.get("time")
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, step, walltime=walltime)
        self.writer.flush()

    def log_samples(self, samples: list, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary  # lazy: an optional extra

        for sample in samples:  # TensorBoard takes any step order: each at its own step
            gif, width, height = gif_bytes(*read_video(Path(sample.video)))
            image = Summary.Image(height=height, width=width, colorspace=3, encoded_image_string=gif)
            summary = Summary(value=[Summary.Value(tag=sample_tag(sample), image=image)])
            self.writer.file_writer.add_summary(summary, sample.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run in ``RUN_DIR/wandb``: offline unless the environment's
    ``WANDB_MODE`` says otherwise (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later),
    project ``WANDB_PROJECT`` (default ``megaslide``), named after the run directory; the config
    as the run's config, each row at its step, each sample as a video under ``sample_tag``,
    captioned with its step and prompt, at the step of the row logged last (W&B drops anything
    logged at an earlier step than one it already has, and a video is written after its row)."""

    def __init__(self, cfg: Config, run_dir: Path):
        import wandb  # lazy: an optional extra

        self.wandb = wandb
        self.run = wandb.init(
            dir=str(run_dir), project=os.environ.get("WANDB_PROJECT", "megaslide"), name=run_dir.name,
            mode=os.environ.get("WANDB_MODE", "offline"), config=dataclasses.asdict(cfg),
            settings=wandb.Settings(console="off", save_code=False, disable_job_creation=True, silent=True))
        self._closed = False

    def log(self, row: dict) -> None:
        self.run.log(scalars(row), step=row["step"])

    def log_samples(self, samples: list, step: int) -> None:
        videos = {sample_tag(s): self.wandb.Video(s.video, caption=sample_caption(s), format="mp4") for s in samples}
        if videos:  # merged into the row of ``step`` (not committed yet: W&B commits it when the step moves on)
            self.run.log(videos, step=step)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.run.finish()
            # The run's file is written by W&B's service process: finish() can return before it
            # is; teardown waits for the service to end, so the file is complete when close returns.
            self.wandb.teardown()


class SafeTracker:
    """A tracker whose failure never ends the run: the first error is logged with what failed and
    the tracker stops logging (metrics.jsonl goes on); ``close`` closes it once."""

    def __init__(self, tracker):
        self.tracker, self.failed, self.closed = tracker, False, False

    def log(self, row: dict) -> None:
        self._call("log", row.get("step"), row)

    def log_samples(self, samples: list, step: int) -> None:
        if samples:
            self._call("log_samples", step, samples, step)

    def _call(self, method: str, step, *args) -> None:
        if self.failed or self.closed:
            return
        try:
            getattr(self.tracker, method)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker never ends the run
            self.failed = True
            log.warning("the %s tracker failed at step %s and logs nothing more (metrics.jsonl has every step): %r",
                        type(self.tracker).__name__, step, e)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.tracker.close()
        except Exception as e:  # noqa: BLE001 - closing a tracker never hides the run's own outcome
            log.warning("closing the %s tracker failed: %r", type(self.tracker).__name__, e)


TRACKERS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def open_tracker(cfg: Config, run_dir: str | Path) -> SafeTracker | None:
    """The tracker of ``cfg.training.tracker`` writing under ``run_dir`` (None for ``none``)."""
    kind = cfg.training.tracker
    if kind == "none":
        return None
    check_tracker(kind)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return SafeTracker(TRACKERS[kind](cfg, run_dir))
