"""The training loop as a small trainer: set up, measure, then epochs of steps, validation and checkpoints.

`Trainer.run` reads like nanoGPT's loop: for each epoch, for each accumulation window, fetch its batches, then one
call of the trial's `TrainStep` (`pipelines.train.step`; the out-of-memory retry around it), then `after_step`
(counters, schedule, clocks, log point, checkpoint); at the epoch's end, `end_epoch` (validation, per-epoch schedule,
checkpoint, callback). The clocks and the CUDA peaks are paused around everything that is not training.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipelines.data.loader import in_process, make_loader, to_device
from pipelines.errors import UserError
from pipelines.runtime import Runtime
from pipelines.train.checkpoint import WHOLE, LoopState
from pipelines.train.compile_warmup import CompileEvents, compile_and_warm, row_units, state_before_recording
from pipelines.train.compiled_step import bounded_graphs, graphs_built, padded_rows, run_shapes
from pipelines.train.distributed_checkpoint import DISTRIBUTED
from pipelines.train.measurement import TrainingMeter, probe_memory, rng_preserved
from pipelines.train.memory import MemoryAtPeak, gradient_bytes, track_step
from pipelines.train.memory_levers import OffloadContext, apply_memory_levers
from pipelines.train.optim import build_optimizer, build_scheduler, create_fresh_state
from pipelines.train.out_of_memory import OUT_OF_MEMORY, recover_from_out_of_memory
from pipelines.train.parallel import ParallelConfig, gather_full_weights, replicate, uses_fsdp
from pipelines.train.request import TrainRequest, refuse_unresolved
from pipelines.train.results import all_reduce, final_metrics, reduce_final_metrics, world
from pipelines.train.shard_loading import shard_model
from pipelines.train.step import StepOutcome, TrainStep, make_scaler
from pipelines.train.validation import evaluate_split
from pipelines.train.windows import (
    WindowCounts,
    fetch_window,
    global_window_rows,
    optimizer_steps,
    plan_windows,
    training_sampler,
    window_units,
)


class NonFiniteLoss(UserError):
    """Training diverged: the loss stayed NaN or infinite for too many steps."""


class StuckLoss(UserError):
    """The loss stopped changing: the model's outputs no longer depend on what it is trained on."""


