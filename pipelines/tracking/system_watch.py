"""A trial's system metrics (CPU, memory, GPU) that survive the tracking server going away, or say what they missed.

MLflow's `SystemMetricsMonitor` samples every few seconds and stops for good the first time the server does not
answer (seen: "too many 503 error responses" while a team's server restarted; the run then had one sample, from
before the outage). `SystemWatch` runs that monitor and watches it: when its thread has ended while the run is
still RUNNING, it waits until the server answers again and starts a new monitor that goes on from the same step.
What was not sampled is recorded on the run: the tag `system_metrics.gaps` (each gap's UTC start and end) and the
metric `system_metrics_gap_s` (their total).
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime
from typing import Any

GAPS_TAG = "system_metrics.gaps"
GAP_METRIC = "system_metrics_gap_s"


class SystemWatch:
    """MLflow's system-metrics monitor of `run_id`, restarted after an outage; `finish()` stops it and records the
    gaps."""

    def __init__(self, run_id: str, tracking_uri: str, interval_s: float = 5.0) -> None:
        self.run_id, self.tracking_uri, self.interval_s = run_id, tracking_uri, interval_s
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self.monitor = self._start_monitor(step=0)
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="SystemWatch")
        self._watcher.start()

    def _start_monitor(self, step: int) -> Any:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.interval_s, tracking_uri=self.tracking_uri)
        monitor._logging_step = step  # go on from the step the stopped monitor reached (MLflow keeps it private)
        self._first_step = step
        monitor.start()
        return monitor

    def _run_status(self) -> str | None:
        """The run's status, or None while the server does not answer."""
        from mlflow.tracking import MlflowClient

        try:
            return MlflowClient(self.tracking_uri).get_run(self.run_id).info.status
        except Exception:  # noqa: BLE001 - any failure means "not reachable yet"
            return None

    def _watch(self) -> None:
        while not self._stop.wait(self.interval_s):
            thread = getattr(self.monitor, "_process", None)
            if thread is not None and thread.is_alive():
                continue
            lost_at = time.time()
            status = self._run_status()
            while status is None and not self._stop.wait(self.interval_s):
                status = self._run_status()
            self.gaps.append((lost_at, time.time()))  # the server answers again, or the run is ending
            if self._stop.is_set() or status != "RUNNING":
                return
            stopped = self.monitor
            self.monitor = self._start_monitor(stopped._logging_step)
            _send_buffered(stopped)  # what it sampled before the outage and could not send

    def finish(self) -> None:
        """Stop watching and sampling; record the gaps on the run (best effort: the run's results do not depend on
        it)."""
        self._stop.set()
        self._watcher.join(timeout=2 * self.interval_s)
        self.monitor.finish()
        if self.gaps or self.monitor._logging_step == self._first_step:
            # MLflow's monitor publishes after each interval and drops what it sampled since at `finish`: a run
            # shorter than the interval (a small trial on a GPU) had no system metrics at all, and a monitor
            # restarted near the run's end after an outage none past it. One last sample, published.
            try:
                self.monitor.collect_metrics()
                self.monitor.publish_metrics(self.monitor.aggregate_metrics())
            except Exception:  # noqa: BLE001 - best effort, like the monitor itself
                pass
            _send_buffered(self.monitor)
        if not self.gaps:
            return
        from mlflow.tracking import MlflowClient

        spans = "; ".join(f"{_utc(start)} to {_utc(end)}" for start, end in self.gaps)
        try:
            client = MlflowClient(self.tracking_uri)
            client.set_tag(self.run_id, GAPS_TAG, f"not sampled (tracking server unreachable): {spans} UTC")
            client.log_metric(self.run_id, GAP_METRIC, sum(end - start for start, end in self.gaps))
        except Exception:  # noqa: BLE001 - the server is gone again: nothing more can be said to it
            pass


def _send_buffered(monitor: Any) -> None:
    """Send the samples a monitor recorded but had not sent (best effort)."""
    try:
        monitor.mlflow_logger.flush()
    except Exception:  # noqa: BLE001 - the server is gone again
        pass


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%H:%M:%S")
