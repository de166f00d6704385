"""Nothing the artifact store refused is lost: a trial keeps whatever its pending artifacts need, a new train keeps
what the earlier one's pending artifacts need, `--resume-upload` sends all it can before it lists the rest, retries
fill one logged model, and a compile blob goes to the store once per experiment.

A real sqlite store whose local artifact store fails for real: a regular file stands where a run's (or the logged
models') artifact folder must be made, so every write there fails with NotADirectoryError, also as root (which
permissions would not stop); removing the file is the bucket coming back.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.atomic import atomic_dir
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.tracking.mlflow_model import upload_trial_model
from pipelines.tracking.uploads import Upload, pending, send_or_defer
from pipelines.trials.unsent import keep_unsent_folders, resume_upload


@pytest.fixture
def store(tmp_path: Path) -> tuple[MlflowClient, str, Path]:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    return client, client.create_experiment("x", artifact_location=artifacts.as_uri()), artifacts


def block(artifacts: Path, name: str) -> None:
    """The store cannot write under `artifacts/<name>` (a run id, or `models`) until `unblock`."""
    (artifacts / name).write_text("not a folder")


def unblock(artifacts: Path, name: str) -> None:
    (artifacts / name).unlink()


def refuse(client: MlflowClient, run_id: str, artifact: str, local: str, source: Path) -> None:
    """Send `source` as the run's `artifact` the way the stages do; the store refuses it, so it is left pending."""
    send = lambda: client.log_artifact(run_id, str(source))  # noqa: E731
    assert send_or_defer(client, run_id, Upload(artifact, local, send), 0.0, lambda _: None) is None


def trial_folder(folder: Path, params: Params) -> Path:
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps(params.model_dump(mode="json")))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def summary_of(parent: str, trials: dict[str, str], best: str) -> dict:
    return {"parent_run_id": parent, "best": {"trial_id": best, "mlflow_run_id": trials[best]},
            "trials": [{"trial_id": trial, "mlflow_run_id": run} for trial, run in trials.items()]}  # fmt: skip


def test_a_trial_whose_params_alone_failed_keeps_them_and_resume_sends_all_it_can_before_listing(
    store, tmp_path, default_params
):
    client, experiment, artifacts = store
    parent, best, stuck, other = (client.create_run(experiment).info.run_id for _ in range(4))
    for run in (parent, best, stuck, other):
        block(artifacts, run)  # the bucket is down while the trials start: each trial's params.json stays pending
    staging, models = tmp_path / "staging", tmp_path / "models"
    trials = {"b1": best, "s2": stuck, "o3": other}
    for trial, run in trials.items():
        folder = trial_folder(staging / trial, default_params)
        refuse(client, run, "params.json", f"trial:{trial}/params.json", folder / "params.json")
    models.mkdir()
    shutil.move(staging / "b1", models / "best")  # as the train stage keeps its best trial
    summary = summary_of(parent, trials, "b1")
    # The models were sent (the bucket came back): only params.json is pending, and only it is kept.
    assert keep_unsent_folders(client, summary, staging, models) == ["o3", "s2"]
    assert (models / "unsent/o3/params.json").is_file() and not (models / "unsent/o3/model.safetensors").exists()
    (models / "trials.json").write_text(json.dumps(summary))
    refuse(client, parent, "trials.json", "out:trials.json", models / "trials.json")

    for run in (parent, best, other):
        unblock(artifacts, run)  # back, except for the run `stuck`, which comes before `other`
    said: list[str] = []
    with pytest.raises(UserError) as failed:
        resume_upload(client, models, 0.0, said.append, lambda run_id: None)
    assert "3 pending artifact(s) sent" in said
    assert "could not send everything; what it could not (1) stays pending" in str(failed.value)
    assert f"'params.json' of run {client.get_run(stuck).info.run_name}: NotADirectoryError" in str(failed.value)
    assert pending(client, stuck) == {"params.json": "trial:s2/params.json"}
    for run in (parent, best, other):
        assert pending(client, run) == {}
    assert [a.path for a in client.list_artifacts(other)] == ["params.json"]
    assert [a.path for a in client.list_artifacts(parent)] == ["trials.json"]


