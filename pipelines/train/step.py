"""One optimizer step as one object: `TrainStep`, built once per trial, the only place a step is assembled.

nanoGPT's step (`train.py`), owned by one object as accelerate's `Accelerator` and litgpt's `Fabric` own it: forward
under the runtime's autocast (and the activation offload the trial asked for), the task's loss through the trial's
loss projection, scaled to its share of the accumulation window; backward through the GradScaler; then unscale,
clip, step, update, and zero with `set_to_none=True`. The trainer's loop, its warm-up memory probe, the LR range
test, the batch-size probe and the memory plan's fake step all call it, so compiling or graph-capturing the step
is wrapping this one object. Batches reach it already on the device: fetching, host-side counting and the clocks
stay with the caller.

The window's loss is a mean over its *loss units*, which the task counts per row before any forward pass (a
classifier's rows, a language model's target tokens), so k accumulated micro-batches give the same gradient as
one batch of all their rows, also for the last, partial window and for bucketed batches of unequal size.

The GradScaler runs in every precision. In fp16 it scales the loss dynamically; in fp32 and bf16 its scale is held
at exactly 1.0 (a multiply by one), so what remains is its non-finite check: a window whose gradients hold a NaN or
an inf is not applied, and weights and optimizer state stay finite. The check costs no extra host sync: fused AdamW
reads the device-side `found_inf` flag in its kernel, and other optimizers pay the one `.item()` per step that
fp16's scaler already pays. A disabled scaler (`make_scaler(runtime, enabled=False)`: the memory plan's fake step,
the CPU batch-size probe) is a plain step: no scale, no check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from pipelines.runtime import Runtime

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

FP16_INITIAL_SCALE = 2.0**16
Batch = dict[str, torch.Tensor]
LossFn = Callable[[Batch], torch.Tensor]


def make_scaler(runtime: Runtime, enabled: bool = True) -> torch.amp.GradScaler:
    """A GradScaler for every precision: dynamic loss scaling in fp16, a fixed scale of 1.0 otherwise."""
    scale = FP16_INITIAL_SCALE if runtime.precision == "fp16" else 1.0
    return torch.amp.GradScaler(runtime.device.type, init_scale=scale, enabled=enabled)


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step returns, on the device (no host sync): the window's mean loss, and 1 when its
    gradients held a NaN or an inf and the update was skipped (else 0)."""

    loss: torch.Tensor
    skipped: torch.Tensor


