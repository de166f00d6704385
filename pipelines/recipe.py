"""One trial, top to bottom: setup -> resolve -> train -> evaluate and save. Each phase is short.

The Ray Tune trial (`pipelines.trials.trial`) and each Ray Train worker (`pipelines.trials.distributed`) both call
`train_and_save`; neither imports the other. Rank 0 logs to MLflow; other ranks get a `NullLogger`, so the
phases log unconditionally and only rank checks that change what is *done* (saving, evaluating) remain.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from pipelines.adapters import BASE_DIR, apply_adapter, save_base_reference, save_trained
from pipelines.concurrency import concurrency_note, training_now
from pipelines.data.tokenization import LABELS_FILE, TOKENIZER_DIR, TokenizedSplit
from pipelines.errors import warn_user
from pipelines.model import set_attention
from pipelines.model_card import (
    CardQuality,
    pretrained_base,
    record_adapter_base,
    set_model_max_length,
    write_model_card,
)
from pipelines.params import Params
from pipelines.progress import TrialProgress
from pipelines.resolve.lr_range import LrRangeResult
from pipelines.resolve.preflight import Preflight, plan_before_training, trial_planner
from pipelines.resolve.target import trial_target
from pipelines.resolve.training import ResolvedTraining, resolve_training
from pipelines.runtime import Runtime, emulated_bf16_warning, resolve_device, resolve_runtime
from pipelines.scored import Scoring, save_scoring
from pipelines.tasks import get_task
from pipelines.tasks.base import QualityMetric, Task
from pipelines.tasks.chance import AT_CHANCE_TAG, at_chance_note
from pipelines.train.checkpoint import discard
from pipelines.train.compiled_step import use_cache
from pipelines.train.engine import TrainRequest, TrainResult, run_training
from pipelines.train.flops import flops_metrics
from pipelines.train.results import world
from pipelines.train.shard_loading import build_on_meta, builds_on_meta
from pipelines.trial_context import FINAL_KEY, QUALITY_TAG, TrialContext

PARAMS_FILE = "params.json"
METRICS_FILE = "metrics.json"  # the trial's final metrics, beside its saved model
__all__ = ["FINAL_KEY", "METRICS_FILE", "PARAMS_FILE", "NullLogger", "Trial", "TrialContext", "train_and_save"]


class TrialLogger(Protocol):
    """What a trial logs through: pipelines.tracking.runs.RunLogger on rank 0, NullLogger elsewhere."""

    def log_dict(self, metrics: dict[str, float], step: int = 0) -> None: ...
    def log_tags(self, tags: dict[str, str]) -> None: ...


class NullLogger:
    """The logger of a rank that does not log (every rank but 0 of a distributed trial)."""

    def log_dict(self, metrics: dict[str, float], step: int = 0) -> None:
        """Log nothing."""

    def log_tags(self, tags: dict[str, str]) -> None:
        """Log nothing."""


@dataclass(frozen=True)
class Trial:
    """Who this trial is: its variant, ids, where it logs and reports, and which rank this process is."""

    context: TrialContext
    variant: str
    trial_id: str
    run_id: str
    logger: TrialLogger
    report: Callable[[dict[str, Any]], None]
    checkpoint_dir: Path
    rank: int = 0
    # Logs the saved folder as the run's MLflow model (pipelines.tracking.mlflow_model.model_logger); None: not logged.
    log_model: Callable[[Path, Params, PreTrainedTokenizerBase, TokenizedSplit, Callable[[str], None]], None] | None = (
        None
    )
    make_bar: Callable[..., Any] | None = None  # a tqdm-like progress bar class; None: epoch lines only

    @property
    def out(self) -> Path:
        """The trial's staging folder: the saved model, its params and metrics."""
        return Path(self.context.staging_dir) / self.trial_id

    def say(self, message: str) -> None:
        """A console line, prefixed with the variant."""
        print(f"[{self.variant}] {message}", flush=True)


