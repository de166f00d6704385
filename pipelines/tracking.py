"""MLflow tracking: store resolution, the run tree, and buffered metric logging.

Only `MlflowClient` is used (no `mlflow.start_run` global state), because runs are
written from several processes: the train stage makes the parent run, each Ray trial
its child run, and evaluate adds to the best trial's run afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from pipelines.errors import UserError
from pipelines.params import Params, TrackingParams, flatten_params

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


def check_server(configured: str, uri: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds when a tracking server does not answer (MLflow's own client retries for minutes)."""
    try:
        with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as response:
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


def open_experiment(tracking: TrackingParams, root: Path) -> tuple[MlflowClient, str]:
    """Return a client and the experiment id, creating the experiment once if needed."""
    uri = resolve_tracking_uri(tracking.uri, root)
    if uri.startswith(("http://", "https://")):
        check_server(tracking.uri, uri)
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(tracking.experiment)
        if experiment is not None:
            return client, experiment.experiment_id
        try:
            return client, client.create_experiment(tracking.experiment, artifact_location=artifact_root(uri, root))
        except Exception:  # noqa: BLE001 - another process created it first
            experiment = client.get_experiment_by_name(tracking.experiment)
            if experiment is None:
                raise
            return client, experiment.experiment_id
    except Exception as err:  # noqa: BLE001 - any failure here means the store is unusable
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


def environment_tags() -> dict[str, str]:
    """Device and library versions, so runs on different machines can be told apart."""
    import torch
    import transformers

    tags = {
        "env.python": platform.python_version(),
        "env.torch": torch.__version__,
        "env.transformers": transformers.__version__,
        "env.platform": platform.platform(),
        "env.cpu_count": str(os.cpu_count()),
    }
    if torch.cuda.is_available():
        tags["env.device"] = torch.cuda.get_device_name(0)
        tags["env.cuda"] = str(torch.version.cuda)
    else:
        tags["env.device"] = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    return tags


class RunLogger:
    """Buffers metrics for one run and sends them in batches (one request per flush, not per point)."""

    def __init__(self, client: MlflowClient, run_id: str, flush_every: int = 200) -> None:
        self.client = client
        self.run_id = run_id
        self.flush_every = flush_every
        self._pending: list[Metric] = []
        self._in_flight: list[Any] = []

    def log_dict(self, metrics: Mapping[str, float], step: int = 0) -> None:
        """Queue metrics at `step`; flushes once enough have piled up."""
        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self._pending) >= self.flush_every:
            self.flush()

    def log_tags(self, tags: Mapping[str, str]) -> None:
        """Set tags on the run right away."""
        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()], synchronous=True)

    def flush(self) -> None:
        """Hand everything queued to MLflow's background logger (training does not wait for the store)."""
        while self._pending:
            chunk, self._pending = self._pending[:_MAX_METRICS_PER_BATCH], self._pending[_MAX_METRICS_PER_BATCH:]
            operation = self.client.log_batch(self.run_id, metrics=chunk, synchronous=False)
            if operation is not None:
                self._in_flight.append(operation)

    def close(self, status: str = "FINISHED") -> None:
        """Flush, wait until every batch is stored, and end the run with `status` (FINISHED, FAILED or KILLED)."""
        try:
            self.flush()
            for operation in self._in_flight:
                operation.wait()
        finally:
            self._in_flight = []
            self.client.set_terminated(self.run_id, status=status)


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


def tracking_client(tracking: TrackingParams, root: Path) -> MlflowClient:
    """A client on the configured store (resolved against `root`, never a path saved elsewhere)."""
    return MlflowClient(tracking_uri=resolve_tracking_uri(tracking.uri, root))


def log_evaluation(client: MlflowClient, run_id: str, metrics: Mapping[str, float], artifacts: list[Path]) -> None:
    """Log the evaluate stage's metrics and files into the best trial's run."""
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()], synchronous=True)
    for path in artifacts:
        client.log_artifact(run_id, str(path), artifact_path="evaluate")
