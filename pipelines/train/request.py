"""What the engine is asked to do: one `TrainRequest` (the model, its splits, its params, where it runs and who to
tell), instead of a dozen loose arguments through `train_model`, `run_training` and the `Trainer`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import ResolvedPrecision

if TYPE_CHECKING:
    from pipelines.tasks.base import Task
    from pipelines.train.compile_decision import CompilePrediction

LogFn = Callable[[int, dict[str, float]], None]
EpochFn = Callable[[int, int, dict[str, float]], None]  # (epoch, optimizer step, validation metrics)


@dataclass(frozen=True)
class TrainRequest:
    """One training run: `model` trained in place on `train` for `params.epochs`, `validation` scored at each
    epoch's end.

    `pad_id`, `device` and `precision` resolve the runtime (`train_model` does; a trial passes its own `Runtime` to
    `run_training`). `task` defaults to the one `params.task` names. `on_log` gets each log point, `on_epoch_end`
    each epoch's validation, `say` the console lines. With `checkpoint_dir`, checkpoints are written and resumed.
    `compile_prediction` decides `compile: auto` (without one it is off).
    """

    model: nn.Module
    train: TokenizedSplit
    validation: TokenizedSplit | None
    params: Params
    pad_id: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: ResolvedPrecision = "fp32"
    task: Task | None = None
    on_log: LogFn | None = None
    on_epoch_end: EpochFn | None = None
    checkpoint_dir: Path | None = None
    say: Callable[[str], None] = print
    compile_prediction: CompilePrediction | None = None


def refuse_unresolved(params: Params) -> None:
    """The `auto`s a trial resolves before training (`pipelines.resolve`): the engine cannot train with them."""
    if params.lr == "auto":
        raise ValueError("lr: auto is resolved before training (pipelines.resolve.lr_range.resolve_lr)")
    if params.compile == "auto":
        raise ValueError("compile: auto is resolved before training (pipelines.train.compile_decision.decide_compile)")
