"""Data-parallel trials: each Ray Tune trial drives a Ray Train `TorchTrainer` of N DDP workers.

Ray Train V2's pattern (docs: "Hyperparameter Tuning with Ray Tune"): the Tune trial is only
the driver. It opens the trial's one MLflow run, starts the workers and waits; Ray Train sets
up the process group (gloo on CPU, NCCL on GPUs), and each worker runs the same engine, which
sees the process group, wraps the model in DDP and trains on its rank's shard of every global
batch. Rank 0 alone logs to that MLflow run, writes checkpoints, evaluates and saves the
model; the metrics it reports are the global ones (the engine reduces them across ranks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.recipe import FINAL_KEY, METRICS_FILE, NullLogger, Trial, TrialContext, train_and_save
from pipelines.trials.resources import worker_gpus, workers_use_gpu


def _epoch_reports_to_tune() -> Any:
    """Ray's TuneReportCallback, except for the workers' final report, which the driver sends itself.

    The driver reports the final metrics only after closing the MLflow run, as a
    single-process trial does, so a scheduler that stops the trial on that report cannot
    leave the run open.
    """
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReportsToTune(TuneReportCallback):
        def after_report(self, run_context: Any, metrics: list[dict[str, Any]], checkpoint: Any) -> None:
            if not metrics[0].get(FINAL_KEY):
                super().after_report(run_context, metrics, checkpoint)

    return EpochReportsToTune()


# Ray Train counts a worker group that did not start (its placement group not ready within
# RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S, 60 s by default) as a controller failure, which it retries without limit by
# default (FailureConfig.controller_failure_limit = -1): a cluster that never frees the room retried forever, logging
# each try. Two retries cover a node that was a moment late; then the trial fails, saying why.
WORKER_GROUP_START_RETRIES = 2
START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train's own variable; the driver's reaches us
TRAIN_LOG_LEVEL = "WARNING"


def start_failed_message(params: Params, threads: int, gpus: float, reason: str) -> str:
    """Why Ray Train gave up starting this trial's workers (of `threads` CPUs and `gpus` GPUs each), and what to do."""
    timeout = float(os.environ.get(START_TIMEOUT_VAR, "60"))
    workers = params.distributed.num_workers
    each = f"{threads} CPU{'s' if threads != 1 else ''}{f' and {gpus:g} GPU' if gpus else ''} each"
    return (
        f"Ray Train could not start this trial's {workers} workers ({each}) in {WORKER_GROUP_START_RETRIES + 1} tries "
        f"of {timeout:g} s ({START_TIMEOUT_VAR}): the cluster has room for them, but it was not free ({reason}); "
        f"free what other work holds on the cluster (`ray status` shows it), or set {START_TIMEOUT_VAR} higher where "
        "nodes take longer to join or free up"
    )


def worker_group(params: Params, threads: int) -> tuple[Any, Any]:
    """Ray Train's ScalingConfig and TorchConfig for the trial's workers: `threads` CPUs and `worker_gpus` GPUs each
    (one bundle each in Ray Train's placement group, PACK: as many on one node as fit).

    Ray takes GPUs per worker only with use_gpu, and then picks NCCL: workers that hold a GPU but train on the CPU
    (tune.resources_per_trial.gpu declared with device: cpu) talk over gloo.
    """
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig

    gpus = worker_gpus(params)
    scaling = ScalingConfig(num_workers=params.distributed.num_workers, use_gpu=gpus > 0,
                            resources_per_worker={"CPU": threads, **({"GPU": gpus} if gpus else {})})  # fmt: skip
    return scaling, TorchConfig(backend=None if workers_use_gpu(params) else "gloo")


def run_distributed_trial(
    params: Params, context: TrialContext, variant: str, trial_id: str, run_id: str, checkpoint_dir: Path
) -> dict[str, float]:
    """Driver side: train on `distributed.num_workers` Ray Train workers; return rank 0's final metrics.

    Rank 0 saves the model beside the driver's staging folder, so the repository's folder must be
    the same shared path on every node (see docs/how-to/ray-cluster.md).
    """
    from ray.train import ControllerError, FailureConfig, LoggingConfig, RunConfig
    from ray.train.v2._internal.exceptions import WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError

    from pipelines.trials.ray_cluster import seal_credentials

    use_gpu = workers_use_gpu(params)  # trains on CUDA; the GPUs reserved are `worker_gpus`, declared ones too
    scaling, torch_config = worker_group(params, context.threads)
    trainer = torch_trainer(context.state_api)(
        train_worker,
        train_loop_config={
            "params": params.model_dump(mode="json"),
            "context": context,
            "variant": variant,
            "trial_id": trial_id,
            "run_id": run_id,
            "use_gpu": use_gpu,
            "checkpoint_dir": str(checkpoint_dir),
            # Ray Train shows this config on its dashboard: the credentials only as an object-store reference, put
            # from this trial's environment, where the driver's were set (pipelines.trials.ray_cluster).
            "credentials": seal_credentials(),
        },
        scaling_config=scaling,
        torch_config=torch_config,
        run_config=RunConfig(
            name=f"{variant}-{trial_id}",
            storage_path=str(Path(context.root) / "ray_results"),
            callbacks=[_epoch_reports_to_tune()],
            failure_config=FailureConfig(controller_failure_limit=WORKER_GROUP_START_RETRIES),
            # Ray Train's own INFO lines (resources requested, the worker group started, each rank's process group,
            # every report) were most of a distributed trial's output: warnings and errors stay on the console, and
            # Ray's session folder keeps every level (its ray-train-sys-*.log files).
            logging_config=LoggingConfig(log_level=TRAIN_LOG_LEVEL),
        ),
    )
    try:
        trainer.fit()
    except ControllerError as err:
        failure = err.controller_failure
        if not isinstance(failure, WorkerGroupStartupTimeoutError | WorkerGroupStartupFailedError):
            raise
        reason = str(failure).split(". ", 1)[0]  # Ray's first sentence; the rest is its generic advice
        raise UserError(start_failed_message(params, context.threads, worker_gpus(params), reason)) from err
    # Rank 0 saved the model and its final metrics to the trial's staging folder (shared storage).
    return json.loads((Path(context.staging_dir) / trial_id / METRICS_FILE).read_text())


