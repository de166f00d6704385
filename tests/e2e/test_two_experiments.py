"""Two `dvc exp run` at once in one workspace: the second is refused, naming the first, and every result keeps the
params it was trained with (issue 62: the first's lr 0.001 result was recorded beside the second's lr 0.002)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.conftest import QUICK, git_env, kill_session, run, up_to_date, write_params

pytestmark = [pytest.mark.timeout(600)]

COMPARED = ("optim", "lr")  # what the two experiments change: each result must sit beside the values it trained with


def wait_for(text: str, log: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until `text` is in `log` (the process's output); fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert process.poll() is None, f"ended before {text!r}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout} s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def misattributed(where: str, params: dict, evaluated: dict, train_metrics: dict, client: MlflowClient) -> list[str]:
    """How a state's params (as recorded beside its results) differ from what its MLflow run trained with, and its
    test accuracy from that run's."""
    trained = client.get_run(train_metrics["mlflow_run_id"]).data
    problems = [f"{where}: {key}={params.get(key)} beside a result trained with {key}={trained.params.get(key)}"
                for key in COMPARED if str(params.get(key)) != trained.params.get(key)]  # fmt: skip
    if evaluated.get("test_accuracy") != pytest.approx(trained.metrics.get("test_accuracy")):
        problems.append(f"{where}: test_accuracy {evaluated.get('test_accuracy')}, its run's "
                        f"{trained.metrics.get('test_accuracy')}")  # fmt: skip
    return problems


def workspace_problems(root: Path, client: MlflowClient) -> list[str]:
    """params.yaml and dvc.lock's train entry against the run metrics/train.json names, beside
    metrics/evaluate.json."""
    read: Callable[[str], dict] = lambda path: json.loads((root / path).read_text())  # noqa: E731
    evaluated, train_metrics = read("metrics/evaluate.json"), read("metrics/train.json")
    locked = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["train"]["params"]["params.yaml"]
    return [
        *misattributed("params.yaml", yaml.safe_load((root / "params.yaml").read_text()), evaluated, train_metrics,
                       client),
        *misattributed("dvc.lock", locked, evaluated, train_metrics, client),
    ]  # fmt: skip


def experiments(root: Path) -> list[dict]:
    """Every experiment row of `dvc exp show --json` (not the workspace's, not the commit's)."""
    shown = json.loads(run(["dvc", "exp", "show", "--json"], root).stdout)
    return [rev for baseline in shown for exp in baseline.get("experiments") or [] for rev in exp.get("revs") or []]


def experiment_problems(root: Path, rows: list[dict], client: MlflowClient) -> list[str]:
    """Each row's params and metrics, as `dvc exp show` lists them, against the run its commit's train metrics name."""
    problems = []
    for row in rows:
        data = row["data"]
        params = data["params"]["params.yaml"]["data"]
        evaluated = data["metrics"]["metrics/evaluate.json"]["data"]
        train_metrics = json.loads(run(["git", "show", f"{row['rev']}:metrics/train.json"], root).stdout)
        problems += misattributed(f"dvc exp show {row.get('name')}", params, evaluated, train_metrics, client)
    return problems


