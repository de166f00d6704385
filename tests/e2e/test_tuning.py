"""Ray Tune trials tracked in MLflow: a real server and the sqlite store, ASHA, variant grids, DVC's queue."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import FOUR_VARIANTS, QUICK, git_env, run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FINAL_METRICS = (
    "train_time_s",
    "samples_per_s",
    "tokens_per_s",
    "peak_memory_bytes",
    "test_accuracy",
    "test_macro_f1",
    "val_accuracy",
    "optimizer_state_bytes",
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_stages(root: Path, *stages: str) -> subprocess.CompletedProcess[str]:
    out = None
    for stage in stages:
        out = run([sys.executable, "-m", f"stages.{stage}"], root, timeout=800)
    return out


def runs_by_kind(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return runs, parents, children


def assert_complete_grid(client: MlflowClient, experiment: str, variants: set[str]) -> None:
    runs, parents, children = runs_by_kind(client, experiment)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["params_hash"] and parents[0].data.tags["git_commit"]
    assert {c.data.tags["variant"] for c in children} == variants and len(children) == len(variants)
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in children)
    for child in children:
        assert child.info.status == "FINISHED", (child.data.tags.get("variant"), child.data.tags.get("error"))
        assert child.data.params["optim"] in ("adamw", "adafactor") and "data.max_length" in child.data.params
        for name in FINAL_METRICS:
            assert name in child.data.metrics, (child.data.tags["variant"], name)
        assert "tokenize.train.pad_fraction_fixed" in child.data.metrics
        assert child.data.tags["env.torch"] and child.data.tags["env.device"]
    assert not [r for r in runs if r.info.status == "RUNNING"]


@pytest.fixture
def mlflow_server(tmp_path: Path):
    """A real `mlflow server` bound to 127.0.0.1 on a free port, stopped after the test."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{tmp_path / 'server.db'}",
            "--artifacts-destination",
            str(tmp_path / "server-artifacts"),
            "--workers",
            "2",
        ],
        cwd=tmp_path,
        env=git_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("mlflow server did not become healthy in 90 s")
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def test_four_variant_grid_two_concurrent_against_a_real_mlflow_server(project_copy: Path, mlflow_server: str):
    write_params(
        project_copy,
        {
            **QUICK,
            "tune.variants": FOUR_VARIANTS,
            "tune.max_concurrent_trials": 2,
            "tracking.uri": mlflow_server,
            "tracking.experiment": "served",
        },
    )
    run_stages(project_copy, "tokenize", "train")
    client = MlflowClient(tracking_uri=mlflow_server)
    assert_complete_grid(client, "served", set(FOUR_VARIANTS))
    best = json.loads((project_copy / "models/trials.json").read_text())["best"]["mlflow_run_id"]
    artifacts = {a.path for a in client.list_artifacts(best, "model")}
    assert "model/model.safetensors" in artifacts


@pytest.mark.parametrize("concurrent", [2, 4])
def test_same_grid_on_the_sqlite_store_concurrently(project_copy: Path, concurrent: int):
    # Half a core per trial lets 4 trials run at once on a 2-core machine.
    write_params(
        project_copy,
        {
            **QUICK,
            "tune.variants": FOUR_VARIANTS,
            "tune.max_concurrent_trials": concurrent,
            "tune.resources_per_trial.cpu": 2 / concurrent,
        },
    )
    out = run_stages(project_copy, "tokenize", "train")
    assert "database is locked" not in out.stdout + out.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    assert_complete_grid(client, "finetune", set(FOUR_VARIANTS))
    for child in runs_by_kind(client, "finetune")[2]:
        assert len(client.get_metric_history(child.info.run_id, "train_loss")) >= 5  # nothing lost


def test_asha_stops_at_least_one_of_six_trials_early(project_copy: Path):
    write_params(
        project_copy,
        {
            "data.generator.num_rows": 1500,
            "epochs": 3,
            "tune.num_samples": 6,
            "tune.scheduler": "asha",
            "tune.grace_period": 1,
            "tune.max_concurrent_trials": 2,
            "tune.search_space": {"lr": {"type": "loguniform", "low": 1e-5, "high": 3e-2}},
        },
    )
    run_stages(project_copy, "tokenize", "train")
    summary = json.loads((project_copy / "models/trials.json").read_text())
    assert len(summary["trials"]) + len(summary["stopped_early"]) == 6 and not summary["failed"]
    assert summary["stopped_early"], "ASHA stopped no trial"
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    _, _, children = runs_by_kind(client, "finetune")
    killed = [c for c in children if c.info.status == "KILLED"]
    assert len(killed) == len(summary["stopped_early"]) and "stopped early" in killed[0].data.tags["stopped"]
    lrs = {c.data.params["lr"] for c in children}
    assert len(lrs) == 6  # six different samples of the search space
    metrics = json.loads((project_copy / "metrics/train.json").read_text())
    assert metrics["trials.stopped_early"] == len(summary["stopped_early"]) and "best.lr" in metrics


def test_invalid_combination_fails_its_trial_alone_and_is_recorded(project_copy: Path):
    # Each part is valid on its own (so the schema accepts it at load); together they are not.
    write_params(
        project_copy,
        {
            **QUICK,
            "tune.max_concurrent_trials": 2,
            "tune.variants": {"fixed": {}, "auto": {"batch_size": "auto", "effective_batch_size": 32}},
            "tune.search_space": {"grad_accum_steps": {"type": "grid", "values": [1, 2]}},
        },
    )
    run_stages(project_copy, "tokenize", "train")
    summary = json.loads((project_copy / "models/trials.json").read_text())
    assert len(summary["trials"]) == 3 and len(summary["failed"]) == 1
    assert summary["failed"][0]["config"] == {"variant": "auto", "grad_accum_steps": 2}
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    _, _, children = runs_by_kind(client, "finetune")
    failed = [c for c in children if c.info.status == "FAILED"]
    assert len(failed) == 1 and "set grad_accum_steps: 1" in failed[0].data.tags["error"]


def test_same_params_and_seed_give_identical_metrics(project_copy: Path):
    write_params(project_copy, QUICK)
    run_stages(project_copy, "tokenize", "train")
    first = json.loads((project_copy / "metrics/train.json").read_text())
    run_stages(project_copy, "train")
    second = json.loads((project_copy / "metrics/train.json").read_text())
    for key in ("final_train_loss", "val_accuracy", "val_loss", "test_accuracy", "optimizer_steps"):
        assert first[key] == second[key], key
