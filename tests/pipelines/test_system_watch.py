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


def new_run(tmp_path: Path) -> tuple[MlflowClient, str, str]:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    return client, uri, client.create_run(client.create_experiment("watched")).info.run_id


def test_the_installed_mlflows_monitor_has_the_private_names_the_restart_reads_with_their_meaning(tmp_path: Path):
    """An MLflow upgrade that renames or changes one of them fails here, not in a run."""
    import threading

    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    from pipelines.tracking.system_watch import RELIED_ON, missing_internals

    client, uri, run_id = new_run(tmp_path)
    monitor = SystemMetricsMonitor(run_id, sampling_interval=30.0, tracking_uri=uri)  # no sample of its own here
    assert set(RELIED_ON) == {"_process", "_logging_step", "mlflow_logger"} and missing_internals(monitor) == []
    # `_logging_step`: the step the next published sample gets, one more after each; `mlflow_logger`: the buffer
    # those samples wait in, sent by its `flush`.
    assert monitor._process is None and monitor._logging_step == 0
    monitor._logging_step = 7
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())
    assert monitor._logging_step == 8
    monitor.mlflow_logger.flush()  # sent now, if its own batching had not sent it yet
    assert [m.step for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")] == [7]
    # `_process`: the sampling thread, alive while it samples; None again once the monitor is finished.
    monitor.start()
    assert isinstance(monitor._process, threading.Thread) and monitor._process.is_alive()
    thread = monitor._process
    monitor.finish()
    assert monitor._process is None and not thread.is_alive()


def test_a_monitor_swap_under_way_when_the_run_finishes_leaves_no_monitor_sampling(tmp_path: Path):
    """`finish()` waits out the watcher's swap (a lock), so it stops the monitor that samples, not the one replaced.
    The swap is made slow here (a new monitor taking longer to start than `finish` waits for the watcher)."""
    import threading

    from pipelines.tracking.system_watch import GAPS_TAG

    started: list = []
    restarting = threading.Event()

    class SlowRestart(SystemWatch):
        def _start_monitor(self, step: int):
            if started:  # a restart, not the first monitor
                restarting.set()
                time.sleep(2.0)  # longer than finish()'s join (2 x 0.5 s)
            started.append(super()._start_monitor(step))
            return started[-1]

    client, uri, run_id = new_run(tmp_path)
    watch = SlowRestart(run_id, uri, interval_s=0.5)
    watch.monitor.finish()  # its thread ends while the run is RUNNING: the watcher restarts it
    assert restarting.wait(timeout=30)  # the watcher is inside the slow restart now
    watch.finish()
    time.sleep(2.5)  # past the end of the slow restart, however it went
    client.set_terminated(run_id)
    assert len(started) == 2  # the first monitor and one restart
    sampling = [m for m in started if isinstance(m._process, threading.Thread) and m._process.is_alive()]
    assert sampling == [], "a monitor started after finish() returned and nobody stops it"
    assert client.get_run(run_id).data.tags[GAPS_TAG].startswith("not sampled (tracking server unreachable): ")


def test_an_mlflow_without_the_private_names_samples_without_restarts_and_says_so_once(tmp_path: Path, monkeypatch,
                                                                                        capsys):  # fmt: skip
    """Where the monitor lacks a name the restart reads (an MLflow that renamed it; simulated by asking for one it
    lacks), nothing restarts it: one warning, MLflow's monitor as it is."""
    import threading

    from pipelines.tracking import system_watch

    monkeypatch.setitem(system_watch.RELIED_ON, "_renamed_later", lambda value: True)
    monkeypatch.setattr(system_watch, "_WARNED", threading.Event())
    client, uri, run_id = new_run(tmp_path)
    watches = [SystemWatch(run_id, uri, interval_s=0.3) for _ in range(2)]  # two trials in one process
    first = watches[0].monitor
    first.finish()  # ended while the run is RUNNING: a restartable watch would start another within 0.3 s
    time.sleep(1.2)
    assert watches[0].monitor is first and watches[0].gaps == []
    for watch in watches:
        watch.finish()
    client.set_terminated(run_id)
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "SystemMetricsMonitor lacks" in ln]
    assert warnings == ["warning: this MLflow's SystemMetricsMonitor lacks _renamed_later (checked on MLflow 3.17): "
                        "system metrics are sampled without restarts, so a tracking-server outage ends them for the "
                        "run"]  # fmt: skip
