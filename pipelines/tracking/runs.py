"""MLflow tracking: store resolution, the run tree, and buffered metric logging.

Only `MlflowClient` is used (no `mlflow.start_run` global state), because runs are
written from several processes: the train stage makes the parent run, each Ray trial
its child run, and evaluate adds to the best trial's run afterwards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from pipelines.errors import UserError
from pipelines.params import Params, TrackingParams, flatten_params
from pipelines.tracking.access import check_can_write, refusal

_MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for log_batch
_MAX_METRICS_PER_BATCH = 1000
_PARAM_VALUE_LIMIT = 6000


def resolve_tracking_uri(uri: str, root: Path) -> str:
    """Make relative sqlite/file stores absolute against `root`, so trials and DVC temp copies share one store."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        return f"sqlite:///{path if path.is_absolute() else (root / path).resolve()}"
    if uri.startswith("file:"):
        path = Path(uri.removeprefix("file://").removeprefix("file:"))
        return (path if path.is_absolute() else (root / path).resolve()).as_uri()
    if "://" not in uri:
        path = Path(uri)
        return (path if path.is_absolute() else (root / path).resolve()).as_uri()
    return uri


def artifact_root(tracking_uri: str, root: Path) -> str | None:
    """Where a new experiment's artifacts go: beside the repo for local stores, the server's choice otherwise."""
    if tracking_uri.startswith(("sqlite:", "file:")):
        return (root / "mlartifacts").resolve().as_uri()
    return None


def tls_context() -> ssl.SSLContext:
    """The TLS checks MLflow's own client makes, from its variables: the probe trusts a server (a self-signed or a
    private CA's certificate, MLFLOW_TRACKING_SERVER_CERT_PATH) exactly when MLflow's client will."""
    from mlflow import environment_variables as variables

    if variables.MLFLOW_TRACKING_INSECURE_TLS.get():
        return ssl._create_unverified_context()  # the user turned verification off for MLflow: so for the probe
    context = ssl.create_default_context(cafile=variables.MLFLOW_TRACKING_SERVER_CERT_PATH.get())
    if client_cert := variables.MLFLOW_TRACKING_CLIENT_CERT_PATH.get():
        context.load_cert_chain(client_cert)  # a server that asks for the client's certificate (mutual TLS)
    return context


