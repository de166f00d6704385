"""The tasks the pipeline fine-tunes for, by the `task` param (see pipelines.tasks.base.Task)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Literal

from pipelines.errors import UserError
from pipelines.task_registry import TASKS

if TYPE_CHECKING:
    from pipelines.params import Params
    from pipelines.tasks.base import Task

# Metric names that are better when lower, for a tune.metric whose tune.mode is auto.
_LOWER_IS_BETTER = ("loss", "perplexity", "time", "bytes")


def get_task(name: str) -> Task:
    """The task named by the `task` param (its module is imported on first use)."""
    if name not in TASKS:
        raise ValueError(f"task = {name!r} is not known; choose {', '.join(TASKS)}")
    module, _, cls = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), cls)()


def tune_objective(params: Params) -> tuple[str, Literal["max", "min"]]:
    """(metric, mode) that picks the best trial: tune.metric/mode, with auto resolved by the task's objective."""
    metric, mode = params.tune.metric, params.tune.mode
    task = get_task(params.task)
    if metric == "auto":
        metric, task_mode = task.objective
        return metric, task_mode if mode == "auto" else mode
    if metric not in task.validation_metric_names:
        raise UserError(
            f"tune.metric = {metric!r}: task {params.task} reports {', '.join(task.validation_metric_names)} at "
            "every epoch (what Tune and its scheduler compare); choose one of them, or auto"
        )
    if mode == "auto":
        mode = "min" if any(word in metric for word in _LOWER_IS_BETTER) else "max"
    return metric, mode
