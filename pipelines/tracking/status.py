"""How a trial's MLflow run is watched, which metrics it lists first, and how it ends: FINISHED, FAILED on an error,
KILLED when stopped."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pipelines.gpu_profiles import mib


def stopped_tags(scheduler: str) -> dict[str, str]:
    """The tags of a run its scheduler stopped early (ASHA): set by the trial, and again by the driver, which knows
    it for sure even when the trial's process ended before recording it."""
    return {"stopped": f"stopped early by the {scheduler} scheduler"}


@contextmanager
def ended_run(
    close: Callable[[str], None],
    on_error: Callable[[Exception], None] = lambda err: None,
    on_stop: Callable[[], None] = lambda: None,
) -> Iterator[None]:
    """Close a run with the status its block earned: `close("FINISHED" | "FAILED" | "KILLED")`.

    An exception is an error (`on_error` records why, in the run); anything else that ends the block early
    (SystemExit when Ray's scheduler stops a trial, KeyboardInterrupt) is a stop (`on_stop`). The run is
    closed either way, so none is left RUNNING; what was raised is raised again.
    """
    status = "FAILED"
    try:
        yield
        status = "FINISHED"
    except Exception as err:
        on_error(err)
        raise
    except BaseException:
        status = "KILLED"
        on_stop()
        raise
    finally:
        close(status)


def open_client(tracking_uri: str) -> Any:
    """An MLflow client of the store at `tracking_uri` (a trial's process opens its own)."""
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def watch_system(run_id: str, tracking_uri: str) -> Any:
    """MLflow's system-metrics monitor of the run (CPU, memory, GPU every 5 s), started and restarted after a
    tracking outage (`pipelines.tracking.system_watch`); `.finish()` it."""
    from pipelines.tracking.system_watch import SystemWatch

    return SystemWatch(run_id, tracking_uri, interval_s=5.0)


def headline_metrics(task: str, on_test: bool = True) -> tuple[str, ...]:
    """What a trial is compared by first: the task's headline quality (the report's first quality column: the test
    split's, or the validation split's where an experiment's trials are compared on it, `TrialContext.score_test`),
    then train time and peak train memory."""
    from pipelines.tasks import get_task

    declared = get_task(task)
    quality = declared.quality if on_test else declared.validation_quality
    return (quality[0].metric, "train_time_s", "peak_train_memory_bytes")


def training_figures(client: Any, run_id: str) -> dict[str, float | str]:
    """The evaluated model's own training figures, from its trial's MLflow run: train time (s), peak train memory
    (MiB), samples/s, the host's load per core while it trained (above 1, its times were taken under load), how
    many trials of the project trained on the host at once (`concurrent_trials`, above 1: the cores were shared)
    and where it was timed (`timed_on`: the host's name and id, and its device), for the headline of `dvc exp show`. A
    registered version evaluated in place of models/best (`eval.model_uri`) brings its own run's figures, not this
    train run's."""
    run = client.get_run(run_id)
    logged = run.data.metrics
    figures: dict[str, float | str] = {k: logged[k] for k in ("train_time_s",) if k in logged}
    if "peak_train_memory_bytes" in logged:
        figures["peak_train_memory_mib"] = mib(logged["peak_train_memory_bytes"])
    figures.update({k: logged[k] for k in ("samples_per_s", "host_load_per_core", "concurrent_trials") if k in logged})
    tags = run.data.tags
    if "host" in tags:
        cores = f", {logged['host_cores']:g} cores" if "host_cores" in logged else ""
        # The host's id beside its name: two machines of one name and kind are not one host (issue 71).
        host = f"{tags['host']} #{tags['env.host_id']}" if "env.host_id" in tags else tags["host"]
        figures["timed_on"] = f"{host}: {tags.get('env.device', 'unknown device')}{cores}"
    return figures


DISPLAY_DIGITS = 4  # significant digits of a parent run's copy of its best trial's figures


