"""The train stage's driver: run the trials under Ray Tune, track them, keep the best model."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipelines.errors import UserError
from pipelines.model_card import follow_move
from pipelines.params import (
    ChoiceDim,
    GridDim,
    LogUniformDim,
    Params,
    SearchDim,
    UniformDim,
    ray_address,
)
from pipelines.tasks import tune_objective
from pipelines.tracking.runs import (
    close_dangling_children,
    git_commit,
    log_params,
    open_store,
    params_hash,
    resolve_tracking_uri,
    start_run,
)
from pipelines.tracking.status import RUNS_VIEW_TAG, ended_run, log_best_on_parent, runs_view, stopped_tags
from pipelines.trial_context import FINAL_KEY, REPEAT_KEY, TrialContext
from pipelines.trials.card_share import CardShare, gpu_shares, refuse_gpus_ray_lacks, shared_resources
from pipelines.trials.ray_cluster import (
    SealedCredentials,
    init_ray,
    local_ray_gpus,
    seal_credentials,
    tune_console,
    tune_verbosity,
)
from pipelines.trials.unsent import BEST_DIR, keep_unsent_folders, save_summary

# Keys in a trial's result that are bookkeeping (ours or Ray's), not measurements.
_NON_METRIC_KEYS = {
    "mlflow_run_id",
    "variant",
    FINAL_KEY,
    "done",
    "timestamp",
    "time_this_iter_s",
    "time_total_s",
    "training_iteration",
    "pid",
    "time_since_restore",
    "iterations_since_restore",
    "epoch",
}


def run_trial(config: dict[str, Any], context: TrialContext, shares: dict[str, CardShare] | None = None,
              credentials: SealedCredentials | None = None) -> None:  # fmt: skip
    """Ray Tune's function trainable: `pipelines.trials.trial.run_trial`, imported in the trial's own process.

    Tune pickles this function by reference, so the driver never imports the engine and transformers' model code
    (seconds per train stage), which only the trials' processes run.
    """
    from pipelines.trials.trial import run_trial as train_one_configuration

    train_one_configuration(config, context, shares, credentials)


def _dimension(dim: SearchDim) -> Any:
    from ray import tune

    if isinstance(dim, GridDim):
        return tune.grid_search(dim.values)
    if isinstance(dim, ChoiceDim):
        return tune.choice(dim.values)
    if isinstance(dim, UniformDim):
        return tune.uniform(dim.low, dim.high)
    if isinstance(dim, LogUniformDim):
        return tune.loguniform(dim.low, dim.high)
    return tune.randint(dim.low, dim.high)


def trial_base_params(params: Params) -> Params:
    """The params every trial starts from: without the variants and search space, which the trial resolves.

    A trial checks its own configuration only; re-checking every other variant against its
    sampled values would fail trials whose siblings, not themselves, are incompatible.
    """
    return params.model_copy(update={"tune": params.tune.model_copy(update={"variants": {}, "search_space": {}})})


def repeat_seeds(params: Params) -> list[int]:
    """Seeds of a variant's repeats: with `tune.num_samples` > 1 and no search space, seed, seed+1, ...

    Repeats of one configuration differ only in their seed (initialisation, shuffling, dropout),
    so their spread is the noise the report sets differences against. Without repeats: [].
    """
    if params.tune.num_samples < 2 or params.tune.search_space:
        return []
    return [params.seed + i for i in range(params.tune.num_samples)]


def tuner_num_samples(params: Params) -> int:
    """Samples Ray draws per grid point: repeats are a grid axis of seeds instead (see repeat_seeds)."""
    return 1 if repeat_seeds(params) else params.tune.num_samples


def param_space(params: Params) -> dict[str, Any]:
    """Ray's search space: the variants as a grid axis, repeats' seeds as another, then every search dimension."""
    from ray import tune

    variant = tune.grid_search(list(params.tune.variants)) if params.tune.variants else "default"
    space: dict[str, Any] = {"variant": variant}
    seeds = repeat_seeds(params)
    if seeds:
        space["seed"] = tune.grid_search(seeds)
        space[REPEAT_KEY] = tune.sample_from(lambda spec: spec.config["seed"] - seeds[0])
    return {**space, **{key: _dimension(dim) for key, dim in params.tune.search_space.items()}}


def trial_resources(params: Params, cpus: int) -> dict[str, float]:
    """CPUs and GPUs per trial: as declared, else an even share of the cores and one GPU when it trains on CUDA.

    A distributed trial is only its workers' driver: it reserves one CPU, and each of its
    workers reserves `worker_threads` CPUs (and a GPU with distributed.use_gpu).
    """
    import torch

    if params.distributed.num_workers > 1:
        return {"cpu": 1, "gpu": 0}
    declared = params.tune.resources_per_trial
    cpu = declared.cpu or max(1, cpus // params.tune.max_concurrent_trials)
    trains_on_cuda = params.device != "cpu" and torch.cuda.is_available()  # device: cpu holds no GPU back
    # gpu: auto's shares are planned once Ray is up (pipelines.trials.card_share); without them, as null.
    gpu = declared.gpu if declared.gpu not in (None, "auto") else (1.0 if trains_on_cuda else 0.0)
    return {"cpu": cpu, "gpu": float(gpu)}


def worker_threads(params: Params, cpus: int) -> int:
    """torch threads (and Ray CPUs) per training process: per trial, or per worker of a distributed trial."""
    declared = params.tune.resources_per_trial.cpu
    processes = params.tune.max_concurrent_trials * params.distributed.num_workers
    return max(1, int(declared or cpus // processes))


def local_ray_cpus(params: Params, cpus: int) -> int:
    """Logical CPUs of a local Ray: the cores, plus one per concurrent distributed trial for its idle driver."""
    return cpus + (params.tune.max_concurrent_trials if params.distributed.num_workers > 1 else 0)


def _scheduler(params: Params) -> Any:
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if params.tune.scheduler == "fifo":
        return FIFOScheduler()
    # Trials report once per epoch, then once more after evaluating and saving; max_t is one past
    # the epochs so ASHA never stops a trial at its last epoch, before its model is saved.
    return ASHAScheduler(
        time_attr="training_iteration",
        max_t=params.epochs + 1,
        grace_period=params.tune.grace_period,
        reduction_factor=params.tune.reduction_factor,
    )


def run_tuning(
    params: Params, root: Path, tokenized_dir: Path, out_dir: Path, tokenize_stats: dict[str, float]
) -> dict[str, Any]:
    """Run every trial; write the best model to `out_dir/best` and a trials summary; return the summary."""
    objective = tune_objective(params)  # first: a tune.metric the task does not report fails before any run opens
    tracking_uri = resolve_tracking_uri(params.tracking.uri, root)
    client, experiment_id = open_store(params.tracking, root)
    client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, runs_view(params.task))  # the runs page's columns
    tags = {
        "git_commit": git_commit(root),
        "params_hash": params_hash(params),
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
        "stage": "train",
    }
    # Named after the DVC experiment when there is one, so the MLflow UI and `dvc exp show` name the same thing.
    parent_run_id = start_run(client, experiment_id, tags["dvc_exp_name"] or f"train-{tags['params_hash'][:8]}", tags)
    log_params(client, parent_run_id, params)

    cpus = os.cpu_count() or 1
    resources = trial_resources(params, cpus)
    staging = out_dir / "trials"
    context = TrialContext(
        params=trial_base_params(params).model_dump(mode="json"),
        root=str(root),
        variants=params.tune.variants,
        tokenized_dir=str(tokenized_dir.resolve()),
        staging_dir=str(staging.resolve()),
        checkpoint_root=str((root / "checkpoints").resolve()),
        tracking_uri=tracking_uri,
        experiment_id=experiment_id,
        parent_run_id=parent_run_id,
        threads=worker_threads(params, cpus),
        scheduler=params.tune.scheduler,
        tokenize_stats=tokenize_stats,
        progress_bars=sys.stdout.isatty(),
        experiment_name=tags["dvc_exp_name"],
    )
    # MLflow is the tracker, so Tune writes only the result files its ResultGrid reads back (JSON, CSV), not
    # TensorBoard event files, whose logger also printed a TensorBoard hint on every run.
    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"

    def close(status: str) -> None:
        close_dangling_children(client, experiment_id, parent_run_id)
        client.set_terminated(parent_run_id, status=status)

    with ended_run(close):
        init_ray(local_ray_cpus(params, cpus), ray_address(params), local_ray_gpus(params))
        refuse_gpus_ray_lacks(params, resources["gpu"], ray_address(params))  # else Tune would wait for them forever
        shares = gpu_shares(params, root, tokenized_dir)  # gpu: auto on a cluster with GPUs: trials packed by plan
        if shares is not None:
            context = replace(context, card_sharing={variant: share.sharing for variant, share in shares.items()})
        placed = resources if shares is None else shared_resources(resources["cpu"], shares)
        tuner = build_tuner(params, context, placed, objective, root, shares)
        with tune_console(tune_verbosity(params)):
            results = tuner.fit()
        summary = _summarize(results, params, parent_run_id, experiment_id, tracking_uri)
        for trial in summary["stopped_early"]:
            # A stopped trial records its stop itself, unless Ray ended its process first (seen on a loaded host).
            for key, value in stopped_tags(params.tune.scheduler).items():
                client.set_tag(trial["mlflow_run_id"], key, value)
        best = summary["best"]
        shutil.move(str(staging / best["trial_id"]), str(out_dir / BEST_DIR))
        follow_move(out_dir / BEST_DIR)
        keep_unsent_folders(client, summary, staging, out_dir)  # the models the bucket refused stay on disk
        shutil.rmtree(staging, ignore_errors=True)
        client.set_tag(parent_run_id, "best_run_id", best["mlflow_run_id"])
        log_best_on_parent(client, parent_run_id, params.task, best["metrics"])
        summary["registered_model"] = register_best_model(client, params, best["mlflow_run_id"], tracking_uri)
        if summary["registered_model"]:
            client.set_tag(parent_run_id, "registered_model", summary["registered_model"]["uri"])
        save_summary(client, summary, out_dir, params.tracking.upload_retry_s)
        return summary


def build_tuner(
    params: Params, context: TrialContext, resources: dict[str, float] | Any, objective: tuple[str, str], root: Path,
    shares: dict[str, CardShare] | None = None,
) -> Any:  # fmt: skip
    """The Tuner of every trial: seeded sampling, its scheduler, a fresh process per trial, Tune's result files; each
    trial gets its variant's card share (`gpu: auto`), which it enforces, and the tracking credentials by reference."""
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback
    from ray.tune.search import BasicVariantGenerator

    trainable = tune.with_parameters(run_trial, context=context, shares=shares, credentials=seal_credentials())
    tuner = tune.Tuner(
        tune.with_resources(trainable, resources),
        param_space=param_space(params),
        tune_config=tune.TuneConfig(
            metric=objective[0],
            mode=objective[1],
            num_samples=tuner_num_samples(params),
            scheduler=_scheduler(params),
            # Seeded sampling: the same params draw the same trial configurations. The concurrency
            # limit goes to the generator itself: Tune ignores max_concurrent_trials (and warns) when
            # search_alg is a SearchGenerator such as this one.
            search_alg=BasicVariantGenerator(
                random_state=params.seed, max_concurrent=params.tune.max_concurrent_trials
            ),
            time_budget_s=params.tune.time_budget_s,
            # A fresh process per trial: a trial's peak RSS and allocator state are its own.
            reuse_actors=False,
        ),
        run_config=tune.RunConfig(
            name=f"train-{context.parent_run_id[:8]}",
            storage_path=str((root / "ray_results").resolve()),
            callbacks=[JsonLoggerCallback(), CSVLoggerCallback()],
            verbose=tune_verbosity(params),
        ),
    )
    return tuner


