"""Loading a saved model of any task, with the params it was trained with, and scoring it on the test split."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.tasks.base import EvaluationResult


def evaluate_saved_model(model_dir: Path, tokenized_dir: Path) -> EvaluationResult:
    """Evaluate a model folder written by a trial on the test split, with the params (and task) it was trained with."""
    from transformers import AutoTokenizer

    from pipelines.adapters import load_trained_model
    from pipelines.runtime import resolve_device, resolve_runtime
    from pipelines.tasks import get_task

    params = Params.model_validate(json.loads((model_dir / "params.json").read_text(encoding="utf-8")))
    task = get_task(params.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = resolve_device(params)
    model = load_trained_model(model_dir, params, task, tokenizer)
    split = TokenizedSplit.load(tokenized_dir / "test")
    runtime = resolve_runtime(params, device, tokenizer.pad_token_id)  # the full loss projection: no training here
    return task.evaluate(model, tokenizer, split, model_dir, params, runtime)


def dvc_metrics(task_name: str, evaluated: dict[str, float], trained: dict[str, float]) -> dict[str, float]:
    """The evaluate stage's metrics file, in the order `dvc exp show` shows its columns: the task's headline
    quality, then the model's training figures (`trained`: time, memory, speed), then the other test figures,
    sorted. `dvc exp show` keeps the leftmost columns when it narrows the table (and a terminal's pager shows
    the left edge first), so this order is what a person sees. Per-class figures (dotted names) stay in MLflow
    and the plots, out of every experiment's columns."""
    from pipelines.tasks import get_task

    headline = get_task(task_name).quality[0].metric
    ordered = {k: evaluated[k] for k in (headline,) if k in evaluated}
    ordered.update(trained)
    ordered.update({k: evaluated[k] for k in sorted(evaluated) if k not in ordered and "." not in k})
    return ordered
