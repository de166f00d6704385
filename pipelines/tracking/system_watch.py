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
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from pipelines.errors import warn_user

GAPS_TAG = "system_metrics.gaps"
GAP_METRIC = "system_metrics_gap_s"

# What the restart reads of MLflow's `SystemMetricsMonitor`, which keeps it private (checked on MLflow 3.17; pyproject
# does not pin MLflow): `_process`, its sampling thread (None before `start` and after `finish`), ended once the
# server stopped answering; `_logging_step`, the step its next sample is published at; `mlflow_logger`, the buffer
# its samples wait in until `flush`. tests/pipelines/test_system_watch.py asserts that meaning on the installed
# MLflow, so an upgrade that moves one fails a test; a run on such an MLflow keeps MLflow's monitor without restarts
# and says so once (`missing_internals`), rather than taking every check for a dead monitor and starting another.
RELIED_ON: dict[str, Callable[[Any], bool]] = {
    "_process": lambda value: value is None or isinstance(value, threading.Thread),
    "_logging_step": lambda value: isinstance(value, int),
    "mlflow_logger": lambda value: callable(getattr(value, "flush", None)),
}
_WARNED = threading.Event()  # the missing internals are said once per process, not once per trial


def missing_internals(monitor: Any) -> list[str]:
    """The names in `RELIED_ON` that `monitor` lacks or holds something else under (empty: the restart can work)."""
    return [name for name, fits in RELIED_ON.items() if not hasattr(monitor, name) or not fits(getattr(monitor, name))]


class SystemWatch:
    """MLflow's system-metrics monitor of `run_id`, restarted after an outage; `finish()` stops it and records the
    gaps."""

    def __init__(self, run_id: str, tracking_uri: str, interval_s: float = 5.0) -> None:
        self.run_id, self.tracking_uri, self.interval_s = run_id, tracking_uri, interval_s
        self.gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        # Held while the watcher swaps monitors and while `finish` takes the last one: `finish` then stops the
        # monitor that samples, never one about to be replaced by a monitor nobody stops.
        self._lock = threading.Lock()
        self.monitor = self._start_monitor(step=0)
        missing = missing_internals(self.monitor)
        self._restartable = not missing
        self._watcher: threading.Thread | None = None
        if missing:
            if not _WARNED.is_set():
                _WARNED.set()
                warn_user(
                    f"this MLflow's SystemMetricsMonitor lacks {', '.join(missing)} (checked on MLflow 3.17): system "
                    "metrics are sampled without restarts, so a tracking-server outage ends them for the run"
                )
            return
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="SystemWatch")
        self._watcher.start()

    def _start_monitor(self, step: int) -> Any:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.interval_s, tracking_uri=self.tracking_uri)
        if step:
            monitor._logging_step = step  # go on from the step the stopped monitor reached (RELIED_ON)
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
            thread = self.monitor._process  # only this thread replaces the monitor: read without the lock
            if thread is not None and thread.is_alive():
                continue
            lost_at = time.time()
            status = self._run_status()
            while status is None and not self._stop.wait(self.interval_s):
                status = self._run_status()
            with self._lock:  # `finish` sets the stop before it takes the lock: no monitor starts after it
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
        if self._watcher is not None:
            self._watcher.join(timeout=2 * self.interval_s)
        with self._lock:  # waits out a swap under way: the monitor taken here is the last one
            monitor, first_step, gaps = self.monitor, self._first_step, list(self.gaps)
        monitor.finish()
        if self._restartable and (gaps or monitor._logging_step == first_step):
            # MLflow's monitor publishes after each interval and drops what it sampled since at `finish`: a run
            # shorter than the interval (a small trial on a GPU) had no system metrics at all, and a monitor
            # restarted near the run's end after an outage none past it. One last sample, published.
            try:
                monitor.collect_metrics()
                monitor.publish_metrics(monitor.aggregate_metrics())
            except Exception:  # noqa: BLE001 - best effort, like the monitor itself
                pass
            _send_buffered(monitor)
        if gaps:
            self._record_gaps(gaps)

    def _record_gaps(self, gaps: list[tuple[float, float]]) -> None:
        """The gaps on the run: their spans as a tag, their total as a metric."""
        from mlflow.tracking import MlflowClient

        spans = "; ".join(f"{_utc(start)} to {_utc(end)}" for start, end in gaps)
        try:
            client = MlflowClient(self.tracking_uri)
            client.set_tag(self.run_id, GAPS_TAG, f"not sampled (tracking server unreachable): {spans} UTC")
            client.log_metric(self.run_id, GAP_METRIC, sum(end - start for start, end in gaps))
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