@dataclass(frozen=True)
class Setup:
    """What setup built: the task, tokenizer, (adapted) model and training split, the runtime (device, precision,
    TF32, padding: resolved here, once), and the preflight's plan; the params are the preflight's (`resolve` then
    settles the rest into `ResolvedTraining`)."""

    params: Params
    task: Task
    tokenizer: PreTrainedTokenizerBase
    model: PreTrainedModel
    train: TokenizedSplit
    runtime: Runtime
    preflight: Preflight
    planner: Any
    started: float = field(default_factory=time.perf_counter)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train_and_save(trial: Trial, params: Params, device: torch.device | None = None) -> dict[str, float]:
    """Train, score the test split (as the experiment's one trial) and save the model; return the run's metrics.

    `trial.report` gets each epoch's validation metrics (Tune's or Ray Train's report). A rank > 0 of a
    distributed trial trains and reports only, and returns {}. `trial.checkpoint_dir` is the folder the
    trial claimed (see claim_checkpoint_dir). Besides the engine's clocks, `setup_time_s` gains the time
    spent here before training (tokenizer, model, plan, batch-size probe), and test evaluation and saving
    get their own clocks.
    """
    setup = set_up(trial, params, device)
    resolved = resolve(trial, setup)
    setup_time = time.perf_counter() - setup.started
    result = train(trial, setup, resolved)
    if trial.rank:
        return {}
    metrics = evaluate_and_save(trial, setup, resolved, result)
    metrics["setup_time_s"] += setup_time
    return metrics


def set_up(trial: Trial, params: Params, device: torch.device | None) -> Setup:
    """Tokenizer, model and training split; the memory plan with its budget and strategy; the runtime."""
    started = time.perf_counter()
    torch.set_num_threads(trial.context.threads)
    seed_everything(params.seed)  # the same initial weights on every rank
    tokenized, root = Path(trial.context.tokenized_dir), Path(trial.context.root)
    tokenizer = AutoTokenizer.from_pretrained(tokenized / TOKENIZER_DIR)
    task = get_task(params.task)
    device = device or resolve_device(params)
    # Under FSDP a rank > 0 builds without storage and gets its shards from rank 0 (Trainer); rank 0 builds whole.
    if builds_on_meta(params, trial.rank, world()[1], device):
        model = build_on_meta(lambda: task.build_model(params, tokenizer, tokenized, root, weights=False))
    else:
        model = task.build_model(params, tokenizer, tokenized, root)
    model = set_attention(model, params.model)
    train = task.training_split(TokenizedSplit.load(tokenized / "train"), params, model)  # packed, if asked
    # Before any training: the memory plan, the budget and strategy (which may change the params).
    target, elsewhere = trial_target(params, device)
    planner = trial_planner(task, train, tokenizer, tokenized, root, target)
    preflight = plan_before_training(params, planner, target)
    params = preflight.params
    if trial.rank == 0:
        for line in (elsewhere, preflight.unavailable and f"no memory plan for {preflight.unavailable}; training "
                     "without one"):  # fmt: skip
            if line:
                trial.say(line)
    runtime = resolve_runtime(params, device, tokenizer.pad_token_id)
    slow_bf16 = emulated_bf16_warning(runtime.precision, device)
    if slow_bf16 and trial.rank == 0:
        warn_user(f"[{trial.variant}] {slow_bf16}")
    tags = {"precision.resolved": runtime.precision, "device.resolved": str(device), "task": params.task,
            QUALITY_TAG: json.dumps([asdict(q) for q in quality_compared(task, trial.context)])}  # fmt: skip
    trial.logger.log_tags(tags)
    if params.adapter.type != "none" and not params.adapter.merge and trial.rank == 0:
        # What the adapter needs to be loaded again: a random base's weights, or where a pretrained one is.
        if params.model.name_or_path is None:
            model.save_pretrained(trial.out / BASE_DIR, safe_serialization=True)
        else:
            save_base_reference(params, root, trial.out)
    model = apply_adapter(model, params.adapter, task, params)
    if trial.rank:
        torch.manual_seed(params.seed + trial.rank)  # own dropout masks per rank
    return Setup(params, task, tokenizer, model, train, runtime, preflight, planner, started=started)


