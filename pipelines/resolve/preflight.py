"""What a trial decides before training, from its memory plan: budget, strategy, micro-batch.

The trial calls `plan_before_training` once its base model and training split exist. It plans
the params (the trial's own first step on fake tensors), applies `memory_budget` and
`strategy: auto` (`pipelines.resolve.budget`), and sizes `batch_size: auto` by the plan where it can,
so a run that would not fit is refused before any training, with the plan in the message.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import torch

from pipelines.adapters import apply_adapter
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.resolve.batch_size import CPU_MEMORY_SHARE
from pipelines.resolve.budget import Planner, describe, fit_to_budget, largest_fitting_batch
from pipelines.resolve.eval_memory import shared_evaluations
from pipelines.resolve.memory_plan import MemoryPlan, PlanUnavailable, plan_memory
from pipelines.resolve.plan_depth import plan_by_depth
from pipelines.resolve.qlora_plan import qlora_from_lora
from pipelines.resolve.target import PlanTarget, as_target
from pipelines.tasks.base import Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Preflight:
    """The params to train with, their plan (None when not planned yet, or not plannable), and a note on both.

    `unavailable` says why no plan could be made (the trial trains without one), else None.
    """

    params: Params
    plan: MemoryPlan | None
    note: str
    unavailable: str | None = None


def trial_planner(
    task: Task, train: TokenizedSplit, tokenizer: PreTrainedTokenizerBase, tokenized: Path, root: Path,
    where: PlanTarget | torch.device,
) -> Planner:  # fmt: skip
    """Plans of params for this task and training split on a target (or where a device is); the global RNG is left
    as it was. Each fake step is traced once per planner (`traced`): a QLoRA candidate reuses its LoRA trace."""
    target = as_target(where)
    traces: dict[tuple[str, int | None], MemoryPlan] = {}
    evaluations: dict[tuple[object, ...], object] = {}  # evaluation peaks, shared by traces that read the same

    def traced(params: Params, layers: int | None) -> MemoryPlan:
        """The fake step of `params` at `layers` blocks, once: what only judges a plan (the budget, the search's mode)
        or only saves the model (`adapter.merge`) is not in the key."""
        judged = params.model_copy(update={"memory_budget": None, "strategy": "manual",
                                           "adapter": params.adapter.model_copy(update={"merge": True})})  # fmt: skip
        key = (judged.model_dump_json(), layers)
        if key not in traces:
            with shared_evaluations(evaluations, layers):
                traces[key] = plan_memory(
                    params,
                    task,
                    train,
                    lambda: task.build_model(params, tokenizer, tokenized, root, weights=False, layers=layers),
                    lambda model: apply_adapter(model, params.adapter, task, params),
                    int(tokenizer.pad_token_id),  # type: ignore[arg-type]
                    target.precision(params),
                    target,
                )
        return traces[key]

    def plan(params: Params) -> MemoryPlan:
        def at_depth(layers: int | None) -> MemoryPlan:
            if params.adapter.type != "qlora":
                return traced(params, layers)
            # QLoRA is planned as its LoRA step with the base's bytes swapped by rule (memory_plan._plan_qlora): the
            # LoRA trace is the one a LoRA candidate of the same settings made (a T4's search plans both).
            as_lora = params.model_copy(update={"adapter": params.adapter.model_copy(update={"type": "lora"})})
            build = lambda: task.build_model(params, tokenizer, tokenized, root, weights=False, layers=layers)  # noqa: E731
            return qlora_from_lora(traced(as_lora, layers), target.precision(params), build)  # type: ignore[return-value]

        rng = torch.get_rng_state()
        try:
            # A deep stack of identical blocks is planned at two small depths and extrapolated (resolve/plan_depth).
            return plan_by_depth(at_depth, task.stacked_layers(params, root), params.grad_checkpointing_every)
        finally:
            torch.set_rng_state(rng)

    return plan


def plan_before_training(params: Params, plan: Planner, where: PlanTarget | torch.device) -> Preflight:
    """Apply the budget and strategy, size `batch_size: auto` on CPU by the plan; plan what will train.

    Without a budget, `batch_size: auto` on CPU keeps the largest micro-batch whose plan fits a
    share of the available RAM; on CUDA it stays with the real probe (`resolve_batch_size`),
    which also sees the allocator's rounding and the CUDA context that a plan does not count.
    """
    target = as_target(where)
    try:
        choice = fit_to_budget(params, plan, target)
        if choice is not None:
            return Preflight(choice.params, choice.plan, choice.why)
        if params.batch_size == "auto" and target.card is None:
            budget = int(psutil.virtual_memory().available * CPU_MEMORY_SHARE)
            found = largest_fitting_batch(params, plan, budget)
            if found is None:
                raise UserError("batch_size: auto found that not even one row of the longest length fits in memory")
            chosen, predicted = found
            note = f"batch_size auto: {chosen.batch_size} rows x {chosen.grad_accum_steps} by the memory plan"
            return Preflight(chosen, predicted, f"{note}; predicted peak {describe(predicted)}")
        if params.batch_size == "auto":
            return Preflight(params, None, "batch_size auto: probed on the device")
        predicted = plan(params)
        return Preflight(params, predicted, f"planned in {predicted.plan_time_s:.1f} s")
    except PlanUnavailable as err:
        if params.memory_budget is not None:
            raise UserError(f"memory_budget needs a memory plan, and this run has none: {err}") from None
        return Preflight(params, None, f"not planned: {err}", unavailable=str(err))


def plan_or_none(plan: Planner, params: Params) -> MemoryPlan | None:
    """The plan of `params`, or None when it cannot be planned."""
    try:
        return plan(params)
    except PlanUnavailable:
        return None
