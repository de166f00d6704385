"""The memory plan's fake step, tracked and counted: its peak (MemTracker), its FLOPs (torch's counter, the hardware's
and the model's) and its launches per phase (`KernelCounter`), in as few fake steps as the optimizer allows."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from pipelines.repeats import counted_repeats
from pipelines.train.flops import FlopRepeats, KernelCounter, flop_counter, recomputing
from pipelines.train.memory import MemoryAtPeak, track_step
from pipelines.train.memory_levers import ContextFn
from pipelines.train.optim import create_fresh_state
from pipelines.train.step import TrainStep

CPU = torch.device("cpu")


class ShardedTimeline:
    """One FSDP worker's peak, read off the whole model's fake step op by op (`track_step`'s `watch`).

    A worker holds 1/`workers` of the weights, of the gradients alive at that moment and of the optimizer state, and,
    while forwards and backwards run, the `gathered` units whole (`memory_plan.fsdp_gathered_bytes`); the update
    steps on shards (its temporaries, which MemTracker counts as optimizer state, are 1/`workers` too), and nothing
    is gathered then (FSDP2 reshards every unit after the backward). Its peak is the highest such point: it can fall
    at another moment than the whole model's (mid-backward, activations alive, where one worker's state is small),
    which no correction of that peak captures (tests/pipelines/test_plan_multiprocess.py: within 5% of gloo ranks).
    """

    def __init__(self, workers: int, gathered: int, kernels: KernelCounter) -> None:
        self.workers, self.gathered, self._kernels = workers, gathered, kernels
        self.peak, self.gradients = 0, 0  # one worker's peak, and its gradients' bytes then

    def __call__(self, kinds: dict[str, int]) -> None:
        """One point of the timeline: the whole model's bytes by MemTracker kind."""
        updating = self._kernels.current == "update"
        # MemTracker counts the update's own allocations (foreach temporaries) as optimizer state: sharded too.
        shardable = sum(kinds.get(k, 0) for k in ("Parameter", "Gradient", "Optstate"))
        held = kinds.get("Total", 0) - shardable + shardable // self.workers + (0 if updating else self.gathered)
        if held > self.peak:
            self.peak, self.gradients = held, kinds.get("Gradient", 0) // self.workers


def track_counting_flops(
    step: PhasedStep, model: nn.Module, optimizer: torch.optim.Optimizer, checkpointing: bool, scale: float
) -> tuple[MemoryAtPeak, int, int]:  # fmt: skip
    """The tracked step's peak (the optimizer state made first), the FLOPs of a step as torch counts them (matmuls,
    convolutions, attention) and the model's FLOPs (without checkpointing's recomputed forward), both times `scale`.

    Where the optimizer's fresh state can be made without a step (`create_fresh_state`, as the trainer does), the
    FLOPs and launches are counted in the tracked step itself: one fake step, which is most of a plan's time (an
    8B-shaped model's search makes dozens of plans). Else an untracked step makes the state and is counted: its
    forward and backward are every step's, and an optimizer step has none of those ops. Under checkpointing the model's
    FLOPs leave out the recomputed forward, which `marking_recompute` marks. The step's `watch` sees the tracked step,
    op by op."""
    kernels = step.kernels
    with kernels:  # launches: the forwards and backwards, and the update of the steady state (step 1)
        # Not under checkpointing: torch's FLOP counter hooks the modules, and the hooks of a recomputed forward
        # kept its activations alive through the tracked backward (a BERT plan's peak rose by half).
        fresh = not checkpointing and create_fresh_state(model, optimizer)
        if fresh:
            kernels.step = 1
        with (
            flop_counter(model_work=False) as hardware,
            flop_counter(model_work=True) as model_work,
            counted_repeats(kernels, FlopRepeats(hardware), FlopRepeats(model_work)),
        ):  # the chunked loss's loop
            if fresh:  # nested dispatch modes each see every op: the tracker's too
                peak = track_step(model, optimizer, CPU, step, step.watch)
            else:
                step(None)
        if not fresh:
            kernels.step = 1
            with counted_repeats(kernels):
                peak = track_step(model, optimizer, CPU, step, step.watch)
    return peak, int(hardware.get_total_flops() * scale), int(model_work.get_total_flops() * scale)


def marking_recompute(context_fn: ContextFn) -> Callable[[], tuple[AbstractContextManager[object], ...]]:
    """torch checkpoint's `context_fn`: `context_fn`'s contexts (a card's rules; none on a CPU), the recompute's
    marked as such (`flops.recomputing`), so the model-work counter leaves it out."""

    def contexts() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
        forward, recompute = context_fn() if context_fn is not None else (nullcontext(), nullcontext())
        return forward, _marked(recompute)

    return contexts


@contextmanager
def _marked(recompute: AbstractContextManager[object]) -> Iterator[None]:
    with recompute, recomputing():
        yield


@dataclass(frozen=True)
class PhasedStep:
    """The plan's step with its ops counted by phase: forwards and backwards (`accumulate`), then the update; and
    what watches its tracked run op by op (one FSDP worker's `ShardedTimeline`), where anything does."""

    step: TrainStep
    batches: list[dict[str, torch.Tensor]]
    units: float
    kernels: KernelCounter
    watch: ShardedTimeline | None = None

    def __call__(self, meter: object | None) -> None:
        """One optimizer step of the window (`meter`: the tracker's per-micro-batch reset, or None)."""
        with self.kernels.phase("accumulate"):
            self.step.accumulate(self.batches, self.units, meter)
        with self.kernels.phase("update"):
            self.step.update()


def window_kernels(kernels: KernelCounter, micro_batches: int, planned: int) -> int:
    """The launches of a window's forwards and backwards, as its FLOPs: the planned micro-batches' counted (in the
    untracked step, or in the tracked one where there is none), scaled to the window's micro-batches."""
    counted = kernels.count("accumulate") or kernels.count("accumulate", step=1)
    return round(counted * micro_batches / planned)
