"""Custom Ray metrics for a run (``ray.util.metrics``), tagged by run name.

Ray exports them with its own metrics (Prometheus text at each node's metrics export port,
shown in the dashboard's Metrics view when Prometheus/Grafana are set up), prefixed ``ray_``:
``ray_megaslide_loss{run="..."}`` and so on. Recorded by the driver once per step (the
validation losses when a step evaluated: ``ray_megaslide_val_loss`` and
``ray_megaslide_val_loss_bucket{bucket="0"}`` ...).
"""

from __future__ import annotations

from ray.util.metrics import Gauge

# metrics.jsonl field -> (metric name, description)
STEP_GAUGES = {
    "step": ("megaslide_step", "optimizer steps completed"),
    "loss": ("megaslide_loss", "training loss of the last step"),
    "lr": ("megaslide_learning_rate", "learning rate of the last step"),
    "grad_norm": ("megaslide_grad_norm", "global gradient L2 norm before clipping"),
    "tokens_per_s": ("megaslide_tokens_per_second", "tokens trained per second (wall clock)"),
    "step_seconds": ("megaslide_step_seconds", "wall-clock seconds of the last step"),
    "compute_seconds": ("megaslide_compute_seconds", "compute actor seconds of the last step"),
    "weight_wait_seconds": ("megaslide_weight_wait_seconds",
                            "seconds the compute actor was blocked on a shard version or transfer"),
    "optimizer_seconds": ("megaslide_optimizer_seconds", "seconds of the store's AdamW for the last step"),
    "data_wait_seconds": ("megaslide_data_wait_seconds", "seconds the compute actor waited for the batch"),
    "h2d_bytes": ("megaslide_h2d_bytes", "weight bytes copied host->device in the last step"),
    "h2d_gbps": ("megaslide_h2d_gbps", "GB/s of those copies"),
    "d2h_bytes": ("megaslide_d2h_bytes", "gradient bytes returned device->host in the last step"),
    "d2h_gbps": ("megaslide_d2h_gbps", "GB/s of those returns"),
    "device_memory_peak_bytes": ("megaslide_device_memory_peak_bytes",
                                 "compute actor peak memory (CUDA: max allocated; CPU: peak RSS)"),
    "reduce_seconds": ("megaslide_reduce_seconds",
                       "seconds the store spent summing the compute actors' gradients (several actors)"),
    "skipped_files": ("megaslide_skipped_files", "video files skipped as unreadable so far"),
    "data_position": ("megaslide_data_position", "manifest draws consumed so far"),
}
# Several compute actors: one series per actor (tag ``actor``), from metrics.jsonl's ``compute_actors``.
ACTOR_GAUGES = {
    "compute_seconds": ("megaslide_actor_step_seconds", "one compute actor's time for the last step"),
    "weight_wait_seconds": ("megaslide_actor_weight_wait_seconds",
                            "seconds one compute actor was blocked on a shard version or transfer"),
    "data_wait_seconds": ("megaslide_actor_data_wait_seconds", "seconds one compute actor waited for its batch"),
    "grad_slot_wait_seconds": ("megaslide_actor_grad_slot_wait_seconds",
                               "seconds one compute actor waited for a free gradient slot"),
}
# Set only by the steps that evaluate (training.eval_every).
VAL_GAUGES = {
    "val_loss": ("megaslide_val_loss", "validation loss at the last evaluation (training.eval_every)"),
}


class RunMetrics:
    def __init__(self, run: str, host_state_bytes: int | None = None):
        self.tags = {"run": run}
        self.gauges = {key: Gauge(name, description=desc, tag_keys=("run",))
                       for key, (name, desc) in {**STEP_GAUGES, **VAL_GAUGES}.items()}
        if host_state_bytes is not None:
            Gauge("megaslide_host_state_bytes", description="bytes of model state held by the parameter store",
                  tag_keys=("run",)).set(float(host_state_bytes), tags=self.tags)
        self.val_bucket = Gauge("megaslide_val_loss_bucket",
                                description="validation loss of one t-bucket at the last evaluation",
                                tag_keys=("run", "bucket"))
        self.actor_gauges = {key: Gauge(name, description=desc, tag_keys=("run", "actor"))
                             for key, (name, desc) in ACTOR_GAUGES.items()}
        self.decoder_fps = Gauge("megaslide_decoder_frames_per_second",
                                 description="frames decoded per second of decoding, all decoders",
                                 tag_keys=("run",))

    def record_decoders(self, frames_per_second: float) -> None:
        self.decoder_fps.set(float(frames_per_second), tags=self.tags)

    def record(self, row: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in row and row[key] is not None:
                gauge.set(float(row[key]), tags=self.tags)
        for actor in row.get("compute_actors", ()):
            tags = {**self.tags, "actor": str(actor["rank"])}
            for key, gauge in self.actor_gauges.items():
                gauge.set(float(actor[key]), tags=tags)
        for key, value in row.items():  # val_loss_t0, val_loss_t1, ...: one series per bucket
            if key.startswith("val_loss_t") and key[10:].isdigit():
                self.val_bucket.set(float(value), tags={**self.tags, "bucket": key[10:]})
