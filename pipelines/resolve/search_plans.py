"""The budget search's planner (`pipelines.resolve.budget`): each distinct plan made once, and a lean optimizer's
candidate not planned where the plan already made with the optimizer as written shows it cannot fit.

A lean optimizer's step (Adafactor, 8-bit AdamW) runs the same forwards and backwards as the written optimizer's
(an optimizer touches neither), with its own state alive throughout instead of the written one's. So at every moment
before the update it holds the written optimizer's bytes less that optimizer's state plus its own, and its peak is
at least the written plan's highest moment before the update less the written optimizer's state then, as the
tracker counted it (`MemoryPlan.peak_before_update`, `state_before_update`: scalar step counters and a card's
rounding included; in a plan by depth each on its own line, as every figure is, and the extrapolated peak never
below the first). Where that bound is over the budget, the candidate cannot fit at any setting of its own state:
the search is given a plan bounded from below (that peak, no optimizer state, and the written plan's FLOPs, which
the optimizer does not change), which it can only judge as over; it is never chosen, printed or kept. The tiers
search the written optimizer before the lean ones (`budget._tiers`), so its plans are there to be read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from pipelines.params import Params, apply_overrides
from pipelines.resolve.memory_plan import MemoryPlan

Planner = Callable[[Params], MemoryPlan]


class Memoized:
    """`plan`, computed once per distinct params (the search asks for some twice); `made` looks without planning."""

    def __init__(self, plan: Planner) -> None:
        self._plan = plan
        self._made: dict[str, MemoryPlan] = {}

    def __call__(self, params: Params) -> MemoryPlan:
        key = params.model_dump_json()
        if key not in self._made:
            self._made[key] = self._plan(params)
        return self._made[key]

    def made(self, params: Params) -> MemoryPlan | None:
        """The plan of `params` if it was made, else None (nothing is planned)."""
        return self._made.get(params.model_dump_json())


def lean_optimizer_floor(written: MemoryPlan) -> int:
    """The least peak the same step can have with another optimizer than `written`'s (see the module docstring)."""
    return written.peak_before_update - written.state_before_update


def bounded_by_written_optimizer(plan: Memoized, written_optim: str, budget: int) -> Planner:
    """`plan`, but a candidate with another optimizer than `written_optim` whose floor, read off the written
    optimizer's plan of the same candidate where made, is over `budget` gets that bounded plan instead."""

    def planned(candidate: Params) -> MemoryPlan:
        if candidate.optim != written_optim:
            written = plan.made(apply_overrides(candidate, {"optim": written_optim}))
            if written is not None and lean_optimizer_floor(written) > budget:
                return replace(written, peak=lean_optimizer_floor(written), optimizer_state=0)
        return plan(candidate)

    return planned
