"""A trial shorter than the system-metrics interval still has its system metrics (a small trial on a GPU ends in
seconds; MLflow's monitor publishes only after each interval and drops what it sampled at `finish`)."""

from __future__ import annotations

import time
from pathlib import Path

from mlflow.tracking import MlflowClient

from pipelines.tracking.system_watch import SystemWatch


def test_a_run_shorter_than_the_interval_gets_its_system_metrics(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    run_id = client.create_run(client.create_experiment("short")).info.run_id
    watch = SystemWatch(run_id, uri, interval_s=30.0)  # the run ends long before the first interval does
    time.sleep(1.0)
    watch.finish()
    client.set_terminated(run_id)
    metrics = client.get_run(run_id).data.metrics
    assert 0 <= metrics["system/cpu_utilization_percentage"] <= 100, metrics
    assert metrics["system/system_memory_usage_megabytes"] > 0
    history = client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert [m.step for m in history] == [0]  # one sample published, once
