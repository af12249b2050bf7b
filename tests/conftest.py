"""Shared fixtures: one Ray session per test module that asks for it, a small demo dataset,
and a small model config that still exercises every part of the pipeline."""

import pytest
import ray

from megaslide_ray.config import build_config
from megaslide_ray.demo_data import ensure_demo_dataset

SMALL = {"model.depth": 2, "model.hidden_size": 64, "model.num_heads": 2, "model.caption_dim": 32,
         "model.patch_size": "2,8,8", "data.num_frames": 8, "data.height": 32, "data.width": 32,
         "data.batch_size": 2, "attention.window": "3,3,3", "training.log_every": 1}


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
