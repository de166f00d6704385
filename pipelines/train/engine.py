"""The training loop every trial runs.

Each optimizer step is the three parts in `pipelines.train.steps`. Around them the loop keeps
one clock per region (`pipelines.train.timing`): the first optimizer step is the warm-up
(compile, lazy allocations), timed on its own; `train_time_s` is every later step, the same
region for every strategy; validation, checkpoint writes and setup have their own clocks.
Memory is measured before the loop by running the first window twice under PyTorch's
MemTracker (then the weights are put back), and on CUDA by the allocator's peak over the
training segments.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.train.checkpoint import LoopState, find_resumable, restore, save_checkpoint
from pipelines.train.device import ResolvedPrecision, apply_tf32, resolve_pad_multiple, resolve_tf32
from pipelines.train.fast_dropout import FastDropoutUse, fast_dropout
from pipelines.train.memory import MemoryAtPeak, gradient_bytes, restored_after, track_training_peak
from pipelines.train.optim import build_optimizer, build_scheduler
from pipelines.train.out_of_memory import OUT_OF_MEMORY, recover_from_out_of_memory
from pipelines.train.parallel import gather_full_weights, replicate, shard, uses_fsdp
from pipelines.train.results import all_reduce, final_metrics, reduce_final_metrics, world
from pipelines.train.steps import (
    accumulate_window,
    global_window_rows,
    make_loader,
    make_scaler,
    optimizer_step,
    plan_windows,
    task_of,
    training_sampler,
    window_units,
)
from pipelines.train.timing import StepClock, timed
from pipelines.train.validation import evaluate_split

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


class NonFiniteLoss(UserError):
    """Training diverged: the loss stayed NaN or infinite for too many steps."""


@dataclass
class TrainResult:
    """What a finished run measured: final metrics, the logged (step, loss, lr) curve, and tags for its run."""

    metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)


# (optimizer step, logged point: loss, lr, ... plus total_steps and rows_timed for progress displays)
LogFn = Callable[[int, dict[str, float]], None]
EpochFn = Callable[[int, int, dict[str, float]], None]  # (epoch, optimizer step, validation metrics)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group (what every schedule here sets)."""
    return float(optimizer.param_groups[0]["lr"])


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
    task: Task | None = None,
) -> TrainResult:
    """Train `model` in place for `params.epochs` and return what was measured.

    `task` (default: the one `params.task` names) gives the batches' labels, the loss and the
    validation metrics; the loop itself is the same for every task.

    `validation` (when given) is scored at every epoch's end, on its own clock (`val_time_s`).

    With `checkpoint_dir`, a checkpoint is written every `checkpoint_every_n_steps` optimizer
    steps and at every epoch's end; a checkpoint made with the same params is resumed from.

    Inside an initialised torch.distributed process group (a Ray Train worker), the model is
    wrapped in DDP, each rank trains on its shard of every global batch, rank 0 alone writes
    checkpoints, and the logged loss and final metrics are reduced across ranks.
    """
    setup_start = time.perf_counter()
    if not uses_fsdp(params, world()[1]):
        model.to(device)  # under FSDP the shards go to the device, and the whole model stays on the host
    train = task_of(params, task).training_split(train, params, model)  # packs, with data.packing
    # Inductor draws its own fused dropout masks under compile; CUDA's dropout is already fused.
    use_fast_dropout = params.fast_dropout and device.type == "cpu" and not params.compile
    probe = _probe_inputs(train, pad_id, task_of(params, task), params) if use_fast_dropout else None
    with fast_dropout(model, probe, bf16=precision == "bf16") if use_fast_dropout else nullcontext() as use:
        notes = {"fast_dropout": use.describe() if isinstance(use, FastDropoutUse) else "off"}
        result = _train(
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
            setup_start=setup_start,
            task=task_of(params, task),
        )
    result.notes.update(notes)
    return result


