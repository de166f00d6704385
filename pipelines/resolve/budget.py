"""`memory_budget` and `strategy: auto`: choose, before training, a plan whose predicted peak fits.

Every candidate is judged by its memory plan (`pipelines.resolve.memory_plan`: the trial's own step on
fake tensors), so nothing is allocated while choosing. Candidates come in tiers, and a later
tier is tried only when nothing in the earlier ones fits, because later tiers change what is
trained, not just how:

0. the same model and optimizer: precision, checkpointing (none, every 2nd block, every block; on CUDA
   also every block with its inputs offloaded to host memory), and accumulation with the largest
   micro-batch that fits (micro-batch x accumulation = the effective batch, exactly). `loss_impl` is
   kept as written: its default, auto, already chunks the loss of large vocabularies;
1. a memory-lean optimizer (Adafactor; 8-bit AdamW on CUDA with bitsandbytes), same grid;
2. LoRA (the adapter section's rank and targets, with Adafactor as well), when the run has none;
3. QLoRA (the same adapters on a 4-bit NF4 base, saved unmerged), on a card where bitsandbytes runs, when the run
   is not QLoRA already: the frozen base in half a byte a weight, at the cost of de-quantizing it every step.

Within a tier the plan with the shortest predicted step time on the target wins (`pipelines.resolve.step_time`):
its executed FLOPs per optimizer step (torch's FlopCounterMode on the same fake step: checkpointing's recompute and
LoRA's skipped weight gradients show in it) at an achievable share of the precision's peak, and its kernel
launches (the ops the same fake step dispatches) at the host's cost per launch; on a card the longer of the two
(launches overlap the arithmetic), on a CPU their sum. So a micro-batch of 8 x 4 with checkpointing, which does
four times the launches for the same rows, ranks behind the plain step on a fast card where launches dominate.
The precision's peak on a card is its data sheet's (`pipelines.gpu_profiles`: bf16 against TF32 when `tf32` is
on, else against plain fp32: 14.8x on an H100); on a CPU bf16 counts what `pipelines.runtime.cpu_bf16_speed` says:
where it is native (AVX-512 BF16, AMX), the slowest speed-up measured on such a host (0.81x on an AVX512-BF16 EPYC)
or 1 where none is, and 1/17 where it is emulated (a MiniLM step took 17x as long on an AVX2 host).
Ties go to the larger micro-batch (fewer, fuller kernels), then to the fewest changes from the params as written.
Leaner checkpointing is planned only while the setting before it does not fit at the full micro-batch (it
only adds recompute FLOPs), and the leanest plans (the refusal) only when the fastest candidate does not fit. A
candidate whose weights alone are over the budget, by a plan of the same adapter in as narrow a precision, is not
planned (the weights do not depend on the optimizer, micro-batch or checkpointing), and neither is a lean
optimizer's candidate that the written optimizer's plan of it shows cannot fit (`search_plans`: the same forwards
and backwards, another state).

The search runs for a `PlanTarget` (pipelines.resolve.target): where the trial trains, or a named card from any
machine (`python -m stages.plan`); 8-bit AdamW is offered on a card (planned by rule) when bitsandbytes is
installed, or always when only planning.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipelines.errors import UserError
from pipelines.gpu_profiles import MIB, gpu_profile
from pipelines.optimizer_registry import OPTIMIZERS
from pipelines.params import Params, apply_overrides
from pipelines.resolve.memory_plan import MemoryPlan
from pipelines.resolve.search_plans import Memoized, bounded_by_written_optimizer
from pipelines.resolve.step_time import arithmetic_floor_s, predict_step
from pipelines.resolve.target import PlanTarget, as_target
from pipelines.runtime import cpu_bf16_speed

Planner = Callable[[Params], MemoryPlan]


@dataclass(frozen=True)
class Choice:
    """The params a trial trains with, their plan, and why they were chosen (a tag and a log line)."""

    params: Params
    plan: MemoryPlan
    why: str


def size(n: float) -> str:
    """Bytes in MiB (2^20; KiB below one MiB), as the report and the plan table write them."""
    return f"{n / MIB:,.1f} MiB" if n >= MIB else f"{n / 1024:,.1f} KiB"


def describe(plan: MemoryPlan) -> str:
    """A plan's peak and breakdown in one line."""
    return (
        f"{size(plan.peak)} (parameters {size(plan.parameters)}, gradients {size(plan.gradients)}, optimizer state "
        f"{size(plan.optimizer_state)}, activations {size(plan.activations)}; batch {plan.batch_rows} x "
        f"{plan.batch_width})"
    )


