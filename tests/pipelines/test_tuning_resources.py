"""What a trial reserves on Ray: a single-process trial, or a distributed trial's driver and workers; what a local Ray
is told of this machine's GPUs, and trials asking for GPUs Ray lacks refused before Tune starts."""

from __future__ import annotations

import os

import pytest

from pipelines.trials.tuning import local_ray_cpus, trial_resources, worker_threads
from tests.conftest import tiny_params


def test_single_process_trials_share_the_cores(default_params):
    params = tiny_params(default_params, **{"tune.max_concurrent_trials": 2})
    assert trial_resources(params, 8)["cpu"] == 4
    assert worker_threads(params, 8) == 4
    assert local_ray_cpus(params, 8) == 8


def test_distributed_trial_is_a_one_cpu_driver_and_its_workers_share_the_cores(default_params):
    params = tiny_params(default_params, **{"tune.max_concurrent_trials": 2, "distributed.num_workers": 2})
    assert trial_resources(params, 8) == {"cpu": 1, "gpu": 0}
    assert worker_threads(params, 8) == 2  # 2 trials x 2 workers on 8 cores
    assert local_ray_cpus(params, 8) == 10  # one logical CPU more per concurrent driver
    declared = tiny_params(params, **{"tune.resources_per_trial.cpu": 3})
    assert worker_threads(declared, 8) == 3  # declared CPUs are per worker when distributed


def test_a_single_trial_silences_tunes_console_and_restores_the_engine_choice(monkeypatch):
    from pipelines.trials.ray_cluster import tune_console

    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT", raising=False)
    with tune_console(0):
        # Tune's newer engine prints its header box even at verbose 0; the legacy one prints nothing.
        assert os.environ["RAY_AIR_NEW_OUTPUT"] == "0"
    assert "RAY_AIR_NEW_OUTPUT" not in os.environ
    with tune_console(1):  # a sweep keeps Tune's own output (its status table)
        assert "RAY_AIR_NEW_OUTPUT" not in os.environ
    monkeypatch.setenv("RAY_AIR_NEW_OUTPUT", "1")
    with tune_console(0):
        assert os.environ["RAY_AIR_NEW_OUTPUT"] == "0"
    assert os.environ["RAY_AIR_NEW_OUTPUT"] == "1"


