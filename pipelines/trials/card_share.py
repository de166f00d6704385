"""`tune.resources_per_trial.gpu: auto`: each trial's share of one card, from its variant's memory plan.

Ray Tune places trials by fractional GPUs (`{"gpu": 0.25}`) but does not know what fits; the peers (the HF Trainer,
TRL, Axolotl) run one job per card. Here each variant's plan says what its trial needs on the card: its planned peak
plus its process's reserve outside the allocator (the CUDA context and libraries' workspaces: measured 619-787 MiB
per process on the H200, `../shared/gpu/H200-2026-11-26.md`; the plan's own card reserve, `TargetPlan.reserve`).
A variant whose need fits k times on the card, k at most `max_concurrent_trials`, gets 1/k of it: trials of any
mix of variants then fit the card together, since each share is at least its need over the card. A variant that
fits once gets the whole card; one that does not fit is refused before any trial starts, with the plan's numbers.

A share is enforced, not only planned: a packed trial on CUDA caps its process's caching allocator
(`torch.cuda.set_per_process_memory_fraction`, `memory_cap`) at its share of the card less the CUDA context's reserve,
which lives outside the allocator. Neither 1/sharing (every allocator could then take the whole card, the contexts on
top, and the trial that ran out would be whichever grew last, not the one over its plan) nor need/card (the
packing's slack, share minus need, would go unused, and the plan's 30% fragmentation allowance is an estimate): the
caps and contexts of the trials on a card add up to at most the card, and each cap still holds its plan (share >=
need = peak + context + fragmentation). A trial over its cap then runs out of memory alone, and says so with its plan.

Ray's GPUs are checked before Tune starts (`refuse_gpus_ray_lacks`): a trial asking for a GPU Ray does not have waits
forever (Tune only warns), so it is refused with what Ray sees and what to do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.errors import UserError
from pipelines.gpu_profiles import CONTEXT_RESERVE_BYTES, MIB
from pipelines.params import Params

if TYPE_CHECKING:
    from pipelines.resolve.target import PlanTarget


@dataclass(frozen=True)
class CardShare:
    """One variant's share of a card: Ray's GPU fraction, how many of its trials share one card, its need (planned peak
    + reserve) and its planned peak."""

    gpu: float
    sharing: int
    need_bytes: int
    peak_bytes: int


def card_share(variant: str, peak: int, reserve: int, card: str, card_bytes: int, cap: int) -> CardShare:
    """`variant`'s share of one `card` of `card_bytes`, no more than `cap` trials to a card (see the module)."""
    need = peak + reserve
    if need > card_bytes:
        raise UserError(
            f"variant {variant!r} does not fit one {card}: its plan's peak {peak / MIB:,.1f} MiB + the process's "
            f"reserve {reserve / MIB:,.1f} MiB = {need / MIB:,.1f} MiB, over the card's {card_bytes / MIB:,.1f} MiB; "
            "run `python -m stages.plan` for what would fit (memory_budget with strategy: auto finds it)"
        )
    sharing = max(1, min(cap, card_bytes // need))
    return CardShare(gpu=gpu_fraction(sharing), sharing=sharing, need_bytes=need, peak_bytes=peak)


def gpu_fraction(sharing: int) -> float:
    """Ray's GPU share of one of `sharing` trials to a card: a whole GPU alone (exactly 1.0), else 1/sharing."""
    return 1.0 if sharing == 1 else 1.0 / sharing


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
    """Every variant's share of `card`, from its memory plan on that card (`python -m stages.plan`'s plans), a
    `compile: auto` variant planned as compiled: the trial decides auto only after its plan, and a compiled step holds
    its padded widths' activations and its CUDA graphs' pool (`pipelines.resolve.plan_report.as_compiled`)."""
    from pipelines.resolve.plan_report import plan_targets

    plans = plan_targets(params, root, tokenized, [card], fastest=False, compiled_auto=True)[card.name]
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


@dataclass(frozen=True)
class MemoryCap:
    """A packed trial's cap on its caching allocator: `fraction` of the device's memory (what
    `torch.cuda.set_per_process_memory_fraction` takes), its share of the card and the cap, in bytes."""

    fraction: float
    share_bytes: int
    cap_bytes: int

    def exceeded(self, variant: str, share: CardShare) -> str:
        """Why a packed trial ran out of memory, with its plan's numbers, and what to do."""
        return (
            f"variant {variant!r} ran out of memory in its share of the card: {share.sharing} trials to a card "
            f"(tune.resources_per_trial.gpu: auto), its share {self.share_bytes / MIB:,.1f} MiB, its allocator capped "
            f"at {self.cap_bytes / MIB:,.1f} MiB (the rest is its CUDA context's); its plan's peak was "
            f"{share.peak_bytes / MIB:,.1f} MiB, {share.need_bytes / MIB:,.1f} MiB with the process's reserve. "
            "It needed more than planned: lower tune.max_concurrent_trials (fewer trials to a card, each a larger "
            "share) or set tune.resources_per_trial.gpu: 1 (a card to itself)"
        )


def memory_cap(share: CardShare, device_bytes: int) -> MemoryCap:
    """The allocator cap of a trial of `share` on a device of `device_bytes`: its share of the card less the CUDA
    context's reserve, which is outside the allocator (see the module). Never below zero: a device smaller than the
    card planned on then fails the trial at its first allocation, with `MemoryCap.exceeded`'s numbers."""
    share_bytes = device_bytes // share.sharing
    cap = max(0, share_bytes - CONTEXT_RESERVE_BYTES)
    return MemoryCap(cap / device_bytes, share_bytes, cap)


@contextmanager
def enforced_share(
    params: Params, share: CardShare | None, variant: str, record: Callable[[dict[str, str]], None]
) -> Iterator[None]:
    """A packed trial's share of the card, enforced on CUDA around its training: its caching allocator capped
    (`memory_cap`) before its model is built, the cap's fraction recorded (`record`: the run's tags) as
    `card.memory_fraction`, and an out-of-memory then failing this trial alone, with its plan's numbers and what to
    do. Nothing for a trial with a card to itself; off CUDA only the tag, which says so."""
    if share is None or share.sharing == 1:
        yield
        return
    import torch

    from pipelines.runtime import resolve_device

    device = resolve_device(params)
    if device.type != "cuda":
        record({"card.memory_fraction": f"none (trains on {device.type})"})
        yield
        return
    index = torch.cuda.current_device()  # Ray's CUDA_VISIBLE_DEVICES shows a trial its assigned card alone
    cap = memory_cap(share, torch.cuda.get_device_properties(index).total_memory)
    torch.cuda.set_per_process_memory_fraction(cap.fraction, index)
    record({"card.memory_fraction": f"{cap.fraction:.4g}"})
    try:
        yield
    except torch.OutOfMemoryError as err:
        raise UserError(cap.exceeded(variant, share)) from err
    except UserError as err:
        # The engine halves micro-batches on an out-of-memory and gives up at one row (pipelines.train.out_of_memory):
        # in a packed trial that too is its share running out, so its plan's numbers are added.
        if not str(err).startswith("out of memory"):
            raise
        raise UserError(f"{err}; {cap.exceeded(variant, share)}") from err


def gpus_asked(params: Params, per_trial: float) -> float:
    """GPUs one trial holds on Ray at once: its own (`per_trial`), or a distributed trial's workers'
    (`pipelines.trials.resources.worker_gpus` each)."""
    from pipelines.trials.resources import worker_gpus

    workers = params.distributed.num_workers
    return per_trial if workers < 2 else workers * worker_gpus(params)


def unseen_gpus_message(params: Params, asked: float, seen: float, address: str | None) -> str:
    """Why trials asking Ray for `asked` GPUs each cannot start on a cluster of `seen` GPUs, and what to do."""
    declared = params.tune.resources_per_trial.gpu
    why = "as declared" if declared not in (None, "auto") else "a whole GPU, as this machine trains on CUDA"
    what = f"tune.resources_per_trial.gpu = {'null' if declared is None else declared}: {why}"
    fix = f"tune.resources_per_trial.gpu: {seen:g}"
    where = f"at {address}" if address else "started here (told this machine's CUDA devices, torch's count)"
    start = "start its nodes with their GPUs (`ray start --num-gpus=N`)" if address else "run where CUDA is visible"
    return (
        f"each trial asks Ray for {asked:g} GPU(s) ({what}), but the Ray cluster {where} has {seen:g} "
        f"(ray.cluster_resources() GPU: {seen:g}), so Ray Tune would wait for them forever; {start}, set {fix}, "
        "or train on the CPU (device: cpu)"
    )


def refuse_gpus_ray_lacks(params: Params, per_trial: float, address: str | None) -> None:
    """Refuse, before Tune starts, trials asking for more GPUs than the Ray cluster has: Tune only warns, and waits
    for them forever (a cluster that adds GPU nodes by autoscaling is not waited for either). A distributed trial's
    workers are checked node by node, with how many fit, by `pipelines.trials.placement.refuse_unplaceable`."""
    import ray

    if params.distributed.num_workers > 1:
        return
    asked = gpus_asked(params, per_trial)
    seen = float(ray.cluster_resources().get("GPU", 0.0))
    if asked > seen:
        raise UserError(unseen_gpus_message(params, asked, seen, address))
