"""Several GPUs of one card as a plan's target: `8xA100-80GB` (one node of 8) or `2x8xH100-80GB` (2 nodes of 8).

A cluster is planned per GPU: each worker's card is the single-card target (`PlanTarget`, whose rules the fake step
runs under), and what the other workers change (the shards, the collectives, the host each node shares) is added by
`pipelines.resolve.sharding_plan`. The names' syntax lives with the card profiles (`pipelines.gpu_profiles`), where
the params schema can check it without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.errors import UserError
from pipelines.gpu_profiles import CLUSTER_FORMS, GPU_PROFILES, GpuProfile, parse_cluster
from pipelines.resolve.interconnects import COLLECTIVE_EFFICIENCY, Link, links_for
from pipelines.resolve.target import PlanTarget


@dataclass(frozen=True)
class Cluster:
    """`nodes` nodes of `gpus_per_node` cards each, one data-parallel worker per GPU."""

    card: GpuProfile
    nodes: int = 1
    gpus_per_node: int = 1

    @property
    def name(self) -> str:
        """As the user writes it: `8xA100-80GB`, `2x8xH100-80GB`."""
        node = f"{self.gpus_per_node}x{self.card.name}"
        return node if self.nodes == 1 else f"{self.nodes}x{node}"

    @property
    def workers(self) -> int:
        """Every GPU: `distributed.num_workers` for a run on the whole cluster."""
        return self.nodes * self.gpus_per_node

    @property
    def per_gpu(self) -> PlanTarget:
        """One worker's card, as the single-card plan models it."""
        return PlanTarget(self.card)

    def collective_link(self) -> tuple[str, float]:
        """The link a ring collective over every worker is limited by, and the bytes per second each GPU moves over
        it one way, `COLLECTIVE_EFFICIENCY` applied: NVLink (or PCIe) within one node; across nodes the slower of that
        and each GPU's share of its node's network."""
        within, _, between = links_for(self.card.name)
        if self.nodes == 1:
            return within.name, within.bytes_per_s * COLLECTIVE_EFFICIENCY
        share = between.bytes_per_s / self.gpus_per_node
        if share < within.bytes_per_s:
            return f"{between.name}, {share / 1e9:g} GB/s a GPU", share * COLLECTIVE_EFFICIENCY
        return within.name, within.bytes_per_s * COLLECTIVE_EFFICIENCY

    def host_link(self) -> Link:
        """Each GPU's link to its host (CPU offload's copies)."""
        return links_for(self.card.name)[1]


def cluster_named(name: str) -> Cluster | None:
    """The cluster `name` describes, or None for a single card or `cpu` (an unknown name is refused, naming the
    forms allowed)."""
    parsed = parse_cluster(name)
    if parsed is not None:
        nodes, gpus, card = parsed
        return Cluster(GPU_PROFILES[card], nodes, gpus)
    if name == "cpu" or name in GPU_PROFILES:
        return None
    raise UserError(
        f"target_device (or --target) = {name!r}: must be cpu, a GPU profile ({', '.join(GPU_PROFILES)}), "
        f"or several GPUs of one: {CLUSTER_FORMS}"
    )
