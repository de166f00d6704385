"""The three parts of an optimizer step, and how an epoch's batches become steps.

Forward under autocast with the loss scaled to its share of the accumulation window;
backward through the GradScaler; then unscale, clip, step, update, and zero with
`set_to_none=True` (nanoGPT's shape). The window's loss is a mean over its *loss units*, which
the task counts per row before any forward pass (a classifier's rows, a language model's target
tokens), so k accumulated micro-batches give the same gradient as one batch of all their rows,
also for the last, partial window and for bucketed batches of unequal size and length.

The GradScaler runs in every precision. In fp16 it scales the loss dynamically; in fp32 and
bf16 its scale is held at exactly 1.0 (a multiply by one), so what remains is its non-finite
check: a window whose gradients hold a NaN or an inf is not applied, and weights and optimizer
state stay finite. The check costs no extra host sync: fused AdamW reads the device-side
`found_inf` flag in its kernel, and other optimizers pay the one `.item()` per step that fp16's
scaler already pays.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from pipelines.data.batching import LengthGroupedBatchSampler
from pipelines.data.loader import to_device
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import ResolvedPrecision, autocast_context
from pipelines.train.memory_levers import offloading

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

FP16_INITIAL_SCALE = 2.0**16


def make_scaler(precision: ResolvedPrecision, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler for every precision: dynamic loss scaling in fp16, a fixed scale of 1.0 otherwise."""
    return torch.amp.GradScaler(device.type, init_scale=FP16_INITIAL_SCALE if precision == "fp16" else 1.0)


def training_sampler(
    train: TokenizedSplit, params: Params, num_replicas: int = 1, rank: int = 0
) -> LengthGroupedBatchSampler:
    """The training split's sampler as the params set it up (bucketing, seed, token budget, DDP shard)."""
    return LengthGroupedBatchSampler(
        train.lengths,
        params.batch_size,
        bucketing=params.data.bucketing,
        seed=params.seed,
        max_tokens=params.data.max_tokens_per_batch,
        num_replicas=num_replicas,
        rank=rank,
    )


def backward_micro_batch(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    units_in_window: float,
    precision: ResolvedPrecision,
    device: torch.device,
    scaler: torch.amp.GradScaler,
    task: Task,
) -> torch.Tensor:
    """Forward under autocast, then backward of this batch's share of the window's mean loss.

    The task's loss is summed over the batch's loss units (rows, or target tokens) and divided
    by the units of the whole accumulation window, so every unit weighs the same whichever
    micro-batch it is in: k accumulated micro-batches give the gradient of one batch of all
    their rows. Returns the (detached) contribution to the window's loss.
    """
    with autocast_context(precision, device), offloading(model):
        total, _ = task.loss(model, batch)
    loss = total / max(units_in_window, 1)  # a window whose answers were all truncated away adds 0
    scaler.scale(loss).backward()
    return loss.detach()


def plan_windows(batches: list[list[int]], accum: int, halvings: int = 0) -> list[list[list[int]]]:
    """Group an epoch's batches into accumulation windows (the last may be partial).

    Each batch is halved `halvings` times (after out-of-memory): same windows, smaller micro-batches.
    """
    windows = [batches[i : i + accum] for i in range(0, len(batches), accum)]
    for _ in range(halvings):
        windows = halve_windows(windows, 0)
    return windows


def halve_windows(windows: list[list[list[int]]], start: int) -> list[list[list[int]]]:
    """Split every batch of windows[start:] in two: the same rows per window, half per micro-batch."""
    halved = [
        [part for batch in window for part in (batch[: len(batch) // 2], batch[len(batch) // 2 :]) if part]
        for window in windows[start:]
    ]
    return windows[:start] + halved


def window_units(window: list[list[int]], units: np.ndarray | None) -> int:
    """Loss units of a window: the sum of its rows' units (None: one per row)."""
    if units is None:
        return sum(len(batch) for batch in window)
    return int(sum(int(units[batch].sum()) for batch in window))


def global_window_rows(
    sampler: LengthGroupedBatchSampler, epoch: int, accum: int, units: np.ndarray | None = None
) -> list[int]:
    """Loss units (default: rows) of each optimizer step's global window: every rank's window s together.

    Computed from the sampler's global batch plan, which every rank knows, so no communication.
    """
    all_batches = sampler.global_batches(epoch)
    per_rank = [plan_windows(all_batches[r :: sampler.num_replicas], accum) for r in range(sampler.num_replicas)]
    return [sum(window_units(windows[s], units) for windows in per_rank) for s in range(len(per_rank[0]))]


@dataclass
class WindowCounts:
    """What one window's micro-batches held: examples, real tokens, padded positions, and the wait for them."""

    rows: int = 0
    tokens: int = 0
    positions: int = 0  # tokens plus padding: the batch tensors' size
    wait_s: float = 0.0


def accumulate_window(
    model: nn.Module,
    loader: Iterator[dict[str, torch.Tensor]],
    window: list[list[int]],
    precision: ResolvedPrecision,
    device: torch.device,
    scaler: torch.amp.GradScaler,
    meter: object | None,
    units_in_window: float | None,
    task: Task,
) -> tuple[torch.Tensor, WindowCounts]:
    """Forward and backward every micro-batch of one window; return its loss and what it held (`WindowCounts`).

    The loss is divided by `units_in_window`, the window's loss units (`window_units`; None:
    its rows, a classifier's unit). Under data parallelism the caller passes the units of the
    *global* window divided by the rank count, so that DDP's gradient average over ranks gives
    the mean over every unit of the global batch. `meter`, when given, has a `measure()` context
    entered around each micro-batch (memory measurement).
    """
    if units_in_window is None:
        units_in_window = window_units(window, None)
    total = torch.zeros((), device=device)
    counts = WindowCounts()
    for index in range(len(window)):
        fetch = time.perf_counter()
        batch = next(loader)
        counts.wait_s += time.perf_counter() - fetch
        # Counted on the host copy: no device sync.
        counts.rows += int(batch["num_rows"])
        counts.tokens += int(batch["num_tokens"])
        counts.positions += int(batch["num_positions"])
        batch = to_device(batch, device)
        # Under DDP, gradients are all-reduced once per window, on its last micro-batch only.
        last = index == len(window) - 1
        no_sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else nullcontext()
        if isinstance(model, FSDPModule):  # FSDP: reduce-scatter the window's gradients once, on its last
            model.set_requires_gradient_sync(last)
        with no_sync, meter.measure() if meter is not None else nullcontext():  # type: ignore[attr-defined]
            total += backward_micro_batch(model, batch, units_in_window, precision, device, scaler, task)
    return total, counts


def found_nonfinite(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """1 if the unscaled gradients hold a NaN/inf, else 0, as a device tensor (no host sync).

    GradScaler keeps the flag per device after `unscale_`; it has no public accessor for it.
    """
    flags = list(scaler._found_inf_per_device(optimizer).values())
    return torch.stack([f.reshape(()) for f in flags]).sum().clamp(max=1) if flags else torch.zeros(())


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    max_grad_norm: float | None,
    precision: ResolvedPrecision,
) -> torch.Tensor:
    """Unscale, clip, step (skipped on non-finite gradients), update, zero. Returns the device-side skip flag."""
    scaler.unscale_(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    skipped = found_nonfinite(scaler, optimizer)
    scaler.step(optimizer)
    # fp16: grow or back off the scale; otherwise hold it at exactly 1.0 (fill_, no sync).
    scaler.update(None if precision == "fp16" else 1.0)
    optimizer.zero_grad(set_to_none=True)
    return skipped
