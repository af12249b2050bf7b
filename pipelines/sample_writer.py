"""Wiring of the sample writer (``actors.sample_writer``): its Ray actor, placed and named.

It asks for no CPU of Ray's (it works only while a sample decodes, and a CPU reserved for it
would be taken from the compute actor's share on a small machine) and no GPU: with
``training.sample_device = cuda`` it uses the GPU the compute actor holds, and the driver lets
it run only between steps (``driver.components.Sampler``)."""

from __future__ import annotations

from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.sample_writer import SampleWriter
from megaslide_ray.config import Config
from megaslide_ray.data.demo import DEMO_FPS
from pipelines.streaming import NAMESPACE, actor_options


def sample_fps(cfg: Config) -> int:
    """The frame rate the samples are written at: ``data.fps`` when the clips were sampled at one,
    else the demo set's."""
    return max(1, round(cfg.data.fps)) if cfg.data.fps > 0 else DEMO_FPS


def start_sample_writer(cfg: Config, run_dir: str | Path, model_dir: Path | None):
    """The run's sample writer actor (``NAMESPACE/sample-writer``), started and ready, on the
    driver's node: it writes into the run directory the driver reads (and, with ``cuda``, uses the
    GPU of the compute actor beside it)."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(SampleWriter).options(name=f"{NAMESPACE}/sample-writer", num_cpus=0, num_gpus=0,
                                             scheduling_strategy=here, **actor_options()).remote(
        str(run_dir), str(model_dir) if model_dir is not None else None, cfg.training.sample_device, sample_fps(cfg))
    ray.get(actor.__ray_ready__.remote())  # a writer that cannot start says so here, before training
    return actor
