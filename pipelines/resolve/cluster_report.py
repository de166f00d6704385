"""The plan stage's answer for N GPUs and nodes: one table per cluster and variant, and its JSON.

A row per trained configuration and strategy: the per-GPU peak and its parts (this GPU's shard of weights, gradients
and optimizer state; the units gathered whole; the activations and temporaries), whether peak and reserve fit the
card and by how much, the largest per-GPU batch that fits, the host RAM each node needs (CPU offload's shards; the
weights as loaded), and the step time with the collectives' share of it. Under it: the link the collectives run over
and its source, what the plan assumes overlapped, and the recommended configuration with the `-S` overrides.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from pipelines.data.tokenization import TOKENIZER_DIR, TokenizedSplit
from pipelines.params import Params, apply_overrides
from pipelines.resolve.cluster import Cluster
from pipelines.resolve.cluster_plan import ClusterPlan, ClusterRow, UnitPlanner, plan_cluster, unit_planner
from pipelines.resolve.interconnects import COLLECTIVE_EFFICIENCY, links_for

ADAPTER_LABELS = {"none": "full", "lora": "LoRA", "qlora": "QLoRA"}


def _gib(value: float) -> str:
    return f"{value / 2**30:,.1f}"


def _fits(row: ClusterRow) -> str:
    share = row.share
    if share is None:
        return "—"
    return f"yes, {_gib(share.room)} spare" if share.fits else f"no, {_gib(-share.room)} over"


def _cells(row: ClusterRow) -> str:
    share = row.share
    if share is None:
        return f"not planned: {row.note} |" + " |" * 7
    host = share.host_offloaded + share.host_loading
    comm = f"{share.collective_s + share.host_copy_s:,.2f} s ({share.exposed_s:,.2f} s)"
    return (f"{_gib(share.peak)} | {_gib(share.resident)} | {_gib(share.gathered)} | {_gib(share.working)} | "
            f"{_fits(row)} | {share.largest_batch} | {_gib(host)} | {share.step_s:,.2f} s | {comm} |")  # fmt: skip


def cluster_table(variant: str, plan: ClusterPlan) -> str:
    """One cluster's rows for one variant as a markdown table (GiB of 2^30 bytes), then the link, the assumptions and
    the recommendation."""
    cluster = plan.cluster
    lines = [
        f"Target: {cluster.name} ({cluster.workers} GPU{'s' * (cluster.workers > 1)}), variant {variant}",
        "",
        "| Adapter | Ckpt | Strategy | Peak/GPU | Shard | Gathered | Activations | Fits (reserve counted) | Max batch "
        "| Host/node | Step | Collectives (exposed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in plan.rows:
        lines.append(f"| {ADAPTER_LABELS[row.adapter]} | {'yes' if row.checkpointing else 'no'} | "
                     f"{row.strategy.label if cluster.workers > 1 else 'one GPU'} | {_cells(row)}")  # fmt: skip
    return "\n".join(lines + [""] + notes(plan))


def notes(plan: ClusterPlan) -> list[str]:
    """The lines under a cluster's table: units, link and source, overlap, reserve, host RAM, the recommendation."""
    cluster = plan.cluster
    within, to_host, between = links_for(cluster.card.name)
    out = ["Peak, shard, gathered and activations in GiB per GPU; host RAM in GiB per node; step time per optimizer "
           "step, per GPU's batch."]  # fmt: skip
    if cluster.workers > 1:
        _, rate = cluster.collective_link()
        out.append(f"- Collectives over {plan.link}: {rate / 1e9:,.0f} GB/s a GPU one way as assumed "
                   f"({COLLECTIVE_EFFICIENCY:.0%} of the spec's one-way rate). Sources: {within.source}"
                   + (f"; {between.source}" if cluster.nodes > 1 else "") + ".")  # fmt: skip
        out.append(
            "- Overlap assumed: FSDP's all-gathers and reduce-scatters (and CPU offload's copies over "
            f"{to_host.name}) hide behind the previous block's compute but for one block's share; DDP's "
            "all-reduce behind backward (2/3 of the step) but for its last 25 MiB bucket. Exposed: in brackets."
        )
    out.append(f"- Reserve: the card's CUDA context and allocator slack (800 MiB + 30% of the peak) beside each peak. "
               f"Host/node: CPU offload's shards plus the weights as loaded (each of the node's "
               f"{cluster.gpus_per_node} workers builds the model whole in fp32 before sharding).")  # fmt: skip
    by_note: dict[str, list[str]] = {}
    for row in plan.rows:
        if row.note and row.share is not None:
            by_note.setdefault(row.note, []).append(f"{ADAPTER_LABELS[row.adapter]}{', ckpt' * row.checkpointing}")
    out += [f"- {row_note} (DDP: {'; '.join(labels)})"
            for row_note, labels in by_note.items()]  # fmt: skip
    out.append(recommendation(plan))
    return out


