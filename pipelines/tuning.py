"""The train stage's driver: run the trials under Ray Tune, track them, keep the best model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.tracking import (
    close_dangling_children,
    git_commit,
    log_params,
    open_experiment,
    params_hash,
    resolve_tracking_uri,
    start_run,
)
from pipelines.trial import FINAL_KEY, TrialContext, run_trial

BEST_DIR = "best"
TRIALS_FILE = "trials.json"
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


def init_ray(num_cpus: int) -> None:
    """Join the cluster named by RAY_ADDRESS, or start a local one sized to this machine, dashboard off."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, configure_logging=False)


def _param_space(params: Params) -> dict[str, Any]:
    from ray import tune

    if params.tune.variants:
        return {"variant": tune.grid_search(list(params.tune.variants))}
    return {"variant": "default"}


def run_tuning(
    params: Params, root: Path, tokenized_dir: Path, out_dir: Path, tokenize_stats: dict[str, float]
) -> dict[str, Any]:
    """Run every trial; write the best model to `out_dir/best` and a trials summary; return the summary."""
    from ray import tune

    tracking_uri = resolve_tracking_uri(params.tracking.uri, root)
    client, experiment_id = open_experiment(params.tracking, root)
    tags = {
        "git_commit": git_commit(root),
        "params_hash": params_hash(params),
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
        "stage": "train",
    }
    parent_run_id = start_run(client, experiment_id, f"train-{tags['params_hash'][:8]}", tags)
    log_params(client, parent_run_id, params)

    cpus = os.cpu_count() or 1
    threads = max(1, cpus // params.tune.max_concurrent_trials)
    staging = out_dir / "trials"
    context = TrialContext(
        params=params.model_dump(mode="json"),
        root=str(root),
        variants=params.tune.variants,
        tokenized_dir=str(tokenized_dir.resolve()),
        staging_dir=str(staging.resolve()),
        checkpoint_root=str((root / "checkpoints" / params.tracking.experiment).resolve()),
        tracking_uri=tracking_uri,
        experiment_id=experiment_id,
        parent_run_id=parent_run_id,
        threads=threads,
        tokenize_stats=tokenize_stats,
    )
    status = "FAILED"
    try:
        init_ray(cpus)
        tuner = tune.Tuner(
            tune.with_resources(tune.with_parameters(run_trial, context=context), {"cpu": threads}),
            param_space=_param_space(params),
            tune_config=tune.TuneConfig(
                num_samples=params.tune.num_samples,
                max_concurrent_trials=params.tune.max_concurrent_trials,
            ),
            run_config=tune.RunConfig(
                name=f"train-{parent_run_id[:8]}",
                storage_path=str((root / "ray_results").resolve()),
                verbose=1,
            ),
        )
        results = tuner.fit()
        summary = _summarize(results, params, parent_run_id, experiment_id, tracking_uri)
        best = summary["best"]
        shutil.move(str(staging / best["trial_id"]), str(out_dir / BEST_DIR))
        shutil.rmtree(staging, ignore_errors=True)
        (out_dir / TRIALS_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        client.log_artifact(parent_run_id, str(out_dir / TRIALS_FILE))
        status = "FINISHED"
        return summary
    finally:
        close_dangling_children(client, experiment_id, parent_run_id)
        client.set_terminated(parent_run_id, status=status)


def _summarize(
    results: Any, params: Params, parent_run_id: str, experiment_id: str, tracking_uri: str
) -> dict[str, Any]:
    metric, mode = params.tune.metric, params.tune.mode
    trials, failures = [], []
    for result in results:
        if result.error is not None or not (result.metrics or {}).get(FINAL_KEY):
            failures.append(
                {
                    "trial": (result.metrics or {}).get("trial_id", "?"),
                    "config": result.config,
                    "error": str(result.error).splitlines()[-1:],
                }
            )
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
        details = "; ".join(f"{f['config']}: {' '.join(f['error'])}" for f in failures)
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
