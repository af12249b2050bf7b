"""The run's custom metrics reach Ray's Prometheus export with the values of metrics.jsonl."""

import json
import socket
import time
import urllib.request

import pytest
import ray

from megaslide_ray.driver import Trainer
from megaslide_ray.runtime.metrics import STEP_GAUGES, VAL_GAUGES


@pytest.fixture(scope="module")
def metrics_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _metrics_export_port=port, namespace="megaslide",
             logging_level="ERROR")
    yield port
    ray.shutdown()


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("ray_megaslide_") and 'run="metricsrun"' in line:
            values[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return values


@pytest.mark.slow  # about 21 s of Ray drill: the default run keeps it under 10 minutes
def test_megaslide_metrics_are_exported(metrics_port, small_config, manifest, tmp_path):
    cfg = small_config(**{"training.steps": 2, "training.eval_every": 2, "data.val_manifest": manifest,
                          "training.val_clips": 1, "training.val_t_buckets": 2})
    trainer = Trainer(cfg, run_dir=str(tmp_path / "metricsrun"), progress=False)
    try:
        trainer.train()
    finally:
        trainer.close()
    last = json.loads((tmp_path / "metricsrun" / "metrics.jsonl").read_text().splitlines()[-1])
    wanted = {f"ray_{name}" for name, _ in [*STEP_GAUGES.values(), *VAL_GAUGES.values()]} | {
        "ray_megaslide_host_state_bytes", "ray_megaslide_decoder_frames_per_second", "ray_megaslide_val_loss_bucket"}
    deadline = time.monotonic() + 60  # Ray reports metrics every few seconds
    values: dict[str, float] = {}
    while time.monotonic() < deadline and not wanted <= values.keys():
        time.sleep(2)
        values = _scrape(metrics_port)
    assert wanted <= values.keys(), f"missing: {sorted(wanted - values.keys())}"
    assert values["ray_megaslide_step"] == 2
    assert values["ray_megaslide_loss"] == pytest.approx(last["loss"], rel=1e-6)
    assert values["ray_megaslide_val_loss"] == pytest.approx(last["val_loss"], rel=1e-6)
    assert values["ray_megaslide_tokens_per_second"] > 0
    assert values["ray_megaslide_host_state_bytes"] > 0
    assert values["ray_megaslide_decoder_frames_per_second"] > 0
    assert values["ray_megaslide_device_memory_peak_bytes"] > 0
    assert values["ray_megaslide_d2h_bytes"] > 0  # gradients always return to the store
