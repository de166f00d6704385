"""DataLoaders over the task's rows: training batches as the sampler planned them, scoring batches by length.

Below the tasks and the engine: a task scores with `eval_batches`, the engine trains with `make_loader`, and
neither imports the other for it. The task is always given: this module never picks one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime, eval_mode

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


def make_loader(
    split: TokenizedSplit, batches: list[list[int]], params: Params, runtime: Runtime, task: Task
) -> DataLoader:
    """A DataLoader over precomputed batches of the task's rows; pads dynamically (to the runtime's padding),
    or to max_length unbucketed; pinned for a CUDA runtime."""
    collator = make_collator(split, params, runtime, task)
    device = runtime.device
    workers = params.num_workers
    return DataLoader(
        collator,
        batch_sampler=batches,
        collate_fn=collator,
        num_workers=workers,
        pin_memory=params.pin_memory and device.type == "cuda",
        persistent_workers=params.persistent_workers and workers > 0,
        prefetch_factor=params.prefetch_factor if workers else None,
        # Its own generator: iterating a DataLoader draws a seed, which would otherwise come from
        # torch's global RNG and shift every later dropout mask (breaking exact resume).
        generator=torch.Generator().manual_seed(params.seed),
    )


def make_collator(split: TokenizedSplit, params: Params, runtime: Runtime, task: Task) -> PadCollator:
    """The task's collator for training batches: padded to the runtime's padding, or to max_length unbucketed."""
    return task.collator(
        split,
        runtime.pad_id,
        fixed_length=None if params.data.bucketing else params.data.max_length,
        pad_to_multiple_of=runtime.padding,
        params=params,
    )


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # non_blocking overlaps the copy with compute when the host batch is pinned.
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def eval_batch_rows(params: Params) -> int:
    """Rows per evaluation batch: twice the rows of an optimizer step.

    Tied to the effective batch, not the micro-batch, so strategies that differ only in how a
    step is split (accumulation, batch_size: auto) validate in the same batches.
    """
    assert isinstance(params.batch_size, int)
    return 2 * params.batch_size * params.grad_accum_steps


def in_process(params: Params) -> Params:
    """`params` with batches collated in this process (no loader workers): probes and scoring."""
    return params.model_copy(update={"num_workers": 0, "persistent_workers": False})


def eval_batches(
    split: TokenizedSplit, params: Params, runtime: Runtime, task: Task
) -> Iterator[dict[str, torch.Tensor]]:
    """The split's rows as the task's batches on the runtime's device: sorted by length (least padding), in-process."""
    sampler = LengthGroupedBatchSampler(split.lengths, eval_batch_rows(params), bucketing=True, shuffle=False)
    for batch in make_loader(split, sampler.batches(0), in_process(params), runtime, task):
        yield to_device(batch, runtime.device)


Scored = TypeVar("Scored")


@torch.inference_mode()
def score_batches(
    model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime, task: Task,
    score: Callable[[dict[str, torch.Tensor]], Scored],
) -> list[Scored]:  # fmt: skip
    """The one evaluation loop: `score(batch)` for each of the split's scoring batches (`eval_batches`), in inference
    mode, the model in eval mode (then as it was), under the runtime's autocast."""
    with eval_mode(model):
        results = []
        for batch in eval_batches(split, params, runtime, task):
            with runtime.autocast():
                results.append(score(batch))
        return results
