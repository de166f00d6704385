"""`batch_size: auto`: the largest micro-batch that fits, with accumulation keeping the effective batch.

Candidates are the divisors of `effective_batch_size`, largest first, so micro-batch x
accumulation equals the requested effective batch exactly. Each candidate is probed
with the split's longest rows (the sampler puts that batch first, so it is the peak).
On CUDA a probe is a real optimizer step (forward, backward and the update, beside optimizer
state allocated before the first candidate) that may raise out-of-memory; a CPU
raises nothing before the OS kills the process, so there the activation bytes of one
row are measured and scaled against a share of the memory available.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import psutil
import torch
from torch import nn

from pipelines.errors import UserError
from pipelines.params import Params, apply_overrides
from pipelines.runtime import Runtime
from pipelines.train.memory import SavedActivationMeter, parameter_bytes, restored_after, tensor_bytes
from pipelines.train.optim import build_optimizer
from pipelines.train.step import TrainStep, make_scaler

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

# Share of the machine's available RAM a CPU run may plan to use for one step.
CPU_MEMORY_SHARE = 0.5


def divisors_descending(n: int) -> list[int]:
    """All divisors of `n`, largest first."""
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def largest_fitting(effective: int, fits: Callable[[int], bool]) -> int:
    """The largest divisor of `effective` for which `fits` holds."""
    for rows in divisors_descending(effective):
        if fits(rows):
            return rows
    raise UserError("batch_size: auto found that not even one row of the longest length fits in memory")


def probe_batch(rows: int, length: int, vocab_size: int, device: torch.device, task: Task) -> dict[str, torch.Tensor]:
    """A batch of `rows` full-length rows of arbitrary tokens (memory depends on shape, not content), with labels
    of the task's shape."""
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, vocab_size, (rows, length), generator=generator).to(device)
    labels = task.probe_labels(input_ids)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def cuda_fits(
    model: nn.Module, length: int, vocab_size: int, runtime: Runtime, params: Params, task: Task
) -> Callable[[int], bool]:
    """A probe that runs a full optimizer step of `rows` rows, with the optimizer state already allocated.

    The state exists before the first candidate (one step on zero gradients makes it), so every
    forward and backward is probed beside it, as training's second step will run. The caller
    restores the weights afterwards (`pipelines.train.memory.restored_after`): the probe's steps change them.
    """
    lr = params.lr if params.lr != "auto" else 1e-3  # the rate does not change memory
    optimizer = build_optimizer(params.optim, model, lr, params.weight_decay, runtime.device)
    step = TrainStep(model, optimizer, task, runtime, make_scaler(runtime), params.max_grad_norm)
    if not _step_fits(model, lambda: _materialize_state(model, optimizer)):
        raise UserError(
            "batch_size: auto: the weights, gradients and optimizer state alone do not fit on this GPU; "
            "try adapter.type: lora, optim: adafactor, or a smaller model"
        )

    def one_step(rows: int) -> None:
        step([probe_batch(rows, length, vocab_size, runtime.device, task)], rows)

    return lambda rows: _step_fits(model, lambda: one_step(rows))


def _materialize_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients: the optimizer allocates its state (moments, factors) for real."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    optimizer.step()


def _step_fits(model: nn.Module, step: Callable[[], None]) -> bool:
    """Run `step`; False if it ran out of CUDA memory. The cache is emptied after the `except` block, once
    the traceback (and the failed step's tensors it holds) is gone."""
    out_of_memory = False
    try:
        step()
    except torch.cuda.OutOfMemoryError:
        out_of_memory = True
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    return not out_of_memory


def cpu_fits(
    model: nn.Module, length: int, vocab_size: int, runtime: Runtime, optimizer_factor: float, task: Task
) -> Callable[[int], bool]:
    """A probe that scales one row's measured activation bytes against a share of the available RAM."""
    meter = SavedActivationMeter()
    idle = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)  # the probe never steps
    step = TrainStep(model, idle, task, runtime, make_scaler(runtime, enabled=False), None)
    with meter.measure():
        step.backward(probe_batch(1, length, vocab_size, runtime.device, task), 1)
    model.zero_grad(set_to_none=True)
    # Parameters are paid once, whatever the batch; gradients and optimizer state for the trainable ones only.
    trainable = tensor_bytes(p for p in model.parameters() if p.requires_grad)
    fixed = parameter_bytes(model) + trainable * (1 + optimizer_factor)
    budget = psutil.virtual_memory().available * CPU_MEMORY_SHARE
    return lambda rows: fixed + rows * meter.peak_bytes <= budget


def resolve_batch_size(params: Params, model: nn.Module, longest_row: int, runtime: Runtime, task: Task) -> Params:
    """Return params with a concrete micro-batch and accumulation (unchanged unless batch_size is auto)."""
    if params.batch_size != "auto":
        return params
    assert params.effective_batch_size is not None  # the schema requires it with auto
    device = runtime.device
    model.to(device).train()
    vocab_size = model.get_input_embeddings().num_embeddings
    if device.type == "cuda":
        with restored_after(model):
            fits = cuda_fits(model, longest_row, vocab_size, runtime, params, task)
            rows = largest_fitting(params.effective_batch_size, fits)
            del fits  # and with it the probe's optimizer state, before the cache is emptied
    else:
        factor = 2.0 if params.optim == "adamw" else 1.0
        fits = cpu_fits(model, longest_row, vocab_size, runtime, optimizer_factor=factor, task=task)
        rows = largest_fitting(params.effective_batch_size, fits)
    return apply_overrides(
        params,
        {"batch_size": rows, "grad_accum_steps": params.effective_batch_size // rows, "effective_batch_size": None},
    )
