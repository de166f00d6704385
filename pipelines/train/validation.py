"""Scoring a split during and after training: bucketed, in inference mode, rows back in their order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.data.batching import LengthGroupedBatchSampler
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.train.device import ResolvedPrecision, autocast_context, resolve_pad_multiple
from pipelines.train.steps import forward_logits, make_loader, to_device

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


def eval_batch_rows(params: Params) -> int:
    """Rows per evaluation batch: twice the rows of an optimizer step.

    Tied to the effective batch, not the micro-batch, so strategies that differ only in how a
    step is split (accumulation, batch_size: auto) validate in the same batches.
    """
    assert isinstance(params.batch_size, int)
    return 2 * params.batch_size * params.grad_accum_steps


def eval_batches(
    model: nn.Module, split: TokenizedSplit, params: Params, pad_id: int, device: torch.device, task: Task | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The split's rows as the task's batches on `device`: sorted by length (least padding), in-process."""
    sampler = LengthGroupedBatchSampler(split.lengths, eval_batch_rows(params), bucketing=True, shuffle=False)
    loader = make_loader(
        split,
        sampler.batches(0),
        params.model_copy(update={"num_workers": 0, "persistent_workers": False}),
        pad_id,
        device,
        resolve_pad_multiple(params, device),
        task,
    )
    for batch in loader:
        yield to_device(batch, device)


@torch.inference_mode()
def predict_logits(
    model: nn.Module,
    split: TokenizedSplit,
    params: Params,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
) -> tuple[np.ndarray, float]:
    """A classifier's (logits in the split's row order, mean loss), from length-bucketed batches."""
    was_training = model.training
    model.eval()
    logits = np.zeros((len(split), 0), dtype=np.float32)
    total_loss = torch.zeros((), device=device)
    for batch in eval_batches(model, split, params, pad_id, device):
        with autocast_context(precision, device):
            out = forward_logits(model, batch).float()
        total_loss += F.cross_entropy(out, batch["labels"], reduction="sum")
        if logits.shape[1] == 0:
            logits = np.zeros((len(split), out.shape[1]), dtype=np.float32)
        # Scatter back by row index: bucketing reorders rows, predictions must not move.
        logits[batch["row_index"].cpu().numpy()] = out.cpu().numpy()
    model.train(was_training)
    return logits, float(total_loss) / len(split)


def evaluate_split(
    model: nn.Module,
    split: TokenizedSplit,
    params: Params,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
    task: Task | None = None,
) -> dict[str, float]:
    """The task's validation metrics of `split` (`val_loss` and its own), e.g. at an epoch's end."""
    from pipelines.tasks import get_task

    task = task or get_task(params.task)
    return task.validation_metrics(model, split, params, pad_id, device, precision)
