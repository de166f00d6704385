"""A deep model's plan from two shallow ones: identical blocks planned twice, counted n times.

A plan runs the trial's step on fake tensors, op by op, so its time grows with the model's depth: an 8B-shaped
Llama (32 blocks) takes minutes per plan, and a strategy search plans dozens of candidates per card. A stack of
identical blocks adds the same bytes per block to every memory figure: each block's weights, gradients, optimizer
state, the activations it saves for the backward (or, checkpointed, its input), its launches and FLOPs; what is
not in a block (embeddings, the head, the loss, the logits) is the same at any depth. So the plan of `n` blocks
is the plan at depth `a` plus (n - a) times the difference between the plans at depths `b` and `a`, per block.

The two depths are one and two groups of blocks. A group is a checkpointed block and the plain ones after it
(`grad_checkpointing_every` blocks), so the checkpointed blocks repeat alike; without checkpointing every 2nd block
it is two blocks, as the first and the last block are special cases (the first's input needs no gradient). So a model
checkpointed every 2nd block is planned at 2 and 4 blocks (at 4 and 8 before: twice the time). A model no deeper than
`WHOLE_UP_TO` blocks is planned whole. `tests/pipelines/test_plan_depth.py` checks the extrapolation against whole
plans.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from pipelines.resolve.memory_plan import MemoryPlan

WHOLE_UP_TO = 8  # blocks: planned whole, as before (a shallow model's plan is quick anyway)
# Figures that grow with the blocks; the rest describe the batch or the target and are the same at any depth.
PER_BLOCK = ("peak", "parameters", "trainable_parameters", "gradients", "optimizer_state", "activations",
             "step_flops", "model_flops", "eval_peak", "step_kernels", "update_kernels", "peak_gradients",
             "peak_before_update", "state_before_update")  # fmt: skip
ALLOCATION_BLOCK = 512  # a card's allocations round to 512 bytes (resolve/cuda_plan): so does the extrapolated peak


def planned_depths(layers: int, every: int = 1) -> tuple[int, int] | None:
    """The two depths a model of `layers` blocks is planned at, or None to plan it whole."""
    group = every if every > 1 else 2  # whole groups (a checkpointed block and the plain ones after it), 2+ blocks
    a, b = group, 2 * group
    return (a, b) if layers > max(WHOLE_UP_TO, b) else None


def extrapolate(shallow: MemoryPlan, deeper: MemoryPlan, depths: tuple[int, int], layers: int) -> MemoryPlan:
    """The plan at `layers` blocks from the plans at `depths` (each figure linear in the blocks)."""
    a, b = depths

    def grow(at_a: float, at_b: float) -> int:
        return round(at_a + (at_b - at_a) / (b - a) * (layers - a))

    grown = {name: grow(getattr(shallow, name), getattr(deeper, name)) for name in PER_BLOCK}
    # The peak is the larger of moments that grow at different rates (activations early, the optimizer step late):
    # a line through two shallow peaks can pass below either at depth, so neither is undercut: the forwards' and
    # backwards' own highest moment, grown on its own line, and the update, which holds every weight, gradient and
    # state tensor at once.
    floor = grown["parameters"] + grown["gradients"] + grown["optimizer_state"]
    grown["peak"] = max(grown["peak"], grown["peak_before_update"], floor)
    if shallow.target != "cpu":
        grown["peak"] = -(-grown["peak"] // ALLOCATION_BLOCK) * ALLOCATION_BLOCK
    # Generation's two phases grow at their own rates (its last step holds the whole cache): the larger at `layers`
    # need not be the larger at the planned depths.
    phases = tuple(grow(x, y) for x, y in zip(shallow.generation_phases, deeper.generation_phases, strict=True))
    # The step's moments do not extrapolate one by one: a cluster plan reads the workers' peaks at both depths.
    return replace(shallow, **grown, generation_phases=phases, generation_peak=max(phases), moments=(),
                   plan_time_s=shallow.plan_time_s + deeper.plan_time_s)  # fmt: skip


def plan_by_depth(plan_at: Callable[[int | None], MemoryPlan], layers: int | None, every: int = 1) -> MemoryPlan:
    """`plan_at(None)` (the whole model) when it is shallow or its depth unknown; else extrapolated from
    `plan_at(a)` and `plan_at(b)`, its time the time of both."""
    depths = None if layers is None else planned_depths(layers, every)
    if depths is None:
        return plan_at(None)
    start = time.perf_counter()
    shallow, deeper = plan_at(depths[0]), plan_at(depths[1])
    plan = extrapolate(shallow, deeper, depths, layers)  # type: ignore[arg-type]
    return replace(plan, plan_time_s=time.perf_counter() - start)
