"""A split's validation metrics during training, as its task scores them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


def evaluate_split(
    model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime, task: Task
) -> dict[str, float]:
    """The task's validation metrics of `split` (`val_loss` and its own) in `runtime`, e.g. at an epoch's end."""
    return task.validation_metrics(model, split, params, runtime)