def test_a_new_train_keeps_what_the_earlier_ones_pending_uploads_need_and_resume_sends_them(
    store, tmp_path, default_params, monkeypatch, capsys
):
    from stages.train import OUT_DIR, keep_earlier_unsent

    client, experiment, artifacts = store
    monkeypatch.chdir(tmp_path)  # the stage's outputs are relative to the repository root
    parent, best, other, sent = (client.create_run(experiment).info.run_id for _ in range(4))
    for run in (parent, best, other):
        block(artifacts, run)
    trials = {"b1": best, "o2": other, "s3": sent}
    trial_folder(OUT_DIR / "best", default_params)  # the earlier train: its best's params.json was refused
    refuse(client, best, "params.json", "trial:b1/params.json", OUT_DIR / "best/params.json")
    trial_folder(OUT_DIR / "unsent/o2", default_params)  # another trial's model was refused
    refuse(client, other, "model", "trial:o2", OUT_DIR / "unsent/o2/model.safetensors")
    (OUT_DIR / "trials.json").write_text(json.dumps(summary_of(parent, trials, "b1")))
    refuse(client, parent, "trials.json", "out:trials.json", OUT_DIR / "trials.json")

    with atomic_dir(OUT_DIR) as new:  # the next train, as stages/train.py runs it
        new_parent, new_best = (client.create_run(experiment).info.run_id for _ in range(2))
        trial_folder(new / "best", default_params)
        (new / "trials.json").write_text(json.dumps(summary_of(new_parent, {"n1": new_best}, "n1")))
        keep_earlier_unsent(client.tracking_uri, new)
    assert "3 run(s) of an earlier train still have artifacts marked upload.pending" in capsys.readouterr().out
    assert (OUT_DIR / "unsent/b1/params.json").is_file() and not (OUT_DIR / "unsent/b1/model.safetensors").exists()
    assert (OUT_DIR / "unsent/o2/model.safetensors").is_file()
    assert json.loads((OUT_DIR / f"unsent/{parent}/trials.json").read_text())["parent_run_id"] == parent
    assert json.loads((OUT_DIR / "unsent/runs.json").read_text()) == sorted([parent, best, other])

    for run in (parent, best, other):
        unblock(artifacts, run)
    said: list[str] = []
    assert resume_upload(client, OUT_DIR, 0.0, said.append, lambda run_id: pytest.fail("not this train's best")) == 3
    assert all(pending(client, run) == {} for run in (parent, best, other))
    assert client.get_run(other).data.tags["model_uri"].startswith("models:/")
    (tmp_path / "back").mkdir()
    back = Path(client.download_artifacts(parent, "trials.json", str(tmp_path / "back")))
    assert json.loads(back.read_text())["parent_run_id"] == parent  # the earlier train's summary, not the new one


def test_retries_of_a_model_upload_fill_one_logged_model(store, tmp_path):
    client, experiment, artifacts = store
    run = client.create_run(experiment).info.run_id
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "MLmodel").write_text("flavors: {}\n")
    block(artifacts, "models")  # every logged model's files go under artifacts/models/<model id>/
    send = lambda: upload_trial_model(client, experiment, run, saved, retry_s=0.0)  # noqa: E731
    # Two attempts (the outer retry waits 1 s, then the budget is spent), as a trial's upload is retried.
    assert send_or_defer(client, run, Upload("model", "trial:t1", send), 1.5, lambda _: None) is None
    assert [m.status.name for m in client.search_logged_models([experiment])] == ["FAILED"]
    unblock(artifacts, "models")
    uri = upload_trial_model(client, experiment, run, saved)  # what --resume-upload sends
    models = client.search_logged_models([experiment])
    assert [(m.model_id, m.status.name) for m in models] == [(uri.removeprefix("models:/"), "READY")]
    assert (artifacts / "models" / models[0].model_id / "artifacts/MLmodel").is_file()


def test_a_compile_blob_goes_to_the_store_once_per_experiment(store, tmp_path):
    from pipelines.tracking.uploads import BLOB_RUN_TAG, send_compile_blob_once

    client, experiment, _ = store
    blob = tmp_path / "mega/0123abcd.bin"
    blob.parent.mkdir()
    blob.write_bytes(b"graphs")
    first, second = (client.create_run(experiment).info.run_id for _ in range(2))
    assert send_compile_blob_once(client, first, blob) == first
    assert send_compile_blob_once(client, second, blob) == first  # the same fingerprint: not sent again
    assert [a.path for a in client.list_artifacts(first, "compile_cache")] == ["compile_cache/0123abcd.bin"]
    assert client.list_artifacts(second, "compile_cache") == []
    assert client.get_run(second).data.tags[BLOB_RUN_TAG] == first
    other_experiment = client.create_experiment("y", artifact_location=(tmp_path / "y").as_uri())
    elsewhere = client.create_run(other_experiment).info.run_id
    assert send_compile_blob_once(client, elsewhere, blob) == elsewhere  # another experiment gets its own copy
