"""After a `kill -9`, the next stage that opens the store (evaluate and report too) closes the dead runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.params import load_params
from pipelines.tracking.runs import open_experiment, start_run
from tests.conftest import REPO_ROOT, git_env


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no process has it now


def store_with_a_dead_run(root: Path) -> tuple[object, str, str, str]:
    shutil.copy(REPO_ROOT / "params.yaml", root / "params.yaml")
    client, experiment_id = open_experiment(load_params(root / "params.yaml").tracking, root)
    parent = start_run(client, experiment_id, "train-x", {})
    child = start_run(client, experiment_id, "vanilla-1", {"variant": "vanilla"}, parent_run_id=parent)
    client.log_metric(child, "train_time_s", 1.0)
    client.set_terminated(child, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    dead = start_run(client, experiment_id, "killed-trial", {"pid": str(dead_pid())}, parent_run_id=parent)
    return client, experiment_id, parent, dead


@pytest.mark.parametrize("stage", ["evaluate", "report"])
def test_a_stage_closes_runs_whose_process_died(tmp_path: Path, stage: str):
    client, experiment_id, parent, dead = store_with_a_dead_run(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "trials.json").write_text(
        json.dumps({"experiment_id": experiment_id, "parent_run_id": parent, "best": {"mlflow_run_id": parent}})
    )
    assert client.get_run(dead).info.status == "RUNNING"
    env = {**git_env(), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", f"stages.{stage}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    # report succeeds; evaluate has no model to evaluate here and fails, after opening the store.
    assert (proc.returncode == 0) == (stage == "report"), proc.stderr[-2000:]
    assert client.get_run(dead).info.status == "KILLED"
    assert "closed MLflow run 'killed-trial' as KILLED" in proc.stdout