# A loss equal to the one before it (relative 1e-5) for this many optimizer steps in a row, each on a different
# batch, means outputs that no longer depend on the inputs (a compiled kernel that failed: on an H100, compile +
# Liger trained at ln(vocabulary size) from the second step on): the run stops instead of training on.
STUCK_STEPS, STUCK_TOLERANCE = 5, 1e-5
# A log point at least this often (a single process: under DDP every rank must log at the same steps), so a run of
# slow steps shows progress (`pipelines.progress`) long before its first `log_every_n_steps`.
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class WindowStep:
    """One window's step as the loop sees it: the step's outcome, what its batches held, and whether it was the
    (untimed) warm-up."""

    outcome: StepOutcome
    counts: WindowCounts
    warmup: bool


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group (what every schedule here sets)."""
    return float(optimizer.param_groups[0]["lr"])


class Trainer:
    """One run of the loop over `params.epochs`, on the model it is given (trained in place)."""

    def __init__(self, request: TrainRequest, runtime: Runtime) -> None:
        refuse_unresolved(request.params)
        self.keep(request, runtime)
        offload = self.ready_model(request.model)
        self.place_model(request.model)
        self.plan_run()
        self.build_step(offload)
        self.plan_compiled()

    def keep(self, request: TrainRequest, runtime: Runtime) -> None:
        """What the loop reads of the request and the runtime: the splits, params, task, callbacks and checkpoints."""
        assert request.task is not None, "the Trainer needs the request's task (train_model resolves it)"
        self.train, self.validation, self.params = request.train, request.validation, request.params
        self.task, self.runtime, self.device, self.say = request.task, runtime, runtime.device, request.say
        self.on_log, self.on_epoch_end = request.on_log, request.on_epoch_end
        self.checkpoint_dir = request.checkpoint_dir

    def ready_model(self, model: nn.Module) -> OffloadContext:
        """`model` in training mode with its memory levers (frozen weights in the compute dtype, checkpointing,
        kernels) and the runtime's settings applied; the activation offload's context, which the step opens."""
        model.train()
        offload = apply_memory_levers(model, self.params, self.device, precision=self.runtime.precision)
        self.runtime.apply()
        return offload

    def place_model(self, model: nn.Module) -> None:
        """This rank of the world, and the model it trains: the caller's, in place, or under FSDP this rank's shards
        (`shard_model`), the caller's kept (`whole`) to be given the gathered weights at the end."""
        self.rank, self.world_size = world()
        self.fsdp = uses_fsdp(self.params, self.world_size)
        self.whole = self.model = model
        self.shard_note: dict[str, str] = {}
        if self.fsdp:
            config = ParallelConfig.of(self.params, self.runtime.precision, self.device, self.world_size)
            self.model, self.shard_note = shard_model(model, config, self.rank)
        self.checkpoints = DISTRIBUTED if self.world_size > 1 else WHOLE  # every rank's part, or the one file

    def plan_run(self) -> None:
        """This rank's batches (its sampler), the optimizer steps they make, and each row's loss units."""
        self.sampler = training_sampler(self.train, self.params, self.world_size, self.rank)
        self.total_steps = optimizer_steps(self.sampler, self.params)
        self.units = self.task.loss_units(self.train, self.params)  # per row: what a window's mean loss divides by

    def build_step(self, offload: OffloadContext) -> None:
        """The optimizer, its schedule over the run's steps, and the step, built once: the loop, the warm-up probe
        and the memory probe all run this object."""
        params, runtime = self.params, self.runtime
        self.optimizer = build_optimizer(params.optim, self.model, params.lr, params.weight_decay, self.device)
        warmup_steps = int(params.warmup_ratio * self.total_steps)
        self.scheduler = build_scheduler(params.lr_schedule, self.optimizer, params.lr, self.total_steps, warmup_steps)
        self.per_epoch_schedule = params.lr_schedule == "reduce_on_plateau"
        self.train_step = TrainStep(self.model, self.optimizer, self.task, runtime, make_scaler(runtime),
                                    params.max_grad_norm, offload)  # fmt: skip

    def plan_compiled(self) -> None:
        """A compiled run's batch shapes, one batch of each (`run_shapes`: every epoch's batches, padded to one row
        count), which it warms and bounds its graphs by; its graph counts and notes, empty until it compiles."""
        self.compiled = self.params.compile is True
        shapes = run_shapes(self.train, self.params, self.runtime, self.task, self.sampler) if self.compiled else {}
        self.shape_batches: list[list[int]] = list(shapes.values())
        self.graphs = {"compile_graphs": 0.0, "compile_graphs_in_loop": 0.0}
        self.timed_from = CompileEvents(0, 0)  # a compiled run's compile counters as its timed steps start
        self.compile_notes: dict[str, str] = {}

    def run(self, setup_start: float) -> tuple[dict[str, float], LoopState, dict[str, str]]:
        """Train every epoch; the final metrics (reduced across ranks), the loop's state, and notes for the run."""
        # A compiled step that would need a graph beyond its shapes' fails instead of running eager unannounced.
        with bounded_graphs(len(self.shape_batches)) if self.compiled else nullcontext():
            self.start(setup_start)
            in_loop = graphs_built()
            while self.state.epoch < self.params.epochs:
                self.epoch()
            self.graphs["compile_graphs_in_loop"] = float(graphs_built() - in_loop) if self.compiled else 0.0
        self.meter.pause()
        self.count_timed_compiles()
        metrics = {**final_metrics(self.state, self.model, self.optimizer, self.device), **self.graphs}
        if self.fsdp:  # the metrics are this rank's shards'
            gather_full_weights(self.model, self.whole, self.rank, self.device)
        if self.world_size > 1:
            metrics = reduce_final_metrics(metrics, self.device)
        return metrics, self.state, {**self.runtime.notes(), **self.compile_notes, **self.shard_note}

    def count_timed_compiles(self) -> None:
        """Recompiles and CUDA-graph skips after the warm-up, in the timed steps: metrics, and a warning when any,
        for the step times hold their cost (a recompile takes seconds where a step takes milliseconds)."""
        timed = CompileEvents.now().since(self.timed_from) if self.compiled else CompileEvents(0, 0)
        self.graphs.update(timed_recompiles=float(timed.graphs), timed_cudagraph_skips=float(timed.cudagraph_skips))
        if timed.graphs or timed.cudagraph_skips:
            self.say(
                f"warning: compile: {timed.graphs} recompiles and {timed.cudagraph_skips} CUDA-graph skips in the "
                "timed steps, after the warm-up; the step times (train_time_s, step_time_p50_ms and p90, "
                "samples_per_s, tokens_per_s) include them"
            )

    def start(self, setup_start: float) -> None:
        """Measure memory on the first window, resume from a checkpoint, wrap the model, start the clocks.

        The memory probe is the warm-up step itself, tracked, once the optimizer's fresh state exists (so the
        step is the steady state): no window runs twice. Where that state cannot be made ahead (an optimizer
        whose fresh state is not zeros) or the step is compiled or distributed, the first window is probed
        on its own beforehand and the weights put back."""
        single = not self.compiled and self.world_size == 1
        self.track_warmup = single and create_fresh_state(self.model, self.optimizer)
        memory = None if self.track_warmup else self.measure_memory()
        self.state = LoopState()
        if self.checkpoint_dir is not None:
            payload, message = self.checkpoints.find(self.checkpoint_dir, self.params)
            if self.rank == 0:  # every rank finds the same
                self.say(message)
            if payload is not None:
                self.state = self.checkpoints.restore(payload, self.train_step, self.scheduler)
        if memory is not None:
            self.state.memory = memory.as_metrics()
        forward: nn.Module = self.model  # the step runs its forward through the DDP replica, compiled when asked
        if self.world_size > 1 and not self.fsdp:
            forward = replicate(self.model, self.device)
        self.train_step = self.train_step.through(forward)
        if self.compiled:
            # The state before the CUDA peak's window opens: making it holds zeroed gradients beside it for a moment,
            # as large as the recording's would be, and the peak must be the recording's (`compile_warmup`).
            state_before_recording(self.train_step)
        self.meter = TrainingMeter(self.device, self.state, setup_start)  # clocks and CUDA peaks, beside the loop
        if self.compiled:
            self.compile_and_warm()
        state, device = self.state, self.device
        self.logged_loss = torch.tensor(state.logged_loss, device=device)  # summed on device; read at log points
        # Counted on the device so the loop never waits to check: [consecutive non-finite, total non-finite, skipped,
        # consecutive steps whose loss equals the step's before].
        self.counters = torch.tensor(
            [state.nonfinite_consecutive, state.nonfinite_total, state.skipped_total, 0], device=device
        )
        self.previous_loss, self.previous_rows = torch.full((), float("nan"), device=device), -2
        self.last_log = time.monotonic()

    def compile_and_warm(self) -> None:
        """Compile the step and run it on one batch of each of the run's shapes, on its own clock
        (`compile_time_s`), before any timed step, the optimizer's state alive (`pipelines.train.compile_warmup`);
        the gradients are dropped and the random state put back. The recording's CUDA peak counts as training's."""
        padded, accumulate = padded_rows(self.params), self.params.grad_accum_steps
        loader = make_loader(self.train, self.shape_batches, in_process(self.params), self.runtime, self.task, padded)
        batches = [to_device(batch, self.device) for batch in loader]
        units = [row_units(rows, self.units) for rows in self.shape_batches]
        with self.meter.region("compile_time_s"), rng_preserved(self.device):
            self.train_step, warmed = compile_and_warm(self.train_step, batches, units, self.say, accumulate)
        self.meter.keep_cuda_peaks()
        self.graphs.update(warmed.metrics)
        self.compile_notes = warmed.notes
        self.timed_from = CompileEvents.now()

    def measure_memory(self) -> MemoryAtPeak | None:
        """Peak training memory and its breakdown from two runs of the first window; the weights are then put back."""
        first_window = plan_windows(self.sampler.batches(0), self.params.grad_accum_steps)[0]  # the longest batch
        # Collated once, run twice by the probe (untracked, then tracked).
        loader = make_loader(self.train, first_window, in_process(self.params), self.runtime, self.task)
        batches = [to_device(batch, self.device) for batch in loader]
        units = window_units(first_window, self.units)
        return probe_memory(self.train_step, lambda meter: self.train_step(batches, units, meter), self.say)

    def epoch(self) -> None:
        """One epoch's windows, resumed mid-epoch when the state says so, then its end."""
        state, params, epoch = self.state, self.params, self.state.epoch
        windows = plan_windows(self.sampler.batches(epoch), params.grad_accum_steps, halvings=state.oom_halvings)
        # Each window's loss is divided by its loss units; under DDP by (global window units / ranks).
        if self.world_size > 1:
            global_units = global_window_rows(self.sampler, epoch, params.grad_accum_steps, self.units)
            divisors = [u / self.world_size for u in global_units]
        else:
            divisors = [window_units(window, self.units) for window in windows]
        loader: Iterator[Any] | None = None
        while state.window < len(windows):
            if loader is None:
                # Resuming mid-epoch: the window plan is deterministic, so skip the windows already done.
                remaining = [batch for window in windows[state.window :] for batch in window]
                rows = padded_rows(params, state.oom_halvings) if self.compiled else None
                loader = iter(make_loader(self.train, remaining, params, self.runtime, self.task, rows))
            outcome = self.step(loader, len(windows[state.window]), divisors[state.window])
            if outcome is None:  # out of memory: the step's frames are gone, so its activations can be freed
                windows = recover_from_out_of_memory(self.optimizer, windows, state, self.device, self.world_size,
                                                     self.say)  # fmt: skip
                loader = None
                continue
            self.after_step(epoch, outcome)
        self.end_epoch(epoch)

    def step(self, loader: Iterator[Any], micro_batches: int, divisor: float) -> WindowStep | None:
        """Fetch the next window's batches and run the step on them; None when it ran out of memory."""
        warmup = self.state.step == 0
        region = self.meter.region("warmup_time_s") if warmup else nullcontext()
        if not warmup:
            self.meter.resume()
        try:
            with region:
                batches, counts = fetch_window(loader, micro_batches, self.device)
                if warmup and self.track_warmup:  # the probe: this step, under the tracker (see `start`)
                    outcome = self.tracked_warmup_step(batches, divisor)
                elif warmup:
                    outcome = self.warmup_step(batches, divisor)
                else:
                    outcome = self.train_step(batches, divisor)
        except OUT_OF_MEMORY:
            return None
        return WindowStep(outcome, counts, warmup)

    def tracked_warmup_step(self, batches: list[dict[str, torch.Tensor]], divisor: float) -> StepOutcome:
        """The warm-up step under PyTorch's MemTracker: the trial's memory measurement (see `start`)."""
        outcomes: list[StepOutcome] = []
        memory = track_step(self.model, self.optimizer, self.device,
                            lambda meter: outcomes.append(self.warmup_step(batches, divisor, meter)))  # fmt: skip
        self.state.memory = memory.as_metrics()
        return outcomes[0]

    def warmup_step(self, batches: list[dict[str, torch.Tensor]], divisor: float, meter: object = None) -> StepOutcome:
        """The first step, its gradients' bytes read between backward and the update (the only time they all live)."""
        loss = self.train_step.accumulate(batches, divisor, meter)
        self.state.peak_grad_bytes = gradient_bytes(self.model)
        return StepOutcome(loss, self.train_step.update())

    def after_step(self, epoch: int, done: WindowStep) -> None:
        """Count the step (on the device), step the schedule and clocks, log every few steps, checkpoint."""
        state, params, counters = self.state, self.params, self.counters
        window_loss, counts, warmup = done.outcome.loss, done.counts, done.warmup
        finite = torch.isfinite(window_loss)
        counters[0] = torch.where(finite, 0, counters[0] + 1)
        if counts.rows_key != self.previous_rows:  # a window on the rows before (one batch an epoch) proves nothing
            previous, self.previous_loss, self.previous_rows = self.previous_loss, window_loss, counts.rows_key
            same = finite & (window_loss != 0) & ((window_loss - previous).abs() <= STUCK_TOLERANCE * window_loss.abs())
            counters[3] = torch.where(same, counters[3] + 1, 0)
        counters[1] += (~finite).long()
        counters[2] += done.outcome.skipped.to(counters.device).long()
        self.logged_loss += torch.where(finite, window_loss, 0.0)  # keep the curve readable
        if not self.per_epoch_schedule:
            self.scheduler.step()
        state.step += 1
        state.window += 1
        state.logged_windows += 1
        if warmup:
            # The warm-up step is not timed, but it is training, and usually the largest (the longest batch comes
            # first, and the optimizer state is created in it): keep its peak before the next step's reset.
            self.meter.keep_cuda_peaks()
            if self.compiled:  # what the untimed warm-up step compiled is not the timed steps'
                self.timed_from = CompileEvents.now()
        else:
            self.meter.clock.lap()
            state.add_timed(counts.rows, counts.tokens, counts.positions, counts.wait_s)
        overdue = self.world_size == 1 and time.monotonic() - self.last_log >= PROGRESS_EVERY_S
        if state.step % params.log_every_n_steps == 0 or state.step == self.total_steps or overdue:
            self.log_point(epoch)
            self.meter.clock.read_laps()
            if state.nonfinite_consecutive >= params.max_nonfinite_steps:
                raise NonFiniteLoss(
                    f"the loss was not finite for {state.nonfinite_consecutive} optimizer steps in a row "
                    f"(max_nonfinite_steps = {params.max_nonfinite_steps}), up to step {state.step}; those steps "
                    "were skipped, not applied; lower lr, set max_grad_norm, or use bf16 instead of fp16"
                )
        if params.checkpoint_every_n_steps and state.step % params.checkpoint_every_n_steps == 0:
            self.checkpoint()

    def log_point(self, epoch: int) -> None:
        """The loop's one host-device sync, every log_every_n_steps steps (and, under DDP, its one extra
        all-reduce: the global loss and the worst rank's counters)."""
        state, counters, logged_loss, device = self.state, self.counters, self.logged_loss, self.device
        self.last_log = time.monotonic()
        consecutive, total_bad, skipped, stuck = (int(v) for v in all_reduce(counters.tolist(), "max", device))
        if stuck >= STUCK_STEPS - 1:
            raise StuckLoss(
                f"the training loss stayed at {float(self.previous_loss):.6g} (to a relative {STUCK_TOLERANCE:g}) for "
                f"{stuck + 1} optimizer steps in a row, on different batches, up to step {state.step}: the model's "
                "outputs no longer depend on its inputs (a kernel that failed to compile, a learning rate that "
                "saturated it); check the warnings above, set compile: false or kernels: none, or lower lr"
            )
        interval_loss = all_reduce([float(logged_loss)], "sum", device)[0] / self.world_size
        bad_in_interval = total_bad - state.nonfinite_total
        state.nonfinite_consecutive, state.nonfinite_total, state.skipped_total = consecutive, total_bad, skipped
        good = state.logged_windows - bad_in_interval
        point = {
            "loss": interval_loss / good if good else float("nan"),
            "lr": current_lr(self.optimizer),
            "skipped_steps": float(skipped),
        }
        scale = self.train_step.scaler.get_scale()
        if scale != 1.0:  # fp16's dynamic scale (other precisions hold it at 1.0)
            point["loss_scale"] = scale
        state.history.append({"step": state.step, "epoch": epoch, **point})
        logged_loss.zero_()
        state.logged_windows = 0
        if self.on_log:  # and, for progress displays, how far along the run is (not part of the logged curve)
            self.on_log(
                state.step, {**point, "total_steps": float(self.total_steps), "rows_timed": float(state.rows_timed)}
            )

    def end_epoch(self, epoch: int) -> None:
        """Validate (on its own clock), step a per-epoch schedule, checkpoint, and tell the caller."""
        state = self.state
        if state.logged_windows:  # steps since the last log point: the epoch's line shows their loss, not none
            self.log_point(epoch)
            self.meter.clock.read_laps()
        self.meter.pause()
        if self.validation is not None:
            with self.meter.region("val_time_s"):
                state.val_metrics = evaluate_split(self.model, self.validation, self.params, self.runtime, self.task)
        if self.per_epoch_schedule:
            # On the validation loss; without validation, on the epoch's last logged training loss.
            last_train = state.history[-1]["loss"] if state.history else 0.0
            self.scheduler.step(state.val_metrics.get("val_loss", last_train))
        state.epoch, state.window = epoch + 1, 0
        self.checkpoint()
        if self.on_epoch_end:
            self.on_epoch_end(epoch + 1, state.step, state.val_metrics)

    def checkpoint(self) -> None:
        """The one file of a single process; on several ranks (DDP, FSDP), each rank's part."""
        if self.checkpoint_dir is not None and (self.rank == 0 or self.checkpoints.every_rank_writes):
            self.meter.pause()
            with self.meter.region("checkpoint_time_s"):
                self.state.logged_loss = float(self.logged_loss)
                self.checkpoints.save(self.checkpoint_dir, self.params, self.state, self.train_step, self.scheduler)
