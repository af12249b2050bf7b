"""Shared fixtures: one Ray session per test module that asks for it, a small demo dataset,
a small model config that still exercises every part of the pipeline, one real run of the main
job's CLI that several modules read (its run directory is read-only to them), and one tiny
random diffusers Wan directory (read-only too)."""

import os
import subprocess
import sys

import pytest
import ray
import shards
import torch

from megaslide_ray.config import build_config
from megaslide_ray.data.demo import ensure_demo_dataset

SMALL = {"model.depth": 2, "model.hidden_size": 64, "model.num_heads": 2, "model.caption_dim": 32,
         "model.patch_size": "2,8,8", "data.num_frames": 8, "data.height": 32, "data.width": 32,
         "data.batch_size": 2, "attention.window": "3,3,3", "training.log_every": 1}


EXACT = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
         "model.patch_size": "2,8,8", "data.num_frames": 4, "data.height": 32, "data.width": 32,
         "attention.kind": "dense", "optim.grad_clip": 0.05, "optim.lr": 3e-3, "optim.weight_decay": 0.05,
         "runtime.compute_threads": 1, "runtime.optimizer_threads": 1, "training.steps": 3}
"""A model for the exactness tests of a split global batch (several compute actors, several
nodes): small and dense, clipping and weight decay active, one thread per actor."""


@pytest.fixture(scope="module")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="megaslide", logging_level="ERROR")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return str(ensure_demo_dataset(tmp_path_factory.mktemp("cache"), num_videos=6))


@pytest.fixture(scope="module")
def small_config(manifest):
    """``small_config(**overrides)``: the small model on the demo manifest."""
    def make(**extra):
        return build_config("tiny", None, {**SMALL, "data.manifest": manifest, **extra})
    return make


CLI_SMALL = ["--model.depth", "1", "--model.hidden_size", "32", "--model.num_heads", "2", "--data.num_frames", "6",
             "--data.height", "16", "--data.width", "16", "--ray.num_cpus", "2", "--no-progress"]
"""The smallest model the CLI tests train: one block, 16x16 clips of 6 frames."""


def run_cli(args, env, module="megaslide_ray.train", timeout=600):
    """``python -m megaslide_ray.train`` (or ``module``) with ``args``, as a user runs it."""
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def cli_run(tmp_path_factory):
    """One 2-step run of the main job on the generated demo set, made once per test session:
    ``(run_dir, completed process, env)``. Tests copy the run directory before changing it."""
    root = tmp_path_factory.mktemp("cli")
    env = {**os.environ, "MEGASLIDE_CACHE": str(root / "cache")}
    run_dir = root / "run"
    proc = run_cli([*CLI_SMALL, "--steps", "2", "--run-dir", str(run_dir)], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc, env


@pytest.fixture(scope="session")
def wan_dir(tmp_path_factory):
    """A tiny random diffusers Wan directory, ``wan-tiny/``, made once per test session (tests
    read it, never write it): ``vae/``, ``text_encoder/`` and ``tokenizer/`` of
    ``wan_models.make_wan_dir`` and a ``transformer/`` (``wan_models.TRANSFORMER``) that reads
    their latents and text embeddings."""
    # lazy: wan_models imports diffusers and transformers (seconds); most test modules never need them
    from diffusers import WanTransformer3DModel  # lazy: as above
    from wan_models import TRANSFORMER, make_wan_dir

    root = make_wan_dir(tmp_path_factory.mktemp("models") / "wan-tiny")
    torch.manual_seed(3)
    WanTransformer3DModel(**TRANSFORMER).save_pretrained(root / "transformer")
    return root


# -----------------------------------------------------------------------------
# CI's share of the slow Ray drills


def pytest_addoption(parser):
    parser.addoption(
        "--drill-shard", default=None, metavar="I/N",
        help="of the selected `slow` tests not marked `core`, keep only shard I of N (0 <= I < N: sorted by "
             "test id, every N-th from the I-th); the `core` ones and every test not `slow` stay")


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the shards split what was selected
def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--drill-shard")
    if shard is None:
        return
    try:
        kept, dropped = shards.split(items, shard)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
