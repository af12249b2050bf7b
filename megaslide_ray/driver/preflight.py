"""The checks of a training run that need no Ray: whose run directory it is, whether a resumed
checkpoint was trained with this model, and whether the machine has the devices the run asks for.

Each check raises ``ConfigError`` with one message naming the value and what to do;
``launch`` prints it and exits 2 before Ray starts, having changed nothing.

A run directory belongs to one run. A new run (no ``--resume``) starts only in a directory that
does not exist or is empty, and whose run left no kept shared-memory state; ``--overwrite``
replaces an earlier run (``clear_run_dir``: the files a run writes, ``RUN_ENTRIES``, and its
kept state), and never removes anything else. ``--resume`` continues the run with the model its
checkpoint holds: another model section (``model.*``) or another attention (``attention.*`` but
the backend, which computes the same attention) is refused, naming each field that differs.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

from megaslide_ray.config import Config, ConfigError, config_from_dict
from megaslide_ray.state.checkpoint import read_checkpoint_state
from megaslide_ray.state.kept import find_kept_state, release_state

RUN_ENTRIES = ("checkpoints", "config.toml", "metrics.jsonl", "error.log", "samples", "decoders", "report",
               "tensorboard", "wandb")  # the last two: the trackers' (training.tracker)
"""What a run writes into its directory (``--overwrite`` removes these, and only these)."""

FREE_TO_CHANGE = {"attention.backend"}
"""Fields of the weight-defining sections a resumed run may change: they compute the same model."""


def check_run_dir(cfg: Config, run_dir: str, resume: bool, overwrite: bool) -> None:
    """Refuse a run directory that is not this run's to write (see the module docstring)."""
    path = Path(run_dir)
    if resume and overwrite:
        raise ConfigError(f"--resume continues the run in {run_dir} and --overwrite replaces it: give one of them")
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is an existing file, not a directory: give the path of a "
                          f"directory (a new one, or an earlier run's with --resume)")
    if resume:
        return
    entries = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    kept = find_kept_state(cfg, run_dir)
    if not entries and kept is None:
        return
    what = ", ".join(entries[:6]) + (f" and {len(entries) - 6} more" if len(entries) > 6 else "")
    held = (f"holds {what}" if entries else "is empty") + (
        f"; the shared-memory state its run kept is {kept.describe()}" if kept is not None else "")
    if not overwrite:
        raise ConfigError(f"--run-dir {run_dir} already {held}: a run directory belongs to one run. Continue that "
                          f"run with --resume, replace it with --overwrite, or give a new --run-dir")
    foreign = [name for name in entries if name not in RUN_ENTRIES]
    if foreign:
        raise ConfigError(f"--overwrite: --run-dir {run_dir} holds {', '.join(foreign[:6])}, which no run writes; "
                          f"nothing was removed. Give a run's directory or a new --run-dir")


def clear_run_dir(cfg: Config, run_dir: str) -> list[str]:
    """``--overwrite``: remove what an earlier run wrote into ``run_dir`` (``RUN_ENTRIES``) and
    the shared-memory state it kept; returns what was removed. ``check_run_dir`` ran first."""
    removed = []
    for name in RUN_ENTRIES:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        removed.append(str(path))
    kept = find_kept_state(cfg, run_dir)
    if kept is not None:
        release_state(kept.path)
        removed.append(str(kept.path))
    return removed


def _fields(cfg: Config, section: str) -> dict:
    return {f"{section}.{f.name}": getattr(getattr(cfg, section), f.name)
            for f in dataclasses.fields(getattr(cfg, section))}


def check_resume_config(cfg: Config, checkpoint: str | Path) -> None:
    """Refuse to continue ``checkpoint`` with another model: every ``model.*`` and
    ``attention.*`` field (but ``FREE_TO_CHANGE``) must be the one its ``state.json`` records, and
    ``data.buckets`` too (a bucketed data position counts batches of those buckets)."""
    recorded = read_checkpoint_state(checkpoint).get("config")
    if not recorded:
        return
    then = config_from_dict(recorded)
    differ = []
    for section in ("model", "attention"):
        old, new = _fields(then, section), _fields(cfg, section)
        differ += [f"{key} {_show(old[key])} -> {_show(new[key])}" for key in old
                   if key not in FREE_TO_CHANGE and _norm(old[key]) != _norm(new[key])]
    if _norm_buckets(then.data.buckets) != _norm_buckets(cfg.data.buckets):
        # a bucketed data position counts blocks of the buckets, an unbucketed one clips
        raise ConfigError(f"--resume: {checkpoint} was trained with data.buckets={then.data.buckets!r}, this config has "
                          f"{cfg.data.buckets!r}: its data positions would name other batches. Resume with "
                          f"--data.buckets {then.data.buckets or chr(34) * 2}, or start a new run")
    if differ:
        raise ConfigError(f"--resume: {checkpoint} was trained with another model than this config's: "
                          f"{'; '.join(differ)} (checkpoint -> this config). Leave these fields as the run had them "
                          f"to continue it, or start a new run in a new --run-dir (--init-from {checkpoint} starts "
                          f"from its weights)")


def _norm_buckets(text: str) -> str:
    return ",".join(t.strip().lower() for t in text.split(",")) if text.strip() else ""


def _norm(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _show(value) -> str:
    return ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else repr(value)


def local_devices(cfg: Config) -> tuple[int, int]:
    """(GPUs, CPUs) a local Ray cluster of ``cfg`` gets on this machine: the CUDA devices torch
    sees (none when ``runtime.device`` is cpu), and ``ray.num_cpus`` or the CPUs this process may
    run on."""
    gpus = torch.cuda.device_count() if cfg.runtime.device != "cpu" and torch.cuda.is_available() else 0
    cpus = cfg.ray.num_cpus or len(os.sched_getaffinity(0))
    return gpus, cpus


def check_devices(cfg: Config, gpus: float, cpus: float, where: str) -> None:
    """Refuse more compute actors (``runtime.compute_actors`` per node) than ``where`` has GPUs,
    or, on a CPU run, CPUs: each compute actor holds its own copy of a block's weights and its
    activations, so more of them than devices only share the devices and the memory runs out.
    Samples decoded on the GPU (``training.sample_device``) need a GPU run."""
    n = cfg.runtime.compute_actors
    t = cfg.training
    if t.sample_every and t.sample_device == "cuda" and gpus < 1:
        raise ConfigError(f"training.sample_device='cuda' decodes the samples on the training GPU between steps, but "
                          f"{where} trains on no GPU (runtime.device={cfg.runtime.device!r}); use "
                          f"--training.sample_device cpu")
    if cfg.runtime.device == "cuda" and gpus < 1:
        raise ConfigError(f"runtime.device='cuda' but {where} has no GPU (found {cpus:g} CPUs and no CUDA device); "
                          f"use --runtime.device auto or cpu")
    if n == "auto":
        return  # one per GPU, or one on a CPU run
    if gpus >= 1 and n > gpus:
        raise ConfigError(f"runtime.compute_actors={n} asks for {n} GPU compute actors, but {where} has {gpus:g} "
                          f"GPU(s): use at most {gpus:g} (or auto: one per GPU)")
    if gpus < 1 and n > cpus:
        raise ConfigError(f"runtime.compute_actors={n} asks for {n} CPU compute actors, but {where} has {cpus:g} "
                          f"CPU(s) and no GPU: use at most {int(cpus)} (each holds its own copy of a block's weights "
                          f"and activations), or raise ray.num_cpus on a machine that has them")
