"""Loading a saved model of any task, with the params it was trained with, and scoring it on the test split; the
evaluate stage's metrics file. Light at import (torch and transformers only inside `evaluate_saved_model`): the
evaluate stage that reuses its trial's scoring (`pipelines.scored`) imports neither."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelines.tasks.base import EvaluationResult


def evaluate_saved_model(model_dir: Path, tokenized_dir: Path) -> EvaluationResult:
    """Evaluate a model folder written by a trial on the test split, with the params (and task) it was trained with."""
    from transformers import AutoTokenizer

    from pipelines.adapters import load_trained_model
    from pipelines.data.tokenization import TokenizedSplit
    from pipelines.params import Params
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


# `dvc exp show`'s first columns after the experiment's name: what it changed, then the headline figures.
HEAD_COLUMNS = ("changed",)
TRAINED_HEAD = ("train_time_s", "peak_train_memory_mib", "timing")


def dvc_metrics(
    headline: str, evaluated: dict[str, float], trained: dict[str, float | str], compared: dict[str, float | str]
) -> dict[str, float | str]:
    """The evaluate stage's metrics file, in the order `dvc exp show` shows its columns: what the experiment changed
    from its baseline commit (`compared["changed"]`), the task's headline quality, train time, peak train memory
    and the time's `timing` note (`compared`: `pipelines.baseline`), then the time's interval over repeats, the
    other training figures (`trained`) and the other test figures, sorted. A terminal's pager shows the table's
    left edge (`less -S`; DVC renders it at full width for the pager), so this order is what a person sees at 120
    columns. Per-class figures (dotted names) stay in MLflow and the plots, out of every experiment's columns."""
    pool: dict[str, float | str] = {**compared, **trained}
    ordered = {k: pool[k] for k in HEAD_COLUMNS if k in pool}
    ordered.update({k: evaluated[k] for k in (headline,) if k in evaluated})
    ordered.update({k: pool[k] for k in TRAINED_HEAD if k in pool})
    ordered.update({k: v for k, v in pool.items() if k not in ordered})
    ordered.update({k: evaluated[k] for k in sorted(evaluated) if k not in ordered and "." not in k})
    return ordered
