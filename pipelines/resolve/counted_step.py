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


Point = tuple[int, int, int, int]  # a step's moment: (unshardable bytes, shardable bytes, gradients, updating 0/1)


class StepTimeline:
    """The whole model's fake step op by op (`track_step`'s `watch`), kept as the moments that can be any FSDP
    worker's peak: what a worker of N holds then is `WorkerPeak.at`.

    A worker holds 1/N of the weights, of the gradients alive at that moment and of the optimizer state, and, while
    forwards and backwards run, the gathered units whole; the update steps on shards (its temporaries, which
    MemTracker counts as optimizer state, are 1/N too), and nothing is gathered then (FSDP2 reshards every unit after
    the backward). The peak can fall at another moment than the whole model's (mid-backward, activations alive, where
    one worker's state is small), which no correction of that peak captures (tests/pipelines/test_plan_multiprocess.py:
    within 5% of gloo ranks). Only moments that no other moment of the same phase exceeds in both the unshardable
    and the shardable bytes are kept: whatever N and the gathered bytes, one of them is the worker's peak.
    """

    def __init__(self, kernels: KernelCounter) -> None:
        self._kernels = kernels
        self._points: list[Point] = []
        self._state = 0  # the optimizer state's bytes while the forwards and backwards run

    def __call__(self, kinds: dict[str, int]) -> None:
        """One moment: the whole model's bytes by MemTracker kind."""
        shardable = sum(kinds.get(k, 0) for k in ("Parameter", "Gradient", "Optstate"))
        updating = int(self._kernels.current == "update")
        self._points.append((kinds.get("Total", 0) - shardable, shardable, kinds.get("Gradient", 0), updating))
        if not updating:
            self._state = max(self._state, kinds.get("Optstate", 0))

    def before_update(self, pool: int) -> dict[str, int]:
        """The forwards' and backwards' highest moment (with a compiled step's graph `pool`) and the optimizer state
        then, as MemTracker counts it (scalar step counters included): what another optimizer's step holds too,
        but for that state (`pipelines.resolve.search_plans`)."""
        highest = max((sum(point[:2]) for point in self._points if not point[3]), default=0)
        return {"peak_before_update": highest + pool, "state_before_update": self._state}

    def moments(self) -> tuple[Point, ...]:
        """The moments that can set a worker's peak (see the class)."""
        kept: list[Point] = []
        for phase in (0, 1):
            most_shardable = -1
            for point in sorted({p for p in self._points if p[3] == phase}, key=lambda p: (-p[0], -p[1])):
                if point[1] > most_shardable:  # no moment with as much unshardable memory has more shardable
                    kept.append(point)
                    most_shardable = point[1]
        return tuple(kept)


@dataclass(frozen=True)
class WorkerPeak:
    """One FSDP worker's peak and its parts: its shard of weights, gradients and state then, the units it holds
    gathered then, and the rest (activations and temporaries); its gradients' bytes then."""

    peak: int
    resident: int
    gathered: int
    working: int
    gradients: int

    @staticmethod
    def at(moments: tuple[Point, ...], workers: int, gathered: int, offloaded: bool = False) -> WorkerPeak:
        """The highest of `moments` for one worker of `workers`, holding `gathered` bytes of whole units while the
        forwards and backwards run; `offloaded`: its shards live in host RAM (FSDP's CPU offload)."""
        best = WorkerPeak(0, 0, 0, 0, 0)
        for unshardable, shardable, gradients, updating in moments:
            resident = 0 if offloaded else shardable // workers
            whole = 0 if updating else gathered
            if unshardable + resident + whole > best.peak:
                best = WorkerPeak(unshardable + resident + whole, resident, whole, unshardable, gradients // workers)
        return best


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
    what watches its tracked run op by op (`StepTimeline`, for the FSDP workers' peaks), where anything does."""

    step: TrainStep
    batches: list[dict[str, torch.Tensor]]
    units: float
    kernels: KernelCounter
    watch: StepTimeline | None = None

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