def resolve(trial: Trial, setup: Setup) -> ResolvedTraining:
    """Every `auto` left after the plan (the micro-batch, probed for real on CUDA; the learning rate), logged."""
    planner = setup.planner if trial.rank == 0 else None  # ranks that log nothing plan nothing again
    use_cache(Path(trial.context.root))  # a compiled step's graphs, kept for the next trial and experiment
    resolved = resolve_training(setup.preflight, planner, setup.model, setup.train, setup.task, setup.runtime)
    plan, sweep = resolved.plan, resolved.lr_sweep
    predicted = {} if resolved.predicted_step_ms is None else {"predicted_step_time_ms": resolved.predicted_step_ms}
    if resolved.predicted_compile_s is not None:
        predicted["predicted_compile_time_s"] = resolved.predicted_compile_s
    trial.logger.log_dict({**(plan.as_metrics() if plan else {}), **(sweep.as_metrics() if sweep else {}), **predicted})
    if sweep:
        log_lr_range(trial.logger, sweep)
    trial.logger.log_tags(resolved.tags())
    return resolved


def log_lr_range(logger: TrialLogger, sweep: LrRangeResult) -> None:
    """The range test's curve: as metrics by sweep step (the MLflow UI plots them) and as `lr_range.json`."""
    for step, (lr, loss) in enumerate(zip(sweep.lrs, sweep.smoothed, strict=True)):
        if not math.isfinite(loss):  # the step that diverged
            continue
        logger.log_dict({"lr_range_lr": lr, "lr_range_loss": loss}, step=step)
    logger.log_tags({"lr_range_test": f"{sweep.rule}: lr {sweep.chosen:.3g} from {len(sweep.lrs)} steps"})
    client = getattr(logger, "client", None)  # a RunLogger's MLflow client (lr: auto runs in one process only)
    if client is not None:
        client.log_text(logger.run_id, json.dumps(sweep.as_json(), indent=1), "lr_range.json")


def train(trial: Trial, setup: Setup, resolved: ResolvedTraining) -> TrainResult:
    """The engine's run, with rank 0 showing progress (a bar on a terminal, a line per epoch) and logging."""
    params, logger = resolved.params, trial.logger
    project = str(Path(trial.context.root).resolve())

    def epoch_line(line: str) -> None:  # marked while other trials of this project share the host (their times too)
        together = training_now(project)
        trial.say(line + (f" [{concurrency_note(together)}: times shared]" if together > 1 else ""))

    progress = TrialProgress(params.epochs, epoch_line, trial.make_bar, trial.variant)
    shown = trial.rank == 0

    def on_epoch_end(epoch: int, step: int, metrics: dict[str, float]) -> None:
        logger.log_dict(metrics, step=step)
        if shown:
            progress.on_epoch_end(epoch, step, metrics)
        trial.report({**metrics, "mlflow_run_id": trial.run_id})

    def on_log(step: int, point: dict[str, float]) -> None:
        logger.log_dict({"train_loss": point["loss"], "lr": point["lr"]}, step=step)
        if shown:
            progress.on_log(step, point)

    resume_messages: list[str] = []

    def say(message: str) -> None:
        trial.say(message)
        resume_messages.append(message)

    validation = TokenizedSplit.load(Path(trial.context.tokenized_dir) / "validation")
    request = TrainRequest(setup.model, setup.train, validation, params, task=setup.task, on_log=on_log,
                           on_epoch_end=on_epoch_end, checkpoint_dir=trial.checkpoint_dir, say=say)  # fmt: skip
    result = run_training(request, resolved.runtime)
    progress.close()
    logger.log_tags({"checkpoint": " / ".join(resume_messages), **result.notes})
    log_compile_blob(logger, result.notes.get("compile.blob"))
    return result


def log_compile_blob(logger: TrialLogger, blob: str | None) -> None:
    """A compiled trial's Mega-Cache blob as the artifact `compile_cache/<fingerprint>.bin` of the experiment's first
    run that made it (each run's `compile.blob_run` tag names that run): another machine with the same torch and
    device copies it into `.cache/torch/mega/` and loads its graphs instead of compiling."""
    from pipelines.tracking.uploads import send_compile_blob_once

    client = getattr(logger, "client", None)
    if client is not None and blob is not None and Path(blob).is_file():
        try:
            send_compile_blob_once(client, logger.run_id, Path(blob))
        except Exception as err:  # noqa: BLE001 - optional: the blob stays in the local compile cache
            print(f"the compile cache blob was not sent to the artifact store ({type(err).__name__}); "
                  f"it stays at {blob}", flush=True)  # fmt: skip