def display_rounded(value: float, digits: int = DISPLAY_DIGITS) -> float:
    """`value` to `digits` significant digits (0 and non-finite values as they are)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def log_best_on_parent(client: Any, parent_run_id: str, task: str, best: dict[str, float]) -> None:
    """The best trial's headline figures (quality, train time, peak memory, samples/s) on the parent run too: MLflow's
    runs table lists parent runs, collapsed, and a parent without metrics shows no columns to compare by.

    MLflow prints a figure whole (it has no display format), so these copies are rounded to 4 significant digits
    for that table; the trial's run keeps each figure exact (rows = samples/s x seconds must hold), as do the byte
    counts here."""
    # The test split's headline where the best trial scored it (the experiment's one trial), else validation's.
    keys = [*headline_metrics(task), headline_metrics(task, on_test=False)[0], "peak_train_memory_mib", "samples_per_s"]
    log_display_copies(client, parent_run_id, {k: best[k] for k in keys if k in best})


def log_test_headline_on_parent(client: Any, run_id: str, metric: str, value: float) -> None:
    """The evaluate stage's test headline (`metric`) on the evaluated run's parent, rounded as the best trial's
    figures are there; nothing for a run without a parent. Takes no task (no torch to import)."""
    parent = client.get_run(run_id).data.tags.get("mlflow.parentRunId")
    if parent:
        log_display_copies(client, parent, {metric: value})


def log_display_copies(client: Any, run_id: str, figures: dict[str, float]) -> None:
    """`figures` on a parent run, for the runs table: rounded to DISPLAY_DIGITS, byte counts exact."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    shown = {k: v if k.endswith("_bytes") else display_rounded(v) for k, v in figures.items()}
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in shown.items()])


def list_first(client: Any, run_id: str, keys: Iterable[str]) -> None:
    """Log each of `keys` as NaN ("not measured yet") at step 0, one call each, before any other metric of the run.

    MLflow lists a run's metrics in the order they were first logged, and its compare view opens its
    parallel-coordinates plot on the first metric the compared runs share: without this, that is
    `system/cpu_utilization_percentage`, which the system-metrics monitor writes within seconds of the run's
    start. The measured value, logged at the run's last step, replaces NaN as the run's value; a run that fails
    keeps NaN, having measured nothing.
    """
    for key in keys:
        client.log_metric(run_id, key, math.nan, step=0)


# The runs page's columns, as an MLflow shared view (an experiment tag the UI reads when the page's URL names its key):
# without it MLflow 3.17 shows no metric column ("Show more columns (242 total)").
RUNS_VIEW_KEY = "training"
RUNS_VIEW_TAG = f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"


def view_metrics(task: str) -> tuple[str, ...]:
    """The headline as the runs table shows it: the peak memory in MiB, as DVC and the report show it."""
    return tuple("peak_train_memory_mib" if key == "peak_train_memory_bytes" else key for key in headline_metrics(task))


def runs_view(task: str) -> str:
    """The runs page's view for `task` (the tag's JSON): the headline figures the parent runs carry (the best
    trial's quality, train time, peak memory) and each trial's logged model."""
    import json

    # MLflow shows the metric columns in name order, after Run Name, Created, Duration and Models: in a 1400-pixel
    # window (a laptop) the fourth, samples/s, pushed train time (last by name) off the screen, so it is left to the
    # Columns menu with the Dataset column (the widest). Checked in Chromium (tests/e2e/test_dvc_experiments.py).
    columns = [*(f"metrics.`{key}`" for key in view_metrics(task)), "attributes.`Models`"]
    return json.dumps({"selectedColumns": columns, "orderByKey": "attributes.start_time", "orderByAsc": False})


def runs_page_line(tracking_uri: str, experiment_id: str) -> str:
    """Where a person finds the trials: the experiment's runs page in MLflow's UI, opened on model training with
    the headline columns (`runs_view`).

    MLflow 3.17's UI opens every experiment on its GenAI overview (traces, latency): its GenAI / Model training
    toggle starts at GenAI in each new browser and does not read the experiment's kind tag; the page's
    `workflowType=machine_learning` parameter opens Model training (checked in Chromium)."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_KEY}"
    if tracking_uri.startswith(("http://", "https://")):
        return f"MLflow: {tracking_uri.rstrip('/')}/{page}"
    return (
        f"MLflow: MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri {tracking_uri} --host "
        f"127.0.0.1 --port 5000, then open http://127.0.0.1:5000/{page}"
    )
