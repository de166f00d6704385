"""Models the artifact store refused survive the next train, and `--resume-upload` sends those of both trains, one
logged model per trial. The default sqlite store, no server: its artifact store (`mlartifacts/` beside the project)
fails for real while a regular file stands in its place, and comes back when the file is removed.
The same with a team server's bucket: tests/e2e/test_team_server.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import QUICK, run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def stage(root: Path, *args: str):
    return run([sys.executable, "-m", *args], root, timeout=800)


def test_a_second_train_keeps_the_first_ones_unsent_models_and_resume_upload_sends_both(project_copy: Path):
    variants = {"adamw": {}, "adafactor": {"optim": "adafactor"}}
    write_params(project_copy, {**QUICK, "tune.variants": variants, "tracking.upload_retry_s": 1})
    stage(project_copy, "stages.tokenize")
    (project_copy / "mlartifacts").write_text("the artifact store is down")
    first = stage(project_copy, "stages.train")
    assert "could not send 'model'" in first.stdout + first.stderr
    earlier = json.loads((project_copy / "models/trials.json").read_text())

    second = stage(project_copy, "stages.train")  # the store is still down
    assert "3 run(s) of an earlier train still have artifacts marked upload.pending" in second.stdout
    for trial in earlier["trials"]:  # the earlier best included: the new train replaced models/best
        assert (project_copy / "models/unsent" / trial["trial_id"] / "model.safetensors").is_file()
    assert (project_copy / f"models/unsent/{earlier['parent_run_id']}/trials.json").is_file()

    (project_copy / "mlartifacts").unlink()  # the store is back
    resumed = stage(project_copy, "stages.train", "--resume-upload")
    assert "10 pending artifact(s) sent" in resumed.stdout and "registered the best model" in resumed.stdout
    client = MlflowClient(f"sqlite:///{project_copy / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune").experiment_id
    runs = client.search_runs([experiment])
    assert len(runs) == 6 and not [r.info.run_name for r in runs if "upload.pending" in r.data.tags]
    for trial in [r for r in runs if "mlflow.parentRunId" in r.data.tags]:
        models = client.search_logged_models([experiment], filter_string=f"source_run_id = '{trial.info.run_id}'")
        # One per trial: the failed attempt in the train stage and the resumed one filled the same model.
        assert [(m.model_id, m.status.name) for m in models] == [
            (trial.data.tags["model_uri"].removeprefix("models:/"), "READY")
        ]
