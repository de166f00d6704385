"""The plan stage's answer, before training and before renting a GPU: every variant's plan on every target.

For each target (the CPU or a GPU profile, `pipelines.resolve.target`) and each variant of `tune.variants`:
the predicted peak allocated, the card's reserve stated beside it (CUDA context, allocator slack:
`pipelines.gpu_profiles`), whether it fits, and the fastest configuration that fits (`strategy: auto` run
against the card's memory, or against `memory_budget` on the CPU), and the predicted step time eager and
compiled with the samples/s it gives (`pipelines.resolve.step_time`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params, apply_overrides
from pipelines.resolve.budget import budget_bytes, choose_strategy
from pipelines.resolve.memory_plan import MB, MemoryPlan, PlanUnavailable
from pipelines.resolve.preflight import trial_planner
from pipelines.resolve.step_time import StepTime, predict_step
from pipelines.resolve.target import PlanTarget


@dataclass(frozen=True)
class TargetPlan:
    """One variant on one target: its plan (or why there is none), the reserve, the verdict, the fastest fit."""

    plan: MemoryPlan | None
    precision: str
    reserve: int | None = None  # None on the CPU
    fits: bool | None = None  # None when there is nothing to fit into (the CPU without memory_budget)
    fastest: str | None = None  # the fastest fitting configuration's changes and plan, or why none fits
    unavailable: str | None = None
    step: StepTime | None = None  # predicted step time, eager and compiled (pipelines.resolve.step_time)

    def as_json(self) -> dict[str, object]:
        """The entry of metrics/plan.json."""
        entry = asdict(self)
        entry["plan"] = None if self.plan is None else asdict(self.plan)
        return entry


def plan_targets(
    params: Params, root: Path, tokenized: Path, targets: list[PlanTarget], fastest: bool = True
) -> dict[str, dict[str, TargetPlan]]:
    """`{target name: {variant: TargetPlan}}` for every variant of `tune.variants` (or the params alone)."""
    from transformers import AutoTokenizer

    from pipelines.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    train = TokenizedSplit.load(tokenized / "train")
    base = params.model_copy(update={"tune": params.tune.model_copy(update={"variants": {}, "search_space": {}})})
    variants = {name: apply_overrides(base, dict(o)) for name, o in (params.tune.variants or {"default": {}}).items()}
    out: dict[str, dict[str, TargetPlan]] = {}
    for target in targets:
        out[target.name] = {}
        for name, variant in variants.items():
            task = get_task(variant.task)
            rows = task.training_split(train, variant, None)  # a packed run's packs, as its trial makes them
            planner = trial_planner(task, rows, tokenizer, tokenized, root, target)
            out[target.name][name] = _on_target(variant, planner, target, fastest)
    return out


def _on_target(variant: Params, planner: object, target: PlanTarget, fastest: bool) -> TargetPlan:
    card = target.card
    budget = card.name if card is not None else variant.memory_budget
    best = _fastest(variant, planner, target, budget) if fastest and budget is not None else None
    try:
        precision = target.precision(variant)
        plan = planner(variant)  # type: ignore[operator]
    except (PlanUnavailable, UserError) as err:  # e.g. bf16 on a T4: the fastest fitting configuration still says
        return TargetPlan(None, variant.precision, fastest=best, unavailable=str(err))
    step = predict_step(plan, precision, target, variant.tf32)
    if card is not None:
        return TargetPlan(plan, precision, card.reserve_bytes(plan.peak), card.fits(plan.peak), best, step=step)
    fits = None if variant.memory_budget is None else plan.peak <= (budget_bytes(variant) or 0)
    return TargetPlan(plan, precision, None, fits, best, step=step)


def _fastest(variant: Params, planner: object, target: PlanTarget, budget: int | str) -> str:
    """`strategy: auto`'s choice against `budget` on the target, or why nothing fits (a precision the card lacks is
    left to the search: it tries the card's 16-bit and fp32)."""
    changes: dict[str, object] = {"memory_budget": budget, "strategy": "auto"}
    try:
        target.precision(variant)
    except UserError:
        changes["precision"] = "auto"
    auto = apply_overrides(variant, changes)
    try:
        return choose_strategy(auto, planner, target, planning=True).why  # type: ignore[arg-type]
    except (PlanUnavailable, UserError) as err:
        return f"none fits: {err}"


def _speed(step: StepTime | None) -> str:
    """Predicted step time eager and compiled, and samples/s eager: three cells."""
    if step is None:
        return "— | — | —"
    return f"{1000 * step.eager_s:,.1f} ms | {1000 * step.compiled_s:,.1f} ms | {step.samples_per_s(False):,.1f}"


def _size(value: int | None) -> str:
    return "—" if value is None else f"{value / MB:,.1f} MiB"


def target_table(name: str, plans: dict[str, TargetPlan]) -> str:
    """One target's plans as a markdown table (MiB), one row per variant, its fastest fitting config below."""
    lines = [
        f"Target: {name}",
        "",
        "| Variant | Precision | Predicted peak | Reserve | Fits | Parameters | Trainable | Gradients "
        "| Optimizer state | Activations | Batch | Validation peak | Generation peak | Step, eager | Step, compiled "
        "| Samples/s, eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for variant, entry in plans.items():
        plan = entry.plan
        if plan is None:
            lines.append(f"| {variant} | {entry.precision} | not planned: {entry.unavailable} |" + "  |" * 13)
            notes += [f"- {variant}, fastest that fits: {entry.fastest}"] if entry.fastest else []
            continue
        fits = "—" if entry.fits is None else "yes" if entry.fits else "no"
        sizes = (plan.peak, entry.reserve, None, plan.parameters, plan.trainable_parameters, plan.gradients,
                 plan.optimizer_state, plan.activations)  # fmt: skip
        cells = [fits if i == 2 else _size(value) for i, value in enumerate(sizes)]
        evaluation = f"{_size(plan.eval_peak)} | {_size(plan.generation_peak or None)}"
        lines.append(
            f"| {variant} | {entry.precision} | " + " | ".join(cells)
            + f" | {plan.batch_rows} x {plan.batch_width} | {evaluation} | {_speed(entry.step)} |"
        )  # fmt: skip
        if entry.fastest:
            notes.append(f"- {variant}, fastest that fits: {entry.fastest}")
    return "\n".join(lines + ([""] + notes if notes else []))
