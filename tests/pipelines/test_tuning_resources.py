"""What a trial reserves on Ray: a single-process trial, or a distributed trial's driver and workers."""

from __future__ import annotations

import os

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