def test_a_cpu_trial_reserves_no_gpu_even_where_cuda_is_present(default_params, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trial_resources(tiny_params(default_params, device="cpu"), 8)["gpu"] == 0.0
    assert trial_resources(tiny_params(default_params, device="auto"), 8)["gpu"] == 1.0
    declared = tiny_params(default_params, **{"device": "cpu", "tune.resources_per_trial.gpu": 0.5})
    assert trial_resources(declared, 8)["gpu"] == 0.5  # what the user declared stands


def test_a_local_ray_is_told_the_gpus_torch_sees_and_none_for_a_cpu_run(default_params):
    import torch

    from pipelines.trials.ray_cluster import local_ray_gpus

    # torch's count where the trials train on CUDA (device: auto), whatever Ray's own detection would find.
    assert local_ray_gpus(tiny_params(default_params, device="auto")) == torch.cuda.device_count()
    assert local_ray_gpus(tiny_params(default_params, device="cpu")) == 0  # a CPU run holds no GPU back


def test_a_train_stage_asking_for_gpus_ray_lacks_fails_in_seconds_instead_of_waiting_forever(
    default_params, own_ray_cluster, tmp_path
):
    import time

    import ray
    import torch

    from pipelines.errors import UserError
    from pipelines.trials.tuning import run_tuning

    # One GPU more than this machine has (none here): Ray's local cluster, told torch's count, cannot place a trial.
    asked = torch.cuda.device_count() + 1
    params = tiny_params(default_params, **{"tune.resources_per_trial.gpu": asked, "tune.address": None})
    if ray.is_initialized():  # a cluster of this process's own, started by run_tuning below
        ray.shutdown()
    start = time.perf_counter()
    try:
        with pytest.raises(UserError) as refused:
            run_tuning(params, tmp_path, tmp_path / "tokenized", tmp_path / "model", {})
        took = time.perf_counter() - start
        seen = ray.cluster_resources().get("GPU", 0)
    finally:
        ray.shutdown()
    assert seen == torch.cuda.device_count()  # the local head was told torch's count
    message = str(refused.value)
    assert (
        f"each trial asks Ray for {asked} GPU(s) (tune.resources_per_trial.gpu = {float(asked)}: as declared)"
        in message
    )
    assert f"has {seen:g} (ray.cluster_resources() GPU: {seen:g}), so Ray Tune would wait for them forever" in message
    assert "or train on the CPU (device: cpu)" in message
    assert took < 120, took  # Ray's start and MLflow's store, no trial: before, Tune waited for the GPU forever


def test_a_distributed_trials_workers_are_placed_node_by_node_beside_its_driver(default_params):
    from pipelines.trials.placement import trial_ask, unplaceable_message, workers_placed

    params = tiny_params(default_params, **{"distributed.num_workers": 2, "distributed.use_gpu": False})
    two_cpus = trial_ask(params, 1, 0, 2)
    # 4 CPUs in all but 2 per node: the driver takes one CPU of a node, so one worker of 2 fits beside it.
    assert workers_placed([{"CPU": 2, "GPU": 0}, {"CPU": 2, "GPU": 0}], two_cpus) == 1
    assert workers_placed([{"CPU": 3, "GPU": 0}, {"CPU": 2, "GPU": 0}], two_cpus) == 2  # the driver beside a worker
    assert workers_placed([{"CPU": 0, "GPU": 1}], two_cpus) == -1  # the driver itself fits nowhere
    message = unplaceable_message(params, [{"CPU": 2, "GPU": 0}, {"CPU": 2, "GPU": 0}], two_cpus, "10.0.0.5:6379")
    assert message == (
        "each trial needs its driver (1 CPU) and 2 Ray Train workers of 2 CPUs each, a worker on one node "
        "(distributed.num_workers = 2, tune.resources_per_trial.cpu = null: this machine's cores shared among the "
        "workers), but the Ray cluster at 10.0.0.5:6379 has 2 nodes (2 CPUs, 0 GPUs; 2 CPUs, 0 GPUs; ray.nodes()): "
        "beside the driver, 1 of the 2 workers fit, so Ray Train would wait for them forever; set "
        "tune.resources_per_trial.cpu: 1 (CPUs per worker), or add nodes or CPUs to the cluster (`ray start`)"
    )
    # A GPU each: two 1-GPU nodes hold them, one 2-GPU node too, but not one 1-GPU node.
    gpus = trial_ask(tiny_params(params, **{"distributed.use_gpu": True}), 1, 0, 1)
    assert workers_placed([{"CPU": 4, "GPU": 1}, {"CPU": 4, "GPU": 1}], gpus) == 2
    assert workers_placed([{"CPU": 4, "GPU": 2}], gpus) == 2
    assert workers_placed([{"CPU": 4, "GPU": 1}], gpus) == 1


def test_more_concurrent_distributed_trials_than_their_workers_leave_room_for_is_refused(default_params):
    """Tune starts up to max_concurrent_trials drivers first; where they hold what every worker group needs, no trial
    ever trains. Hand-counted: 6 CPUs; 4 drivers leave 2, one group of 2 x 2 CPUs needs 4; 2 drivers leave 4."""
    from pipelines.trials.placement import concurrency_message, drivers_leave_room, trial_ask, trials_at_once

    params = tiny_params(default_params, **{"distributed.num_workers": 2, "distributed.use_gpu": False,
                                            "tune.max_concurrent_trials": 4, "tune.num_samples": 4})  # fmt: skip
    ask = trial_ask(params, 1, 0, 2)
    six = [{"CPU": 6, "GPU": 0}]
    assert trials_at_once(params) == 4
    assert [drivers_leave_room(six, ask, k) for k in (1, 2, 3, 4)] == [True, True, False, False]
    # Over two nodes of 4 and 2 CPUs, the drivers on the first: 2 drivers leave it 2 CPUs, a worker, and the second
    # node holds the other; 3 drivers leave it 1 CPU, and only the second node's worker fits.
    assert [drivers_leave_room([{"CPU": 4, "GPU": 0}, {"CPU": 2, "GPU": 0}], ask, k) for k in (1, 2, 3)] == [
        True, True, False]  # fmt: skip
    assert concurrency_message(params, six, ask, "10.0.0.5:6379") == (
        "tune.max_concurrent_trials = 4 starts 4 distributed trials at once, each a driver (1 CPU) that then asks for "
        "2 workers of 2 CPUs each; on the Ray cluster at 10.0.0.5:6379 (1 node (6 CPUs, 0 GPUs; ray.nodes())) 4 "
        "drivers leave no room for any trial's workers, so no trial would ever start training; set "
        "tune.max_concurrent_trials: 2, or add nodes or CPUs to the cluster"
    )
    # One trial in the grid: one driver, whatever the cap.
    assert trials_at_once(tiny_params(params, **{"tune.num_samples": 1})) == 1


@pytest.mark.timeout(300)  # before, Tune waited for the CPUs forever
def test_a_train_stage_asking_for_more_cpus_than_any_node_has_fails_in_seconds(
    default_params, own_ray_cluster, tmp_path
):
    import ray

    from pipelines.errors import UserError
    from pipelines.trials.tuning import run_tuning

    cores = os.cpu_count() or 1
    overrides = {"tune.resources_per_trial.cpu": cores + 1, "tune.address": None, "device": "cpu"}  # no GPU held
    params = tiny_params(default_params, **overrides)
    if ray.is_initialized():  # a cluster of this process's own, started by run_tuning below
        ray.shutdown()
    try:
        with pytest.raises(UserError) as refused:
            run_tuning(params, tmp_path, tmp_path / "tokenized", tmp_path / "model", {})
    finally:
        ray.shutdown()
    assert str(refused.value) == (
        f"each trial asks Ray for {cores + 1} CPUs on one node (tune.resources_per_trial.cpu = {cores + 1}: as "
        f"declared), but no node of the Ray cluster started here has that many: 1 node ({cores} CPUs, 0 GPUs; "
        f"ray.nodes()), so Ray Tune would wait for it forever; set tune.resources_per_trial.cpu: {cores}, or join a "
        "larger cluster (tune.address or RAY_ADDRESS)"
    )


def test_a_distributed_trial_reserves_declared_gpus_per_worker_even_where_it_trains_on_the_cpu(default_params):
    from pipelines.trials.card_share import gpus_asked
    from pipelines.trials.resources import worker_gpus

    cpu_workers = {"distributed.num_workers": 4, "device": "cpu"}
    assert worker_gpus(tiny_params(default_params, **cpu_workers)) == 0.0  # gpu: auto, no use_gpu: none
    declared = tiny_params(default_params, **cpu_workers, **{"tune.resources_per_trial.gpu": 1})
    assert worker_gpus(declared) == 1.0 and gpus_asked(declared, 0.0) == 4.0  # per worker, as its cpu is
    on_gpus = tiny_params(default_params, **{"distributed.num_workers": 4, "distributed.use_gpu": True})
    assert worker_gpus(on_gpus) == 1.0
