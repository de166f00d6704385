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
from pipelines.data.packing import IGNORE
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime, eval_mode

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


def make_loader(
    split: TokenizedSplit, batches: list[list[int]], params: Params, runtime: Runtime, task: Task,
    rows: int | None = None,
) -> DataLoader:  # fmt: skip
    """A DataLoader over precomputed batches of the task's rows; pads dynamically (to the runtime's padding),
    or to max_length unbucketed, and to `rows` rows when given (`RowPadded`); pinned for a CUDA runtime."""
    collator = make_collator(split, params, runtime, task, rows)
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


def make_collator(
    split: TokenizedSplit, params: Params, runtime: Runtime, task: Task, rows: int | None = None
) -> PadCollator | RowPadded:
    """The task's collator for training batches: padded to the runtime's padding, or to max_length unbucketed; every
    batch grown to `rows` rows when given (a compiled step's one row count, `RowPadded`)."""
    collator = task.collator(
        split,
        runtime.pad_id,
        fixed_length=None if params.data.bucketing else params.data.max_length,
        pad_to_multiple_of=runtime.padding,
        params=params,
    )
    return collator if rows is None else RowPadded(collator, rows)


# A batch's loss targets: a padding row's are all IGNORE, so it adds no term to the loss and no gradient.
TARGET_KEYS = ("labels", "target_labels")


def pad_rows(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """`batch` grown to `rows` rows, its loss and gradients unchanged: every per-row tensor gets copies of its first
    row (a real row, so the forward sees nothing it would not: an all-padding row can give NaN under some attention
    masks, and 0 x NaN is NaN in the backward), their targets (`TARGET_KEYS`) IGNORE and their `row_index` -1.

    `num_rows` and `num_tokens` stay the real rows' and tokens'; `num_positions` counts the padding rows' positions
    too (computed, so padding, in `padding_fraction`). A batch of `rows` rows or more is returned as it is."""
    count = int(batch["input_ids"].shape[0])
    if count >= rows:
        return batch
    extra = rows - count
    out = {}
    for key, tensor in batch.items():
        if tensor.dim() == 0 or tensor.shape[0] != count:
            out[key] = tensor
            continue
        fill = tensor[:1].expand(extra, *tensor.shape[1:])
        if key in TARGET_KEYS:
            fill = torch.full_like(fill, IGNORE)
        elif key == "row_index":
            fill = torch.full_like(fill, -1)
        out[key] = torch.cat([tensor, fill])
    if "num_positions" in batch:
        out["num_positions"] = batch["num_positions"] * rows // count  # every position scales with the rows
    return out


class RowPadded:
    """A task's collator whose every batch holds `rows` rows (`pad_rows`): a compiled step then sees one row count,
    and an epoch's partial last batch compiles no graph of its own. Dataset and collate function, as the collator."""

    def __init__(self, collator: PadCollator, rows: int) -> None:
        self.collator, self.rows = collator, rows
        # What `pipelines.train.compiled_step.batches_by_shape` reads to group batches by shape.
        self.lengths = collator.lengths
        self.source_lengths = getattr(collator, "source_lengths", None)

    def __len__(self) -> int:
        return len(self.collator)

    def __getitem__(self, index: int) -> int:
        return index

    def __call__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        return pad_rows(self.collator(indices), self.rows)


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
