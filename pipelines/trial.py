"""One Ray Tune trial: validated params + the trial's overrides → a trained, tracked, saved model.

Shaped like accelerate's `train(config, args)`: `config` is what Tune varies (the
variant name and any sampled overrides), `TrialContext` is the infrastructure (absolute
paths, the MLflow run tree), which never enters the search space.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from ray import tune
from transformers import AutoTokenizer

from pipelines.adapters import BASE_DIR, apply_adapter, save_base_reference, save_trained
from pipelines.data.batching import padded_length
from pipelines.data.tokenization import LABELS_FILE, TOKENIZER_DIR, TokenizedSplit
from pipelines.errors import UserError
from pipelines.lineage import log_datasets
from pipelines.mlflow_model import MODEL_URI_TAG, input_examples, log_trial_model
from pipelines.model import set_attention
from pipelines.params import Params, apply_overrides
from pipelines.preflight import plan_before_training, plan_or_none, trial_planner
from pipelines.progress import TrialProgress
from pipelines.tasks import get_task
from pipelines.tracking import (
    RunLogger,
    environment_tags,
    leave_retries_to_run_logger,
    log_params,
    quiet_mlflow_info,
    start_run,
)
from pipelines.train.batch_size import resolve_batch_size
from pipelines.train.checkpoint import claim_checkpoint_dir, discard
from pipelines.train.device import resolve_device, resolve_pad_multiple, resolve_precision, resolve_tf32
from pipelines.train.engine import train_model
from pipelines.train.flops import flops_metrics
from pipelines.train.lr_range import LrRangeResult, resolve_lr
from pipelines.train.memory import reset_peak_rss

PARAMS_FILE = "params.json"
METRICS_FILE = "metrics.json"  # the trial's final metrics, beside its saved model
# Marks a trial's last result. Not "done": that key is Ray Tune's own and stops the trial.
FINAL_KEY = "final"


@dataclass(frozen=True)
class TrialContext:
    """Everything a trial needs that is not a hyperparameter; all paths absolute."""

    params: dict[str, Any]
    root: str
    variants: dict[str, dict[str, Any]]
    tokenized_dir: str
    staging_dir: str
    checkpoint_root: str
    tracking_uri: str
    experiment_id: str
    parent_run_id: str
    threads: int
    scheduler: str
    tokenize_stats: dict[str, float]
    progress_bars: bool = False  # the driver's stdout is a terminal: draw a bar per trial

    @property
    def fallback_dir(self) -> Path:
        """Where a run's metrics go when the tracking store stays unreachable (see RunLogger)."""
        return Path(self.root) / "mlflow-fallback"


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def trial_overrides(config: dict[str, Any], variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The variant's overrides, then any sampled keys (dotted) from the search space (and a repeat's seed)."""
    overrides = dict(variants.get(config.get("variant", ""), {}))
    overrides.update({k: v for k, v in config.items() if k not in ("variant", REPEAT_KEY)})
    return overrides


# The run tag holding the variant's position in tune.variants.
VARIANT_ORDER_TAG = "variant_order"

# The config key of a repeat's index (tune.num_samples > 1 without a search space); its seed is under "seed".
REPEAT_KEY = "repeat"


def run_trial(config: dict[str, Any], context: TrialContext) -> None:
    """Ray Tune function trainable: train one configuration and report its metrics."""
    from mlflow.tracking import MlflowClient

    leave_retries_to_run_logger()
    quiet_mlflow_info()
    trial_start = time.perf_counter()
    # Ray starts a fresh process per trial (reuse_actors=False); the reset makes sure of it for RSS.
    rss_reset = reset_peak_rss()
    variant = config.get("variant", "default")
    trial_id = tune.get_context().get_trial_id()
    client = MlflowClient(tracking_uri=context.tracking_uri)
    run_id = start_run(
        client,
        context.experiment_id,
        f"{variant}-{trial_id}",
        {
            "variant": variant,
            # Trials finish (and start) in any order when they run concurrently; the report orders
            # variants as tune.variants declares them.
            VARIANT_ORDER_TAG: str(list(context.variants).index(variant) if variant in context.variants else 0),
            "trial_id": trial_id,
            **({REPEAT_KEY: str(config[REPEAT_KEY])} if REPEAT_KEY in config else {}),
        },
        context.parent_run_id,
    )
    logger = RunLogger(client, run_id, fallback_dir=context.fallback_dir)
    system_metrics = SystemMetricsMonitor(run_id, sampling_interval=5, tracking_uri=context.tracking_uri)
    system_metrics.start()
    status = "FAILED"
    try:
        overrides = trial_overrides(config, context.variants)
        params = apply_overrides(Params.model_validate(context.params), overrides, source=f"variant {variant!r}")
        log_params(client, run_id, params)
        logger.log_tags(
            {
                **environment_tags(),
                "overrides": json.dumps(overrides, sort_keys=True),
                "peak_rss": "reset at trial start" if rss_reset else "process lifetime (no /proc/self/clear_refs)",
            }
        )
        client.log_text(run_id, json.dumps(params.model_dump(mode="json"), indent=2), PARAMS_FILE)
        log_datasets(client, run_id, params.data, Path(context.root), Path(context.tokenized_dir))
        logger.log_dict(context.tokenize_stats)
        with claim_checkpoint_dir(Path(context.checkpoint_root), params) as checkpoint_dir:
            if params.distributed.num_workers > 1:
                from pipelines.distributed import run_distributed_trial

                metrics = run_distributed_trial(params, context, variant, trial_id, run_id, checkpoint_dir)
            else:
                metrics = train_and_save(
                    params, context, variant, trial_id, run_id, logger, tune.report, checkpoint_dir
                )
        metrics["wall_time_s"] = time.perf_counter() - trial_start
        logger.log_dict(metrics, step=int(metrics["optimizer_steps"]))
        status = "FINISHED"
    except Exception as err:
        # Record why in the run itself, so the MLflow UI shows the failure next to its params.
        message = str(err) if isinstance(err, UserError) else traceback.format_exc(limit=5)
        logger.log_tags({"error": message[:5000]})
        raise
    except BaseException:
        # Ray ends a trial's thread with SystemExit when the scheduler (ASHA) stops it early.
        status = "KILLED"
        logger.log_tags({"stopped": f"stopped early by the {context.scheduler} scheduler"})
        raise
    finally:
        try:
            system_metrics.finish()
        except Exception as err:  # noqa: BLE001 - system metrics are best effort; the run's own metrics are not
            print(f"system metrics could not be flushed: {err}")
        logger.close(status)
    # Reported after the run is closed: Tune may end this thread (SystemExit) once it has the last result.
    tune.report({**metrics, "mlflow_run_id": run_id, "variant": variant, FINAL_KEY: 1})


def log_lr_range(logger: RunLogger, sweep: LrRangeResult) -> None:
    """The range test's curve: as metrics by sweep step (the MLflow UI plots them) and as `lr_range.json`."""
    for step, (lr, loss) in enumerate(zip(sweep.lrs, sweep.smoothed, strict=True)):
        if not math.isfinite(loss):  # the step that diverged
            continue
        logger.log_dict({"lr_range_lr": lr, "lr_range_loss": loss}, step=step)
    logger.log_tags({"lr_range_test": f"{sweep.rule}: lr {sweep.chosen:.3g} from {len(sweep.lrs)} steps"})
    logger.client.log_text(logger.run_id, json.dumps(sweep.as_json(), indent=1), "lr_range.json")