def quality_compared(task: Task, context: TrialContext) -> tuple[QualityMetric, ...]:
    """The quality columns the report compares this experiment's trials on: the test split's as its one trial, else
    the validation split's (`TrialContext.score_test`)."""
    return task.quality if context.score_test else task.validation_quality


def evaluate_and_save(trial: Trial, setup: Setup, resolved: ResolvedTraining, result: TrainResult) -> dict[str, float]:
    """Rank 0: score the test split (as the experiment's one trial: `TrialContext.score_test`), save the model folder,
    log it as the run's MLflow model; the metrics."""
    params, tokenizer, out = resolved.params, setup.tokenizer, trial.out
    runtime = resolved.runtime
    tokenized = Path(trial.context.tokenized_dir)
    validation = TokenizedSplit.load(tokenized / "validation")
    note = at_chance_note(setup.task, result.metrics, validation, params)
    if note is not None:  # trained to nothing usable: said, and tagged on the run, before it is saved as if it had
        warn_user(note)
        trial.logger.log_tags({AT_CHANCE_TAG: note})
    eval_start = time.perf_counter()
    examples, evaluation = validation, None  # the logged model's input examples: the split it was scored on
    if trial.context.score_test:
        examples = TokenizedSplit.load(tokenized / "test")
        evaluation = setup.task.evaluate(setup.model, tokenizer, examples, tokenized, params, runtime)
    scored = {} if evaluation is None else {**evaluation.metrics, "test_eval_time_s": time.perf_counter() - eval_start}
    save_start = time.perf_counter()
    save_trained(setup.model, out, params)
    set_model_max_length(tokenizer, setup.model, params)
    tokenizer.save_pretrained(out)
    if (tokenized / LABELS_FILE).is_file():
        shutil.copyfile(tokenized / LABELS_FILE, out / LABELS_FILE)
    (out / PARAMS_FILE).write_text(json.dumps(params.model_dump(mode="json"), indent=2, sort_keys=True) + "\n")
    (out / "history.json").write_text(json.dumps(result.history) + "\n")
    metrics = {**result.metrics, **scored, "val_rows": float(len(validation))}  # val_rows: validation's noise
    if resolved.plan is not None:  # achieved model FLOP/s (and MFU on a known GPU), from the plan's FLOPs per position
        per_position = resolved.plan.model_flops_per_position()
        metrics |= flops_metrics(per_position, metrics, runtime.device, runtime.precision, runtime.tf32,
                                 params.distributed.num_workers)  # fmt: skip
    base = pretrained_base(params, Path(trial.context.root))
    record_adapter_base(out, base)
    quality = {q.metric: metrics[q.metric] for q in quality_compared(setup.task, trial.context) if q.metric in metrics}
    write_model_card(out, params, setup.task.peft_task_type, base, TokenizedSplit.load(tokenized / "train").digest(),
                     CardQuality(quality, on_test=trial.context.score_test))  # fmt: skip
    metrics["save_time_s"] = time.perf_counter() - save_start
    if trial.log_model is not None:  # the folder (weights, tokenizer, labels, params) as the run's MLflow model
        log_start = time.perf_counter()
        trial.log_model(out, params, tokenizer, examples, trial.say)
        metrics["log_model_time_s"] = time.perf_counter() - log_start
    (out / METRICS_FILE).write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    if evaluation is not None:
        # Last, over the finished folder: the evaluate stage reuses this scoring while the folder, the test split and
        # the code still hash the same, instead of loading the model to score the same rows again (pipelines.scored).
        scoring = Scoring(evaluation.metrics, evaluation.predictions.to_csv(index=False), evaluation.plots,
                          setup.task.quality[0].metric, f"{runtime.device.type}, {runtime.precision}")  # fmt: skip
        save_scoring(out, tokenized / "test", scoring)
    discard(trial.checkpoint_dir)  # finished: a later run with the same params must train, not skip
    return metrics
