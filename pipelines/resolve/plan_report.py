"""The plan stage's answer, before training and before renting a GPU: every variant's plan on every target.

For each target (the CPU or a GPU profile, `pipelines.resolve.target`) and each variant of `tune.variants`:
the predicted peak allocated, the card's reserve stated beside it (CUDA context, allocator slack:
`pipelines.gpu_profiles`), whether it fits, and the fastest configuration that fits (`strategy: auto` run
against the card's memory, or against `memory_budget` on the CPU), and the predicted step time eager and
compiled with the samples/s it gives (`pipelines.resolve.step_time`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
from pipelines.errors import UserError
from pipelines.gpu_profiles import MIB
from pipelines.params import Params, apply_overrides
from pipelines.resolve.budget import budget_bytes, changed_settings, choose_strategy
from pipelines.resolve.memory_plan import MemoryPlan, PlanUnavailable
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
    room: int | None = None  # bytes to spare on the card (negative: over), reserve counted; None on the CPU
    recommended: str | None = None  # the precision of the fastest configuration that fits; None when none fits
    advice: str | None = None  # the fastest fitting configuration in plain words, or what would fit
    tf32: bool | None = None  # whether the step times assume TF32 for fp32 matmuls (the runtime's rule); None: CPU

    def as_json(self) -> dict[str, object]:
        """The entry of metrics/plan.json."""
        entry = asdict(self)
        entry["plan"] = None if self.plan is None else asdict(self.plan)
        if entry["plan"] is not None:
            del entry["plan"]["moments"]  # the fake step's candidate peaks: internal to the cluster plan
        return entry


def plan_targets(
    params: Params, root: Path, tokenized: Path, targets: list[PlanTarget], fastest: bool = True,
    compiled_auto: bool = False,
) -> dict[str, dict[str, TargetPlan]]:  # fmt: skip
    """`{target name: {variant: TargetPlan}}` for every variant of `tune.variants` (or the params alone);
    `compiled_auto`: each `compile: auto` planned as compiled (`as_compiled`)."""
    from transformers import AutoTokenizer

    from pipelines.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    train = TokenizedSplit.load(tokenized / "train")
    base = params.model_copy(update={"tune": params.tune.model_copy(update={"variants": {}, "search_space": {}})})
    variants = {name: apply_overrides(base, dict(o)) for name, o in (params.tune.variants or {"default": {}}).items()}
    if compiled_auto:
        variants = {name: as_compiled(variant) for name, variant in variants.items()}
    out: dict[str, dict[str, TargetPlan]] = {}
    shared: dict[tuple[str, str], MemoryPlan] = {}  # (target's plan key, params): cards alike plan alike, once
    for target in targets:
        out[target.name] = {}
        for name, variant in variants.items():
            task = get_task(variant.task)
            rows = task.training_split(train, variant, None)  # a packed run's packs, as its trial makes them
            planner = _shared(trial_planner(task, rows, tokenizer, tokenized, root, target), target, shared)
            out[target.name][name] = _on_target(variant, planner, target, fastest)
    return out


def as_compiled(variant: Params) -> Params:
    """`variant` with `compile: auto` as `true`: the trial decides auto after its plan (from the predicted saving and
    the compile cache), so a plan made before, to pack trials onto a card, takes the conservative side (a compiled
    step's padded widths and graph pool, `pipelines.resolve.cuda_plan.cuda_graph_pool`). As written where auto stays
    off anyway: activation offloading, and what the params' rules refuse with compile: true (kernels: liger,
    loss_impl: chunked, FSDP)."""
    if variant.compile != "auto" or variant.activation_offload:
        return variant
    try:
        return apply_overrides(variant, {"compile": True})
    except UserError:
        return variant


def _shared(
    plan: Callable[[Params], MemoryPlan], target: PlanTarget, cache: dict[tuple[str, str], MemoryPlan]
) -> Callable[[Params], MemoryPlan]:
    """`plan` on `target`, taken from `cache` when a target with the same plan key planned these params (the plan
    named for this target); an 8B-shaped model's search for three cards plans each candidate once, not thrice."""

    def planned(params: Params) -> MemoryPlan:
        # The budget and the search's mode judge a plan; they do not change it (plan_memory reads neither).
        judged = params.model_copy(update={"memory_budget": None, "strategy": "manual"})
        key = (target.plan_key, judged.model_dump_json())
        if key not in cache:
            cache[key] = plan(params)
        return replace(cache[key], target=target.name)

    return planned


