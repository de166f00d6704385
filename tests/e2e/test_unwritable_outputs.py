"""An immutable `models/` (the issue's reporter: `chattr +i`, which stops root too): refused before any training when it
is so at the start; when it becomes so during training, the stage fails cleanly at its end, with nothing registered,
its run FAILED, the old `models/` intact and no temporary folder left. Ray's lines in the captured output are plain."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import git_env, kill_session, run, write_params
from tests.pipelines.test_unwritable_outputs import immutable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SETTINGS = {"data.generator.num_rows": 3000, "epochs": 2, "checkpoint_every_n_steps": 20, "log_every_n_steps": 5}
MODEL = "finetune-classification"  # tracking.registered_model: auto, for the default task


def store(root: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith((".models.", ".metrics.", ".plots.")))


def test_an_immutable_models_folder_is_refused_before_anything_is_trained(project_copy: Path):
    models = project_copy / "models"
    (models / "best").mkdir(parents=True)
    (models / "best" / "weights.bin").write_bytes(b"the model of an earlier run")
    with immutable(models):
        proc = run([sys.executable, "-m", "stages.train"], project_copy, check=False, timeout=300)
    # Before: every trial trained, then `PermissionError: ... 'models' -> '.models.old-<pid>'`, the model registered.
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(
        "error: the train stage could not put its outputs in place, so it stops before doing anything: "
        f"{Path('models')} is immutable or read-only; make it writable (`lsattr -d models` shows an immutable `i`, "
        "removed by `chattr -i models`"
    ), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (project_copy / "checkpoints").exists() and not (project_copy / "mlflow.db").exists()  # no trial ran
    assert (models / "best" / "weights.bin").read_bytes() == b"the model of an earlier run"
    assert leftovers(project_copy) == []


def test_models_made_immutable_during_training_fails_at_the_end_with_nothing_registered(
    project_copy: Path, own_ray_cluster: None
):
    write_params(project_copy, SETTINGS)
    run([sys.executable, "-m", "stages.tokenize"], project_copy)
    models = project_copy / "models"
    models.mkdir()
    (models / "earlier.txt").write_text("an earlier run's")
    metrics = (project_copy / "metrics" / "train.json").read_bytes()  # the committed one
    checkpoints = project_copy / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.train"], cwd=project_copy, env=git_env(), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(checkpoints.glob("*/checkpoint.pt")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert list(checkpoints.glob("*/checkpoint.pt")), "no checkpoint was written"
        with immutable(models):  # past the check at the start: training is under way
            stdout, stderr = proc.communicate(timeout=600)
            assert leftovers(project_copy) == []  # the staged folder went with the failure, not only after a chattr -i
    finally:
        kill_session(proc.pid)
    assert proc.returncode == 1, stderr
    assert f"error: {Path('models')}: operation not permitted, so the new output could not take its place" in stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in models.iterdir()) == ["earlier.txt"]
    assert (project_copy / "metrics" / "train.json").read_bytes() == metrics  # no metrics of a model not in place

    client = store(project_copy)
    assert client.search_model_versions(f"name = '{MODEL}'") == []  # before: registered, then the stage failed
    runs = client.search_runs([client.get_experiment_by_name("finetune").experiment_id])
    parent = [r for r in runs if r.data.tags.get("stage") == "train"]
    assert [r.info.status for r in parent] == ["FAILED"], [(r.info.run_name, r.info.status) for r in runs]
    assert "RUNNING" not in {r.info.status for r in runs}

    # Ray's lines (a trial's own output, `(pid=...)`-prefixed) reached the captured streams, without colour codes.
    assert "pid=" in stdout + stderr
    assert "\x1b[" not in stdout + stderr
