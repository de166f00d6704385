"""A tracking server that refuses a request is not down: tell the two apart by what MLflow says, and keep what an
outage left on disk until it is delivered.

MLflow maps each error to an HTTP status (`MlflowException.get_http_status_code`: its error code, or the server's
status where the body was no JSON). A 4xx (a bad metric name: INVALID_PARAMETER_VALUE; a missing run; a permission)
is a refusal: the same request fails again, so waiting out an "outage" (120 s, then a fallback file and a run left
KILLED with NaN metrics) only hides the cause. A refusal fails the run at once, FAILED, with MLflow's message and the
key. Connection errors and timeouts (MLflow's client raises them as INTERNAL_ERROR, 500), 5xx, 408 and 429 are an
outage, retried as before; anything that is not an `MlflowException` (a socket error, SQLite's lock) too.

What a lasting outage could not deliver is written to `mlflow-fallback/<run id>.json`; the next `train` replays each
such file into its run (`replay_fallbacks`) and deletes it once delivered, so a metric already delivered is never
sent twice.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pipelines.atomic import atomic_write_text
from pipelines.errors import UserError

FALLBACK_DIR = "mlflow-fallback"  # under the repository root (TrialContext.fallback_dir)
RETRIED_4XX = (408, 429)  # a timeout and a rate limit: the same request may pass later


class TrackingRefused(UserError):
    """The tracking server refused a request (a 4xx): retrying cannot help."""


def is_refusal(err: BaseException) -> bool:
    """Whether MLflow says the request itself is wrong (a 4xx other than 408/429), not that the store is away."""
    from mlflow.exceptions import MlflowException

    if not isinstance(err, MlflowException):
        return False
    status = err.get_http_status_code()
    return 400 <= status < 500 and status not in RETRIED_4XX


def bad_key(keys: Iterable[str]) -> str | None:
    """The first key MLflow's own validation refuses as a metric name, or None."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_metric_name

    for key in keys:
        try:
            _validate_metric_name(key)
        except MlflowException:
            return key
    return None


def refused(err: BaseException, run_id: str, keys: Iterable[str]) -> TrackingRefused:
    """The error for a refused request about `keys` of `run_id`: MLflow's message and the key it names."""
    key = bad_key(keys)
    named = f" (key {key!r})" if key else ""
    first = str(err).splitlines()[0][:600] if str(err) else type(err).__name__
    return TrackingRefused(
        f"the tracking server refused a request for run {run_id}{named}: {first}. This is no outage (a retry "
        "would be refused again); the run is closed FAILED"
    )


def write_fallback(folder: Path, record: dict[str, Any]) -> Path:
    """Keep what an outage left undelivered (a run's metrics, tags and final status) as `<folder>/<run id>.json`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record['run_id']}.json"
    atomic_write_text(path, json.dumps(record) + "\n")
    return path


def replay_fallbacks(client: Any, folder: Path, say: Callable[[str], None]) -> int:
    """Deliver each fallback file in `folder` into its run (metrics in chunks, the file rewritten after each so a
    chunk is never sent twice; then tags and the final status) and delete it; returns how many runs were replayed.
    A file whose run the store refuses (deleted) is kept and named; an outage leaves the rest for the next train."""
    from mlflow.entities import Metric, RunTag

    replayed = 0
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = json.loads(path.read_text(encoding="utf-8"))
        run_id = record["run_id"]
        try:
            while record["metrics"]:
                chunk, rest = record["metrics"][:1000], record["metrics"][1000:]
                client.log_batch(run_id, metrics=[Metric(**m) for m in chunk], synchronous=True)
                record["metrics"] = rest
                write_fallback(folder, record)  # delivered: never sent again, even if the next chunk fails
            if record.get("tags"):
                client.log_batch(run_id, tags=[RunTag(k, v) for k, v in record["tags"].items()], synchronous=True)
            if record.get("status"):
                client.set_terminated(run_id, status=record["status"])
        except Exception as err:  # noqa: BLE001 - kept on disk either way; said, not raised: training goes on
            why = "refused" if is_refusal(err) else "still unreachable"
            say(f"{path}: not replayed into run {run_id}, the store {why} ({str(err).splitlines()[0][:200]})")
            continue
        path.unlink()
        replayed += 1
        say(f"replayed {path.name} into MLflow run {run_id} (what a tracking outage had kept on disk)")
    return replayed
