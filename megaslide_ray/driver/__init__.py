"""The driver: the Trainer loop and the components it delegates to (checkpointing, validation,
sampling, metrics), and the launch of a training run (Ray, signals, exit codes)."""

from megaslide_ray.driver.components import BadStepsError
from megaslide_ray.driver.loop import Trainer, TrainSummary, resolve_data

__all__ = ["BadStepsError", "TrainSummary", "Trainer", "resolve_data"]