def _on_target(variant: Params, planner: object, target: PlanTarget, fastest: bool) -> TargetPlan:
    card = target.card
    budget = card.name if card is not None else variant.memory_budget
    best = _fastest(variant, planner, target, budget) if fastest and budget is not None else Fastest(None, None, None)
    best = _native_16_bit(variant, planner, target, best)
    advice = {"fastest": best.why, "recommended": best.precision, "advice": best.plain}
    try:
        precision = target.precision(variant)
        plan = planner(variant)  # type: ignore[operator]
    except (PlanUnavailable, UserError) as err:  # e.g. bf16 on a T4: the fastest fitting configuration still says
        return TargetPlan(None, variant.precision, unavailable=str(err), **advice)  # type: ignore[arg-type]
    step = predict_step(plan, precision, target, variant.tf32)
    if card is not None:  # runtime.resolve_tf32's rule, as predict_step prices it
        advice["tf32"] = variant.tf32 is True or (variant.tf32 == "auto" and precision != "fp32")
    if card is not None:
        reserve = card.reserve_bytes(plan.peak)
        room = card.memory_bytes - plan.peak - reserve
        return TargetPlan(plan, precision, reserve, card.fits(plan.peak), step=step, room=room, **advice)  # type: ignore[arg-type]
    fits = None if variant.memory_budget is None else plan.peak <= (budget_bytes(variant) or 0)
    return TargetPlan(plan, precision, None, fits, step=step, **advice)  # type: ignore[arg-type]


def _native_16_bit(variant: Params, planner: object, target: PlanTarget, best: Fastest) -> Fastest:
    """The search's answer, but the card's native 16-bit precision (what `precision: auto` resolves to there) where
    the search kept fp32 and the 16-bit plan fits too: a launch-bound eager step is predicted as fast in either,
    but the 16-bit one is never slower, is faster once compiled (compute-bound) and holds half the activations."""
    if best.precision != "fp32" or target.card is None:
        return best
    native = target.precision(apply_overrides(variant, {"precision": "auto"}))
    if native == "fp32":
        return best
    try:
        plan = planner(apply_overrides(variant, {"precision": native}))  # type: ignore[operator]
    except (PlanUnavailable, UserError):
        return best
    if not target.card.fits(plan.peak):
        return best
    why = f"{native}: the card's native 16-bit, no slower than fp32 and faster compiled; peak {_gib(plan.peak)}"
    return Fastest(best.why, native, f"{best.plain}; train in {why}" if best.plain else why)


@dataclass(frozen=True)
class Fastest:
    """The search's answer on a target: its reason line (as a trial logs it), the precision it chose, plain words."""

    why: str | None
    precision: str | None
    plain: str | None


def _fastest(variant: Params, planner: object, target: PlanTarget, budget: int | str) -> Fastest:
    """`strategy: auto`'s choice against `budget` on the target, or why nothing fits (a precision the card lacks is
    left to the search: it tries the card's 16-bit and fp32)."""
    changes: dict[str, object] = {"memory_budget": budget, "strategy": "auto"}
    try:
        target.precision(variant)
    except UserError:
        changes["precision"] = "auto"
    auto = apply_overrides(variant, changes)
    where = f"the {target.name}" if target.card is not None else f"memory_budget {_gib(budget_bytes(auto) or 0)}"
    if variant.distributed.num_workers > 1:  # a plan is one worker's: a 70B under FSDP on 8 cards is not one card's
        where = f"each worker's {where.removeprefix('the ')} ({_workers(variant)})"
    try:
        choice = choose_strategy(auto, planner, target, planning=True)  # type: ignore[arg-type]
    except (PlanUnavailable, UserError) as err:
        # The search's refusal names the budget in bytes first ("memory_budget = ...: "); here the card is named.
        reason = str(err).split(": ", 1)[-1]
        return Fastest(f"none fits: {err}", None, f"nothing fits {where}: {reason}")
    changed = ", ".join(changed_settings(variant, choice.params)) or "as written"
    step = predict_step(choice.plan, target.precision(choice.params), target, choice.params.tf32)
    seconds = step.compiled_s if choice.params.compile is True else step.eager_s
    # As the Fits cell counts it on a card (its reserve at this peak), so the two figures agree.
    card, peak = target.card, choice.plan.peak
    budget_left = card.memory_bytes - peak - card.reserve_bytes(peak) if card else (budget_bytes(auto) or 0) - peak
    plain = (f"fastest that fits {where}: {changed}; peak {_gib(choice.plan.peak)}, {_gib(budget_left)} to spare; "
             f"about {1000 * seconds:,.0f} ms a step")  # fmt: skip
    return Fastest(choice.why, target.precision(choice.params), plain)


