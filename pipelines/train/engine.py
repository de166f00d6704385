"""The training loop every trial runs.

Each optimizer step is one call of the trial's `TrainStep` (`pipelines.train.step`). Around it the loop keeps
one clock per region (`pipelines.train.timing`): the first optimizer step is the warm-up
(compile, lazy allocations), timed on its own; `train_time_s` is every later step, the same
region for every strategy; validation, checkpoint writes and setup have their own clocks.
Memory is measured on the warm-up step itself, under PyTorch's MemTracker, with the optimizer's
fresh state made ahead so the step is the steady state (`Trainer.start`), and on CUDA by the
allocator's peak over the training segments.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from pipelines.data.batching import HOST_COUNTS
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import Runtime, resolve_runtime
from pipelines.train.compile_decision import resolve_compile
from pipelines.train.fast_dropout import FastDropoutUse, fast_dropout
from pipelines.train.memory_levers import resolve_loss
from pipelines.train.parallel import uses_fsdp
from pipelines.train.request import TrainRequest
from pipelines.train.results import world
from pipelines.train.trainer import Trainer

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


@dataclass
class TrainResult:
    """What a finished run measured: final metrics, the logged (step, loss, lr) curve, and tags for its run."""

    metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)


def train_model(request: TrainRequest) -> TrainResult:
    """Train `request.model` in place for `params.epochs` on its device in its precision; what was measured.

    The entry point for callers outside a trial (benchmarks, tests): the training split (packed with
    data.packing) and the runtime are resolved here from the request, then `run_training` trains. `compile: auto`
    is decided by `request.compile_prediction` (a trial's comes from its plan:
    `pipelines.resolve.step_time.predict_compile`); without one it is off.
    """
    params, model = request.params, request.model
    task = request.task or _named_task(params)
    train = task.training_split(request.train, params, model)  # packs, with data.packing (a trial packs in setup)
    runtime = replace(resolve_runtime(params, request.device, request.pad_id, request.precision),
                      loss=resolve_loss(model, params, task))  # fmt: skip
    params, runtime, choice = resolve_compile(params, runtime, train, task, model, request.compile_prediction)
    result = run_training(replace(request, train=train, params=params, task=task), runtime)
    result.notes["compile.resolved"] = choice.tag()
    if choice.enabled and choice.predicted_s is not None:
        result.metrics["predicted_compile_time_s"] = choice.predicted_s
    return result


def run_training(request: TrainRequest, runtime: Runtime) -> TrainResult:
    """Train `request.model` in place for `params.epochs` with a resolved `runtime`; what was measured.

    `request.train` is the training split as trained (`Task.training_split`: packed with data.packing), resolved
    before, and `request.task` is set: it gives the batches' labels, the loss and the validation metrics; the loop
    itself is the same for every task.

    `validation` (when given) is scored at every epoch's end, on its own clock (`val_time_s`).

    With `checkpoint_dir`, a checkpoint is written every `checkpoint_every_n_steps` optimizer
    steps and at every epoch's end; a checkpoint made with the same params is resumed from.

    Inside an initialised torch.distributed process group (a Ray Train worker), the model is
    wrapped in DDP, each rank trains on its shard of every global batch, rank 0 alone writes
    checkpoints, and the logged loss and final metrics are reduced across ranks.
    """
    setup_start = time.perf_counter()
    model, params, task = request.model, request.params, request.task
    assert task is not None, "run_training needs the request's task (train_model resolves it)"
    device = runtime.device
    if not uses_fsdp(params, world()[1]):
        model.to(device)  # under FSDP the shards go to the device, and the whole model stays on the host
    # Inductor draws its own fused dropout masks under compile; CUDA's dropout is already fused.
    use_fast_dropout = params.fast_dropout and device.type == "cpu" and params.compile is not True
    probe = _probe_inputs(request.train, runtime.pad_id, task, params) if use_fast_dropout else None
    with fast_dropout(model, probe, bf16=runtime.precision == "bf16") if use_fast_dropout else nullcontext() as use:
        notes = {"fast_dropout": use.describe() if isinstance(use, FastDropoutUse) else "off"}
        metrics, state, trainer_notes = Trainer(request, runtime).run(setup_start)
    return TrainResult(metrics=metrics, history=state.history, notes={**trainer_notes, **notes})


def _named_task(params: Params) -> Task:
    """The task `params.task` names (train_model's default for callers outside a trial)."""
    from pipelines.tasks import get_task

    return get_task(params.task)


def _probe_inputs(train: TokenizedSplit, pad_id: int, task: Task, params: Params) -> dict[str, torch.Tensor]:
    """A few rows of unequal length (so the batch has padding) for fast_dropout's equality check: the model's inputs."""
    order = train.lengths.argsort()
    picks = sorted({int(order[0]), int(order[len(order) // 2]), int(order[-1])})
    batch = task.collator(train, pad_id, fixed_length=None, pad_to_multiple_of=None, params=params)(picks)
    return {k: v for k, v in batch.items() if k != "labels" and k not in HOST_COUNTS}
