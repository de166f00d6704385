"""Validation's memory during training: the largest scoring batch's forward, beside the weights and optimizer state.

Users most often run out of memory in evaluation, not in the training step: the scoring batch is twice an optimizer
step's rows (`eval_batch_rows`), its logits are computed whole for every position, and the optimizer state is still
resident. The memory plan runs this on its fake model after the training step (`predicted_eval_peak_bytes`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pipelines.data.batching import HOST_COUNTS
from pipelines.data.loader import eval_batch_rows, make_loader
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import ResolvedPrecision, autocast_context
from pipelines.tasks.base import Task
from pipelines.train.memory import track_step


def largest_eval_batch(
    split: TokenizedSplit, params: Params, task: Task, pad_id: int, pad_multiple: int | None
) -> dict[str, torch.Tensor]:
    """The scoring batch of the split's longest rows, as validation batches them (sorted by length)."""
    rows = min(eval_batch_rows(params), len(split))
    longest = sorted(np.argsort(split.lengths, kind="stable")[::-1][:rows].tolist())
    in_process = params.model_copy(update={"num_workers": 0, "persistent_workers": False})
    loader = make_loader(split, [longest], in_process, pad_id, torch.device("cpu"), pad_multiple, task)
    return {k: v for k, v in next(iter(loader)).items() if k not in HOST_COUNTS}


def validation_peak(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, torch.Tensor],
    precision: ResolvedPrecision,
    task: Task,
) -> int:
    """Peak bytes (MemTracker) of the task's no-grad loss on `batch` with the optimizer state alive, gradients freed."""
    optimizer.zero_grad(set_to_none=True)
    was_training = model.training
    model.eval()
    device = torch.device("cpu")

    def forward(_meter: object) -> None:
        with torch.no_grad(), autocast_context(precision, device):
            task.loss(model, batch)

    peak = track_step(model, optimizer, device, forward).total
    model.train(was_training)
    return peak
