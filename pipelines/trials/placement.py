"""Refuse, before any trial starts, a trial that the Ray cluster can never place, with the numbers.

Ray Tune waits for a trial it cannot place (it only warns, every few seconds), and Ray Train waits for a worker group
it cannot place, retrying its start every 60 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), so a request no node can
hold used to wait forever. One trial holds at once: its own process (a single-process trial's CPUs and GPUs, or a
distributed trial's driver, one CPU) on one node, and a distributed trial's `distributed.num_workers` workers, each
a bundle of its CPUs (and a GPU with distributed.use_gpu) on some node (Ray Train's placement group, PACK: a worker
never spans nodes). Checked against every live node's total CPUs and GPUs (ray.nodes()), not what is free now: a
cluster busy with other work frees it later, and too small a cluster for `tune.max_concurrent_trials` trials at once
runs fewer at once. A cluster that would add nodes by autoscaling is not waited for either.

`pipelines.trials.card_share.refuse_gpus_ray_lacks`, run first, refuses more GPUs than the whole cluster has; this
refuses what fits the cluster's totals but no node (or no set of nodes, for the workers).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.errors import UserError
from pipelines.params import Params

Node = dict[str, float]  # a node's total resources: {"CPU": ..., "GPU": ...}


@dataclass(frozen=True)
class TrialAsk:
    """What one trial holds on Ray at once: its own process's bundle, and `workers` bundles of `worker` each (a
    distributed trial's Ray Train workers; none for a single-process trial)."""

    own: Node
    workers: int = 0
    worker: Node | None = None


def cluster_nodes() -> list[Node]:
    """Every live node's total CPUs and GPUs (Ray must be initialized)."""
    import ray

    return [
        {"CPU": float(node["Resources"].get("CPU", 0)), "GPU": float(node["Resources"].get("GPU", 0))}
        for node in ray.nodes()
        if node.get("Alive")
    ]


def _count(node: Node, bundle: Node) -> int:
    """How many of `bundle` fit on `node`."""
    asked = [(node.get(key, 0.0), amount) for key, amount in bundle.items() if amount > 0]
    return min((int(have / amount + 1e-9) for have, amount in asked), default=1 << 30)


def workers_placed(nodes: list[Node], ask: TrialAsk) -> int:
    """How many of the trial's workers fit beside its own bundle, the best node for that bundle chosen; -1 where no
    node holds the bundle itself. Exact: the workers are identical, so each node holds as many as fit on what is
    left of it."""
    best = -1
    for index, node in enumerate(nodes):
        if _count(node, ask.own) < 1:
            continue
        left = [
            {key: have - ask.own.get(key, 0.0) for key, have in other.items()} if i == index else other
            for i, other in enumerate(nodes)
        ]
        placed = sum(_count(other, ask.worker) for other in left) if ask.worker else 0
        best = max(best, min(placed, ask.workers))
    return best


def trial_ask(params: Params, cpu: float, gpu: float, worker_cpus: int) -> TrialAsk:
    """One trial's bundles: `cpu` and `gpu` for its own process (a distributed trial's driver), and a distributed
    trial's workers of `worker_cpus` CPUs each, and a GPU each where it asks for GPUs (`gpus_asked`)."""
    from pipelines.trials.card_share import gpus_asked

    own = {"CPU": float(cpu), "GPU": float(gpu)}
    workers = params.distributed.num_workers
    if workers < 2:
        return TrialAsk(own)
    gpu_each = 1.0 if gpus_asked(params, gpu) > 0 else 0.0
    return TrialAsk(own, workers, {"CPU": float(worker_cpus), "GPU": gpu_each})


def _amounts(bundle: Node) -> str:
    gpus = f", {bundle['GPU']:g} GPU" if bundle.get("GPU", 0) > 0 else ""
    return f"{bundle['CPU']:g} CPU{'s' if bundle['CPU'] != 1 else ''}{gpus}"


def _nodes_text(nodes: list[Node]) -> str:
    each = "; ".join(f"{node['CPU']:g} CPUs, {node['GPU']:g} GPUs" for node in nodes)
    return f"{len(nodes)} node{'s' if len(nodes) != 1 else ''} ({each}; ray.nodes())"


def _fixes(params: Params, nodes: list[Node], ask: TrialAsk, address: str | None) -> list[str]:
    """What would fit: fewer CPUs per worker (or per trial), fewer workers, or a larger cluster."""
    fixes = []
    if ask.worker is not None:
        cpus = next((c for c in range(int(ask.worker["CPU"]) - 1, 0, -1)
                     if workers_placed(nodes, TrialAsk(ask.own, ask.workers, {**ask.worker, "CPU": c})) == ask.workers),
                    None)  # fmt: skip
        if cpus:
            fixes.append(f"set tune.resources_per_trial.cpu: {cpus} (CPUs per worker)")
        fewer = workers_placed(nodes, ask)
        if fewer >= 2:
            fixes.append(f"distributed.num_workers: {fewer}")
    else:
        most = max((node["CPU"] for node in nodes), default=0)
        if 1 <= most < ask.own["CPU"]:
            fixes.append(f"set tune.resources_per_trial.cpu: {most:g}")
    grow = "join a larger cluster (tune.address or RAY_ADDRESS)"
    if address:
        grow = "add nodes or CPUs to the cluster (`ray start`)"
    return [*fixes, grow]


def unplaceable_message(params: Params, nodes: list[Node], ask: TrialAsk, address: str | None) -> str:
    """Why one trial of `ask` can never be placed on `nodes`, and what would fit."""
    where = f"at {address}" if address else "started here"
    declared = params.tune.resources_per_trial.cpu
    fixes = ", or ".join(_fixes(params, nodes, ask, address))
    if ask.worker is None:
        how = "as declared" if declared else "this machine's cores shared among tune.max_concurrent_trials"
        return (
            f"each trial asks Ray for {_amounts(ask.own)} on one node (tune.resources_per_trial.cpu = "
            f"{f'{declared:g}' if declared else 'null'}: {how}), but no node of the Ray cluster {where} has that many: "
            f"{_nodes_text(nodes)}, so Ray Tune would wait for it forever; {fixes}"
        )
    how = f"{declared:g}: CPUs per worker" if declared else "null: this machine's cores shared among the workers"
    placed = workers_placed(nodes, ask)
    fit = f"beside the driver, {placed} of the {ask.workers} workers fit"
    if placed < 0:
        fit = "the driver itself fits no node"
    return (
        f"each trial needs its driver ({_amounts(ask.own)}) and {ask.workers} Ray Train workers of "
        f"{_amounts(ask.worker or {})} each, a worker on one node (distributed.num_workers = {ask.workers}, "
        f"tune.resources_per_trial.cpu = {how}), but the Ray cluster {where} has {_nodes_text(nodes)}: {fit}, "
        f"so Ray Train would wait for them forever; {fixes}"
    )


def refuse_unplaceable(params: Params, cpu: float, gpu: float, worker_cpus: int, address: str | None) -> None:
    """Refuse, before Tune starts, a trial (its own process of `cpu` CPUs and `gpu` GPUs, and a distributed trial's
    workers of `worker_cpus` CPUs each) that no node, or no set of nodes, of the Ray cluster can ever hold."""
    nodes = cluster_nodes()
    ask = trial_ask(params, cpu, gpu, worker_cpus)
    if workers_placed(nodes, ask) < ask.workers:
        raise UserError(unplaceable_message(params, nodes, ask, address))
