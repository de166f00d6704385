"""A run's metrics sent in batches from a background thread, surviving tracking outages and failing fast on a
store's refusal (`pipelines.tracking.refusals`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient

from pipelines.tracking.refusals import TrackingRefused, bad_key, is_refusal, refused, write_fallback

_MAX_METRICS_PER_BATCH = 1000  # MLflow's limit for log_batch


class RunLogger:
    """Sends one run's metrics in batches from a background thread, surviving tracking outages.

    Training only appends to a buffer. A sender thread ships a batch every `flush_every` points
    (one request per batch, not per point); when the store is unreachable it keeps the points
    and retries with backoff. `close` waits up to `outage_timeout_s` for the store to come back,
    then writes whatever it could not deliver to a local JSON fallback file and says where.
    Nothing is lost either way. Tags go out immediately; a failed tag is kept and sent at close.
    """

    def __init__(
        self,
        client: MlflowClient,
        run_id: str,
        flush_every: int = 200,
        fallback_dir: Path | None = None,
        outage_timeout_s: float = 120.0,
        say: Callable[[str], None] = print,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.flush_every = flush_every
        self.fallback_dir = fallback_dir
        self.outage_timeout_s = outage_timeout_s
        self.say = say
        self._pending: list[Metric] = []
        self._pending_tags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._offline = False
        self._refused: Exception | None = None
        self._refusal_raised = False
        self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-{run_id[:8]}", daemon=True)
        self._sender.start()

    def log_dict(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Queue metrics at `step`; the sender ships them once `flush_every` have piled up. Raises the store's
        refusal (`TrackingRefused`) of an earlier batch: training stops at once, not after an outage's wait."""
        self._raise_refusal()
        now = int(time.time() * 1000)
        with self._lock:
            self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
            if len(self._pending) >= self.flush_every:
                self._wake.set()

    def log_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags now; if the store is unreachable they are kept and sent at close."""
        tags = {k: str(v) for k, v in tags.items()}
        try:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        except Exception:  # noqa: BLE001 - any transport or server error: keep the tags for later
            with self._lock:
                self._pending_tags.update(tags)

    def flush(self) -> None:
        """Ask the sender to ship what is queued now (it does not wait for the store)."""
        self._wake.set()

    def _raise_refusal(self) -> None:
        if self._refused is not None and not self._refusal_raised:
            self._refusal_raised = True
            raise self._refused

    def _send_pending(self) -> bool:
        with self._lock:
            count, tags = len(self._pending), dict(self._pending_tags)
        sent, chunk = 0, []
        try:
            while sent < count:
                with self._lock:
                    chunk = self._pending[: min(_MAX_METRICS_PER_BATCH, count - sent)]
                self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
                with self._lock:  # delivered: out of the buffer now, so a retry never sends it twice
                    del self._pending[: len(chunk)]
                sent += len(chunk)
            if tags:
                chunk = []
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        except Exception as err:  # noqa: BLE001 - an outage is retried; a refusal (4xx) is not
            if is_refusal(err):
                self._refuse(err, chunk, tags)
                return True
            if not self._offline:
                self.say(f"tracking store unreachable ({type(err).__name__}); buffering metrics and retrying")
            self._offline = True
            return False
        with self._lock:
            for key in tags:
                self._pending_tags.pop(key, None)
        if self._offline:
            self.say(f"tracking store reachable again; delivered {sent} buffered metrics")
        self._offline = False
        return True

    def _refuse(self, err: Exception, chunk: list[Metric], tags: dict[str, str]) -> None:
        """Keep the store's refusal to raise, and drop what it refused: the metrics whose names MLflow's own check
        refuses (the rest of their batch is sent again), or the whole request where none is named."""
        self._refused = self._refused or refused(err, self.run_id, [m.key for m in chunk] or list(tags))
        with self._lock:
            if not chunk:
                for key in tags:
                    self._pending_tags.pop(key, None)
                return
            bad = {key for key in {m.key for m in chunk} if bad_key([key]) is not None}
            kept = [m for m in chunk if m.key not in bad] if bad else []
            self._pending[: len(chunk)] = kept

    def _send_loop(self) -> None:
        backoff = 1.0
        while not self._closing:
            self._wake.wait(timeout=backoff if self._offline else 30.0)
            self._wake.clear()
            if self._closing:
                return
            if self._pending or self._pending_tags:
                backoff = 1.0 if self._send_pending() else min(backoff * 2, 15.0)

    def close(self, status: str | None = "FINISHED") -> None:
        """Deliver everything and end the run with `status`; on a lasting outage, write the fallback file.

        With `status=None` the run is left open: another process (a distributed trial's driver) ends it.
        """
        self._closing = True
        self._wake.set()
        self._sender.join(timeout=60)
        deadline = time.monotonic() + self.outage_timeout_s
        while True:
            while self._pending or self._pending_tags:  # a refused request leaves the rest to send
                if not self._send_pending():
                    break
            if not (self._pending or self._pending_tags):
                try:
                    status = "FAILED" if self._refused is not None and status is not None else status
                    if status is not None:
                        self.client.set_terminated(self.run_id, status=status)
                    self._raise_refusal()
                    return
                except TrackingRefused:
                    raise
                except Exception:  # noqa: BLE001 - lost again between the two calls: retry below
                    pass
            if time.monotonic() >= deadline:
                break
            time.sleep(2.0)
        self._write_fallback(status)
        self._raise_refusal()

    def _write_fallback(self, status: str | None) -> None:
        record = {
            "run_id": self.run_id,
            "status": status,
            "tags": self._pending_tags,
            "metrics": [
                {"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in self._pending
            ],
        }
        path = write_fallback(self.fallback_dir or Path.cwd(), record)
        self.say(
            f"tracking store still unreachable after {self.outage_timeout_s:.0f} s: {len(self._pending)} metrics and "
            f"the final status ({status}) of run {self.run_id} were written to {path}"
        )