def register_best_model(client: Any, params: Params, run_id: str, tracking_uri: str) -> dict[str, str] | None:
    """Register the best trial's logged model as a new version (`tracking.registered_model`); None when off."""
    from pipelines.tracking.mlflow_model import MODEL_URI_TAG, register_best

    name = params.tracking.registered_model_name(params.task)
    model_uri = client.get_run(run_id).data.tags.get(MODEL_URI_TAG)
    if name is None or model_uri is None:
        return None
    version = register_best(tracking_uri, model_uri, name, params.task)
    return {"name": name, "version": version, "uri": f"models:/{name}/{version}", "source": model_uri}


def _last_line(error: BaseException) -> str:
    # Ray wraps the trial's exception; its last line is the user-facing message.
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def _summarize(
    results: Any, params: Params, parent_run_id: str, experiment_id: str, tracking_uri: str
) -> dict[str, Any]:
    metric, mode = tune_objective(params)
    trials, failures, stopped = [], [], []
    for result in results:
        last = result.metrics or {}
        if result.error is not None:
            failures.append(
                {"trial": last.get("trial_id", "?"), "config": result.config, "error": _last_line(result.error)}
            )
            continue
        if not last.get(FINAL_KEY):
            # Stopped by the scheduler (ASHA) after its last report: not a failure, not a candidate.
            stopped.append({"trial": last.get("trial_id", "?"), "config": result.config, metric: last.get(metric),
                            "mlflow_run_id": last["mlflow_run_id"]})  # fmt: skip
            continue
        m = result.metrics
        trials.append(
            {
                "trial_id": m["trial_id"],
                "variant": m["variant"],
                "config": result.config,
                "mlflow_run_id": m["mlflow_run_id"],
                "metrics": {k: v for k, v in m.items() if isinstance(v, float | int) and k not in _NON_METRIC_KEYS},
            }
        )
    if not trials:
        details = "; ".join(f"{f['config']}: {f['error']}" for f in failures)
        raise UserError(f"every trial failed: {details}")
    if metric not in trials[0]["metrics"]:
        raise UserError(
            f"tune.metric = {metric!r} is not reported by trials; choose one of {sorted(trials[0]['metrics'])}"
        )
    pick = max if mode == "max" else min
    best = pick(trials, key=lambda t: t["metrics"][metric])
    return {
        "parent_run_id": parent_run_id,
        "experiment_id": experiment_id,
        "tracking_uri": tracking_uri,
        "metric": metric,
        "mode": mode,
        "best": best,
        "trials": trials,
        "failed": failures,
        "stopped_early": stopped,
    }


