"""The training loop every trial runs.

One optimizer step is three parts (nanoGPT's shape): forward under autocast with the
loss scaled to its share of the accumulation window; backward through the GradScaler
(a no-op unless fp16); then unscale, clip, step, update, and zero with
`set_to_none=True`. The window's loss is a mean over its *rows*, so k accumulated
micro-batches give the same gradient as one batch of all their rows, also for the
last, partial window and for bucketed batches of unequal size.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.train.checkpoint import LoopState, find_resumable, restore, save_checkpoint
from pipelines.train.device import ResolvedPrecision, autocast_context
from pipelines.train.fast_dropout import fast_dropout
from pipelines.train.memory import (
    SavedActivationMeter,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    peak_rss_bytes,
)
from pipelines.train.optim import build_optimizer, build_scheduler


class NonFiniteLoss(UserError):
    """Training diverged: the loss stayed NaN or infinite for too many steps."""


# Out-of-memory errors that training recovers from by halving micro-batches.
OUT_OF_MEMORY: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)

# Saved-activation hooks cost Python time per op, so they run on the first optimizer
# step only; the sampler puts the longest batch first, so that step holds the peak.
_ACTIVATION_MEASURE_STEPS = 1


@dataclass
class TrainResult:
    """What a finished run measured: final metrics and the logged (step, loss, lr) curve."""

    metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)


LogFn = Callable[[int, dict[str, float]], None]
EpochFn = Callable[[int, int, dict[str, float]], None]  # (epoch, optimizer step, validation metrics)


def make_loader(
    split: TokenizedSplit,
    batches: list[list[int]],
    params: Params,
    pad_id: int,
    device: torch.device,
) -> DataLoader:
    """A DataLoader over precomputed batches; pads dynamically, or to max_length without bucketing."""
    collator = PadCollator(
        split,
        pad_id,
        fixed_length=None if params.data.bucketing else params.data.max_length,
        pad_to_multiple_of=params.data.pad_to_multiple_of,
    )
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


def forward_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a batch already on the model's device."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def backward_micro_batch(
    model: nn.Module,
    batch: dict[str, torch.Tensor],
    rows_in_window: float,
    precision: ResolvedPrecision,
    device: torch.device,
    scaler: torch.amp.GradScaler,
) -> torch.Tensor:
    """Forward under autocast, then backward of this batch's share of the window's mean loss.

    The loss is summed over the batch's rows and divided by the rows of the whole
    accumulation window, so every row weighs the same whichever micro-batch it is in:
    k accumulated micro-batches give the gradient of one batch of all their rows.
    Returns the (detached) contribution to the window's loss.
    """
    with autocast_context(precision, device):
        logits = forward_logits(model, batch)
    # Cross-entropy in fp32 even under autocast: a bf16 log-softmax loses the small differences.
    loss = F.cross_entropy(logits.float(), batch["labels"], reduction="sum") / rows_in_window
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


def accumulate_window(
    model: nn.Module,
    loader: Iterator[dict[str, torch.Tensor]],
    window: list[list[int]],
    precision: ResolvedPrecision,
    device: torch.device,
    scaler: torch.amp.GradScaler,
    meter: SavedActivationMeter | None,
    rows_in_window: float | None = None,
) -> tuple[torch.Tensor, tuple[int, int, float]]:
    """Forward and backward every micro-batch of one window; return its loss and (rows, real tokens, data wait s).

    The loss is divided by `rows_in_window` (default: this window's rows). Under data parallelism
    the caller passes the rows of the *global* window divided by the rank count, so that DDP's
    gradient average over ranks gives the mean over every row of the global batch.
    """
    if rows_in_window is None:
        rows_in_window = sum(len(batch) for batch in window)
    total = torch.zeros((), device=device)
    rows = tokens = 0
    wait = 0.0
    for index in range(len(window)):
        fetch = time.perf_counter()
        batch = next(loader)
        wait += time.perf_counter() - fetch
        rows += len(batch["labels"])
        tokens += int(batch["num_tokens"])  # counted on the host copy: no device sync
        batch = to_device(batch, device)
        # Under DDP, gradients are all-reduced once per window, on its last micro-batch only.
        last = index == len(window) - 1
        no_sync = model.no_sync() if isinstance(model, DistributedDataParallel) and not last else nullcontext()
        with no_sync, meter.measure() if meter is not None else nullcontext():
            total += backward_micro_batch(model, batch, rows_in_window, precision, device, scaler)
    return total, (rows, tokens, wait)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # non_blocking overlaps the copy with compute when the host batch is pinned.
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.inference_mode()
def evaluate_split(
    model: nn.Module,
    split: TokenizedSplit,
    params: Params,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
) -> tuple[np.ndarray, float]:
    """Return (logits in the split's row order, mean loss), using length-bucketed batches."""
    model.eval()
    sampler = LengthGroupedBatchSampler(split.lengths, params.batch_size * 2, bucketing=True, shuffle=False)
    loader = make_loader(split, sampler.batches(0), params.model_copy(update={"num_workers": 0}), pad_id, device)
    logits = np.zeros((len(split), 0), dtype=np.float32)
    total_loss = torch.zeros((), device=device)
    for batch in loader:
        batch = to_device(batch, device)
        with autocast_context(precision, device):
            out = forward_logits(model, batch).float()
        total_loss += F.cross_entropy(out, batch["labels"], reduction="sum")
        if logits.shape[1] == 0:
            logits = np.zeros((len(split), out.shape[1]), dtype=np.float32)
        # Scatter back by row index: bucketing reorders rows, predictions must not move.
        logits[batch["row_index"].cpu().numpy()] = out.cpu().numpy()
    model.train()
    return logits, float(total_loss) / len(split)


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed process group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def global_window_rows(sampler: LengthGroupedBatchSampler, epoch: int, accum: int) -> list[int]:
    """Rows of each optimizer step's global window: every rank's window s together.

    Computed from the sampler's global batch plan, which every rank knows, so no communication.
    """
    all_batches = sampler.global_batches(epoch)
    per_rank = [plan_windows(all_batches[r :: sampler.num_replicas], accum) for r in range(sampler.num_replicas)]
    return [sum(len(b) for windows in per_rank for b in windows[s]) for s in range(len(per_rank[0]))]


def _all_reduce(values: list[float], op: str, device: torch.device) -> list[float]:
    """Reduce host numbers across ranks (a no-op without a process group)."""
    if world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group (what every schedule here sets)."""
    return float(optimizer.param_groups[0]["lr"])


def _percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else 0.0


def train_model(
    model: nn.Module,
    train: TokenizedSplit,
    validation: TokenizedSplit | None,
    params: Params,
    *,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
    on_log: LogFn | None = None,
    on_epoch_end: EpochFn | None = None,
    checkpoint_dir: Path | None = None,
    say: Callable[[str], None] = print,
) -> TrainResult:
    """Train `model` in place for `params.epochs` and return what was measured.

    `validation` (when given) is scored at every epoch's end, inside the measured time.

    With `checkpoint_dir`, a checkpoint is written every `checkpoint_every_n_steps` optimizer
    steps and at every epoch's end; a checkpoint made with the same params is resumed from.

    Inside an initialised torch.distributed process group (a Ray Train worker), the model is
    wrapped in DDP, each rank trains on its shard of every global batch, rank 0 alone writes
    checkpoints, and the logged loss and final metrics are reduced across ranks.
    """
    # Inductor draws its own fused dropout masks under compile; CUDA's dropout is already fused.
    use_fast_dropout = params.fast_dropout and device.type == "cpu" and not params.compile
    with fast_dropout(model) if use_fast_dropout else nullcontext():
        return _train(
            model,
            train,
            validation,
            params,
            pad_id=pad_id,
            device=device,
            precision=precision,
            on_log=on_log,
            on_epoch_end=on_epoch_end,
            checkpoint_dir=checkpoint_dir,
            say=say,
        )


def _train(
    model: nn.Module,
    train: TokenizedSplit,
    validation: TokenizedSplit | None,
    params: Params,
    *,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
    on_log: LogFn | None,
    on_epoch_end: EpochFn | None,
    checkpoint_dir: Path | None,
    say: Callable[[str], None],
) -> TrainResult:
    model.to(device)
    model.train()
    if params.grad_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    rank, world_size = world()
    forward_model: nn.Module = model
    if world_size > 1:
        forward_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if params.compile:
        forward_model = torch.compile(forward_model)

    sampler = LengthGroupedBatchSampler(
        train.lengths,
        params.batch_size,
        bucketing=params.data.bucketing,
        seed=params.seed,
        max_tokens=params.data.max_tokens_per_batch,
        num_replicas=world_size,
        rank=rank,
    )
    accum = params.grad_accum_steps
    total_steps = sum(math.ceil(len(sampler.batches(e)) / accum) for e in range(params.epochs))
    optimizer = build_optimizer(params.optim, model, params.lr, params.weight_decay, device)
    scheduler = build_scheduler(
        params.lr_schedule, optimizer, params.lr, total_steps, int(params.warmup_ratio * total_steps)
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    per_epoch_schedule = params.lr_schedule == "reduce_on_plateau"
    activations = SavedActivationMeter()

    state = LoopState()
    if checkpoint_dir is not None:
        payload, message = find_resumable(checkpoint_dir, params)
        say(message)
        if payload is not None:
            state = restore(payload, model, optimizer, scheduler, scaler)

    def checkpoint() -> None:
        # Every rank holds the same weights and optimizer state: rank 0 alone writes them.
        if checkpoint_dir is not None and rank == 0:
            state.logged_loss = float(logged_loss)
            state.elapsed_s = time.perf_counter() - start + elapsed_before
            save_checkpoint(checkpoint_dir, params, state, model, optimizer, scheduler, scaler)

    logged_loss = torch.tensor(state.logged_loss, device=device)  # summed on device; read at log points only
    # Non-finite windows, counted on the device too (consecutive, total) so the loop never waits to check.
    nonfinite = torch.tensor([state.nonfinite_consecutive, state.nonfinite_total], device=device)
    loss_scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    elapsed_before = state.elapsed_s
    start = time.perf_counter()
    while state.epoch < params.epochs:
        epoch = state.epoch
        windows = plan_windows(sampler.batches(epoch), accum, halvings=state.oom_halvings)
        # Under DDP each rank's loss is divided by (global window rows / ranks); see accumulate_window.
        window_rows = [r / world_size for r in global_window_rows(sampler, epoch, accum)] if world_size > 1 else None
        loader = None
        step_start = time.perf_counter()
        while state.window < len(windows):
            if loader is None:
                # Resuming mid-epoch: the window plan is deterministic, so skip the windows already done.
                remaining = [batch for window in windows[state.window :] for batch in window]
                loader = iter(make_loader(train, remaining, params, pad_id, device))
            measure = activations if state.step < _ACTIVATION_MEASURE_STEPS else None
            try:
                window_loss, counts = accumulate_window(
                    forward_model,
                    loader,
                    windows[state.window],
                    precision,
                    device,
                    scaler,
                    measure,
                    window_rows[state.window] if window_rows else None,
                )
            except OUT_OF_MEMORY:
                optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows = max(len(b) for b in windows[state.window])
                if rows == 1:
                    raise UserError("out of memory with one row per micro-batch; lower data.max_length") from None
                # Same rows per optimizer step, half per micro-batch: the effective batch is unchanged.
                windows = halve_windows(windows, state.window)
                state.oom_halvings += 1
                loader = None
                say(
                    f"out of memory on a micro-batch of {rows} rows: micro-batches halved, accumulation doubled "
                    f"(x{2**state.oom_halvings} since the start); the step is redone"
                )
                continue
            finite = torch.isfinite(window_loss)
            nonfinite[0] = torch.where(finite, 0, nonfinite[0] + 1)
            nonfinite[1] += (~finite).long()
            logged_loss += torch.where(finite, window_loss, 0.0)  # keep the curve readable
            state.rows_seen += counts[0]
            state.tokens_seen += counts[1]
            state.data_wait_s += counts[2]

            if params.max_grad_norm is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), params.max_grad_norm)
            if state.step == 0:
                state.peak_grad_bytes = gradient_bytes(model)
                state.peak_activation_bytes = activations.peak_bytes
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            if not per_epoch_schedule:
                scheduler.step()
            state.step += 1
            state.window += 1
            state.logged_windows += 1
            now = time.perf_counter()
            state.step_times.append(now - step_start)
            step_start = now
            if state.step % params.log_every_n_steps == 0 or state.step == total_steps:
                # The one host-device sync of the loop, every log_every_n_steps steps (and, under
                # DDP, its one extra all-reduce: the global loss and the worst rank's counters).
                consecutive, total_bad = (int(v) for v in _all_reduce(nonfinite.tolist(), "max", device))
                interval_loss = _all_reduce([float(logged_loss)], "sum", device)[0] / world_size
                bad_in_interval = total_bad - state.nonfinite_total
                state.nonfinite_consecutive, state.nonfinite_total = consecutive, total_bad
                good = state.logged_windows - bad_in_interval
                point = {"loss": interval_loss / good if good else float("nan"), "lr": current_lr(optimizer)}
                if scaler.is_enabled():
                    # Each skipped fp16 step halves the scale (growth happens once per 2,000 clean steps).
                    new_scale = scaler.get_scale()
                    state.scaler_skips += max(0, round(math.log2(loss_scale / new_scale))) if new_scale else 0
                    loss_scale = new_scale
                    point |= {"loss_scale": new_scale, "scaler_skips": state.scaler_skips}
                state.history.append({"step": state.step, "epoch": epoch, **point})
                logged_loss.zero_()
                state.logged_windows = 0
                if on_log:
                    on_log(state.step, point)
                if consecutive >= params.max_nonfinite_steps:
                    raise NonFiniteLoss(
                        f"the loss was not finite for {consecutive} optimizer steps in a row (max_nonfinite_steps = "
                        f"{params.max_nonfinite_steps}), up to step {state.step}; lower lr, set max_grad_norm, "
                        "or use bf16 instead of fp16"
                    )
            if params.checkpoint_every_n_steps and state.step % params.checkpoint_every_n_steps == 0:
                checkpoint()

        if validation is not None:
            val_logits, val_loss = evaluate_split(model, validation, params, pad_id, device, precision)
            state.val_metrics = {
                "val_loss": val_loss,
                "val_accuracy": float((val_logits.argmax(1) == validation.labels).mean()),
            }
        if per_epoch_schedule:
            # On the validation loss; without validation, on the epoch's last logged training loss.
            last_train = state.history[-1]["loss"] if state.history else 0.0
            scheduler.step(state.val_metrics.get("val_loss", last_train))
        state.epoch, state.window = epoch + 1, 0
        checkpoint()
        if on_epoch_end:
            on_epoch_end(epoch + 1, state.step, state.val_metrics)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    train_time = time.perf_counter() - start + elapsed_before
    metrics = _final_metrics(state, train_time, model, optimizer, device)
    if world_size > 1:
        metrics = _reduce_final_metrics(metrics, device)
    return TrainResult(metrics=metrics, history=state.history)


# Under DDP: rows and tokens add up over ranks; times and memory peaks take the slowest/largest rank.
_MAXED = ("train_time_s", "data_wait_fraction", "peak_rss_bytes", "peak_memory_bytes", "peak_reserved_bytes")


def _reduce_final_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """The run's global metrics: rows and tokens of every rank over the slowest rank's time."""
    rows, tokens = _all_reduce(
        [metrics["samples_per_s"] * metrics["train_time_s"], metrics["tokens_per_s"] * metrics["train_time_s"]],
        "sum",
        device,
    )
    maxed = [k for k in _MAXED if k in metrics]
    reduced = dict(zip(maxed, _all_reduce([metrics[k] for k in maxed], "max", device), strict=True))
    out = {**metrics, **reduced}
    out["samples_per_s"] = rows / out["train_time_s"]
    out["tokens_per_s"] = tokens / out["train_time_s"]
    out["world_size"] = float(world()[1])
    return out


def _final_metrics(
    state: LoopState, train_time: float, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, float]:
    metrics: dict[str, float] = {
        "train_time_s": train_time,
        "samples_per_s": state.rows_seen / train_time,
        "tokens_per_s": state.tokens_seen / train_time,
        "step_time_p50_ms": _percentile_ms(state.step_times, 50),
        "step_time_p90_ms": _percentile_ms(state.step_times, 90),
        "data_wait_fraction": state.data_wait_s / train_time,
        "optimizer_steps": state.step,
        "oom_halvings": state.oom_halvings,
        "nonfinite_steps": state.nonfinite_total,
        "scaler_skips": state.scaler_skips,
        "final_train_loss": state.history[-1]["loss"] if state.history else float("nan"),
        "param_bytes": parameter_bytes(model),
        "grad_bytes": state.peak_grad_bytes,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_activation_bytes": state.peak_activation_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        **state.val_metrics,
    }
    if device.type == "cuda":
        metrics["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        metrics["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        metrics["peak_memory_bytes"] = metrics["peak_rss_bytes"]
    return {k: float(v) for k, v in metrics.items()}
