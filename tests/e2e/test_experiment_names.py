"""After `dvc exp run -S optim=adafactor`: the README's `dvc exp show` line reads whole at 120 columns (no cell cut to
`…`, the test quality and `timing` shown), and the trial is named by what the experiment changed (`optim=adafactor`),
not `default`, in reports/report.md and in its MLflow run name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import QUICK, REPO_ROOT, run, write_params
from tests.e2e.test_readme import command_blocks, commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def readme_exp_show() -> str:
    """The README's `dvc exp show` line, as written there."""
    found = [c for path, block in command_blocks() if path == REPO_ROOT / "README.md" for c in commands(block)
             if c.startswith("dvc exp show --no-pager")]  # fmt: skip
    assert len(found) == 1, found
    return found[0]


def test_an_experiment_reads_whole_at_120_columns_and_is_named_by_its_change(project_copy: Path):
    root = project_copy
    write_params(root, QUICK)
    run(["dvc", "repro"], root, timeout=900)
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "baseline"], root)
    run(["dvc", "exp", "run", "-S", "optim=adafactor"], root, timeout=900)

    shown = run(["bash", "-c", readme_exp_show()], root, env={"COLUMNS": "120"}).stdout
    lines = [line.rstrip() for line in shown.splitlines() if line.strip()]
    assert "…" not in shown and max(len(line) for line in lines) <= 120, shown
    header = lines[1].split()
    assert header == ["changed", "test_accuracy", "train_time_s", "timing"], shown
    evaluated = json.loads((root / "metrics/evaluate.json").read_text())
    row = next(line for line in lines if line.lstrip().startswith("optim=adafactor"))
    changed, accuracy, train_time, timing = re.split(r"\s{3,}", row.strip())
    # dvc prints 5 significant digits of the figures the evaluate stage wrote.
    assert float(accuracy) == pytest.approx(evaluated["test_accuracy"], rel=1e-4), (row, evaluated)
    assert float(train_time) == pytest.approx(evaluated["train_time_s"], rel=1e-4), (row, evaluated)
    assert (changed, timing) == (evaluated["changed"], evaluated["timing"]), (row, evaluated)

    report = (root / "reports/report.md").read_text()
    assert "| optim=adafactor |" in report and "| default |" not in report, report
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    trials = [r for r in client.search_runs([experiment.experiment_id]) if r.data.params.get("optim") == "adafactor"
              and "mlflow.parentRunId" in r.data.tags]  # fmt: skip
    assert len(trials) == 1 and trials[0].info.run_name.startswith("optim=adafactor · seed "), trials
