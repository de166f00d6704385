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
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from pipelines.errors import UserError
from pipelines.params import Params, TrackingParams, flatten_params
from pipelines.tracking.access import check_can_write, refusal
from pipelines.tracking.run_logger import RunLogger

__all__ = ["RunLogger"]  # re-exported: trials import the logger from here

_MAX_PARAMS_PER_BATCH = 100  # MLflow's limit for log_batch
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


def log_evaluation_metrics(client: MlflowClient, run_id: str, metrics: Mapping[str, float]) -> None:
    """The evaluate stage's metrics into the best trial's run; a store's refusal (4xx) as a `TrackingRefused`
    naming the key, an outage as a `UserError`: either before the stage writes any result."""
    from pipelines.tracking.refusals import is_refusal, refused

    now = int(time.time() * 1000)
    try:
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()], synchronous=True)
    except Exception as err:  # noqa: BLE001 - said in one line, as a user error: no result is written after it
        if is_refusal(err):
            raise refused(err, run_id, list(metrics)) from None
        raise UserError(f"the tracking store did not take the evaluation of run {run_id} ({type(err).__name__}: "
                        f"{str(err).splitlines()[0][:300] if str(err) else ''}); nothing was written: rerun "
                        "`dvc repro` once it answers") from None  # fmt: skip


def log_evaluation_files(client: MlflowClient, run_id: str, artifacts: list[Path], retry_s: float) -> None:
    """The evaluate stage's files into the best trial's run (one the bucket refuses stays pending)."""
    from pipelines.tracking.uploads import Upload, send_or_defer

    for path in artifacts:
        send = lambda path=path: client.log_artifact(run_id, str(path), artifact_path="evaluate")  # noqa: E731
        send_or_defer(client, run_id, Upload(f"evaluate/{path.name}", str(path), send), retry_s, print)
