"""Refuse, before any trial starts, a trial that the Ray cluster can never place, with the numbers.

Ray Tune waits for a trial it cannot place (it only warns, every few seconds), and Ray Train waits for a worker group
it cannot place, retrying its start every 60 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), so a request no node can
hold used to wait forever. One trial holds at once: its own process (a single-process trial's CPUs and GPUs, or a
distributed trial's driver, one CPU) on one node, and a distributed trial's `distributed.num_workers` workers, each
a bundle of its CPUs (and a GPU with distributed.use_gpu) on some node (Ray Train's placement group, PACK: a worker
never spans nodes). Checked against every live node's total CPUs and GPUs (ray.nodes()), not what is free now: a
cluster busy with other work frees it later, and too small a cluster for `tune.max_concurrent_trials` trials at once
runs fewer at once, except where the drivers Tune starts first would hold what every worker group needs: then no trial
would ever train, and `tune.max_concurrent_trials` is refused with how many fit. A cluster that would add nodes by
autoscaling is not waited for either.

`pipelines.trials.card_share.refuse_gpus_ray_lacks`, run first, refuses a single-process trial asking for more GPUs
than the whole cluster has; this refuses what fits the cluster's totals but no node, and a distributed trial whose
workers no set of nodes holds: more GPUs than the cluster has (a model sharded over more workers than it has GPUs)
among them, said with the trial's numbers (workers, GPUs each and in all) against each node's.
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
    """Every live node's total CPUs and GPUs, the largest first (Ray must be initialized; its own order varies)."""
    import ray

    nodes = [
        {"CPU": float(node["Resources"].get("CPU", 0)), "GPU": float(node["Resources"].get("GPU", 0))}
        for node in ray.nodes()
        if node.get("Alive")
    ]
    return sorted(nodes, key=lambda node: (node["GPU"], node["CPU"]), reverse=True)


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
    trial's workers of `worker_cpus` CPUs and `worker_gpus` GPUs each."""
    from pipelines.trials.resources import worker_gpus

    own = {"CPU": float(cpu), "GPU": float(gpu)}
    workers = params.distributed.num_workers
    if workers < 2:
        return TrialAsk(own)
    return TrialAsk(own, workers, {"CPU": float(worker_cpus), "GPU": worker_gpus(params)})


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
        gpus = ask.worker is not None and ask.worker["GPU"] > 0
        grow = "add nodes or GPUs to the cluster (`ray start --num-gpus=N`)" if gpus else \
            "add nodes or CPUs to the cluster (`ray start`)"  # fmt: skip
    return [*fixes, grow]


def _gpus_short(nodes: list[Node], ask: TrialAsk) -> str:
    """`; they need 10 GPUs in all, the cluster has 8` where the workers' GPUs alone exceed the cluster's, else ''."""
    gpus = ask.workers * (ask.worker or {}).get("GPU", 0.0)
    have = sum(node["GPU"] for node in nodes)
    return f"; they need {gpus:g} GPUs in all, the cluster has {have:g}" if gpus > have else ""


def _gpus_how(params: Params, ask: TrialAsk) -> str:
    """Where the workers' GPUs come from (`pipelines.trials.resources.worker_gpus`), '' without any."""
    if ask.worker is None or ask.worker["GPU"] <= 0:
        return ""
    declared = params.tune.resources_per_trial.gpu
    if declared not in (None, "auto") and declared > 0:
        return f", tune.resources_per_trial.gpu = {declared:g}: GPUs per worker"
    use_gpu = params.distributed.use_gpu
    return f", distributed.use_gpu = {'null' if use_gpu is None else str(use_gpu).lower()}: a GPU each"


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
    how += _gpus_how(params, ask)
    placed = workers_placed(nodes, ask)
    fit = f"beside the driver, {placed} of the {ask.workers} workers fit"
    if placed < 0:
        fit = "the driver itself fits no node"
    fit += _gpus_short(nodes, ask)
    return (
        f"each trial needs its driver ({_amounts(ask.own)}) and {ask.workers} Ray Train workers of "
        f"{_amounts(ask.worker or {})} each, a worker on one node (distributed.num_workers = {ask.workers}, "
        f"tune.resources_per_trial.cpu = {how}), but the Ray cluster {where} has {_nodes_text(nodes)}: {fit}, "
        f"so Ray Train would wait for them forever; {fixes}"
    )


def _without_drivers(nodes: list[Node], driver: Node, drivers: int) -> list[Node]:
    """`nodes` less `drivers` driver bundles, each on the first node (the largest) that still holds one."""
    left = [dict(node) for node in nodes]
    for _ in range(drivers):
        node = next((node for node in left if _count(node, driver) >= 1), None)
        if node is None:
            break
        for key, amount in driver.items():
            node[key] = node.get(key, 0.0) - amount
    return left


def drivers_leave_room(nodes: list[Node], ask: TrialAsk, drivers: int) -> bool:
    """Whether one trial's whole worker group still fits once `drivers` trials' drivers hold their bundles.

    Ray Tune starts up to `tune.max_concurrent_trials` trials' drivers before their worker groups are placed, and a
    worker group is placed whole or not at all (Ray Train's placement group): when the drivers hold what every
    group needs, no trial ever starts training. While one group fits, its trial ends and frees it for the next."""
    if ask.worker is None:
        return True
    left = _without_drivers(nodes, ask.own, drivers)
    return workers_placed(left, TrialAsk({}, ask.workers, ask.worker)) >= ask.workers


def trials_at_once(params: Params) -> int:
    """The trials Tune may run at once: `tune.max_concurrent_trials`, or fewer where the grid has fewer (the
    variants times `tune.num_samples`, a lower bound when the search space has grid axes)."""
    trials = max(1, len(params.tune.variants)) * params.tune.num_samples
    return min(params.tune.max_concurrent_trials, trials)


def concurrency_message(params: Params, nodes: list[Node], ask: TrialAsk, address: str | None) -> str:
    """Why `tune.max_concurrent_trials` distributed trials at once would never start, and how many would."""
    at_once = trials_at_once(params)
    fits = next((k for k in range(at_once - 1, 0, -1) if drivers_leave_room(nodes, ask, k)), 0)
    where = f"at {address}" if address else "started here"
    return (
        f"tune.max_concurrent_trials = {params.tune.max_concurrent_trials} starts {at_once} distributed trials at "
        f"once, each a driver ({_amounts(ask.own)}) that then asks for {ask.workers} workers of "
        f"{_amounts(ask.worker or {})} each; on the Ray cluster {where} ({_nodes_text(nodes)}) {at_once} drivers leave "
        f"no room for any trial's workers, so no trial would ever start training; set tune.max_concurrent_trials: "
        f"{fits}, or add nodes or CPUs to the cluster"
    )


def refuse_unplaceable(params: Params, cpu: float, gpu: float, worker_cpus: int, address: str | None) -> None:
    """Refuse, before Tune starts, a trial (its own process of `cpu` CPUs and `gpu` GPUs, and a distributed trial's
    workers of `worker_cpus` CPUs each) that no node, or no set of nodes, of the Ray cluster can ever hold."""
    nodes = cluster_nodes()
    ask = trial_ask(params, cpu, gpu, worker_cpus)
    if workers_placed(nodes, ask) < ask.workers:
        raise UserError(unplaceable_message(params, nodes, ask, address))
    if not drivers_leave_room(nodes, ask, trials_at_once(params)):
        raise UserError(concurrency_message(params, nodes, ask, address))
