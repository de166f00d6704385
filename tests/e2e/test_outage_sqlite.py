"""A real `mlflow server` that dies mid-run and comes back, with nothing but MLflow installed: its store is sqlite,
its artifacts a local folder the server proxies. The same outage against the team's stack (PostgreSQL, a bucket,
auth) is in tests/e2e/test_team_server.py, which needs PostgreSQL's server programs; this one runs everywhere."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tests.conftest import FINAL_METRICS, free_port, git_env, kill_session, run, write_params
from tests.e2e.mlflow_ui import SERVER_ENV
from tests.e2e.team_stack import answers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXPERIMENT = "outage"
# How long the server stays down before it is started again. MLflow's system-metrics monitor asks the server for its
# run every 5 s, and the pipeline bounds MLflow's HTTP retries to 1 + 2 + 4 s (pipelines/tracking/__init__.py): one
# that asks within 5 s of the kill has given up 12 s after it, so 15 s down (plus the restart) always costs a gap.
DOWN_S = 15


class SqliteServer:
    """`mlflow server` on 127.0.0.1 over a sqlite store and a local artifacts folder in `folder`, on a free port;
    `kill()` and `start()` again keep the port, the store and the artifacts."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.proc = folder, free_port(), None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder / 'server.db'}",
             "--artifacts-destination", str(self.folder / "server-artifacts"), "--workers", "2"],
            cwd=self.folder, env={**git_env(), **SERVER_ENV}, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        proc = self.proc
        wait_until(lambda: answers(f"{self.url}/health") or proc.poll() is not None, 120, "the MLflow server")
        if proc.poll() is not None:
            raise AssertionError(f"the MLflow server exited:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc is not None:
            kill_session(self.proc.pid)  # the server and its workers
            self.proc.wait(timeout=30)
            self.proc = None


@pytest.fixture
def server(tmp_path: Path):
    srv = SqliteServer(tmp_path)
    srv.start()
    yield srv
    srv.kill()


def first_logging_trial(client: MlflowClient, stage: subprocess.Popen) -> Run | None:
    """The trial's run once it has logged a training step (None if the stage ended or 300 s passed first)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and stage.poll() is None:
        experiment = client.get_experiment_by_name(EXPERIMENT)
        runs = client.search_runs([experiment.experiment_id]) if experiment else []
        for candidate in runs:
            if "mlflow.parentRunId" in candidate.data.tags and client.get_metric_history(
                candidate.info.run_id, "train_loss"
            ):
                return candidate
        time.sleep(0.5)
    return None


def assert_results_intact(client: MlflowClient, run_id: str) -> None:
    """The trial and its parent finished; the trial with every step's loss, its final figures, and its model stored
    through the server."""
    finished = client.get_run(run_id)
    assert finished.info.status == "FINISHED", finished.data.tags.get("error")
    assert client.get_run(finished.data.tags["mlflow.parentRunId"]).info.status == "FINISHED"
    steps = int(finished.data.metrics["optimizer_steps"])
    history = client.get_metric_history(run_id, "train_loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))  # every step's point, none lost or doubled
    assert not [name for name in FINAL_METRICS if name not in finished.data.metrics]
    model_id = finished.data.tags["model_uri"].removeprefix("models:/")
    folder = next(a.path for a in client.list_logged_model_artifacts(model_id, "artifacts"))
    assert f"{folder}/model.safetensors" in {a.path for a in client.list_logged_model_artifacts(model_id, folder)}


def test_a_sqlite_server_that_dies_mid_run_loses_nothing_and_the_gap_is_recorded(
    project_copy: Path, server: SqliteServer
):
    overrides = {"data.generator.num_rows": 3000, "epochs": 3, "log_every_n_steps": 1}
    write_params(project_copy, {**overrides, "tracking.uri": server.url, "tracking.experiment": EXPERIMENT})
    run([sys.executable, "-m", "stages.tokenize"], project_copy)
    stage = subprocess.Popen([sys.executable, "-m", "stages.train"], cwd=project_copy, env=git_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)  # fmt: skip
    try:
        client = MlflowClient(tracking_uri=server.url)
        child = first_logging_trial(client, stage)
        assert child is not None, "the trial never logged"
        killed = time.time()
        server.kill()  # the tracking server dies mid-run...
        time.sleep(DOWN_S)
        server.start()  # ...and comes back on the same port, store and artifacts
        back = time.time()
        output, _ = stage.communicate(timeout=600)
    finally:
        if stage.poll() is None:
            kill_session(stage.pid)  # the stage and its Ray cluster, when an assertion above left them running
    assert stage.returncode == 0, output[-3000:]
    assert "buffering metrics" in output and "reachable again" in output
    assert_results_intact(client, child.info.run_id)
    # The system metrics resumed once the server answered (sampled every 5 s), and the run says what they missed:
    # a gap no longer than the outage the test made, plus the watcher's 5 s between looks (and a request's time).
    finished = client.get_run(child.info.run_id)
    cpu = client.get_metric_history(child.info.run_id, "system/cpu_utilization_percentage")
    assert cpu and max(m.timestamp for m in cpu) / 1000 > back, "no system metric after the server came back"
    assert "tracking server unreachable" in finished.data.tags["system_metrics.gaps"]
    assert 0 < finished.data.metrics["system_metrics_gap_s"] <= back - killed + 10, finished.data.metrics
    assert not list((project_copy / "mlflow-fallback").glob("*.json"))  # the buffered points were all sent