def train_and_save(
    params: Params,
    context: TrialContext,
    variant: str,
    trial_id: str,
    run_id: str,
    logger: RunLogger | None,
    report: Callable[[dict[str, Any]], None],
    checkpoint_dir: Path,
    device: torch.device | None = None,
    rank: int = 0,
) -> dict[str, float]:
    """Train, evaluate on the test split and save the model; return the run's metrics.

    `report` gets each epoch's validation metrics (Tune's or Ray Train's report). As one
    rank of a distributed trial (`rank` > 0) it trains and reports only: rank 0 logs to
    MLflow (`logger` is None elsewhere), evaluates, saves, and returns the metrics; other
    ranks return {}. `checkpoint_dir` is the folder the trial claimed (see claim_checkpoint_dir).
    Besides the engine's clocks, `setup_time_s` gains the time spent here before training
    (tokenizer, model, batch-size probe), and test evaluation and saving get their own clocks.
    """
    setup_start = time.perf_counter()
    torch.set_num_threads(context.threads)
    seed_everything(params.seed)  # the same initial weights on every rank
    tokenized = Path(context.tokenized_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    task = get_task(params.task)
    device = device or resolve_device(params)
    root = Path(context.root)
    model = set_attention(task.build_model(params, tokenizer, tokenized, root), params.model)
    train = task.training_split(TokenizedSplit.load(tokenized / "train"), params, model)  # packed, if asked
    # Before any training: the memory plan, the budget and strategy (which may change the params).
    planner = trial_planner(task, train, tokenizer, tokenized, root, device)
    preflight = plan_before_training(params, planner, device)
    params = preflight.params
    if preflight.unavailable is not None and rank == 0:
        print(f"[{variant}] no memory plan for {preflight.unavailable}; training without one", flush=True)
    precision = resolve_precision(params, device)
    if logger:
        logger.log_tags({"precision.resolved": precision, "device.resolved": str(device), "task": params.task})
    out = Path(context.staging_dir) / trial_id
    if params.adapter.type != "none" and not params.adapter.merge and rank == 0:
        # What the adapter needs to be loaded again: a random base's weights, or where a pretrained one is.
        if params.model.name_or_path is None:
            model.save_pretrained(out / BASE_DIR, safe_serialization=True)
        else:
            save_base_reference(params, root, out)
    model = apply_adapter(model, params.adapter, task, params)
    if rank:
        torch.manual_seed(params.seed + rank)  # own dropout masks per rank
    longest = int(train.lengths.max())
    if params.data.bucketing:
        longest = padded_length(longest, resolve_pad_multiple(params, device))
    probed = params.batch_size == "auto"  # still auto: CUDA without a budget, probed for real
    params = resolve_batch_size(
        params, model, longest if params.data.bucketing else params.data.max_length, device, precision
    )
    plan = plan_or_none(planner, params) if probed and rank == 0 else preflight.plan
    params, sweep = resolve_lr(params, model, train, tokenizer.pad_token_id, device, precision, task)
    if logger:
        logger.log_dict({**(plan.as_metrics() if plan else {}), **(sweep.as_metrics() if sweep else {})})
        logger.log_tags({"memory_plan": preflight.note})
        if sweep:
            log_lr_range(logger, sweep)
        logger.log_tags(
            {"batch_size.resolved": str(params.batch_size), "grad_accum_steps.resolved": str(params.grad_accum_steps)}
        )

    # Rank 0 shows the trial's progress: a bar on a terminal, and a summary line per epoch.
    progress = TrialProgress(
        params.epochs, lambda line: print(f"[{variant}] {line}", flush=True), context.progress_bars, variant
    )

    def on_epoch_end(epoch: int, step: int, metrics: dict[str, float]) -> None:
        if logger:
            logger.log_dict(metrics, step=step)
        if rank == 0:
            progress.on_epoch_end(epoch, step, metrics)
        report({**metrics, "mlflow_run_id": run_id})

    def on_log(step: int, point: dict[str, float]) -> None:
        if logger:
            logger.log_dict({"train_loss": point["loss"], "lr": point["lr"]}, step=step)
        if rank == 0:
            progress.on_log(step, point)

    resume_messages: list[str] = []

    def say(message: str) -> None:
        print(f"[{variant}] {message}", flush=True)
        resume_messages.append(message)

    validation = TokenizedSplit.load(tokenized / "validation")
    setup_before_engine = time.perf_counter() - setup_start
    result = train_model(
        model,
        train,
        validation,
        params,
        pad_id=tokenizer.pad_token_id,
        device=device,
        precision=precision,
        on_log=on_log,
        on_epoch_end=on_epoch_end,
        checkpoint_dir=checkpoint_dir,
        say=say,
        task=task,
    )
    progress.close()
    if rank:
        return {}
    if logger:
        logger.log_tags(
            {
                "checkpoint": " / ".join(resume_messages),
                **result.notes,
            }
        )
    eval_start = time.perf_counter()
    test = TokenizedSplit.load(tokenized / "test")
    evaluation = task.evaluate(model, tokenizer, test, tokenized, params, device, precision)
    test_eval_time = time.perf_counter() - eval_start
    save_start = time.perf_counter()
    save_trained(model, out, params)
    tokenizer.save_pretrained(out)
    if (tokenized / LABELS_FILE).is_file():
        shutil.copyfile(tokenized / LABELS_FILE, out / LABELS_FILE)
    (out / PARAMS_FILE).write_text(json.dumps(params.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
    (out / "history.json").write_text(json.dumps(result.history) + "\n")
    metrics = {**result.metrics, **evaluation.metrics, "test_eval_time_s": test_eval_time}
    if plan is not None:  # achieved model FLOP/s (and MFU on a known GPU), from the plan's FLOPs per position
        tf32 = resolve_tf32(params, precision, device)
        flops_per_position = plan.model_flops_per_position()
        metrics |= flops_metrics(flops_per_position, metrics, device, precision, tf32, params.distributed.num_workers)
    metrics["setup_time_s"] += setup_before_engine
    metrics["save_time_s"] = time.perf_counter() - save_start
    if logger is not None:  # the folder (weights, tokenizer, labels, params) as the run's MLflow model, on rank 0
        log_start = time.perf_counter()
        examples = input_examples(tokenizer, test, params.task)
        model_uri = log_trial_model(logger.client, context.experiment_id, run_id, out, params, examples, say)
        if model_uri is not None:
            logger.log_tags({MODEL_URI_TAG: model_uri})
        metrics["log_model_time_s"] = time.perf_counter() - log_start
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    discard(checkpoint_dir)  # finished: a later run with the same params must train, not skip
    return metrics
