"""Ray Tune trials tracked in MLflow: a real server and the sqlite store, ASHA, variant grids, DVC's queue."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import FINAL_METRICS, FOUR_VARIANTS, QUICK, free_port, git_env, kill_session, run, write_params
from tests.e2e.mlflow_ui import SERVER_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


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


class MlflowServer:
    """A real `mlflow server` bound to 127.0.0.1 on a free port; can be killed and restarted on the same port."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.proc = folder, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--backend-store-uri",
                f"sqlite:///{self.folder / 'server.db'}",
                "--artifacts-destination",
                str(self.folder / "server-artifacts"),
                "--workers",
                "2",
            ],
            cwd=self.folder,
            env={**git_env(), **SERVER_ENV},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.kill()
        pytest.fail("mlflow server did not become healthy in 90 s")

    def kill(self) -> None:
        if self.proc is not None:
            kill_session(self.proc.pid)  # the server and its workers
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def server(tmp_path: Path):
    srv = MlflowServer(tmp_path)
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
def mlflow_server(server: MlflowServer) -> str:
    return server.url


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
    # The best trial's model, logged through the server as an MLflow model, holds the trial's weights.
    model_id = client.get_run(best).data.tags["model_uri"].removeprefix("models:/")
    folder = next(a.path for a in client.list_logged_model_artifacts(model_id, "artifacts"))
    assert f"{folder}/model.safetensors" in {a.path for a in client.list_logged_model_artifacts(model_id, folder)}


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


def test_training_goes_on_through_a_tracking_outage_and_nothing_is_lost(project_copy: Path, server: MlflowServer):
    write_params(
        project_copy,
        {
            "data.generator.num_rows": 3000,
            "epochs": 3,
            "log_every_n_steps": 1,
            "tracking.uri": server.url,
            "tracking.experiment": "outage",
        },
    )
    run([sys.executable, "-m", "stages.tokenize"], project_copy)
    stage = subprocess.Popen(
        [sys.executable, "-m", "stages.train"],
        cwd=project_copy,
        env=git_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    client = MlflowClient(tracking_uri=server.url)
    deadline = time.monotonic() + 300
    child = None
    while time.monotonic() < deadline and child is None:  # wait until the trial has logged some steps
        experiment = client.get_experiment_by_name("outage")
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        child = next(
            (
                r
                for r in runs
                if "mlflow.parentRunId" in r.data.tags
                and len(client.get_metric_history(r.info.run_id, "train_loss")) > 0
            ),
            None,
        )
        time.sleep(0.5)
    assert child is not None, "the trial never logged"
    server.kill()  # the tracking server dies mid-run...
    time.sleep(8)
    server.start()  # ...and comes back on the same port and store
    output, _ = stage.communicate(timeout=600)
    assert stage.returncode == 0, output[-3000:]
    assert "buffering metrics" in output and "reachable again" in output
    run_after = client.get_run(child.info.run_id)
    assert run_after.info.status == "FINISHED"
    steps = int(run_after.data.metrics["optimizer_steps"])
    history = client.get_metric_history(child.info.run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # every step's point, none lost
    assert not list((project_copy / "mlflow-fallback").glob("*.json"))


def test_repeats_run_each_variant_over_seeds_and_the_report_shows_mean_sd(project_copy: Path):
    write_params(
        project_copy,
        {
            **QUICK,
            "data.generator.num_rows": 800,
            "tune.num_samples": 2,
            "tune.variants": {"vanilla": {}, "adafactor": {"optim": "adafactor"}},
            "tune.max_concurrent_trials": 2,
        },
    )
    run_stages(project_copy, "tokenize", "train", "evaluate", "report")
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    _, _, children = runs_by_kind(client, "finetune")
    seeds = sorted((c.data.tags["variant"], c.data.params["seed"], c.data.tags["repeat"]) for c in children)
    assert seeds == [("adafactor", "42", "0"), ("adafactor", "43", "1"), ("vanilla", "42", "0"), ("vanilla", "43", "1")]
    assert all(c.info.status == "FINISHED" for c in children)
    report = (project_copy / "reports/report.md").read_text()
    vanilla = next(line for line in report.splitlines() if line.startswith("| vanilla |"))
    adafactor = next(line for line in report.splitlines() if line.startswith("| adafactor |"))
    assert "(n=2)" in vanilla and "(n=2)" in adafactor
    assert "*" in adafactor.split("|")[7] or "within noise" in adafactor.split("|")[7]  # optimizer state: marked
