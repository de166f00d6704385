"""Trials placed by Ray across the nodes of a cluster: a simulated one (`ray.cluster_utils.Cluster`: two nodes on this
machine, each declaring GPUs; the trials train on the CPU, as `tests/e2e/test_card_packing.py`'s do), checked
against Ray's own record of where each worker and trial went, not against what our code asked for.

The placement checks run on 2 nodes x 4 GPUs. The training run uses 2 nodes x 2 GPUs (4 workers). 8 FSDP workers
on 2 x 4 trained too, placed the same way (ranks 0-3 on one node's GPUs 0-3, ranks 4-7 on the other's), but their train
stage took 3.6 minutes on this 2-core host (load average about 20), over a slow test's budget; under that load this
4-worker test took 3.6 to 3.9 minutes, its cluster and tokenize stage included.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import free_port, run, tiny_params, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

GPUS_PER_NODE = 4


@contextmanager
def simulated_cluster(gpus_per_node: int, cpus_per_node: int) -> Iterator[object]:
    """Two nodes of `cpus_per_node` CPUs and `gpus_per_node` GPUs each (logical: the trials' threads come from this
    machine's cores), on ports free now."""
    from ray.cluster_utils import Cluster

    head = {"num_cpus": cpus_per_node, "num_gpus": gpus_per_node, "gcs_server_port": free_port(),
            "include_dashboard": False, "dashboard_agent_listen_port": free_port()}  # fmt: skip
    # Without a token, whatever this test process did before: the nodes inherit its environment, and a test that
    # joined a token cluster earlier in the same pytest worker leaves RAY_AUTH_MODE=token in it (Ray's own
    # maybe_enable_token_auth_if_token_available), which the stage, run with RAY_AUTH_MODE=disabled, cannot reach.
    before = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    try:
        simulated = Cluster(initialize_head=True, head_node_args=head)
        simulated.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
    finally:
        os.environ.pop("RAY_AUTH_MODE") if before is None else os.environ.__setitem__("RAY_AUTH_MODE", before)
    try:
        yield simulated
    finally:
        simulated.shutdown()


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """2 nodes x 4 GPUs, and CPUs enough for every trial and worker of the placement checks at once."""
    with simulated_cluster(GPUS_PER_NODE, 2 * GPUS_PER_NODE) as simulated:
        yield simulated


@pytest.fixture
def joined(cluster) -> Iterator[str]:
    """This process connected to the cluster (ray.init), for Ray's own records; its address."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address=cluster.address)
    try:
        yield cluster.address
    finally:
        ray.shutdown()


def test_an_fsdp_trial_holds_one_gpu_per_worker_across_both_nodes(project_copy: Path):
    gpus, workers = 2, 4  # 2 nodes x 2 GPUs: the 4 workers need both nodes
    settings = {"data.generator.num_rows": 200, "epochs": 1, "batch_size": 4, "log_every_n_steps": 1,
                "checkpoint_every_n_steps": None, "compile": False, "lr": 0.001, "device": "cpu",
                "distributed.num_workers": workers, "distributed.strategy": "fsdp",
                "tune.resources_per_trial.cpu": 1, "tune.resources_per_trial.gpu": 1}  # fmt: skip
    write_params(project_copy, settings)
    run([sys.executable, "-m", "stages.tokenize"], project_copy)
    with simulated_cluster(gpus, cpus_per_node=gpus + 1) as simulated:
        # The simulated cluster takes no token: without RAY_AUTH_MODE the stage would send ~/.ray/auth_token's, which
        # a `ray start` of this machine wrote, and the cluster would drop the trial (`use_cluster_token`).
        env = {"RAY_ADDRESS": simulated.address, "RAY_AUTH_MODE": "disabled"}
        run([sys.executable, "-m", "stages.train"], project_copy, timeout=800, env=env)
        nodes = {node.node_id for node in (simulated.head_node, *simulated.worker_nodes)}

    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    trial = next(r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags)
    assert trial.info.status == "FINISHED", trial.data.tags.get("error")
    tags, metrics = trial.data.tags, trial.data.metrics
    # Ray's runtime context in each worker: its node, and the GPU ids Ray assigned it.
    placement = json.loads(tags["distributed.placement"])
    assert [p["rank"] for p in placement] == list(range(workers))
    assert {p["node"] for p in placement} == nodes  # both nodes of the cluster
    assert all(len(p["gpus"]) == 1 for p in placement)
    for node in nodes:
        held = sorted(gpu for p in placement if p["node"] == node for gpu in p["gpus"])
        assert held == [str(i) for i in range(gpus)], (node, held)  # each GPU of the node, once
    assert metrics["world_size"] == workers and metrics["num_nodes"] == 2 and tags["distributed.nodes"] == "2"
    assert tags["distributed.strategy.resolved"] == "fsdp" and trial.data.params["distributed.strategy"] == "fsdp"
    peaks = [metrics[f"peak_train_memory_bytes_rank_{rank}"] for rank in range(workers)]
    assert all(peak > 0 for peak in peaks) and f"peak_train_memory_bytes_rank_{workers}" not in metrics
    assert metrics["peak_train_memory_bytes"] == max(peaks)  # the run's peak is its largest rank's


def test_a_trial_needing_more_gpus_than_the_cluster_has_is_refused_before_it_starts(joined, default_params, tmp_path):
    from pipelines.errors import UserError
    from pipelines.trials.tuning import run_tuning

    workers = 2 * GPUS_PER_NODE + 2
    params = tiny_params(default_params, **{"device": "cpu", "distributed.num_workers": workers,
                                            "tune.resources_per_trial.cpu": 1, "tune.resources_per_trial.gpu": 1,
                                            "tune.address": joined})  # fmt: skip
    with pytest.raises(UserError) as refused:
        run_tuning(params, tmp_path, tmp_path / "tokenized", tmp_path / "model", {})
    assert str(refused.value) == (
        f"each trial needs its driver (1 CPU) and {workers} Ray Train workers of 1 CPU, 1 GPU each, a worker on one "
        f"node (distributed.num_workers = {workers}, tune.resources_per_trial.cpu = 1: CPUs per worker, "
        "tune.resources_per_trial.gpu = 1: GPUs per worker), but the Ray cluster at "
        f"{joined} has 2 nodes (8 CPUs, 4 GPUs; 8 CPUs, 4 GPUs; ray.nodes()): beside the driver, 8 of the {workers} "
        f"workers fit; they need {workers} GPUs in all, the cluster has 8, so Ray Train would wait for them forever; "
        "distributed.num_workers: 8, or add nodes or GPUs to the cluster (`ray start --num-gpus=N`)"
    )
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not [r for r in runs if "mlflow.parentRunId" in r.data.tags]  # no trial started


def test_packed_trials_and_a_multi_gpu_trial_share_the_cluster_as_planned(joined, default_params):
    """A 7-worker trial (a card each) and four variants packed four to a card (`gpu: auto`'s plan): Ray holds them all
    at once, on all 8 cards, each trial with the share the plan gives it, read back from what Ray assigned each.

    The multi-GPU trial is placed first: Ray spreads single-bundle requests over the nodes, so four packed trials
    placed first take a card on each node (two to a card), and 7 whole cards are then not free until they end."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from pipelines.gpu_profiles import MIB
    from pipelines.trials.card_share import card_shares, shared_resources
    from pipelines.trials.distributed import worker_group
    from pipelines.trials.placement import cluster_nodes, trial_ask, workers_placed

    gpu_workers = {"device": "cpu", "tune.resources_per_trial.cpu": 1, "tune.resources_per_trial.gpu": 1}
    params = tiny_params(default_params, **gpu_workers, **{"distributed.num_workers": 7})
    scaling, _ = worker_group(params, threads=1)
    worker = scaling.resources_per_worker  # what Ray Train asks for each worker
    assert scaling.use_gpu and worker == {"CPU": 1, "GPU": 1}
    assert workers_placed(cluster_nodes(), trial_ask(params, 1, 0, 1)) == 7
    card = 141_000 * MIB  # an H200's memory: four trials of 20,000 MiB each fit, so four share a card
    shares = card_shares({f"v{i}": (20_000 * MIB, 700 * MIB) for i in range(4)}, "H200", card, cap=4)
    assert {(share.sharing, share.gpu) for share in shares.values()} == {(4, 0.25)}
    packed = [shared_resources(1, shares)({"variant": variant}) for variant in shares]  # Tune's request per trial

    # Ray Train's placement group for the workers (PACK), beside the trial's driver; then the four packed trials.
    groups = [placement_group([{"CPU": 1}] + [worker] * 7, strategy="PACK")]
    ray.get(groups[0].ready(), timeout=60)
    groups += [placement_group(request.bundles, strategy=request.strategy) for request in packed]
    ray.get([group.ready() for group in groups], timeout=60)  # all held at once: they fit together

    @ray.remote
    def where() -> tuple[str, str, float]:
        context = ray.get_runtime_context()
        (gpu,) = context.get_accelerator_ids()["GPU"]
        return context.get_node_id(), str(gpu), context.get_assigned_resources()["GPU"]

    def held(group: object, index: int, bundle: dict[str, float]) -> tuple[str, str, float]:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return ray.get(where.options(num_cpus=bundle["CPU"], num_gpus=bundle["GPU"],
                                     scheduling_strategy=strategy).remote())  # fmt: skip

    try:
        workers = [held(groups[0], i, worker) for i in range(1, 8)]
        trials = [held(group, 0, request.bundles[0]) for group, request in zip(groups[1:], packed, strict=True)]
    finally:
        for group in groups:
            ray.util.remove_placement_group(group)
    assert {share for *_, share in workers} == {1.0} and {share for *_, share in trials} == {0.25}
    worker_cards = {(node, gpu) for node, gpu, _ in workers}
    trial_cards = {(node, gpu) for node, gpu, _ in trials}
    assert len(worker_cards) == 7 and len(trial_cards) == 1  # a card per worker; one card for the four trials
    cards = worker_cards | trial_cards
    assert len(cards) == 2 * GPUS_PER_NODE  # none shared between the two: every card of both nodes in use
    assert {node for node, _ in cards} == {node["NodeID"] for node in ray.nodes() if node["Alive"]}