def effective_batch(params: Params) -> int:
    """Rows per optimizer step, as the params ask for them."""
    if params.batch_size == "auto":
        assert params.effective_batch_size is not None
        return params.effective_batch_size
    return params.batch_size * params.grad_accum_steps


def _micro_batches(params: Params) -> list[int]:
    effective = effective_batch(params)
    return [d for d in range(effective, 0, -1) if effective % d == 0]


def _batch(params: Params, rows: int) -> dict[str, object]:
    return {"batch_size": rows, "grad_accum_steps": effective_batch(params) // rows, "effective_batch_size": None}


def largest_fitting_batch(params: Params, plan: Planner, budget: int) -> tuple[Params, MemoryPlan] | None:
    """The params with the largest micro-batch (divisor of the effective batch) whose plan fits, or None.

    Plans grow with the micro-batch, so the largest fitting divisor is found by bisection, the
    largest tried first: a few plans, not one per divisor (small micro-batches, which make long
    windows, are planned only when the larger ones do not fit).
    """
    sizes = _micro_batches(params)[::-1]  # ascending
    best: tuple[Params, MemoryPlan] | None = None
    low, high, middle = 0, len(sizes) - 1, len(sizes) - 1
    while low <= high:
        candidate = apply_overrides(params, _batch(params, sizes[middle]))
        predicted = plan(candidate)
        if predicted.peak <= budget:
            best, low = (candidate, predicted), middle + 1
        else:
            high = middle - 1
        middle = (low + high) // 2
    return best


def precision_speed(precision: str, where: PlanTarget | torch.device, tf32: bool | str = "auto") -> float:
    """Relative matmul speed of a precision against fp32 on the target (see the module docstring)."""
    target = as_target(where)
    if target.card is None:
        if precision == "fp32":
            return 1.0
        return cpu_bf16_speed()
    tf32_on = tf32 is True or (tf32 == "auto" and precision != "fp32")  # runtime.resolve_tf32's rule
    return target.card.peak_flops(precision, tf32=tf32_on) / target.card.fp32_flops


def _checkpointing(target: PlanTarget) -> list[dict[str, object]]:
    """Checkpointing settings from fastest to leanest: none, every 2nd block, every block (then offloaded)."""
    options: list[dict[str, object]] = [
        {"grad_checkpointing": False, "grad_checkpointing_every": 1},
        {"grad_checkpointing": True, "grad_checkpointing_every": 2},
        {"grad_checkpointing": True, "grad_checkpointing_every": 1},
    ]
    if target.card is not None:
        options.append({"grad_checkpointing": True, "grad_checkpointing_every": 1, "activation_offload": True})
    return options


def _installed(package: str | None, planning: bool) -> bool:
    """Whether a lever needing `package` can be offered: always when only planning (it is planned by rule)."""
    return planning or package is None or importlib.util.find_spec(package) is not None


def _adapters(params: Params, target: PlanTarget, lora_allowed: bool, planning: bool) -> list[dict[str, object]]:
    """The adapters the search may switch to, leanest last: LoRA when the run has none, then QLoRA's 4-bit base on a
    card where bitsandbytes runs (CUDA only; saved unmerged, as the params rules require of QLoRA)."""
    if not lora_allowed:
        return []
    adapters: list[dict[str, object]] = [{"adapter.type": "lora"}] if params.adapter.type == "none" else []
    if params.adapter.type != "qlora" and target.card is not None and _installed("bitsandbytes", planning):
        adapters.append({"adapter.type": "qlora", "adapter.merge": False})
    return adapters


def _tiers(params: Params, target: PlanTarget, lora_allowed: bool, planning: bool) -> list[list[dict[str, object]]]:
    lean = [{"optim": name} for name, entry in OPTIMIZERS.items() if entry.lean and name != params.optim
            and (not entry.cuda_only or target.card is not None) and _installed(entry.package, planning)]  # fmt: skip
    adapters = _adapters(params, target, lora_allowed, planning)
    return [[{}], lean, *([{**adapter, **extra} for extra in ({}, *lean)] for adapter in adapters)]


def changed_settings(params: Params, chosen: Params) -> list[str]:
    """The settings the search changed, as `key: value` (the adapter type too)."""
    keys = (
        "precision", "grad_checkpointing", "grad_checkpointing_every", "activation_offload", "optim", "batch_size",
        "grad_accum_steps",
    )  # fmt: skip
    changed = [f"{key}: {getattr(chosen, key)}" for key in keys if getattr(chosen, key) != getattr(params, key)]
    if chosen.adapter.type != params.adapter.type:
        changed.append(f"adapter.type: {chosen.adapter.type}")
    if chosen.adapter.merge != params.adapter.merge:
        changed.append(f"adapter.merge: {chosen.adapter.merge}")
    return changed


def budget_bytes(params: Params) -> int | None:
    """`memory_budget` in bytes: as written, or a GPU profile's memory less its reserve."""
    if isinstance(params.memory_budget, str):
        return gpu_profile(params.memory_budget).budget_bytes()
    return params.memory_budget


def choose_strategy(
    params: Params, plan: Planner, where: PlanTarget | torch.device, lora_allowed: bool = True, planning: bool = False
) -> Choice:
    """`strategy: auto`: the fastest predicted plan that fits `memory_budget`, from the earliest tier with one.

    `planning`: only planning (no training follows), so 8-bit AdamW is offered on a card without bitsandbytes."""
    target = as_target(where)
    budget = budget_bytes(params)
    plan = Memoized(plan)
    assert budget is not None, "strategy: auto needs memory_budget (the schema says so)"
    tiers = _tiers(params, target, lora_allowed, planning)
    weights: WeightFloors = {}
    for tier, changes in enumerate(tiers):
        judged = bounded_by_written_optimizer(plan, params.optim, budget)  # lean optimizers: bounded first
        fits = _fits_in_tier(params, changes, judged, target, budget, weights)
        if fits:
            seconds, _, _, chosen, predicted = min(fits, key=lambda fit: fit[:3])
            changed = ", ".join(changed_settings(params, chosen)) or "nothing changed"
            why = (
                f"strategy auto (tier {tier} of {len(tiers) - 1}, {len(fits)} plans fit memory_budget "
                f"{size(budget)}): {changed}; "
                f"predicted peak {describe(predicted)}; {predicted.step_flops / 1e9:,.2f} GFLOP per step, "
                f"predicted {1000 * seconds:,.1f} ms per step"
            )
            return Choice(chosen, predicted, why)
    # Nothing fits: say what the leanest plan needs (a tier where nothing fits costs two plans per precision).
    _refuse_if_nothing_fits(params, plan, target, budget, _adapters(params, target, lora_allowed, planning))
    raise AssertionError("the leanest plan fits, so some tier has a plan that fits")


def _candidate(params: Params, change: dict[str, object], precision: str, checkpointing: dict[str, object]) -> Params:
    return apply_overrides(params, {**change, "precision": precision, **checkpointing})


def _refuse_if_nothing_fits(
    params: Params, plan: Planner, target: PlanTarget, budget: int, adapters: list[dict[str, object]]
) -> None:
    """Raise a UserError naming the leanest plan when even it is over `budget`: every lever at its leanest (1 row
    per micro-batch, lean optimizer, the leanest of `adapters`), with and without checkpointing and 16-bit, which
    can cost more than they save on a tiny step."""
    lean: dict[str, object] = {"optim": "adafactor", **(adapters[-1] if adapters else {})}  # Adafactor: factored
    leanest = min(
        (
            (candidate, plan(candidate))
            for candidate in (
                apply_overrides(params, {**lean, **_batch(params, 1), "precision": precision, **checkpointing})
                for precision in target.capability().candidates()
                for checkpointing in (_checkpointing(target)[0], _checkpointing(target)[-1])  # none, and leanest
            )
        ),
        key=lambda found: found[1].peak,
    )
    if leanest[1].peak > budget:
        raise UserError(
            f"memory_budget = {size(budget)}: no plan fits, with any precision, checkpointing, micro-batch down to "
            f"1 row, a lean optimizer{''.join(f' or {a}' for a in _adapter_names(adapters))}; the leanest "
            f"({', '.join(changed_settings(params, leanest[0]))}) needs {describe(leanest[1])}. What would fit: "
            f"{_what_would_fit(leanest[0])}"
        )


def _adapter_names(adapters: list[dict[str, object]]) -> list[str]:
    return [{"lora": "LoRA", "qlora": "QLoRA"}[str(adapter["adapter.type"])] for adapter in adapters]


def _what_would_fit(leanest: Params) -> str:
    """The refusal's suggestions, the nearest first: a 4-bit base (when the leanest plan had none: on a CPU, or
    without bitsandbytes), shorter rows, a larger card, a smaller model."""
    qlora = (
        "adapter.type: qlora (the frozen base in 4 bits; CUDA with bitsandbytes), "
        if leanest.adapter.type != "qlora"
        else ""
    )
    return (
        f"{qlora}a shorter data.max_length (now {leanest.data.max_length}), a card with more memory (compare them with "
        "`python -m stages.plan --target <card> ...`) and a larger memory_budget, or a smaller model"
    )


# Bytes per weight a precision stores at most: a plan's weights in fp32 are at least its weights in 16 bits.
_WIDTH = {"fp32": 4, "bf16": 2, "fp16": 2}
WeightFloors = dict[tuple[str, int], int]  # (adapter type, precision's width): the fewest weight bytes planned


def _weights_over(weights: WeightFloors, adapter: str, precision: str, budget: int) -> bool:
    """Whether a plan of this adapter in this precision holds more weight bytes than `budget`, by a plan made: its
    weights do not depend on the optimizer, the micro-batch or checkpointing, and never shrink in a wider precision
    (an 8B-shaped base in 16 bits is over a T4 whatever else changes: 1 plan a tier, not 3 per candidate)."""
    return any(a == adapter and w <= _WIDTH.get(precision, 4) and n > budget for (a, w), n in weights.items())


def _fits_in_tier(
    params: Params, changes: list[dict[str, object]], plan: Planner, target: PlanTarget, budget: int,
    weights: WeightFloors,
) -> list[tuple[float, int, int, Params, MemoryPlan]]:  # fmt: skip
    """Every candidate of a tier that fits, as (predicted seconds, accumulation, changes, params, plan).

    Checkpointing settings are tried fastest first, and the leaner ones only while the one before did not fit
    at the full micro-batch: they add only recompute FLOPs, and cannot make the micro-batch larger, so they
    cannot be faster (a budget that fits everything makes two plans here, not six). A slower precision is tried
    only while its arithmetic alone (`step_time.arithmetic_floor_s`, from the change's plan without
    checkpointing: FLOPs do not depend on the precision) could beat a fit already found, and a leaner checkpointing
    setting only while its own arithmetic could. A precision whose leanest settings (one row a micro-batch, every
    block checkpointed or none, which can cost more than it saves on a tiny step) do not fit is not searched
    further: a tier where nothing fits costs a few plans, so the refusal is made after the tiers, not before.
    """
    fits: list[tuple[float, int, int, Params, MemoryPlan]] = []
    options = _checkpointing(target)
    compiled = params.compile is True  # as each fit is priced below (the search keeps `compile` as written)
    for change in changes:
        fewest_flops: MemoryPlan | None = None  # the change's plan without checkpointing (fewest FLOPs), once made
        for precision in target.capability().candidates():
            # Its plans take seconds each (an 8B-shaped LoRA's), and its fp32 step on an H100 is 14.8x the bf16 one.
            floor = arithmetic_floor_s(fewest_flops, precision, target, params.tf32, compiled) if fewest_flops else None
            if fits and floor is not None and floor > _fastest_s(fits):
                continue
            fastest = _candidate(params, change, precision, options[0])
            adapter = fastest.adapter.type
            if _weights_over(weights, adapter, precision, budget):
                continue  # its weights alone are over, at any micro-batch, checkpointing or optimizer
            whole = plan(apply_overrides(fastest, _batch(fastest, effective_batch(fastest))))
            fewest_flops = fewest_flops or whole
            key = (adapter, _WIDTH.get(precision, 4))
            weights[key] = min(weights.get(key, whole.parameters), whole.parameters)
            if whole.peak > budget and (
                whole.parameters + whole.optimizer_state > budget  # held at every step, whatever the micro-batch
                or min(_one_row(params, change, precision, o, plan) for o in (options[-1], options[0])) > budget
            ):
                continue  # nothing of this precision fits, at any micro-batch or checkpointing
            for checkpointing in options:
                candidate = _candidate(params, change, precision, checkpointing)
                # A leaner setting only adds recompute: once its arithmetic alone (its FLOPs do not depend on the
                # micro-batch) is slower than a fit found, so is every leaner one.
                widest = plan(apply_overrides(candidate, _batch(candidate, effective_batch(candidate))))
                if fits and arithmetic_floor_s(widest, precision, target, params.tf32, compiled) > _fastest_s(fits):
                    break
                found = largest_fitting_batch(candidate, plan, budget)
                if found is None:
                    continue
                chosen, predicted = found
                step = predict_step(predicted, precision, target, params.tf32)
                seconds = step.compiled_s if chosen.compile is True else step.eager_s
                changed = len(changed_settings(params, chosen))
                fits.append((seconds, chosen.grad_accum_steps, changed, chosen, predicted))
                if chosen.batch_size == effective_batch(chosen):
                    break
    return fits


def _fastest_s(fits: list[tuple[float, int, int, Params, MemoryPlan]]) -> float:
    return min(fit[0] for fit in fits)


def _one_row(
    params: Params, change: dict[str, object], precision: str, checkpointing: dict[str, object], plan: Planner
) -> int:
    """The peak of a candidate at one row a micro-batch (accumulation makes up the effective batch)."""
    candidate = _candidate(params, change, precision, checkpointing)
    return plan(apply_overrides(candidate, _batch(candidate, 1))).peak


def fit_to_budget(
    params: Params, plan: Planner, where: PlanTarget | torch.device, lora_allowed: bool = True
) -> Choice | None:
    """The params to train with under `memory_budget` (None without a budget); refuse what cannot fit.

    `strategy: manual` keeps the params (with `batch_size: auto`, the largest micro-batch that fits)
    and refuses them, before training, when their plan does not fit; `strategy: auto` chooses.
    """
    budget = budget_bytes(params)
    if budget is None:
        return None
    if params.strategy == "auto":
        return choose_strategy(params, plan, where, lora_allowed)
    if params.batch_size == "auto":
        found = largest_fitting_batch(params, plan, budget)
        if found is not None:
            chosen, predicted = found
            why = f"batch_size auto: {chosen.batch_size} rows x {chosen.grad_accum_steps} by the memory plan"
            return Choice(chosen, predicted, f"{why}, predicted peak {describe(predicted)}")
        params = apply_overrides(params, _batch(params, 1))
    predicted = plan(params)
    if predicted.peak > budget:
        raise UserError(
            f"memory_budget = {size(budget)}: this trial's memory plan needs {describe(predicted)}. Set strategy: "
            "auto to choose precision, checkpointing, accumulation, optimizer and adapter that fit, or raise "
            "memory_budget"
        )
    return Choice(params, predicted, f"fits memory_budget {size(budget)}: predicted peak {describe(predicted)}")
