"""Optimizers and learning-rate schedules, chosen by name from a closed set."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from pipelines.errors import UserError
from pipelines.optimizer_registry import OPTIMIZERS
from pipelines.params import LrSchedule
from pipelines.params import Optimizer as OptimizerName


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    # Biases and normalisation weights are not decayed (standard BERT fine-tuning practice).
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _adamw(groups: list[dict], lr: float) -> Optimizer:
    # fused runs one kernel per parameter group (CUDA and, since torch 2.4, CPU): the fastest step.
    return torch.optim.AdamW(groups, lr=lr, fused=True)


def _adafactor(groups: list[dict], lr: float) -> Optimizer:
    from transformers.optimization import Adafactor

    # Fixed lr (no relative step) so the schedule controls it like the other optimizers.
    return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False, warmup_init=False)


def _adamw_8bit(groups: list[dict], lr: float) -> Optimizer:
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError("optim = 'adamw_8bit' needs bitsandbytes: pip install bitsandbytes") from None
    return bnb.optim.AdamW8bit(groups, lr=lr)


def _lion(groups: list[dict], lr: float) -> Optimizer:
    from lion_pytorch import Lion

    # One moment per parameter (the update is its sign): half of AdamW's optimizer state.
    return Lion(groups, lr=lr)


def _sgd(groups: list[dict], lr: float) -> Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=0.9)


def _adafactor_type() -> type:
    from transformers.optimization import Adafactor

    return Adafactor


def _lion_type() -> type:
    from lion_pytorch import Lion

    return Lion


def _adamw_8bit_type() -> type:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit


@dataclass(frozen=True)
class Builder:
    """How a registered optimizer (`pipelines.optimizer_registry`) is built, and its class (imported only when
    asked: recognising a built optimizer must not import bitsandbytes)."""

    build: Callable[[list[dict], float], Optimizer]
    optimizer_type: Callable[[], type]


# One entry per registered optimizer (tests/pipelines/train/test_optimizers.py holds the two in step).
BUILDERS: dict[str, Builder] = {
    "adamw": Builder(_adamw, lambda: torch.optim.AdamW),
    "adafactor": Builder(_adafactor, _adafactor_type),
    "adamw_8bit": Builder(_adamw_8bit, _adamw_8bit_type),
    "lion": Builder(_lion, _lion_type),
    "sgd": Builder(_sgd, lambda: torch.optim.SGD),
}


def build_optimizer(
    name: OptimizerName, model: nn.Module, lr: float, weight_decay: float, device: torch.device
) -> Optimizer:
    """Build the named optimizer over `model`'s trainable parameters."""
    if name not in BUILDERS:
        raise UserError(f"optim = {name!r} is not known; allowed: {', '.join(BUILDERS)}")
    return BUILDERS[name].build(_param_groups(model, weight_decay), lr)


def _zero_fresh_optimizers() -> tuple[type, ...]:
    """The classes of the registered optimizers whose fresh state is zeros (`OptimizerEntry.fresh_state_is_zeros`),
    of those whose package is installed (an optimizer in hand is of an importable class; the GPU machine had no
    lion-pytorch, and importing it failed every plan there)."""
    found = []
    for name, entry in OPTIMIZERS.items():
        if entry.fresh_state_is_zeros:
            try:
                found.append(BUILDERS[name].optimizer_type())
            except ModuleNotFoundError:
                continue
    return tuple(found)


def create_fresh_state(model: nn.Module, optimizer: Optimizer) -> bool:
    """Create the optimizer's state as its first step would find it, without changing a weight; False where unknown.

    The memory probe needs the state alive to see the steady-state peak of a step, which is what lets the
    trainer track its own first step instead of running the first window twice more. One step at lr 0 over
    zero gradients allocates the state and moves no weight (weight decay is scaled by lr too); the state is
    then zeroed, step counts included, which is exactly the lazily created fresh state of the optimizers
    registered with `fresh_state_is_zeros` (moments, factored second moments, momentum buffers, Lion's moment).
    An optimizer whose fresh state is not zeros (bitsandbytes' quantization maps) returns False and is probed the
    old way.
    """
    if type(optimizer) not in _zero_fresh_optimizers():
        return False
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                value.zero_()
            elif isinstance(value, (int, float)):
                state[key] = type(value)(0)
    return True


def build_scheduler(
    name: LrSchedule, optimizer: Optimizer, lr: float, total_steps: int, warmup_steps: int
) -> LRScheduler | torch.optim.lr_scheduler.ReduceLROnPlateau:
    """Build the named schedule: stepped per optimizer step, except reduce_on_plateau (per epoch, on a loss)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    total_steps = max(total_steps, 1)
    if name == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup_steps)
    if name == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    if name == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup_steps, total_steps)
    if name == "onecycle":
        pct = min(max(warmup_steps / total_steps, 0.01), 0.99)
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=lr, total_steps=total_steps, pct_start=pct, cycle_momentum=False
        )
    if name == "cyclic":
        # Two triangular cycles over the run between lr/10 and lr.
        return torch.optim.lr_scheduler.CyclicLR(
            optimizer, base_lr=lr / 10, max_lr=lr, step_size_up=max(1, math.ceil(total_steps / 4)), cycle_momentum=False
        )
    if name == "reduce_on_plateau":
        # Halves the lr when the epoch's validation loss stops improving; stepped per epoch by the engine.
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)
    raise UserError(f"lr_schedule = {name!r} is not known")