@pytest.mark.slow
def test_a_second_experiment_while_one_trains_is_refused_and_every_result_keeps_its_params(project_copy: Path):
    write_params(project_copy, QUICK)
    run(["git", "commit", "-qam", "quick settings"], project_copy)
    log = project_copy.parent / "first.log"
    with log.open("w") as out:  # unbuffered: its "Running stage" lines say when the train stage starts
        first = subprocess.Popen(["dvc", "exp", "run", "-S", "optim=adafactor"], cwd=project_copy,
                                 env={**git_env(), "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    try:
        wait_for("Running stage 'train'", log, first)
        time.sleep(2)  # into its training (Ray's start, the trial: tens of seconds here)
        second = run(["dvc", "exp", "run", "-S", "lr=0.002"], project_copy, check=False, timeout=300)
        assert first.poll() is None, "the first finished before the second was refused: nothing was tested"
        first.wait(timeout=480)
    finally:
        if first.poll() is None:
            kill_session(first.pid)
    printed = log.read_text()

    # Every result beside the params it came from: the workspace's files, dvc.lock, and every experiment listed.
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    rows = experiments(project_copy)
    assert workspace_problems(project_copy, client) + experiment_problems(project_copy, rows, client) == []
    assert up_to_date(run(["dvc", "status"], project_copy).stdout)

    # The first, untouched by the second: it finished, and is the one experiment listed, with its params.
    assert first.returncode == 0, printed[-4000:]
    shown = [{key: row["data"]["params"]["params.yaml"]["data"][key] for key in COMPARED} for row in rows]
    assert shown == [{"optim": "adafactor", "lr": 0.001}], shown
    # The second, refused at its first stage, naming the first and what to do instead; what DVC had written into
    # params.yaml for it is put back, and kept aside.
    said = second.stdout + second.stderr
    assert second.returncode != 0, said
    running = f"another experiment is running in this workspace: `dvc exp run -S optim=adafactor` (PID {first.pid},"
    assert running in said, said
    assert "queue it: `dvc exp run --queue -S lr=0.002`, then `dvc queue start`" in said, said
    assert "lr: 0.001 -> 0.002" in said and "Traceback" not in said, said
    assert yaml.safe_load((project_copy / ".dvc/tmp/params.refused.yaml").read_text())["lr"] == 0.002
    every_run = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert "0.002" not in {trial.data.params.get("lr") for trial in every_run}  # the second never trained


def test_a_stage_is_refused_while_a_live_pipeline_holds_the_workspace_and_runs_once_it_has_ended(tmp_path: Path):
    # The claim as a running pipeline leaves it, held by a live process (a sleep standing for its DVC), then by a
    # dead one: a crashed run's claim needs no cleaning up.
    import psutil

    from tests.conftest import REPO_ROOT

    (tmp_path / ".dvc/tmp").mkdir(parents=True)
    (tmp_path / "params.yaml").write_text((REPO_ROOT / "params.yaml").read_text())
    holder = subprocess.Popen(["sleep", "120"])
    claim = {"pid": holder.pid, "started": psutil.Process(holder.pid).create_time(), "host": socket.gethostname(),
             "command": "dvc exp run -S optim=adafactor", "stage": "train"}  # fmt: skip
    (tmp_path / ".dvc/tmp/pipeline.lock").write_text(json.dumps(claim))
    validate = [sys.executable, "-m", "stages.validate"]
    try:
        refused = run(validate, tmp_path, check=False, env={"PYTHONPATH": str(REPO_ROOT)})
    finally:
        holder.kill()
        holder.wait()
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith(
        "error: another experiment is running in this workspace: "
        f"`dvc exp run -S optim=adafactor` (PID {holder.pid}, since "
    ), refused.stderr
    assert "at stage train)" in refused.stderr and "dvc queue start" in refused.stderr
    assert not (tmp_path / "metrics").exists()  # refused before writing anything
    run(validate, tmp_path, env={"PYTHONPATH": str(REPO_ROOT)})
    assert (tmp_path / "metrics/params_checked.json").is_file()


def test_a_model_is_not_evaluated_beside_params_it_was_not_trained_with(tmp_path: Path, monkeypatch):
    from pipelines.errors import UserError
    from pipelines.workspace import check_trained, params_now, record_trained
    from tests.conftest import REPO_ROOT

    monkeypatch.chdir(tmp_path)  # the stages' paths are relative to the repository's root
    (tmp_path / "params.yaml").write_text((REPO_ROOT / "params.yaml").read_text())
    write_params(tmp_path, {"lr": 0.001})
    (tmp_path / "models").mkdir()
    record_trained(tmp_path / "models", params_now())
    check_trained(tmp_path / "models", "evaluate")  # as trained: nothing to say
    write_params(tmp_path, {"lr": 0.003, "eval.model_uri": "models:/other/1"})  # the latter: not a train param
    with pytest.raises(UserError, match=r"params.yaml changed since the model was trained \(lr: 0.001 -> 0.003\)"):
        check_trained(tmp_path / "models", "evaluate")
