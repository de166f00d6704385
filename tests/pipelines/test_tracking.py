"""Tracking: store paths resolve against the repository, not the trial's working directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipelines.errors import UserError
from pipelines.params import TrackingParams, resolve_repo_root
from pipelines.tasks import get_task
from pipelines.tracking.runs import RunLogger, open_experiment, resolve_tracking_uri, start_run
from pipelines.tracking.status import display_rounded, headline_metrics, list_first, log_best_on_parent


def test_relative_stores_become_absolute(tmp_path: Path):
    assert resolve_tracking_uri("sqlite:///mlflow.db", tmp_path) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_tracking_uri("sqlite:////abs/x.db", tmp_path) == "sqlite:////abs/x.db"
    assert resolve_tracking_uri("mlruns", tmp_path) == (tmp_path / "mlruns").as_uri()
    assert resolve_tracking_uri("http://127.0.0.1:5000", tmp_path) == "http://127.0.0.1:5000"


def test_repo_root_follows_dvc_root(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("DVC_ROOT", str(tmp_path))
    assert resolve_repo_root("elsewhere/params.yaml") == tmp_path.resolve()
    monkeypatch.delenv("DVC_ROOT")
    assert resolve_repo_root(tmp_path / "params.yaml") == tmp_path.resolve()


def test_experiment_created_once_and_runs_logged_in_batches(tmp_path: Path):
    tracking = TrackingParams(uri="sqlite:///store.db", experiment="t", registered_model=None, upload_retry_s=1)
    client, first = open_experiment(tracking, tmp_path)
    _, second = open_experiment(tracking, tmp_path)
    assert first == second
    run_id = start_run(client, first, "r", {"variant": "v"})
    logger = RunLogger(client, run_id, flush_every=1000)
    for step in range(250):
        logger.log_dict({"train_loss": 1.0 / (step + 1)}, step=step)
    logger.close()
    assert len(client.get_metric_history(run_id, "train_loss")) == 250
    assert client.get_run(run_id).info.status == "FINISHED"


def test_unusable_store_is_a_user_error(tmp_path: Path):
    (tmp_path / "a-file").write_text("not a folder")
    tracking = TrackingParams(uri="sqlite:///a-file/x.db", experiment="t", registered_model=None, upload_retry_s=1)
    with pytest.raises(UserError, match="tracking.uri = 'sqlite:///a-file/x.db': the MLflow store is unreachable"):
        open_experiment(tracking, tmp_path)


def test_logger_writes_a_fallback_file_when_the_store_never_comes_back(tmp_path: Path, monkeypatch):
    import json
    import socket

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with socket.socket() as sock:  # a port with nothing listening: connection refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    messages: list[str] = []
    logger = RunLogger(
        MlflowClient(f"http://127.0.0.1:{port}"),
        "0" * 32,
        flush_every=10,
        fallback_dir=tmp_path,
        outage_timeout_s=1,
        say=messages.append,
    )
    for step in range(25):
        logger.log_dict({"train_loss": 1.0 / (step + 1)}, step=step)
    logger.log_tags({"note": "kept"})
    logger.close("FINISHED")
    record = json.loads((tmp_path / f"{'0' * 32}.json").read_text())
    assert len(record["metrics"]) == 25 and record["status"] == "FINISHED" and record["tags"] == {"note": "kept"}
    assert any("buffering" in m for m in messages) and "were written to" in messages[-1]


@pytest.mark.parametrize("task", ["classification", "causal_lm", "seq2seq"])
def test_the_headline_metrics_are_listed_first_and_keep_their_measured_values(tmp_path: Path, task: str):
    # MLflow lists a run's metrics in first-logged order; its compare view opens on the first one
    # (tests/e2e/test_dvc_experiments.py reads it from the real UI). A trial lists its headline first.
    tracking = TrackingParams(uri="sqlite:///store.db", experiment="t", registered_model=None, upload_retry_s=1)
    client, experiment = open_experiment(tracking, tmp_path)
    run_id = start_run(client, experiment, "r", {})
    headline = headline_metrics(task)
    list_first(client, run_id, headline)
    client.log_metric(run_id, "system/cpu_utilization_percentage", 50.0, step=0)  # what the monitor writes
    logger = RunLogger(client, run_id)
    logger.log_dict({"train_loss": 0.5}, step=3)
    measured = {key: 1.0 + i for i, key in enumerate(headline)}
    logger.log_dict(measured, step=3)  # the trial's final metrics, at its last step
    logger.close()
    run = client.get_run(run_id)
    assert [m.key for m in run.data._metric_objs][:3] == list(headline)
    assert headline[0] == get_task(task).quality[0].metric
    assert {key: run.data.metrics[key] for key in headline} == measured  # NaN only until measured


@pytest.mark.parametrize(("users", "expected"), [(None, "true"), ("false", "false")])
def test_mlflow_telemetry_is_off_in_our_processes_unless_the_user_set_it(users, expected, monkeypatch):
    import subprocess
    import sys

    from pipelines.trials.ray_cluster import worker_env

    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    if users is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = users
    probe = "import os, pipelines.tracking.runs; print(os.environ['MLFLOW_DISABLE_TELEMETRY'])"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == expected  # the driver and every process that imports our tracking
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    if users is not None:
        monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", users)
    assert worker_env()["MLFLOW_DISABLE_TELEMETRY"] == expected  # Ray's trial workers


def test_a_parent_shows_its_best_trials_figures_to_4_significant_digits_and_bytes_exact(tmp_path: Path):
    rounded = [display_rounded(v) for v in (0.7366666, 2600.7746, 4.8324063, 21.0, 0.0)]
    assert rounded == [0.7367, 2601.0, 4.832, 21.0, 0]
    tracking = TrackingParams(uri="sqlite:///store.db", experiment="t", registered_model=None, upload_retry_s=1)
    client, experiment = open_experiment(tracking, tmp_path)
    parent = start_run(client, experiment, "parent", {})
    best = {"test_accuracy": 0.7366666666666667, "train_time_s": 4.8324063870059035, "samples_per_s": 2600.7746,
            "peak_train_memory_bytes": 21998080.0, "peak_train_memory_mib": 21.0, "val_loss": 0.79}  # fmt: skip
    log_best_on_parent(client, parent, "classification", best)
    assert client.get_run(parent).data.metrics == {
        "test_accuracy": 0.7367, "train_time_s": 4.832, "samples_per_s": 2601.0,
        "peak_train_memory_bytes": 21998080.0, "peak_train_memory_mib": 21.0}  # fmt: skip


# /proc/driver/nvidia/version as the proprietary and the open kernel modules write it (the driver of the H200 note).
PROPRIETARY_MODULE = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Thu Oct 30 21:10:01 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04) \n"
)
OPEN_MODULE = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build  "
    "(dvs-builder@U16-I3-B03-4-3)  Thu Feb 22 01:25:25 UTC 2024\n"
    "GCC version:  gcc version 12.3.0 (Ubuntu 12.3.0-1ubuntu1~22.04) \n"
)


def test_the_driver_version_is_read_from_the_kernel_modules_proc_file(tmp_path: Path, monkeypatch):
    from pipelines.tracking import environment

    assert environment.driver_version_from_proc(PROPRIETARY_MODULE) == "580.159.04"
    assert environment.driver_version_from_proc(OPEN_MODULE) == "550.54.14"
    assert environment.driver_version_from_proc("GCC version:  gcc version 13.3.0\n") is None  # GCC's is not it
    # Without NVML (this machine has no NVIDIA driver for it to load) the tag comes from the kernel module's file.
    proc = tmp_path / "version"
    proc.write_text(PROPRIETARY_MODULE, encoding="utf-8")
    monkeypatch.setattr(environment, "PROC_DRIVER_VERSION", proc)
    assert environment.cuda_driver_version() == "580.159.04"


def test_a_cpu_trial_is_tagged_with_the_cpu_it_trained_on():
    import platform

    import torch

    from pipelines.tracking.environment import environment_tags

    tags = environment_tags(cuda_allowed=False)  # a `device: cpu` trial, on this host or a GPU one
    assert tags["env.device"] == f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    assert tags["env.python"] == platform.python_version() and "env.compute_capability" not in tags