def _gib(value: int) -> str:
    return f"{value / 2**30:,.1f} GiB"


def _room(entry: TargetPlan) -> str:
    """The Fits cell in plain words: yes or no, and by how much (the card's reserve counted)."""
    if entry.fits is None:
        return "—"
    if entry.room is None:
        return "yes" if entry.fits else "no"
    return f"yes, {_gib(entry.room)} to spare" if entry.fits else f"no, {_gib(-entry.room)} over"


def _speed(step: StepTime | None) -> str:
    """Predicted step time eager and compiled, and samples/s eager: three cells."""
    if step is None:
        return "— | — | —"
    return f"{1000 * step.eager_s:,.1f} ms | {1000 * step.compiled_s:,.1f} ms | {step.samples_per_s(False):,.1f}"


def _size(value: int | None) -> str:
    return "—" if value is None else f"{value / MIB:,.1f} MiB"


def _workers(params: Params) -> str:
    """'8 FSDP workers': who shares the plan's figures, each on a card of its own."""
    return f"{params.distributed.num_workers} {params.distributed.strategy.upper()} workers"


def target_table(name: str, plans: dict[str, TargetPlan], params: Params | None = None) -> str:
    """One target's plans as a markdown table within 120 columns, one row per variant (the reserve, parameters,
    gradients, optimizer state, activations, batch and evaluation peaks are in metrics/plan.json), then the TF32
    setting the step times assume and each variant's fastest fitting configuration. With several workers
    (`params.distributed.num_workers`), the heading says the figures are each worker's, on a card of its own."""
    heading = f"Target: {name}"
    if params is not None and params.distributed.num_workers > 1:
        heading += f", one per worker ({_workers(params)}): every peak, fit and step below is one worker's"
    lines = [
        heading,
        "",
        "| Variant | Precision | Predicted peak | Fits | Recommended | Step, eager | Step, compiled | Samples/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for variant, entry in plans.items():
        plan = entry.plan
        notes += [f"- {variant}: {entry.advice}"] if entry.advice else []
        notes += [_pool_line(variant, plan.cuda_graph_pool)] if plan is not None and plan.cuda_graph_pool else []
        if plan is None:
            lines.append(f"| {variant} | {entry.precision} | not planned: {entry.unavailable} |" + "  |" * 5)
            continue
        fits = _room(entry) if entry.fits is not None else "—"
        lines.append(f"| {variant} | {entry.precision} | {_size(plan.peak)} | {fits} | {entry.recommended or '—'} | "
                     f"{_speed(entry.step)} |")  # fmt: skip
    assumed = _tf32_line(plans)
    return "\n".join(lines + ([""] + [assumed] if assumed else []) + ([""] + notes if notes else []))


def _pool_line(variant: str, pool: int) -> str:
    """A compiled variant's CUDA-graph pool, as its own line: part of its predicted peak."""
    return (f"- {variant}: compiled on CUDA: its predicted peak includes {_size(pool)} of CUDA-graph pool (its widest "
            "padded width's activations and batch, held by the graphs beside the eager allocator's cache)")  # fmt: skip


def _tf32_line(plans: dict[str, TargetPlan]) -> str | None:
    """Which TF32 setting the step times assume, per variant (a card's fp32 step without TF32 runs at its plain fp32
    peak, where an L4 outruns an A100)."""
    said = {v: e.tf32 for v, e in plans.items() if e.tf32 is not None}
    if not said:
        return None
    parts = ", ".join(f"{v} {'on' if on else 'off'}" for v, on in said.items())
    return (f"TF32 for fp32 matmuls, as assumed: {parts} (tf32: auto turns it on under bf16/fp16 only; "
            "tf32: true prices fp32 matmuls at the card's TF32 peak).")  # fmt: skip
