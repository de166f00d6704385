"""Adding a task is one new file in tasks/ and its line in pipelines/task_registry.py: nothing else changes.

The toy task (tests/pipelines/tasks/toy_regression.py, 50 lines) is registered by one line and then runs
through the engine, validation, the report's columns, Tune's objective and the served model's input column,
none of which names it.
"""

from __future__ import annotations

import torch

from pipelines.comparison import columns_for, delta_header
from pipelines.task_registry import TASKS
from pipelines.tasks import get_task, tune_objective
from pipelines.tracking.mlflow_model import input_column
from pipelines.train.engine import TrainRequest, train_model
from tests.conftest import REPO_ROOT
from tests.pipelines.train.helpers import tiny_model, tiny_split

TOY = REPO_ROOT / "tests/pipelines/tasks/toy_regression.py"


def test_a_fourth_task_is_one_file_and_one_registry_line(monkeypatch, default_params):
    monkeypatch.setitem(TASKS, "regression", "tests.pipelines.tasks.toy_regression:RegressionTask")  # the one line
    task = get_task("regression")
    # The schema takes its task names from the registry when it is imported; this test registers the task later.
    params = default_params.model_copy(
        update={"task": "regression", "epochs": 4, "lr": 0.002, "batch_size": 8, "log_every_n_steps": 6}
    )

    result = train_model(TrainRequest(tiny_model(), tiny_split(seed=1), tiny_split(rows=48, seed=2), params,
                         pad_id=0, device=torch.device("cpu"), precision="fp32", task=task))  # fmt: skip

    losses = [point["loss"] for point in result.history]
    assert sum(losses[-2:]) < 0.5 * sum(losses[:2]), losses  # it learns the label from its tokens
    assert tune_objective(params) == ("val_loss", "min")
    assert [c.header for c in columns_for("regression")][-1] == "MAE" and "MAE" in delta_header("regression")
    assert input_column("regression") == "text"
    assert len(TOY.read_text().splitlines()) <= 60
