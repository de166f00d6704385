"""The plan for N GPUs and nodes: every adapter, checkpointing and data-parallel strategy, per GPU, and the fastest
that fits, with the `-S` overrides that run it.

For each trained configuration (full fine-tuning, LoRA, QLoRA; with and without activation checkpointing) the
whole model's step is planned once on one worker's card (`pipelines.resolve.memory_plan`, by depth for a deep stack:
`pipelines.resolve.plan_depth`), with the per-GPU batch as written; each strategy (DDP; FSDP; FSDP without
resharding; FSDP with CPU offload) is then read off that plan and the model's units (`pipelines.resolve.
sharding_plan`: DDP's copies by arithmetic, an FSDP worker's peak from the traced steps' moments). The units come
from the two shallow plans a deep plan is made of anyway (one block's bytes is the difference between them), so a
70B-shaped model costs a few shallow plans, not a fake trace at full depth. An FSDP run resolves `loss_impl: auto`
to the full loss (the chunked one is refused with FSDP), so its base plan has the full loss; DDP's keeps the params'
own, and is skipped where the weights, gradients and optimizer state alone exceed the card (it is then over by at
least that, and the row says so from the FSDP base's figures).

The recommendation follows the single-card search's order: the adapter as written if any strategy fits it, else
LoRA, else QLoRA (they change what is trained); within that, the shortest predicted step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipelines.adapters import apply_adapter
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import Params, apply_overrides
from pipelines.resolve.cluster import Cluster
from pipelines.resolve.memory_plan import MemoryPlan, PlanUnavailable, plan_memory
from pipelines.resolve.plan_depth import extrapolate, planned_depths
from pipelines.resolve.sharding_plan import STRATEGIES, GpuShare, ModelUnits, Strategy, share_of_gpu
from pipelines.resolve.step_time import predict_step
from pipelines.resolve.target import PlanTarget
from pipelines.tasks.base import Task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ADAPTERS = ("none", "lora", "qlora")
UnitPlanner = Callable[[Params], tuple[MemoryPlan, ModelUnits]]


@dataclass(frozen=True)
class ClusterRow:
    """One trained configuration under one strategy: its GPU's share, or why it has none."""

    adapter: str
    checkpointing: bool
    strategy: Strategy
    precision: str
    share: GpuShare | None = None
    note: str | None = None  # why not planned, or how it was planned


@dataclass(frozen=True)
class ClusterPlan:
    """Every row on one cluster, the recommended row and its overrides (refused: the params rule that refuses them)."""

    cluster: Cluster
    link: str
    rows: list[ClusterRow]
    recommended: ClusterRow | None
    overrides: dict[str, object] = field(default_factory=dict)
    refused: str | None = None
    plan_time_s: float = 0.0


def unit_planner(
    task: Task, train: TokenizedSplit, tokenizer: PreTrainedTokenizerBase, tokenized: Path, root: Path,
    target: PlanTarget,
) -> UnitPlanner:  # fmt: skip
    """Plans of params on `target` with the model's units, each made once per card class (`PlanTarget.plan_key`)
    and params; the global RNG is left as it was."""
    cache: dict[tuple[str, str], tuple[MemoryPlan, ModelUnits]] = {}

    def plan(params: Params) -> tuple[MemoryPlan, ModelUnits]:
        key = (target.plan_key, params.model_dump_json())
        if key not in cache:

            def build(layers: int | None) -> torch.nn.Module:
                return task.build_model(params, tokenizer, tokenized, root, weights=False, layers=layers)

            def at_depth(layers: int | None) -> MemoryPlan:
                return plan_memory(params, task, train, lambda: build(layers),
                                   lambda m: apply_adapter(m, params.adapter, task, params),
                                   int(tokenizer.pad_token_id), target.precision(params), target)  # type: ignore[arg-type]  # fmt: skip

            rng = torch.get_rng_state()
            try:
                compute = 2 if target.card is not None and target.precision(params) != "fp32" else 4
                cache[key] = with_units(params, at_depth, build, task.stacked_layers(params, root), compute)
            finally:
                torch.set_rng_state(rng)
        return cache[key]

    return plan


