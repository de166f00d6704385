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
