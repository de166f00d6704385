"""Which trial metric picks the best trial, and in which direction."""

from __future__ import annotations

from typing import Literal

from pipelines.params.schema import Params

# The validation metric that picks the best trial when tune.metric is auto, and its direction.
TASK_OBJECTIVES: dict[str, tuple[str, Literal["max", "min"]]] = {
    "classification": ("val_accuracy", "max"),
    "causal_lm": ("val_loss", "min"),
    "seq2seq": ("val_loss", "min"),
}
_LOWER_IS_BETTER = ("loss", "perplexity", "time", "bytes")


def tune_objective(params: Params) -> tuple[str, Literal["max", "min"]]:
    """(metric, mode) that picks the best trial: tune.metric/mode, with auto resolved for the task."""
    metric, mode = params.tune.metric, params.tune.mode
    if metric == "auto":
        metric, task_mode = TASK_OBJECTIVES[params.task]
        return metric, task_mode if mode == "auto" else mode
    if mode == "auto":
        mode = "min" if any(word in metric for word in _LOWER_IS_BETTER) else "max"
    return metric, mode
