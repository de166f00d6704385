"""DVC-driven comparisons: a strategy grid in one `dvc repro`, and queued experiments in temporary copies."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.tracking.status import display_rounded
from tests.conftest import QUICK, run, write_params
from tests.e2e.mlflow_ui import compare_view_metrics, mlflow_ui, runs_table_rows

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STRATEGIES = {
    "vanilla": {"data.bucketing": False},
    "bf16": {"precision": "bf16"},
    "accumulation": {"batch_size": 8, "grad_accum_steps": 4},
    "checkpointing": {"grad_checkpointing": True},
    "adafactor": {"optim": "adafactor"},
    "all": {
        "precision": "bf16",
        "batch_size": 8,
        "grad_accum_steps": 4,
        "grad_checkpointing": True,
        "optim": "adafactor",
    },
}


def report_rows(report: str) -> dict[str, list[str]]:
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] in STRATEGIES:
            rows[cells[0]] = cells
    return rows


def test_strategy_grid_in_one_dvc_repro_reports_relative_to_vanilla(project_copy: Path):
    write_params(
        project_copy,
        {"tune.variants": STRATEGIES, "tune.max_concurrent_trials": 2, "epochs": 1, "data.generator.num_rows": 1500},
    )
    done = run(["dvc", "repro"], project_copy, timeout=800)
    report = (project_copy / "reports/report.md").read_text()
    rows = report_rows(report)
    assert list(rows) == list(STRATEGIES)  # one row per strategy, vanilla (the baseline) first
    # The train stage says where the trials are: the runs page, opened on model training (MLflow 3.17's UI
    # otherwise opens on its GenAI overview).
    (page,) = re.findall(r"^MLflow: .* then open http://127\.0\.0\.1:5000/(#/experiments/\d+/runs\?workflowType="
                         r"machine_learning&viewStateShareKey=training)$", done.stdout, re.M)  # fmt: skip
    header = [c.strip() for c in report.split("| Trial |", 1)[1].splitlines()[0].strip("|").split("|")]
    time_col = 1 + header.index("Train time")
    assert rows["vanilla"][time_col].endswith("(100%)")
    assert all(re.search(r"\(\d+%\)$", row[time_col]) for row in rows.values())
    assert "relative to the baseline trial `vanilla`" in report

    # The MLflow UI, as a user opens it (a real server, headless Chromium): every trial's row in the runs
    # table shows its three datasets with their digests, and its model (the best one as a registered version).
    experiment_id = (
        MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
        .get_experiment_by_name("finetune")
        .experiment_id
    )

    def every_cell_loaded(rows: list[str]) -> bool:  # each trial's test dataset, and the registered model
        with_datasets = sum(bool(re.search(r"test \([0-9a-f]{12}\)", row)) for row in rows)
        return with_datasets >= len(STRATEGIES) and any("finetune-classification v1" in row for row in rows)

    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    trial_ids = [r.info.run_id for r in client.search_runs([experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    with mlflow_ui(project_copy / "mlflow.db") as url:
        assert page.startswith(f"#/experiments/{experiment_id}/runs?")
        runs_table_rows(f"{url}/{page}", sidebar=(sidebar := []))  # as the train stage says to open it
        rows = runs_table_rows(f"{url}/#/experiments/{experiment_id}/runs", ready=every_cell_loaded)
        # `Compare` on the trials opens its plot on the headline quality (not system/cpu_utilization_percentage):
        # validation's, which the trials are chosen on; only the chosen one is scored on the test split.
        compared = compare_view_metrics(url, experiment_id, trial_ids)
    assert compared == ["val_accuracy"], compared
    assert "Models" in sidebar[0] and "Judges" not in sidebar[0], sidebar  # Model training's menu, not GenAI's
    for column in ("test_accuracy", "train_time_s", "peak_train_memory_mib"):  # the headline, as columns (MiB),
        assert column in sidebar[1], sidebar[1]  # each whole within a 1400x1000 window (`mlflow_ui.WINDOW`)
    assert len(trial_ids) == len(STRATEGIES)
    # Each trial's row is named by what it varies: its variant and seed.
    named = {name: re.compile(rf"\b{re.escape(name)} · seed \d+") for name in STRATEGIES}
    trial_rows = {name: row for name, pattern in named.items() for row in rows if pattern.search(row)}
    assert set(trial_rows) == set(STRATEGIES), rows
    for name, row in trial_rows.items():
        for split in ("train", "validation", "test"):
            assert re.search(rf"{split} \([0-9a-f]{{12}}\)", row), (name, split, row)
        assert re.search(r"\b(model|finetune-classification v\d+) \|\s*$", row), (name, row)
    # The best trial, registered under the experiment's name and its task.
    assert sum("finetune-classification v1" in row for row in trial_rows.values()) == 1


def test_queued_experiment_lands_in_the_repository_store(project_copy: Path):
    write_params(project_copy, QUICK)  # what is tested is the queue, not the defaults' training (test_pipeline.py)
    run(["dvc", "repro"], project_copy, timeout=600)
    run(["git", "add", "-A"], project_copy)
    run(["git", "commit", "-qm", "baseline"], project_copy)
    run(["dvc", "exp", "run", "--queue", "-S", "lr=0.002"], project_copy)
    run(["dvc", "queue", "start"], project_copy)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = run(["dvc", "queue", "status"], project_copy).stdout
        if not re.search(r"\b(Queued|Running)\b", status):
            break
        time.sleep(5)
    else:
        pytest.fail(f"queued experiment did not finish:\n{status}")
    assert "Success" in status, status
    run(["dvc", "queue", "stop", "--kill"], project_copy, check=False)
    # In DVC's temp copy the evaluate stage still finds the baseline commit (DVC_EXP_BASELINE_REV): `dvc exp show`'s
    # first column names the experiment's one change, and its time is not marked as taken on another host.
    shown = json.loads(run(["dvc", "exp", "show", "--json"], project_copy).stdout)
    figures = [
        rev["data"]["metrics"]["metrics/evaluate.json"]["data"]
        for baseline in shown for exp in baseline.get("experiments") or [] for rev in exp.get("revs") or []
    ]  # fmt: skip
    assert [f["changed"] for f in figures] == ["lr=0.002"], figures
    assert not re.search("other host|host unknown|no baseline", figures[0]["timing"]), figures

    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    runs = client.search_runs([experiment.experiment_id])
    queued = [r for r in runs if r.data.params.get("lr") == "0.002" and "mlflow.parentRunId" in r.data.tags]
    assert len(queued) == 1 and queued[0].info.status == "FINISHED"
    assert queued[0].data.metrics["test_accuracy"] > 0  # evaluate, in the temp copy, logged to the same store
    assert not list((project_copy / ".dvc" / "tmp").rglob("mlflow.db"))  # nothing followed DVC's temp copy
    parent = client.get_run(queued[0].data.tags["mlflow.parentRunId"])
    assert parent.data.tags["dvc_exp_name"]  # the DVC experiment's name is on the parent run
    # It names the parent after what it changed, then the experiment, as `dvc exp show` does (its `changed` column).
    assert parent.info.run_name == f"lr=0.002 · {parent.data.tags['dvc_exp_name']}", parent.info.run_name
    # The runs table lists parents: each carries its best trial's headline figures, so it has columns to compare by,
    # rounded to 4 significant digits for that table (MLflow prints figures whole); the bytes stay exact.
    assert parent.data.metrics["peak_train_memory_bytes"] == queued[0].data.metrics["peak_train_memory_bytes"]
    for key in ("train_time_s", "peak_train_memory_mib", "samples_per_s", "test_accuracy"):
        assert parent.data.metrics[key] == display_rounded(queued[0].data.metrics[key]), key
        assert parent.data.metrics[key] == pytest.approx(queued[0].data.metrics[key], rel=1e-3), key
    assert parent.data.metrics["test_accuracy"] > 0
    # A trial's run name says what it varies: what the experiment changed (the default variant), its seed (and any
    # searched value).
    assert queued[0].info.run_name.startswith("lr=0.002 · seed "), queued[0].info.run_name
    # ...and ends with its DVC experiment's name, so two experiments' trials are told apart in the compare view.
    assert queued[0].info.run_name.endswith(f" · {parent.data.tags['dvc_exp_name']}"), queued[0].info.run_name
