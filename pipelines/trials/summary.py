"""What the trials came to: Tune's results summarised (the best trial, the failed, the stopped early) and the train
stage's DVC metrics taken from them."""

from __future__ import annotations

from typing import Any

from pipelines.errors import UserError
from pipelines.gpu_profiles import mib
from pipelines.params import Params
from pipelines.tasks import tune_objective
from pipelines.trial_context import FINAL_KEY

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


def _last_line(error: BaseException) -> str:
    # Ray wraps the trial's exception; its last line is the user-facing message.
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def summarize(
    results: Any, params: Params, parent_run_id: str, experiment_id: str, tracking_uri: str
) -> dict[str, Any]:
    """Tune's results as the train stage's summary: the best trial, every finished one, the failed (with the last
    line of their error) and those the scheduler stopped early. Refused when no trial finished."""
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
            # Stopped by the scheduler (ASHA) after its last report: not a failure, not a candidate. Without a report
            # (stopped by tune.time_budget_s before its first), it has no run id to tag.
            stopped.append({"trial": last.get("trial_id", "?"), "config": result.config, metric: last.get(metric),
                            "mlflow_run_id": last.get("mlflow_run_id")})  # fmt: skip
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
NOT_HEADLINE = ("test_rows", "val_rows")


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
        out["peak_train_memory_mib"] = mib(metrics["peak_train_memory_bytes"])
    return out