@dataclass(frozen=True)
class TrainStep:
    """Forward, loss, backward, clip, optimizer step and scaler update over one accumulation window.

    `model` holds the parameters that are stepped (under FSDP this rank's shards); `forward` is the callable the
    forward runs through (a DDP replica or a compiled module; `model` itself when None). `offload` opens the
    activation offload around each forward (`pipelines.train.memory_levers.offload_context`).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    task: Task
    runtime: Runtime
    scaler: torch.amp.GradScaler
    max_grad_norm: float | None
    offload: Callable[[], AbstractContextManager[object]] = nullcontext
    forward: nn.Module | None = field(default=None)
    compiled_loss: LossFn | None = field(default=None)

    @property
    def runs_through(self) -> nn.Module:
        """The callable the forward runs through: `forward`, else the model itself (never by truth value: a
        compiled module has no length)."""
        return self.model if self.forward is None else self.forward

    def through(self, forward: nn.Module) -> TrainStep:
        """The same step with its forward run through `forward` (a DDP replica, a compiled module)."""
        return replace(self, forward=forward, compiled_loss=None)

    def compiled(self, compile_fn: Callable[[LossFn], LossFn]) -> TrainStep:
        """The same step with its forward and loss (and so, through AOTAutograd, their backward) run through
        `compile_fn(self.forward_loss)` (`pipelines.train.compiled_step.compile_step`)."""
        return replace(self, compiled_loss=compile_fn(self.forward_loss))

    def forward_loss(self, batch: Batch) -> torch.Tensor:
        """The task's loss of `batch`, summed over its loss units: the part of the step that is compiled."""
        return self.task.loss(self.runs_through, batch, self.runtime.loss)[0]

    def backward(self, batch: Batch, units_in_window: float) -> torch.Tensor:
        """Forward and backward of this batch's share of the window's mean loss; its (detached) contribution.

        The task's loss is summed over the batch's loss units and divided by the units of the whole window, so
        every unit weighs the same whichever micro-batch it is in.
        """
        loss_of = self.forward_loss if self.compiled_loss is None else self.compiled_loss
        with self.runtime.autocast(), self.offload():  # entered outside a compiled loss: it guards on their state
            total = loss_of(batch)
        loss = total / max(units_in_window, 1)  # a window whose answers were all truncated away adds 0
        self.scaler.scale(loss).backward()
        return loss.detach()

    def accumulate(self, batches: Sequence[Batch], units_in_window: float, meter: object | None = None) -> torch.Tensor:
        """Forward and backward every micro-batch of one window; the window's loss (on the device).

        Under data parallelism the caller passes the units of the *global* window divided by the rank count, so
        DDP's gradient average over ranks is the mean over every unit of the global batch. `meter`, when given,
        has a `measure()` context entered around each micro-batch (memory measurement).
        """
        wrapped = self.runs_through
        total = torch.zeros((), device=self.runtime.device)
        if self.compiled_loss is not None and len(batches) > 1:
            stable_gradients(self.model)
        for index, batch in enumerate(batches):
            # Gradients are reduced once per window, on its last micro-batch only (DDP: no_sync before it).
            last = index == len(batches) - 1
            no_sync = wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) and not last else nullcontext()
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(last)
            with no_sync, meter.measure() if meter is not None else nullcontext():  # type: ignore[attr-defined]
                total += self.backward(batch, units_in_window)
        return total

    def update(self) -> torch.Tensor:
        """Unscale, clip, step (skipped on non-finite gradients), update, zero. Returns the device-side skip flag."""
        scaler, optimizer = self.scaler, self.optimizer
        scaler.unscale_(optimizer)
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        skipped = found_nonfinite(scaler, optimizer, self.runtime.device)
        scaler.step(optimizer)
        # fp16: grow or back off the scale; otherwise hold it at exactly 1.0 (fill_, no sync).
        if scaler.is_enabled():
            scaler.update(None if self.runtime.precision == "fp16" else 1.0)
        optimizer.zero_grad(set_to_none=True)
        return skipped

    def __call__(self, batches: Sequence[Batch], units_in_window: float, meter: object | None = None) -> StepOutcome:
        """One optimizer step over a window's micro-batches (on the device): accumulate, then update."""
        loss = self.accumulate(batches, units_in_window, meter)
        return StepOutcome(loss, self.update())


def stable_gradients(model: nn.Module) -> None:
    """A zeroed `.grad` for every trained weight that has none, allocated outside any compiled graph.

    A compiled backward run as a CUDA graph (`reduce-overhead`) writes its gradients into the graphs' memory pool, and
    a `.grad` that is empty takes that output as it is; the window's next micro-batch replays the graphs into the
    same pool, so the first micro-batch's gradients would be overwritten instead of added to (torch's cudagraph trees
    raise where they notice, and replays do not notice). Into buffers of the step's own, every micro-batch's
    gradients are added in place, as eager accumulation adds them; the update's `zero_grad` frees them as before."""
    for param in model.parameters():
        if param.requires_grad and param.grad is None:
            param.grad = torch.zeros_like(param)


def found_nonfinite(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, device: torch.device
) -> torch.Tensor:
    """1 if the unscaled gradients hold a NaN/inf, else 0, as a device tensor (no host sync).

    GradScaler keeps the flag per device after `unscale_`; it has no public accessor for it.
    """
    flags = list(scaler._found_inf_per_device(optimizer).values()) if scaler.is_enabled() else []
    return torch.stack([f.reshape(()) for f in flags]).sum().clamp(max=1) if flags else torch.zeros((), device=device)
