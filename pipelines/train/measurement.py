"""What the loop measures, beside the loop: the step clock over training segments, the CUDA allocator's peaks of
those segments only, the other regions' clocks, and the memory probe that must leave no trace.

The trainer calls `resume` before a timed step, `pause` before anything that is not training (validation,
checkpoints, the end), `warmup_done` and `lap` after a step. Nothing here touches the model's computation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from pipelines.train.checkpoint import LoopState
from pipelines.train.memory import MemoryAtPeak, restored_after, track_training_peak
from pipelines.train.out_of_memory import OUT_OF_MEMORY
from pipelines.train.step import TrainStep
from pipelines.train.timing import StepClock, timed


class TrainingMeter:
    """The run's clocks (`state.clocks`, `state.step_times`) and CUDA peaks (`state.cuda_peak_*`)."""

    def __init__(self, device: torch.device, state: LoopState, setup_start: float) -> None:
        self.device, self.state = device, state
        state.clocks["setup_time_s"] = state.clocks.get("setup_time_s", 0.0) + time.perf_counter() - setup_start
        self.clock = StepClock(device, state.clocks, state.step_times)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def region(self, name: str) -> AbstractContextManager[None]:
        """A clock of its own (`<name>` in the run's clocks): warm-up, validation, checkpoint writes."""
        return timed(self.device, self.state.clocks, name)

    def resume(self) -> None:
        """Start the step clock again (and a fresh CUDA peak), unless it runs."""
        if self.clock.running:
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.clock.start()

    def pause(self) -> None:
        """Stop the step clock; on CUDA keep the training segment's peaks (validation's must not count)."""
        self.clock.stop()
        self.keep_cuda_peaks()

    def keep_cuda_peaks(self) -> None:
        """Fold the CUDA allocator's peaks since its last reset into the run's (no-op on CPU)."""
        if self.device.type == "cuda":
            state = self.state
            state.cuda_peak_allocated = max(state.cuda_peak_allocated, torch.cuda.max_memory_allocated(self.device))
            state.cuda_peak_reserved = max(state.cuda_peak_reserved, torch.cuda.max_memory_reserved(self.device))


@contextmanager
def rng_preserved(device: torch.device) -> Iterator[None]:
    """The CPU's (and CUDA's) random state as it was before the block: a probe draws no dropout mask of the run's."""
    rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else []
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)


def probe_memory(
    step: TrainStep, run_window: Callable[[object], object], say: Callable[[str], None]
) -> MemoryAtPeak | None:
    """Peak training memory and its breakdown from two runs of the first window (`run_window(meter)`); the weights,
    the optimizer, the scaler and the random state are then put back as they were."""
    model, optimizer, scaler, device = step.model, step.optimizer, step.scaler, step.runtime.device
    scaler_state = scaler.state_dict()
    with rng_preserved(device), restored_after(model):  # a host copy of the weights: a device copy skews the peak
        try:
            return track_training_peak(model, optimizer, device, run_window)
        except OUT_OF_MEMORY:
            say("the memory probe ran out of memory on the first window; training will halve micro-batches")
            return None
        finally:
            optimizer.state.clear()  # rebuilt lazily by the first real step
            optimizer.zero_grad(set_to_none=True)
            scaler.load_state_dict(scaler_state)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
