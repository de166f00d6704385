"""`tune.resources_per_trial.gpu: auto`: each trial's share of one card, from its variant's memory plan.

Ray Tune places trials by fractional GPUs (`{"gpu": 0.25}`) but does not know what fits; the peers (the HF Trainer,
TRL, Axolotl) run one job per card. Here each variant's plan says what its trial needs on the card: its planned peak
plus its process's reserve outside the allocator (the CUDA context and libraries' workspaces: measured 619-787 MiB
per process on the H200, `../shared/gpu/H200-2026-11-26.md`; the plan's own card reserve, `TargetPlan.reserve`).
A variant whose need fits k times on the card, k at most `max_concurrent_trials`, gets 1/k of it: trials of any
mix of variants then fit the card together, since each share is at least its need over the card. A variant that
fits once gets the whole card; one that does not fit is refused before any trial starts, with the plan's numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.errors import UserError
from pipelines.params import Params

if TYPE_CHECKING:
    from pipelines.resolve.target import PlanTarget

MB = 2**20


@dataclass(frozen=True)
class CardShare:
    """One variant's share of a card: Ray's GPU fraction, how many of its trials share one card, and its need."""

    gpu: float
    sharing: int
    need_bytes: int


def card_share(variant: str, peak: int, reserve: int, card: str, card_bytes: int, cap: int) -> CardShare:
    """`variant`'s share of one `card` of `card_bytes`, no more than `cap` trials to a card (see the module)."""
    need = peak + reserve
    if need > card_bytes:
        raise UserError(
            f"variant {variant!r} does not fit one {card}: its plan's peak {peak / MB:,.1f} MiB + the process's "
            f"reserve {reserve / MB:,.1f} MiB = {need / MB:,.1f} MiB, over the card's {card_bytes / MB:,.1f} MiB; "
            "run `python -m stages.plan` for what would fit (memory_budget with strategy: auto finds it)"
        )
    sharing = max(1, min(cap, card_bytes // need))
    return CardShare(gpu=1.0 if sharing == 1 else 1.0 / sharing, sharing=sharing, need_bytes=need)


def card_shares(planned: dict[str, tuple[int, int]], card: str, card_bytes: int, cap: int) -> dict[str, CardShare]:
    """Every variant's share: `planned` maps a variant to (its planned peak, its reserve), in bytes."""
    return {name: card_share(name, peak, reserve, card, card_bytes, cap) for name, (peak, reserve) in planned.items()}


def card_of(params: Params) -> PlanTarget | None:
    """The card trials are planned on: this machine's CUDA device, else the card `target_device` names (a driver on
    a CPU head node sending trials to GPU nodes), else None."""
    import torch

    from pipelines.resolve.target import PlanTarget, target_named, visible_card

    if torch.cuda.is_available() and params.device != "cpu":
        return PlanTarget(visible_card())
    if params.target_device not in ("auto", "cpu"):
        return target_named(params.target_device)
    return None


def planned_shares(params: Params, root: Path, tokenized: Path, card: PlanTarget) -> dict[str, CardShare]:
    """Every variant's share of `card`, from its memory plan on that card (`python -m stages.plan`'s plans)."""
    from pipelines.resolve.plan_report import plan_targets

    plans = plan_targets(params, root, tokenized, [card], fastest=False)[card.name]
    planned = {}
    for variant, entry in plans.items():
        if entry.plan is None:
            raise UserError(f"tune.resources_per_trial.gpu: auto needs variant {variant!r}'s plan: {entry.unavailable}")
        planned[variant] = (int(entry.plan.peak), int(entry.reserve or 0))
    assert card.card is not None
    cap = params.tune.max_concurrent_trials
    return card_shares(planned, card.name, card.card.memory_bytes, cap)


def gpu_shares(params: Params, root: Path, tokenized: Path) -> dict[str, CardShare] | None:
    """`gpu: auto`'s shares where they apply: one process per trial, a Ray cluster with GPUs, and a card to plan on
    (`card_of`); None otherwise (a trial then reserves a whole GPU where it trains on CUDA, none elsewhere)."""
    import ray

    if params.tune.resources_per_trial.gpu != "auto" or params.distributed.num_workers > 1:
        return None
    if ray.cluster_resources().get("GPU", 0) <= 0:
        return None
    card = card_of(params)
    return None if card is None else planned_shares(params, root, tokenized, card)


def shared_resources(cpu: float, shares: dict[str, CardShare]) -> Callable[[dict[str, Any]], Any]:
    """Ray Tune's resources per trial config: the trial's CPUs and its variant's share of a card."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory

    return lambda config: PlacementGroupFactory([{"CPU": cpu, "GPU": shares[config["variant"]].gpu}])
