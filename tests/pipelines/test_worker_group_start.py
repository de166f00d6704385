"""Ray Train workers that cannot start: a few bounded tries, then a message, not retries forever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import tiny_params

# Before, Ray Train retried the start every RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S without limit: the trial never
# returned, and this test ran into its timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_workers_that_cannot_start_fail_the_trial_after_bounded_tries_with_a_message(
    default_params, own_ray_cluster, tmp_path: Path, monkeypatch
):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from pipelines.trial_context import TrialContext
    from pipelines.trials.ray_cluster import start_local_ray, worker_env

    # The driver's setting reaches Ray Train's controller, a process of the cluster's, through the trials' environment.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "2")
    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(3, {"env_vars": worker_env()})
    try:
        # The cluster has room for both workers (3 CPUs), but other work holds 2 of them: the workers can never start.
        held = placement_group([{"CPU": 2}])
        ray.get(held.ready(), timeout=60)
        params = tiny_params(default_params, **{"distributed.num_workers": 2})
        context = TrialContext(
            params=params.model_dump(mode="json"), root=str(tmp_path), variants={}, tokenized_dir=str(tmp_path),
            staging_dir=str(tmp_path / "staging"), checkpoint_root=str(tmp_path / "checkpoints"),
            tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment_id="0", parent_run_id="0" * 32,
            threads=1, scheduler="fifo", tokenize_stats={},
        )  # fmt: skip
        outcome = tune_one_trial(params, context, tmp_path)  # a distributed trial's driver is a Tune trial
        remove_placement_group(held)
    finally:
        ray.shutdown()
    message, took = outcome["message"], outcome["took"]
    tries = 3  # the first and two retries (pipelines.trials.distributed.WORKER_GROUP_START_RETRIES)
    assert message.startswith(
        f"Ray Train could not start this trial's 2 workers (1 CPU each) in {tries} tries of 2 s "
        "(RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S): the cluster has room for them, but it was not free "
        "(The worker group startup timed out after 2.0 seconds waiting for 2 workers)"
    ), message
    assert "`ray status`" in message
    assert took < 2 * tries + 60, took  # the tries and Ray Train's start, not a wait without end


def tune_one_trial(params, context, tmp_path: Path) -> dict:
    """Run `run_distributed_trial` as the one trial of a Tuner (1 CPU); its UserError's message and how long it took."""
    from ray import tune

    def trial(config: dict) -> None:
        from pipelines.errors import UserError
        from pipelines.trials.distributed import run_distributed_trial

        start = time.perf_counter()
        try:
            run_distributed_trial(params, context, "default", "t0", "0" * 32, tmp_path / "checkpoints" / "t0")
            message = "trained"
        except UserError as err:
            message = str(err)
        tune.report({"message": message, "took": time.perf_counter() - start})

    tuner = tune.Tuner(
        tune.with_resources(trial, {"cpu": 1}),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "ray_results"), verbose=0),
    )
    [result] = list(tuner.fit())
    assert result.error is None, result.error
    return result.metrics
