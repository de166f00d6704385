"""The train stage's driver: run the trials under Ray Tune, track them, keep the best model.

`run_tuning` reads as the stage's steps, top to bottom: open the parent run (`parent_run.py`), describe the trials
(`trial_context`), start Ray and place them, refusing what no node can hold (`place_trials`: `resources.py`,
`card_share.py`, `placement.py`), run the Tuner (`tuner.py`; Ctrl-C: `interruption.py`), summarise (`summary.py`),
keep the best model's folder and the unsent ones (`keep_model_folders`, `unsent.py`), record the best trial on the
parent run, let the stage put its outputs in place (`publish`), and only then register the best model.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pipelines.model_card import follow_move
from pipelines.params import Params, ray_address
from pipelines.tasks import tune_objective
from pipelines.tracking.status import ended_run
from pipelines.trial_context import TrialContext
from pipelines.trials.card_share import CardShare, gpu_shares, refuse_gpus_ray_lacks, shared_resources
from pipelines.trials.interruption import stopped_on_ctrl_c
from pipelines.trials.parent_run import (
    ParentRun,
    open_parent_run,
    record_best,
    register_best,
    register_best_model,
    tag_stopped_trials,
)
from pipelines.trials.placement import refuse_unplaceable
from pipelines.trials.ray_cluster import (
    init_ray,
    local_ray_gpus,
    state_api_answers,
    stop_ray,
    tune_console,
    tune_verbosity,
)
from pipelines.trials.resources import local_ray_cpus, trial_resources, worker_threads
from pipelines.trials.summary import best_trial_metrics, summarize, tokenize_metrics
from pipelines.trials.tuner import build_tuner, one_trial, trial_base_params
from pipelines.trials.unsent import BEST_DIR, keep_unsent_folders, save_summary

# What the train stage and the benchmarks import from the driver.
__all__ = [
    "BEST_DIR",
    "best_trial_metrics",
    "local_ray_cpus",
    "register_best_model",
    "run_tuning",
    "tokenize_metrics",
    "trial_resources",
    "worker_threads",
]

STAGING_DIR = "trials"  # under the stage's output folder: every trial's model, until the best is kept


def run_tuning(
    params: Params, root: Path, tokenized_dir: Path, out_dir: Path, tokenize_stats: dict[str, float],
    publish: Callable[[dict[str, Any]], None] = lambda summary: None,
) -> dict[str, Any]:  # fmt: skip
    """Run every trial; write the best model to `out_dir/best` and a trials summary; `publish(summary)` (the stage
    puts its outputs in place), then register the best model; return the summary. The parent run is FINISHED only
    after all of it: a stage that fails at its end leaves it FAILED, and no model registered."""
    objective = tune_objective(params)  # first: a tune.metric the task does not report fails before any run opens
    parent = open_parent_run(params, root)
    cpus = os.cpu_count() or 1
    context = trial_context(params, root, tokenized_dir, out_dir, tokenize_stats, parent, cpus)
    # MLflow is the tracker, so Tune writes only the result files its ResultGrid reads back (JSON, CSV), not
    # TensorBoard event files, whose logger also printed a TensorBoard hint on every run.
    os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    with ended_run(parent.close):
        placed = place_trials(params, root, tokenized_dir, context, cpus)
        tuner = build_tuner(params, placed.context, placed.resources, objective, root, placed.shares)
        with tune_console(tune_verbosity(params)), stopped_on_ctrl_c(Path(context.checkpoint_root)):
            results = tuner.fit()
        summary = summarize(results, params, parent.run_id, parent.experiment_id, parent.tracking_uri)
        stop_ray()  # the rest is files and MLflow; Ray stopped here, not by its exit hook (which waits 0.5 s first)
        tag_stopped_trials(parent, params, summary)
        keep_model_folders(parent.client, summary, out_dir)
        record_best(parent, params, summary)
        save_summary(parent.client, summary, out_dir, params.tracking.upload_retry_s)
        publish(summary)
        register_best(parent, params, summary)
        return summary


def trial_context(
    params: Params, root: Path, tokenized_dir: Path, out_dir: Path, tokenize_stats: dict[str, float],
    parent: ParentRun, cpus: int,
) -> TrialContext:  # fmt: skip
    """What every trial is handed besides its hyperparameters: absolute paths, the run tree, its threads."""
    return TrialContext(
        params=trial_base_params(params).model_dump(mode="json"),
        root=str(root),
        variants=params.tune.variants,
        tokenized_dir=str(tokenized_dir.resolve()),
        staging_dir=str((out_dir / STAGING_DIR).resolve()),
        checkpoint_root=str((root / "checkpoints").resolve()),
        tracking_uri=parent.tracking_uri,
        experiment_id=parent.experiment_id,
        parent_run_id=parent.run_id,
        threads=worker_threads(params, cpus),
        scheduler=params.tune.scheduler,
        tokenize_stats=tokenize_stats,
        progress_bars=sys.stdout.isatty(),
        experiment_name=parent.experiment_name,
        changed=parent.changed,
        score_test=one_trial(params),
    )


@dataclass(frozen=True)
class Placement:
    """How the trials go on Ray: their context (with each variant's card sharing), what each reserves (a dict, or a
    function of its config under `gpu: auto`) and each variant's card share (None without `gpu: auto`)."""

    context: TrialContext
    resources: dict[str, float] | Any
    shares: dict[str, CardShare] | None


def place_trials(params: Params, root: Path, tokenized_dir: Path, context: TrialContext, cpus: int) -> Placement:
    """Start (or join) Ray, refuse trials it cannot place, and size each trial's reservation (`gpu: auto`: by plan)."""
    resources = trial_resources(params, cpus)
    init_ray(local_ray_cpus(params, cpus), ray_address(params), local_ray_gpus(params))
    # Our local cluster has no dashboard; a cluster joined by address may have one (`ray start`'s default).
    context = replace(context, state_api=ray_address(params) is not None and state_api_answers())
    refuse_gpus_ray_lacks(params, resources["gpu"], ray_address(params))  # else Tune would wait for them forever
    shares = gpu_shares(params, root, tokenized_dir)  # gpu: auto on a cluster with GPUs: trials packed by plan
    gpu = resources["gpu"] if shares is None else max(share.gpu for share in shares.values())
    # CPUs, and GPUs per node, and a distributed trial's workers each on some node: else Ray waits for them forever
    refuse_unplaceable(params, resources["cpu"], gpu, context.threads, ray_address(params))
    if shares is None:
        return Placement(context, resources, None)
    sharing = {variant: share.sharing for variant, share in shares.items()}
    return Placement(replace(context, card_sharing=sharing), shared_resources(resources["cpu"], shares), shares)


def keep_model_folders(client: Any, summary: dict[str, Any], out_dir: Path) -> None:
    """Move the best trial's folder to `out_dir/best`, keep the folders of models the bucket refused, drop the rest."""
    staging = out_dir / STAGING_DIR
    shutil.move(str(staging / summary["best"]["trial_id"]), str(out_dir / BEST_DIR))
    follow_move(out_dir / BEST_DIR)
    keep_unsent_folders(client, summary, staging, out_dir)  # the models the bucket refused stay on disk
    shutil.rmtree(staging, ignore_errors=True)