def check_server(configured: str, uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds when a tracking server does not answer (MLflow's own client retries for minutes)."""
    try:
        context = tls_context() if uri.startswith("https://") else None
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s, context=context) as response:
            if response.status == 200:
                return
            problem = f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        problem = f"HTTP {err.code}"
    except OSError as err:
        problem = str(getattr(err, "reason", err))
    raise UserError(
        f"tracking.uri = {configured!r}: the MLflow server is unreachable ({problem}); start it "
        "(mlflow server --host 127.0.0.1 --port PORT) or use the default sqlite:///mlflow.db"
    )


# MLflow 3's UI read an experiment's kind from this tag (without it, it may guess "GenAI": traces, judges, prompts;
# model training opens on runs, metrics and models). 3.17's toggle ignores it: see `status.runs_page_line`.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def open_experiment(tracking: TrackingParams, root: Path) -> tuple[MlflowClient, str]:
    """Return a client and the experiment id, creating the experiment once if needed, marked as model training."""
    uri = resolve_tracking_uri(tracking.uri, root)
    if uri.startswith(("http://", "https://")):
        check_server(tracking.uri, uri)
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(tracking.experiment)
        if experiment is None:
            try:
                client.create_experiment(
                    tracking.experiment,
                    artifact_location=artifact_root(uri, root),
                    tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND},
                )
            except Exception:  # noqa: BLE001 - another process created it first
                pass
            experiment = client.get_experiment_by_name(tracking.experiment)
            if experiment is None:
                raise RuntimeError(f"experiment {tracking.experiment!r} could not be created")
        if EXPERIMENT_KIND_TAG not in experiment.tags or uri.startswith(("http://", "https://")):
            # Made before this tag or by another tool; on a server, also the write a user without permission is
            # refused now rather than in every trial.
            check_can_write(client, experiment.experiment_id, (EXPERIMENT_KIND_TAG, EXPERIMENT_KIND), tracking)
        return client, experiment.experiment_id
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure here means the store is unusable
        if (explained := refusal(err, tracking)) is not None:  # wrong credentials, or no right to create it
            raise explained from None
        raise UserError(
            f"tracking.uri = {tracking.uri!r}: the MLflow store is unreachable or unusable "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None


def params_hash(params: Params) -> str:
    """A short, stable hash of the validated params (tags runs made from the same settings)."""
    blob = json.dumps(params.model_dump(mode="json"), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def git_commit(root: Path) -> str:
    """The repository's HEAD commit, or 'unknown' outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def log_params(client: MlflowClient, run_id: str, params: Params) -> None:
    """Log every validated param under its flattened dotted key, in batches."""
    items = [
        Param(key, json.dumps(value) if isinstance(value, dict | list) else str(value))
        for key, value in flatten_params(params).items()
    ]
    items = [Param(p.key, p.value[:_PARAM_VALUE_LIMIT]) for p in items]
    for i in range(0, len(items), _MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + _MAX_PARAMS_PER_BATCH], synchronous=True)


def leave_retries_to_run_logger() -> None:
    """Turn off MLflow's own HTTP retries in this process: RunLogger retries on its own thread,
    where MLflow's built-in retries would block training for minutes."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "10"


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
        self._sender = threading.Thread(target=self._send_loop, name=f"mlflow-{run_id[:8]}", daemon=True)
        self._sender.start()

    def log_dict(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Queue metrics at `step`; the sender ships them once `flush_every` have piled up."""
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

    def _send_pending(self) -> bool:
        with self._lock:
            batch, tags = list(self._pending), dict(self._pending_tags)
        try:
            for i in range(0, len(batch), _MAX_METRICS_PER_BATCH):
                self.client.log_batch(self.run_id, metrics=batch[i : i + _MAX_METRICS_PER_BATCH], synchronous=True)
            if tags:
                self.client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
        except Exception as err:  # noqa: BLE001 - the store is down or refusing: keep everything, retry later
            if not self._offline:
                self.say(f"tracking store unreachable ({type(err).__name__}); buffering metrics and retrying")
            self._offline = True
            return False
        with self._lock:
            del self._pending[: len(batch)]
            for key in tags:
                self._pending_tags.pop(key, None)
        if self._offline:
            self.say(f"tracking store reachable again; delivered {len(batch)} buffered metrics")
        self._offline = False
        return True

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
            if self._send_pending():
                try:
                    if status is not None:
                        self.client.set_terminated(self.run_id, status=status)
                    return
                except Exception:  # noqa: BLE001 - lost again between the two calls: retry below
                    pass
            if time.monotonic() >= deadline:
                break
            time.sleep(2.0)
        self._write_fallback(status)

    def _write_fallback(self, status: str | None) -> None:
        folder = self.fallback_dir or Path.cwd()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.run_id}.json"
        record = {
            "run_id": self.run_id,
            "status": status,
            "tags": self._pending_tags,
            "metrics": [
                {"key": m.key, "value": m.value, "timestamp": m.timestamp, "step": m.step} for m in self._pending
            ],
        }
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
        self.say(
            f"tracking store still unreachable after {self.outage_timeout_s:.0f} s: {len(self._pending)} metrics and "
            f"the final status ({status}) of run {self.run_id} were written to {path}"
        )


def start_run(
    client: MlflowClient, experiment_id: str, name: str, tags: Mapping[str, str], parent_run_id: str | None = None
) -> str:
    """Create a run (a child when `parent_run_id` is given) and return its id."""
    # host and pid let a later run close this one if its process dies without ending it (kill -9).
    all_tags = {MLFLOW_RUN_NAME: name, "host": socket.gethostname(), "pid": str(os.getpid()), **tags}
    if parent_run_id:
        all_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
    return client.create_run(experiment_id, tags=all_tags, run_name=name).info.run_id


def close_dangling_children(client: MlflowClient, experiment_id: str, parent_run_id: str) -> int:
    """Mark children of `parent_run_id` still RUNNING (their process died) as KILLED; return how many."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}' and attributes.status = 'RUNNING'",
    )
    for run in runs:
        client.set_terminated(run.info.run_id, status=RunStatus.to_string(RunStatus.KILLED))
    return len(runs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def close_runs_of_dead_processes(client: MlflowClient, experiment_id: str) -> list[str]:
    """End as KILLED the RUNNING runs started on this host by processes that no longer exist; return their names."""
    runs = client.search_runs(
        [experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.host = '{socket.gethostname()}'"
    )
    closed = []
    for run in runs:
        pid = run.data.tags.get("pid", "")
        if pid.isdigit() and not _alive(int(pid)):
            client.set_tag(run.info.run_id, "closed", "its process died without ending the run (killed?)")
            client.set_terminated(run.info.run_id, status=RunStatus.to_string(RunStatus.KILLED))
            closed.append(run.info.run_name)
    return closed


def child_runs(client: MlflowClient, experiment_id: str, parent_run_id: str) -> list[Any]:
    """All child runs of `parent_run_id`, oldest first."""
    return client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
        order_by=["attributes.start_time ASC"],
    )


# MLflow loggers whose INFO lines read like trouble in a stage's output: the sqlite store's table creation and
# migrations ("Creating initial MLflow database tables...", alembic's steps) and the system-metrics monitor's start.
QUIET_LOGGERS = ("mlflow.store.db.utils", "alembic", "mlflow.system_metrics", "mlflow.pyfunc", "mlflow.models")


def quiet_mlflow_info() -> None:
    """Only warnings and errors from MLflow's store setup, model logging and system metrics; no progress bars."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    # Per-file progress bars (artifact downloads, weight shards) are noise in a stage's log.
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    if "transformers.utils.logging" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
        return
    # Not imported yet: transformers takes huggingface_hub's switch when it is. Importing transformers here would
    # cost a second in the stages that never load a model (the train stage's driver, the report).
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()


def open_store(tracking: TrackingParams, root: Path, say: Callable[[str], None] = print) -> tuple[MlflowClient, str]:
    """Open the configured store and experiment, and first end as KILLED the runs whose process died.

    Every stage that opens the store calls this, so after a `kill -9` no run stays RUNNING past
    the next stage that runs, whichever it is (train, evaluate or report).
    """
    quiet_mlflow_info()
    client, experiment_id = open_experiment(tracking, root)
    for name in close_runs_of_dead_processes(client, experiment_id):
        say(f"closed MLflow run {name!r} as KILLED: its process died without ending it")
    return client, experiment_id


def log_evaluation(
    client: MlflowClient, run_id: str, metrics: Mapping[str, float], artifacts: list[Path], retry_s: float
) -> None:
    """Log the evaluate stage's metrics and files into the best trial's run (a file the bucket refuses stays
    pending on the run: `pipelines.tracking.uploads`)."""
    from pipelines.tracking.uploads import Upload, send_or_defer

    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()], synchronous=True)
    for path in artifacts:
        send = lambda path=path: client.log_artifact(run_id, str(path), artifact_path="evaluate")  # noqa: E731
        send_or_defer(client, run_id, Upload(f"evaluate/{path.name}", str(path), send), retry_s, print)
