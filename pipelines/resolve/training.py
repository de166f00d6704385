"""What a trial trains with, resolved once before training, frozen: `ResolvedTraining`.

The preflight (`pipelines.resolve.preflight`) plans before the adapter is applied, since the budget's
strategy may choose one. Once the model is adapted, what is still `auto` is resolved here: the micro-batch
(CUDA without a budget: probed for real, then planned), `lr: auto` (the LR range test) and `compile: auto` (by the
plan's predicted step time: `pipelines.resolve.step_time`). The engine, the
evaluation and the saved folder then read the same decisions, and nothing changes them later.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from pipelines.data.batching import padded_length
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.resolve.batch_size import resolve_batch_size
from pipelines.resolve.budget import Planner
from pipelines.resolve.lr_range import LrRangeResult, resolve_lr
from pipelines.resolve.memory_plan import MemoryPlan
from pipelines.resolve.preflight import Preflight, plan_or_none
from pipelines.resolve.step_time import predict_compile
from pipelines.runtime import Runtime
from pipelines.tasks.base import Task
from pipelines.train.compile_decision import resolve_compile
from pipelines.train.memory_levers import resolve_loss


@dataclass(frozen=True)
class ResolvedTraining:
    """Every `auto` of a trial resolved: the params (micro-batch, accumulation, learning rate and the strategy's
    choices all concrete), the runtime it trains with (device, precision, TF32, padding), its plan and why, and the
    LR sweep if run."""

    params: Params
    runtime: Runtime
    plan: MemoryPlan | None
    plan_note: str
    lr_sweep: LrRangeResult | None = None
    compile_note: str = "off: compile: false"
    predicted_step_ms: float | None = None  # the plan's predicted average step, as it will run (compiled or not)
    predicted_compile_s: float | None = None  # a compiled run's predicted compile time, cold or warm as its cache holds

    def tags(self) -> dict[str, str]:
        """The decisions as MLflow tags."""
        return {
            "memory_plan": self.plan_note,
            "batch_size.resolved": str(self.params.batch_size),
            "grad_accum_steps.resolved": str(self.params.grad_accum_steps),
            "compile.resolved": self.compile_note,
        }


def resolve_training(
    preflight: Preflight, planner: Planner | None, model: nn.Module, train: TokenizedSplit, task: Task, runtime: Runtime
) -> ResolvedTraining:
    """The micro-batch and learning rate left `auto` after the preflight, on the adapted `model`.

    A micro-batch probed for real is planned again at the size found (`planner`: None on ranks that log nothing).
    """
    params = preflight.params
    runtime = replace(runtime, loss=resolve_loss(model, params, task))  # on the adapted model: its head decides
    longest = int(train.lengths.max())
    if params.data.bucketing:
        longest = padded_length(longest, runtime.pad_multiple)
    probed = params.batch_size == "auto"  # still auto: CUDA without a budget
    width = longest if params.data.bucketing else params.data.max_length
    params = resolve_batch_size(params, model, width, runtime, task)
    plan = plan_or_none(planner, params) if probed and planner is not None else preflight.plan
    params, sweep = resolve_lr(params, model, train, runtime, task)
    predicted = predict_compile(plan, runtime.precision, runtime.device, params.tf32)
    prediction = None if predicted is None else predicted[1]
    params, runtime, choice = resolve_compile(params, runtime, train, task, model, prediction)
    step = None if predicted is None else predicted[0]
    step_ms = None if step is None else 1000 * (step.compiled_s if choice.enabled else step.eager_s)
    compile_s = choice.predicted_s if choice.enabled else None
    return ResolvedTraining(params, runtime, plan, preflight.note, sweep, choice.tag(), step_ms, compile_s)