def with_units(
    params: Params, at_depth: Callable[[int | None], MemoryPlan], build: Callable[[int | None], torch.nn.Module],
    layers: int | None, compute_bytes: int,
) -> tuple[MemoryPlan, ModelUnits]:  # fmt: skip
    """The whole model's plan and its units: from the two shallow plans of a deep stack (as `plan_by_depth`
    extrapolates), or the whole plan beside plans at 1 and 2 blocks for a shallow one."""
    start = time.perf_counter()
    depths = planned_depths(layers, params.grad_checkpointing_every) if layers else None
    if depths is not None:
        shallow, deeper = at_depth(depths[0]), at_depth(depths[1])
        whole = extrapolate(shallow, deeper, depths, layers)  # type: ignore[arg-type]
        traced = ((depths[0], shallow.moments), (depths[1], deeper.moments))
    else:
        whole = at_depth(None)
        depths = (1, 2) if layers and layers >= 2 else None
        shallow, deeper = (at_depth(1), at_depth(2)) if depths else (whole, whole)
        traced = ((layers or 1, whole.moments),)
    a, b = depths or (0, 1)
    block, trained = (deeper.parameters - shallow.parameters) // (b - a), (
        deeper.trainable_parameters - shallow.trainable_parameters) // (b - a)  # fmt: skip
    with FakeTensorMode(allow_non_fake_inputs=True):
        counts = [sum(p.numel() for p in build(d).parameters()) for d in (depths or (None,))]
    per_block = (counts[-1] - counts[0]) // (b - a) if depths else 0
    units = ModelUnits(
        layers=layers if depths else 1, block_params=block if depths else whole.parameters,
        block_trainable=trained if depths else whole.trainable_parameters,
        root_params=shallow.parameters - a * block if depths else 0,
        root_trainable=shallow.trainable_parameters - a * trained if depths else 0,
        weights=counts[0] + per_block * ((layers or 1) - a), compute_bytes=compute_bytes,
        trainable_bytes=2 if params.weights_dtype == "bf16" else 4,
        traced=traced,
    )  # fmt: skip
    return replace(whole, plan_time_s=time.perf_counter() - start), units


def base_params(params: Params, adapter: str, checkpointing: bool, strategy: Strategy) -> Params:
    """The one-worker params whose plan a row starts from: the adapter and checkpointing set, one worker (the
    sharding is added after), and what an FSDP run resolves differently (the full loss; eager)."""
    changes: dict[str, object] = {"adapter.type": adapter, "grad_checkpointing": checkpointing,
                                  "distributed.num_workers": 1, "distributed.strategy": "ddp"}  # fmt: skip
    if strategy.name == "fsdp":
        changes |= {"loss_impl": "full"} if params.loss_impl != "full" else {}
        changes |= {"compile": False} if params.compile is True else {}
    return apply_overrides(params, changes)


def plan_cluster(params: Params, planner: UnitPlanner, cluster: Cluster) -> ClusterPlan:
    """Every adapter x checkpointing x strategy on `cluster` (one strategy on one GPU), and the recommendation."""
    start = time.perf_counter()
    strategies = STRATEGIES if cluster.workers > 1 else (Strategy("ddp"),)
    rows = []
    for adapter in ADAPTERS:
        for checkpointing in (False, True):
            # FSDP's base first (one GPU too): where its weights, gradients and state alone exceed the card, DDP's
            # base (another loss) is not planned.
            fsdp_base = _planned(params, planner, (adapter, checkpointing, Strategy("fsdp")))
            rows += [_row(params, planner, cluster, (adapter, checkpointing, s), fsdp_base) for s in strategies]
    best = recommend(params, rows)
    overrides, refused = _overrides(params, best, cluster) if best else ({}, None)
    return ClusterPlan(cluster, cluster.collective_link()[0], rows, best, overrides, refused,
                       time.perf_counter() - start)  # fmt: skip


