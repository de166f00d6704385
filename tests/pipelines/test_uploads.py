"""Uploads that the artifact store refuses: retried, recorded as pending on their run, sent later; and a server's
401 and 403 explained. A real sqlite store with local artifacts; the store's refusals are MLflow's own exceptions."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED
from mlflow.tracking import MlflowClient

from pipelines.errors import UserError
from pipelines.params import TrackingParams
from pipelines.tracking.access import refusal
from pipelines.tracking.uploads import PENDING_TAG, Upload, pending, send_or_defer, with_retries
from pipelines.trials.unsent import local_place, resume_upload

TRACKING = TrackingParams(uri="http://10.0.0.5:5000", experiment="finetune", registered_model=None, upload_retry_s=1)


@pytest.fixture
def store(tmp_path: Path) -> tuple[MlflowClient, str]:
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("x", artifact_location=(tmp_path / "artifacts").as_uri())
    return client, experiment


def test_an_upload_is_retried_until_it_succeeds_within_the_budget():
    calls = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError("bucket down")
        return "sent"

    assert with_retries(flaky, retry_s=10, first_delay_s=0.05) == "sent" and len(calls) == 3
    assert calls[2] - calls[1] > calls[1] - calls[0]  # the waits double


def test_an_upload_past_its_budget_raises_the_last_error():
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="bucket down"):
        with_retries(lambda: (_ for _ in ()).throw(ConnectionError("bucket down")), retry_s=0.3, first_delay_s=0.1)
    assert time.monotonic() - started < 2


def test_a_refused_upload_is_recorded_on_its_run_and_said(store):
    client, experiment = store
    run_id = client.create_run(experiment).info.run_id
    said: list[str] = []

    def down() -> None:
        raise ConnectionError("bucket down")

    assert send_or_defer(client, run_id, Upload("model", "trial:t1", down), 0.0, said.append) is None
    params_file = Upload("params.json", "trial:t1/params.json", down)
    assert send_or_defer(client, run_id, params_file, 0.0, said.append) is None
    assert pending(client, run_id) == {"model": "trial:t1", "params.json": "trial:t1/params.json"}
    assert "could not send 'model'" in said[0] and "--resume-upload" in said[0] and "bucket down" in said[0]
    assert send_or_defer(client, run_id, Upload("x", "x", lambda: "ok"), 0.0, said.append) == "ok" and len(said) == 2


def test_kept_places_resolve_to_the_best_folder_the_unsent_folder_or_the_outputs(tmp_path: Path):
    models = tmp_path / "models"
    assert local_place("trial:b1", models, best_trial="b1") == models / "best"
    assert local_place("trial:o2/params.json", models, best_trial="b1") == models / "unsent/o2/params.json"
    assert local_place("out:trials.json", models, best_trial="b1") == models / "trials.json"
    assert local_place("reports", models, best_trial="b1") == Path("reports")


def test_resume_upload_sends_pending_files_and_clears_the_tag(store, tmp_path: Path):
    client, experiment = store
    parent, child = (client.create_run(experiment).info.run_id for _ in range(2))
    models = tmp_path / "models"
    (models / "best").mkdir(parents=True)
    (models / "best/params.json").write_text("{}")
    summary = {"parent_run_id": parent, "best": {"trial_id": "b1", "mlflow_run_id": child},
               "trials": [{"trial_id": "b1", "mlflow_run_id": child}]}  # fmt: skip
    (models / "trials.json").write_text(json.dumps(summary))
    client.set_tag(parent, PENDING_TAG, json.dumps({"trials.json": "out:trials.json"}))
    client.set_tag(child, PENDING_TAG, json.dumps({"params.json": "trial:b1/params.json"}))
    said: list[str] = []
    assert resume_upload(client, models, 1.0, said.append, lambda run_id: None) == 2
    assert PENDING_TAG not in client.get_run(parent).data.tags and PENDING_TAG not in client.get_run(child).data.tags
    assert [a.path for a in client.list_artifacts(parent)] == ["trials.json"]
    assert [a.path for a in client.list_artifacts(child)] == ["params.json"]
    assert resume_upload(client, models, 1.0, said.append, lambda run_id: None) == 0
    assert said[-1].startswith("nothing was pending")


def test_resume_upload_names_a_kept_copy_that_is_gone(store, tmp_path: Path):
    client, experiment = store
    parent = client.create_run(experiment).info.run_id
    (tmp_path / "models").mkdir()
    summary = {"parent_run_id": parent, "best": {"trial_id": "b1", "mlflow_run_id": parent}, "trials": []}
    (tmp_path / "models/trials.json").write_text(json.dumps(summary))
    client.set_tag(parent, PENDING_TAG, json.dumps({"model": "trial:gone"}))
    with pytest.raises(UserError, match="unsent/gone: the kept copy of run .*'model' is gone"):
        resume_upload(client, tmp_path / "models", 1.0, print, lambda run_id: None)


def test_a_servers_401_and_403_say_who_and_what_to_do_without_the_password(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "bob")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-pass")
    denied = refusal(MlflowException("Permission denied", error_code=PERMISSION_DENIED), TRACKING)
    assert denied is not None and "user 'bob' may not write" in str(denied) and "EDIT permission" in str(denied)
    assert "tracking.experiment = 'finetune'" in str(denied)
    unknown = refusal(MlflowException("You are not authenticated", error_code=UNAUTHENTICATED), TRACKING)
    assert unknown is not None and "refused the credentials of user 'bob'" in str(unknown)
    assert "MLFLOW_TRACKING_PASSWORD" in str(unknown) and "s3cret-pass" not in str(denied) + str(unknown)
    assert refusal(MlflowException("boom"), TRACKING) is None and refusal(OSError("down"), TRACKING) is None