def tokenize_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """Flatten the tokenize stage's stats to `tokenize.<split>.<name>` metrics for each trial's run."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        if isinstance(value, dict):
            flat.update({f"tokenize.{key}.{k}": float(v) for k, v in value.items()})
        else:
            flat[f"tokenize.{key}"] = float(value)
    return flat


def best_trial_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The DVC metrics of a train run: the best trial's name, its sampled/variant settings and its metrics."""
    best = summary["best"]
    config = {f"best.{k}": v for k, v in best["config"].items()}
    counts = {f"trials.{name}": len(summary[key]) for name, key in
              (("finished", "trials"), ("failed", "failed"), ("stopped_early", "stopped_early"))}  # fmt: skip
    return {
        "variant": best["variant"],
        "mlflow_run_id": best["mlflow_run_id"],
        **config,
        **counts,
        **headline_metrics(best["metrics"]),
    }


# What the train stage keeps of its best trial in metrics/train.json (a plain output: `dvc exp show` opens on
# metrics/evaluate.json alone); the rest is in MLflow.
HEADLINE = ("train_time_s", "samples_per_s", "tokens_per_s", "final_train_loss", "optimizer_steps", "mfu")
NOT_HEADLINE = ("test_rows",)


def headline_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The task's validation and test figures (no per-class ones, no intervals), speed, and memory in MiB."""
    quality = {
        k: v
        for k, v in metrics.items()
        if k.startswith(("val_", "test_"))
        and "." not in k
        and "_ci_" not in k
        and not k.endswith("_s")
        and k not in NOT_HEADLINE
    }
    out = {**quality, **{k: metrics[k] for k in HEADLINE if k in metrics}}
    if "peak_train_memory_bytes" in metrics:
        out["peak_train_memory_mib"] = round(metrics["peak_train_memory_bytes"] / 2**20, 1)
    return out