def _planned(
    params: Params, planner: UnitPlanner, setup: tuple[str, bool, Strategy]
) -> tuple[MemoryPlan, ModelUnits] | None:  # fmt: skip
    """The base plan of a row's setup, or None when it cannot be made (the row then says why)."""
    try:
        return planner(base_params(params, *setup))
    except (PlanUnavailable, UserError):
        return None


def _row(
    params: Params, planner: UnitPlanner, cluster: Cluster, setup: tuple[str, bool, Strategy],
    fsdp_base: tuple[MemoryPlan, ModelUnits] | None,
) -> ClusterRow:  # fmt: skip
    adapter, checkpointing, strategy = setup
    target = cluster.per_gpu
    try:
        variant = base_params(params, adapter, checkpointing, strategy)
        precision = target.precision(variant)
    except UserError as err:
        return ClusterRow(adapter, checkpointing, strategy, params.precision, note=str(err))
    note = None
    try:
        if strategy.name == "ddp" and fsdp_base is not None and _whole(fsdp_base[0]) > cluster.card.memory_bytes:
            planned, note = fsdp_base, "weights, gradients and state alone exceed the card: figures from FSDP's base"
        else:
            planned = planner(variant)
    except (PlanUnavailable, UserError) as err:
        return ClusterRow(adapter, checkpointing, strategy, precision, note=str(err))
    plan, units = planned
    step = predict_step(plan, precision, target, variant.tf32)
    compute_s = step.compiled_s if variant.compile is True else step.eager_s
    rows = variant.batch_size if isinstance(variant.batch_size, int) else plan.batch_rows
    share = share_of_gpu(plan, units, cluster, strategy, compute_s, rows)
    return ClusterRow(adapter, checkpointing, strategy, precision, share, note)


def _whole(plan: MemoryPlan) -> int:
    return plan.parameters + plan.gradients + plan.optimizer_state


def recommend(params: Params, rows: list[ClusterRow]) -> ClusterRow | None:
    """The adapter as written if anything fits it, else the next leaner one; within it the shortest step (ties:
    checkpointing as written, then the earlier strategy)."""
    for adapter in ADAPTERS[ADAPTERS.index(params.adapter.type) :]:
        fitting = [r for r in rows if r.adapter == adapter and r.share is not None and r.share.fits]
        if fitting:
            return min(fitting, key=lambda r: (round(r.share.step_s, 3), r.checkpointing != params.grad_checkpointing,  # type: ignore[union-attr]
                                               STRATEGIES.index(r.strategy)))  # fmt: skip
    return None


def _overrides(params: Params, row: ClusterRow, cluster: Cluster) -> tuple[dict[str, object], str | None]:
    """The `-S` overrides that run `row` on `cluster`, and the params rule that refuses them today (or None)."""
    changes: dict[str, object] = {"adapter.type": row.adapter, "grad_checkpointing": row.checkpointing,
                                  **row.strategy.overrides(cluster.workers), "distributed.use_gpu": True}  # fmt: skip
    if row.strategy.name == "fsdp":
        changes |= {"loss_impl": "full"} if params.loss_impl == "chunked" else {}
        changes |= {"compile": False} if params.compile is True else {}
    changes = {k: v for k, v in changes.items() if not k.startswith(("adapter", "grad")) or _differs(params, k, v)}
    known = type(params.distributed).model_fields
    checkable = {k: v for k, v in changes.items() if not k.startswith("distributed.") or k.split(".")[1] in known}
    try:
        apply_overrides(params, checkable)
    except UserError as err:
        return changes, str(err)
    return changes, None


def _differs(params: Params, key: str, value: object) -> bool:
    current: object = params
    for part in key.split("."):
        current = getattr(current, part)
    return current != value