def torch_trainer(state_api: bool) -> type:
    """Ray Train's TorchTrainer; without the cluster's State API (no dashboard, as our local cluster), less its
    placement group cleaner.

    The cleaner is an actor that asks the State API every second whether the trial's controller still lives, to
    remove its placement group if it died. Without a dashboard every ask fails: a warning each second of training
    ("Failed to query Ray Train Controller actor state", 46 in one cluster run), a traceback when the controller
    stops it, and 12 s of the trial's wall time waiting for that stop. A local cluster goes with its train stage,
    placement groups and all, so nothing is lost without it.
    """
    from ray.train.torch import TorchTrainer

    if state_api:
        return TorchTrainer
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

    class TrainerWithoutCleaner(TorchTrainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if not isinstance(c, PlacementGroupCleanerCallback)]

    return TrainerWithoutCleaner


def quiet_train_reports() -> None:
    """Ray Train logs each `ray.train.report` of every rank at INFO ("Reporting training result 1: TrainingReport(...)")
    through a logger named after its file, which its LoggingConfig's level does not reach: warnings only."""
    import logging

    import ray.train.v2._internal.execution.context as train_context

    logging.getLogger(train_context.__file__).setLevel(logging.WARNING)


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker (one DDP rank) of a distributed trial."""
    import ray.train
    import ray.train.torch

    from pipelines.tracking.mlflow_model import model_logger
    from pipelines.tracking.runs import RunLogger, leave_retries_to_run_logger
    from pipelines.tracking.status import open_client
    from pipelines.trials.ray_cluster import progress_bar, use_tracking_credentials

    use_tracking_credentials(config["credentials"])  # before rank 0's first MLflow call
    quiet_train_reports()
    leave_retries_to_run_logger()
    context: TrialContext = config["context"]
    params = Params.model_validate(config["params"])
    rank = ray.train.get_context().get_world_rank()
    device = ray.train.torch.get_device() if config["use_gpu"] else torch.device("cpu")
    logger: RunLogger | NullLogger = NullLogger()
    log_model = None
    if rank == 0:
        client = open_client(context.tracking_uri)
        logger = RunLogger(client, config["run_id"], fallback_dir=context.fallback_dir)
        log_model = model_logger(logger, context.experiment_id, config["run_id"], config["trial_id"])
    record_placement(logger, rank, params)
    trial = Trial(
        context, config["variant"], config["trial_id"], config["run_id"], logger, ray.train.report,
        Path(config["checkpoint_dir"]), rank, log_model, progress_bar(context.progress_bars and rank == 0),
    )  # fmt: skip
    try:
        train_and_save(trial, params, device=device)
    finally:
        if isinstance(logger, RunLogger):
            logger.close(status=None)  # the driver ends the run
    # Every rank reports as often as the others (Ray Train's report is a barrier). The driver
    # reads the final metrics from the staging folder and reports them to Tune itself.
    ray.train.report({FINAL_KEY: 1})


def worker_placement(rank: int) -> dict[str, Any]:
    """Where Ray put this worker, as Ray's runtime context records it (not what the trial asked for): its node, and
    the ids of the GPUs Ray assigned it (its CUDA_VISIBLE_DEVICES on a GPU node)."""
    import ray

    context = ray.get_runtime_context()
    return {"rank": rank, "node": context.get_node_id(),
            "gpus": [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]}  # fmt: skip


def placement_tags(placements: list[dict[str, Any]], strategy: str) -> tuple[dict[str, str], dict[str, float]]:
    """The trial's run's record of its workers: the strategy, every rank's node and GPU ids (`distributed.placement`,
    JSON, by rank) and the number of nodes, as tags, and the number of nodes as a metric (beside the engine's
    world_size) for the runs table."""
    nodes = len({placement["node"] for placement in placements})
    tags = {"distributed.strategy.resolved": strategy, "distributed.nodes": str(nodes),
            "distributed.placement": json.dumps(sorted(placements, key=lambda p: p["rank"]))}  # fmt: skip
    return tags, {"num_nodes": float(nodes)}


def record_placement(logger: Any, rank: int, params: Params) -> None:
    """Every rank's placement, gathered over the trial's process group (Ray Train set it up) and logged by rank 0."""
    import torch.distributed as dist

    placements: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(placements, worker_placement(rank))
    if rank == 0:
        tags, metrics = placement_tags(placements, params.distributed.strategy)
        logger.log_tags(tags)
        logger.log_dict(metrics)
