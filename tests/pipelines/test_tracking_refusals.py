"""A tracking store's refusal (4xx) fails the run at once, FAILED, with MLflow's message and the key; an outage
(a dropped connection) is retried and loses nothing; what an outage kept on disk is replayed by the next train,
and a chunk already delivered is never sent twice. Against a real `mlflow server` and real sqlite stores."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    INTERNAL_ERROR,
    INVALID_PARAMETER_VALUE,
    PERMISSION_DENIED,
    RESOURCE_DOES_NOT_EXIST,
    TEMPORARILY_UNAVAILABLE,
)
from mlflow.tracking import MlflowClient

from pipelines.params import TrackingParams
from pipelines.tracking.refusals import TrackingRefused, is_refusal, replay_fallbacks
from pipelines.tracking.runs import RunLogger, open_experiment, start_run
from tests.e2e.test_outage_sqlite import SqliteServer

pytestmark = pytest.mark.timeout(300)


def test_what_mlflow_says_decides_refusal_or_outage():
    assert is_refusal(MlflowException("bad name", INVALID_PARAMETER_VALUE))  # 400
    assert is_refusal(MlflowException("no such run", RESOURCE_DOES_NOT_EXIST))  # 404
    assert is_refusal(MlflowException("not yours", PERMISSION_DENIED))  # 403
    # A connection error or timeout reaches us as INTERNAL_ERROR (500); 503: the server says it is away.
    assert not is_refusal(MlflowException("API request failed with exception ConnectionError", INTERNAL_ERROR))
    assert not is_refusal(MlflowException("try later", TEMPORARILY_UNAVAILABLE))
    assert not is_refusal(ConnectionResetError("dropped"))


def test_a_refused_metric_name_fails_the_run_at_once_with_mlflows_message_and_the_key(tmp_path: Path):
    server = SqliteServer(tmp_path)
    server.start()
    try:
        client = MlflowClient(server.url)
        experiment = client.create_experiment("refusal")
        run_id = start_run(client, experiment, "r", {})
        said: list[str] = []
        # An outage would be waited out for 600 s: the test's 300 s timeout fails it if a refusal is taken for one.
        logger = RunLogger(client, run_id, flush_every=1, fallback_dir=tmp_path / "fallback", outage_timeout_s=600,
                           say=said.append)  # fmt: skip
        logger.log_dict({"train_loss": 0.5}, step=1)
        logger.log_dict({"test_recall.Sports & Games": 0.9}, step=1)  # '&' is no legal metric name
        with pytest.raises(TrackingRefused) as failed:
            logger.close("FINISHED")
        message = str(failed.value)
        assert "key 'test_recall.Sports & Games'" in message and "Invalid value" in message, message
        assert client.get_run(run_id).info.status == "FAILED"
        assert [m.value for m in client.get_metric_history(run_id, "train_loss")] == [0.5]  # the rest delivered
        assert not (tmp_path / "fallback").exists() and not [s for s in said if "unreachable" in s], said
    finally:
        server.kill()


def test_a_dropped_connection_is_retried_and_every_metric_arrives_once(tmp_path: Path, monkeypatch):
    import time

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # as a trial sets them (leave_retries_to_run_logger)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    server = SqliteServer(tmp_path)
    server.start()
    try:
        client = MlflowClient(server.url)
        run_id = start_run(client, client.create_experiment("outage"), "r", {})
        said: list[str] = []
        logger = RunLogger(client, run_id, flush_every=5, outage_timeout_s=120, say=said.append)
        server.kill()
        for step in range(12):
            logger.log_dict({"train_loss": float(step)}, step=step)
        logger.flush()
        deadline = time.monotonic() + 60
        while not any("unreachable" in s for s in said) and time.monotonic() < deadline:
            time.sleep(0.2)
        server.start()
        logger.close("FINISHED")
        assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == list(range(12))
        assert client.get_run(run_id).info.status == "FINISHED"
        assert any("unreachable" in s for s in said), said
    finally:
        server.kill()


class DropsOnce:
    """A real client whose `fail_at`-th log_batch call raises a dropped connection (after nothing was stored)."""

    def __init__(self, client: MlflowClient, fail_at: int) -> None:
        self.client, self.calls, self.fail_at = client, 0, fail_at

    def log_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_at:
            raise ConnectionResetError("connection dropped")
        return self.client.log_batch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_a_chunk_already_delivered_is_never_sent_twice(tmp_path: Path):
    tracking = TrackingParams(uri="sqlite:///store.db", experiment="t", registered_model=None, upload_retry_s=1)
    client, experiment = open_experiment(tracking, tmp_path)
    run_id = start_run(client, experiment, "r", {})
    logger = RunLogger(DropsOnce(client, fail_at=2), run_id, flush_every=10**6, outage_timeout_s=60, say=print)
    for step in range(2500):  # three chunks of at most 1000: the second is dropped once
        logger.log_dict({"train_loss": float(step)}, step=step)
    logger.close()
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == list(range(2500))


def test_the_next_train_replays_a_fallback_file_into_its_run_once(tmp_path: Path):
    tracking = TrackingParams(uri="sqlite:///store.db", experiment="t", registered_model=None, upload_retry_s=1)
    client, experiment = open_experiment(tracking, tmp_path)
    run_id = start_run(client, experiment, "r", {})
    folder = tmp_path / "mlflow-fallback"
    folder.mkdir()
    metrics = [{"key": "train_loss", "value": float(i), "timestamp": 1, "step": i} for i in range(1500)]
    (folder / f"{run_id}.json").write_text(json.dumps({"run_id": run_id, "status": "FINISHED",
                                                       "tags": {"note": "kept"}, "metrics": metrics}))  # fmt: skip
    said: list[str] = []
    flaky = DropsOnce(client, fail_at=2)  # the second chunk is dropped: the file keeps only what was not sent
    assert replay_fallbacks(flaky, folder, said.append) == 0
    assert len(json.loads((folder / f"{run_id}.json").read_text())["metrics"]) == 500
    assert replay_fallbacks(client, folder, said.append) == 1 and not list(folder.iterdir())
    assert sorted(m.step for m in client.get_metric_history(run_id, "train_loss")) == list(range(1500))
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["note"] == "kept"