def _probe_inputs(train: TokenizedSplit, pad_id: int, task: Task, params: Params) -> dict[str, torch.Tensor]:
    """A few rows of unequal length (so the batch has padding) for fast_dropout's equality check: the model's inputs."""
    order = train.lengths.argsort()
    picks = sorted({int(order[0]), int(order[len(order) // 2]), int(order[-1])})
    batch = task.collator(train, pad_id, fixed_length=None, pad_to_multiple_of=None, params=params)(picks)
    return {k: v for k, v in batch.items() if k not in ("labels", "row_index", "num_rows", "num_tokens")}


def _measure_memory(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    run_window: Callable[[object], None],
    device: torch.device,
    say: Callable[[str], None],
) -> MemoryAtPeak | None:
    """Peak training memory and its breakdown from two runs of the first window; the weights are then put back."""
    scaler_state = scaler.state_dict()
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else []
    with restored_after(model):  # a host copy of the weights: on a GPU a device copy would skew the peak
        try:
            return track_training_peak(model, optimizer, device, run_window)
        except OUT_OF_MEMORY:
            say("the memory probe ran out of memory on the first window; training will halve micro-batches")
            return None
        finally:
            optimizer.state.clear()  # rebuilt lazily by the first real step
            optimizer.zero_grad(set_to_none=True)
            scaler.load_state_dict(scaler_state)
            torch.set_rng_state(rng)
            if cuda_rng:
                torch.cuda.set_rng_state_all(cuda_rng)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)


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
    setup_start: float,
    task: Task,
) -> TrainResult:
    model.train()
    if params.grad_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    tf32 = resolve_tf32(params, precision, device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        apply_tf32(tf32)
    rank, world_size = world()
    fsdp = uses_fsdp(params, world_size)
    whole = model  # the caller's model: trained in place, or under FSDP given the gathered weights at the end
    if fsdp:
        model = shard(whole, precision, device, world_size)  # from here on, `model` is this rank's shards
        if checkpoint_dir is not None:
            say("FSDP: no checkpoints are written (sharded state is not saved for resume yet); the run starts over")
            checkpoint_dir = None
    pad_multiple = resolve_pad_multiple(params, device)
    sampler = training_sampler(train, params, world_size, rank)
    accum = params.grad_accum_steps
    total_steps = sum(math.ceil(len(sampler.batches(e)) / accum) for e in range(params.epochs))
    if params.lr == "auto":
        raise ValueError("lr: auto is resolved before training (pipelines.train.lr_range.resolve_lr)")
    optimizer = build_optimizer(params.optim, model, params.lr, params.weight_decay, device)
    scheduler = build_scheduler(
        params.lr_schedule, optimizer, params.lr, total_steps, int(params.warmup_ratio * total_steps)
    )
    scaler = make_scaler(precision, device)
    per_epoch_schedule = params.lr_schedule == "reduce_on_plateau"

    units = task.loss_units(train, params)  # per row: what a window's mean loss divides by
    first_window = plan_windows(sampler.batches(0), accum)[0]  # the longest batch comes first
    in_process = params.model_copy(update={"num_workers": 0, "persistent_workers": False})
    # Collated once, run twice by the probe (untracked, then tracked).
    first_batches = list(make_loader(train, first_window, in_process, pad_id, device, pad_multiple, task))

    def probe_window(meter: object) -> None:
        first_units = window_units(first_window, units)
        accumulate_window(model, iter(first_batches), first_window, precision, device, scaler, meter, first_units, task)
        optimizer_step(model, optimizer, scaler, params.max_grad_norm, precision)

    memory = _measure_memory(model, optimizer, scaler, probe_window, device, say)

    state = LoopState()
    if checkpoint_dir is not None:
        payload, message = find_resumable(checkpoint_dir, params)
        say(message)
        if payload is not None:
            state = restore(payload, model, optimizer, scheduler, scaler)
    if memory is not None:
        state.memory = memory.as_metrics()
    forward_model: nn.Module = model
    if world_size > 1 and not fsdp:
        forward_model = replicate(model, device)
    if params.compile:
        forward_model = torch.compile(forward_model)
    clocks = state.clocks
    clocks["setup_time_s"] = clocks.get("setup_time_s", 0.0) + time.perf_counter() - setup_start
    clock = StepClock(device, clocks, state.step_times)

    def pause_training() -> None:
        clock.stop()
        if device.type == "cuda":
            # Keep the training segments' peaks; validation's own allocations must not count.
            state.cuda_peak_allocated = max(state.cuda_peak_allocated, torch.cuda.max_memory_allocated(device))
            state.cuda_peak_reserved = max(state.cuda_peak_reserved, torch.cuda.max_memory_reserved(device))

    def resume_training() -> None:
        if clock.running:
            return
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        clock.start()

    def checkpoint() -> None:
        # Every rank holds the same weights and optimizer state: rank 0 alone writes them.
        if checkpoint_dir is not None and rank == 0:
            pause_training()
            with timed(device, clocks, "checkpoint_time_s"):
                state.logged_loss = float(logged_loss)
                save_checkpoint(checkpoint_dir, params, state, model, optimizer, scheduler, scaler)

    logged_loss = torch.tensor(state.logged_loss, device=device)  # summed on device; read at log points only
    # Counted on the device so the loop never waits to check: [consecutive non-finite, total non-finite, skipped].
    counters = torch.tensor([state.nonfinite_consecutive, state.nonfinite_total, state.skipped_total], device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    while state.epoch < params.epochs:
        epoch = state.epoch
        windows = plan_windows(sampler.batches(epoch), accum, halvings=state.oom_halvings)
        # Each window's loss is divided by its loss units; under DDP by (global window units / ranks).
        if world_size > 1:
            divisors = [u / world_size for u in global_window_rows(sampler, epoch, accum, units)]
        else:
            divisors = [window_units(window, units) for window in windows]
        loader = None
        while state.window < len(windows):
            if loader is None:
                # Resuming mid-epoch: the window plan is deterministic, so skip the windows already done.
                remaining = [batch for window in windows[state.window :] for batch in window]
                loader = iter(make_loader(train, remaining, params, pad_id, device, pad_multiple, task))
            warmup = state.step == 0
            region = timed(device, clocks, "warmup_time_s") if warmup else nullcontext()
            if not warmup:
                resume_training()
            out_of_memory = False
            try:
                with region:
                    window_loss, counts = accumulate_window(
                        forward_model,
                        loader,
                        windows[state.window],
                        precision,
                        device,
                        scaler,
                        None,
                        divisors[state.window],
                        task,
                    )
                    if warmup:
                        state.peak_grad_bytes = gradient_bytes(model)
                    skipped = optimizer_step(model, optimizer, scaler, params.max_grad_norm, precision)
            except OUT_OF_MEMORY:
                # Recovery happens after the except block: inside it, the traceback's frames still hold
                # the failed step's activations, so emptying the cache there would free nothing.
                out_of_memory = True
            if out_of_memory:
                windows = recover_from_out_of_memory(optimizer, windows, state, device, world_size, say)
                loader = None
                continue
            finite = torch.isfinite(window_loss)
            counters[0] = torch.where(finite, 0, counters[0] + 1)
            counters[1] += (~finite).long()
            counters[2] += skipped.to(counters.device).long()
            logged_loss += torch.where(finite, window_loss, 0.0)  # keep the curve readable
            if not per_epoch_schedule:
                scheduler.step()
            state.step += 1
            state.window += 1
            state.logged_windows += 1
            if not warmup:
                clock.lap()
                state.add_timed(counts.rows, counts.tokens, counts.positions, counts.wait_s)
            if state.step % params.log_every_n_steps == 0 or state.step == total_steps:
                _log_point(
                    state, counters, logged_loss, optimizer, scaler, epoch, device, world_size, on_log, total_steps
                )
                clock.read_laps()
                if state.nonfinite_consecutive >= params.max_nonfinite_steps:
                    raise NonFiniteLoss(
                        f"the loss was not finite for {state.nonfinite_consecutive} optimizer steps in a row "
                        f"(max_nonfinite_steps = {params.max_nonfinite_steps}), up to step {state.step}; those steps "
                        "were skipped, not applied; lower lr, set max_grad_norm, or use bf16 instead of fp16"
                    )
            if params.checkpoint_every_n_steps and state.step % params.checkpoint_every_n_steps == 0:
                checkpoint()
        pause_training()
        if validation is not None:
            with timed(device, clocks, "val_time_s"):
                state.val_metrics = evaluate_split(model, validation, params, pad_id, device, precision, task)
        if per_epoch_schedule:
            # On the validation loss; without validation, on the epoch's last logged training loss.
            last_train = state.history[-1]["loss"] if state.history else 0.0
            scheduler.step(state.val_metrics.get("val_loss", last_train))
        state.epoch, state.window = epoch + 1, 0
        checkpoint()
        if on_epoch_end:
            on_epoch_end(epoch + 1, state.step, state.val_metrics)
    pause_training()
    metrics = final_metrics(state, model, optimizer, device, compiled=params.compile)  # under FSDP: this rank's shards
    if fsdp:
        gather_full_weights(model, whole, rank, device)
    if world_size > 1:
        metrics = reduce_final_metrics(metrics, device)
    notes = {"tf32.resolved": str(tf32).lower(), "pad_to_multiple_of.resolved": str(pad_multiple)}
    return TrainResult(metrics=metrics, history=state.history, notes=notes)


def _log_point(
    state: LoopState,
    counters: torch.Tensor,
    logged_loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    epoch: int,
    device: torch.device,
    world_size: int,
    on_log: LogFn | None,
    total_steps: int,
) -> None:
    """The loop's one host-device sync, every log_every_n_steps steps (and, under DDP, its one extra
    all-reduce: the global loss and the worst rank's counters)."""
    consecutive, total_bad, skipped = (int(v) for v in all_reduce(counters.tolist(), "max", device))
    interval_loss = all_reduce([float(logged_loss)], "sum", device)[0] / world_size
    bad_in_interval = total_bad - state.nonfinite_total
    state.nonfinite_consecutive, state.nonfinite_total, state.skipped_total = consecutive, total_bad, skipped
    good = state.logged_windows - bad_in_interval
    point = {
        "loss": interval_loss / good if good else float("nan"),
        "lr": current_lr(optimizer),
        "skipped_steps": float(skipped),
    }
    scale = scaler.get_scale()
    if scale != 1.0:  # fp16's dynamic scale (other precisions hold it at 1.0)
        point["loss_scale"] = scale
    state.history.append({"step": state.step, "epoch": epoch, **point})
    logged_loss.zero_()
    state.logged_windows = 0
    if on_log:  # and, for progress displays, how far along the run is (not part of the logged curve)
        on_log(state.step, {**point, "total_steps": float(total_steps), "rows_timed": float(state.rows_timed)})
