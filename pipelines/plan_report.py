"""The plan stage's answer, before training and before renting a GPU: every variant's plan on every target.

For each target (the CPU or a GPU profile, `pipelines.plan_target`) and each variant of `tune.variants`:
the predicted peak allocated, the card's reserve stated beside it (CUDA context, allocator slack:
`pipelines.gpu_profiles`), whether it fits, and the fastest configuration that fits (`strategy: auto` run
against the card's memory, or against `memory_budget` on the CPU).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pipelines.budget import choose_strategy
from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
from pipelines.errors import UserError
from pipelines.memory_plan import MB, MemoryPlan, PlanUnavailable
from pipelines.params import Params, apply_overrides
from pipelines.plan_target import PlanTarget
from pipelines.preflight import trial_planner


@dataclass(frozen=True)
class TargetPlan:
    """One variant on one target: its plan (or why there is none), the reserve, the verdict, the fastest fit."""

    plan: MemoryPlan | None
    precision: str
    reserve: int | None = None  # None on the CPU
    fits: bool | None = None  # None when there is nothing to fit into (the CPU without memory_budget)
    fastest: str | None = None  # the fastest fitting configuration's changes and plan, or why none fits
    unavailable: str | None = None

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
            planner = trial_planner(get_task(variant.task), train, tokenizer, tokenized, root, target)
            out[target.name][name] = _on_target(variant, planner, target, fastest)
    return out


def _on_target(variant: Params, planner: object, target: PlanTarget, fastest: bool) -> TargetPlan:
    try:
        precision = target.precision(variant)
        plan = planner(variant)  # type: ignore[operator]
    except (PlanUnavailable, UserError) as err:
        return TargetPlan(None, variant.precision, unavailable=str(err))
    card = target.card
    if card is None and variant.memory_budget is None:
        return TargetPlan(plan, precision)
    if card is not None:
        reserve, fits, budget = card.reserve_bytes(plan.peak), card.fits(plan.peak), card.name
    else:
        reserve, fits, budget = None, plan.peak <= _bytes(variant), variant.memory_budget
    if not fastest:
        return TargetPlan(plan, precision, reserve, fits)
    auto = apply_overrides(variant, {"memory_budget": budget, "strategy": "auto"})
    try:
        choice = choose_strategy(auto, planner, target, planning=True)  # type: ignore[arg-type]
        best = choice.why
    except UserError as err:
        best = f"none fits: {err}"
    return TargetPlan(plan, precision, reserve, fits, best)


def _bytes(params: Params) -> int:
    from pipelines.budget import budget_bytes

    return budget_bytes(params) or 0


def _size(value: int | None) -> str:
    return "—" if value is None else f"{value / MB:,.1f} MB"


def target_table(name: str, plans: dict[str, TargetPlan]) -> str:
    """One target's plans as a markdown table (MB), one row per variant, its fastest fitting config below."""
    lines = [
        f"Target: {name}",
        "",
        "| Variant | Precision | Predicted peak | Reserve | Fits | Parameters | Trainable | Gradients "
        "| Optimizer state | Activations | Batch | Validation peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for variant, entry in plans.items():
        plan = entry.plan
        if plan is None:
            lines.append(f"| {variant} | {entry.precision} | not planned: {entry.unavailable} |" + "  |" * 9)
            continue
        fits = "—" if entry.fits is None else "yes" if entry.fits else "no"
        sizes = (plan.peak, entry.reserve, None, plan.parameters, plan.trainable_parameters, plan.gradients,
                 plan.optimizer_state, plan.activations)  # fmt: skip
        cells = [fits if i == 2 else _size(value) for i, value in enumerate(sizes)]
        lines.append(
            f"| {variant} | {entry.precision} | " + " | ".join(cells)
            + f" | {plan.batch_rows} x {plan.batch_width} | {_size(plan.eval_peak)} |"
        )  # fmt: skip
        if entry.fastest:
            notes.append(f"- {variant}, fastest that fits: {entry.fastest}")
    return "\n".join(lines + ([""] + notes if notes else []))