def _labels(row: ClusterRow) -> str:
    ckpt = "checkpointed" if row.checkpointing else "no checkpointing"
    return f"{ADAPTER_LABELS[row.adapter]}, {ckpt}, {row.strategy.label}"


def recommendation(plan: ClusterPlan) -> str:
    """The recommended row and the overrides that run it, or that nothing fits."""
    best = plan.recommended
    if best is None or best.share is None:
        return f"- Recommended: nothing fits {plan.cluster.name}, not even QLoRA with CPU offload."
    flags = " ".join(f"-S {k}={_yaml(v)}" for k, v in plan.overrides.items())
    line = (f"- Recommended on {plan.cluster.name}: {_labels(best)}: peak {_gib(best.share.peak)} GiB per GPU, "
            f"{_gib(best.share.room)} GiB to spare, up to {best.share.largest_batch} rows per GPU, about "
            f"{best.share.step_s:,.2f} s a step. Run it with: dvc exp run {flags}")  # fmt: skip
    if plan.refused:
        line += f" (refused by this version's params rules today: {plan.refused})"
    return line


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def cluster_json(plan: ClusterPlan) -> dict[str, object]:
    """metrics/plan.json's entry for one cluster and variant."""
    return {
        "cluster": plan.cluster.name,
        "workers": plan.cluster.workers,
        "link": plan.link,
        "plan_time_s": plan.plan_time_s,
        "rows": [
            {
                "adapter": r.adapter,
                "checkpointing": r.checkpointing,
                "strategy": r.strategy.label,
                "precision": r.precision,
                "note": r.note,
                **({} if r.share is None else {**asdict(r.share), "fits": r.share.fits}),
            }
            for r in plan.rows
        ],  # fmt: skip
        "recommended": None if plan.recommended is None else _labels(plan.recommended),
        "overrides": plan.overrides,
        "refused": plan.refused,
    }


def plan_clusters(
    params: Params, root: Path, tokenized: Path, clusters: list[Cluster]
) -> dict[str, dict[str, ClusterPlan]]:
    """`{cluster name: {variant: ClusterPlan}}` for every variant of `tune.variants` (or the params alone); clusters
    of cards alike (`PlanTarget.plan_key`) share each variant's plans."""
    from transformers import AutoTokenizer

    from pipelines.tasks import get_task

    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    train = TokenizedSplit.load(tokenized / "train")
    base = params.model_copy(update={"tune": params.tune.model_copy(update={"variants": {}, "search_space": {}})})
    variants = {name: apply_overrides(base, dict(o)) for name, o in (params.tune.variants or {"default": {}}).items()}
    planners: dict[tuple[str, str], UnitPlanner] = {}
    out: dict[str, dict[str, ClusterPlan]] = {}
    for cluster in clusters:
        out[cluster.name] = {}
        for name, variant in variants.items():
            key = (name, cluster.per_gpu.plan_key)
            if key not in planners:
                task = get_task(variant.task)
                rows = task.training_split(train, variant, None)  # a packed run's packs, as its trial makes them
                planners[key] = unit_planner(task, rows, tokenizer, tokenized, root, cluster.per_gpu)
            out[cluster.name][name] = plan_cluster(variant, planners[key], cluster)
    return out
