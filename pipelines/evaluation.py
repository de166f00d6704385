"""A classifier's test-split metrics and per-row predictions (in the split's own row order), and loading a saved model
of any task to score it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support

from pipelines.data.tokenization import TokenizedSplit
from pipelines.noise import bootstrap_macro_f1_interval, wilson_interval
from pipelines.params import Params
from pipelines.tasks.base import EvaluationResult
from pipelines.train.device import ResolvedPrecision
from pipelines.train.validation import predict_logits


@dataclass
class Evaluation:
    """Scalar metrics, the confusion matrix and one prediction row per test row."""

    metrics: dict[str, float]
    confusion: np.ndarray
    predictions: pd.DataFrame


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=1, keepdims=True)


def score(labels: np.ndarray, logits: np.ndarray, label_names: list[str]) -> Evaluation:
    """Accuracy and macro-F1 with 95% intervals, per-class precision/recall, and the confusion matrix.

    Accuracy's interval is Wilson's, macro-F1's a seeded bootstrap over the test rows (pipelines.noise).
    """
    predicted = logits.argmax(axis=1)
    ids = list(range(len(label_names)))
    precision, recall, _, _ = precision_recall_fscore_support(labels, predicted, labels=ids, zero_division=0)
    correct = int((predicted == labels).sum())
    accuracy_low, accuracy_high = wilson_interval(correct, len(labels))
    f1_low, f1_high = bootstrap_macro_f1_interval(labels, predicted, len(label_names))
    metrics = {
        "test_accuracy": correct / len(labels) if len(labels) else 0.0,
        "test_accuracy_ci_low": accuracy_low,
        "test_accuracy_ci_high": accuracy_high,
        "test_macro_f1": float(f1_score(labels, predicted, labels=ids, average="macro", zero_division=0)),
        "test_macro_f1_ci_low": f1_low,
        "test_macro_f1_ci_high": f1_high,
        "test_rows": float(len(labels)),
    }
    for name, p, r in zip(label_names, precision, recall, strict=True):
        metrics[f"test_precision.{name}"] = float(p)
        metrics[f"test_recall.{name}"] = float(r)
    probabilities = softmax(logits)
    predictions = pd.DataFrame(
        {
            "row_id": np.arange(len(labels)),
            "label": [label_names[i] for i in labels],
            "predicted": [label_names[i] for i in predicted],
            **{f"p_{name}": probabilities[:, i].round(6) for i, name in enumerate(label_names)},
        }
    )
    return Evaluation(metrics, confusion_matrix(labels, predicted, labels=ids), predictions)


def evaluate_model(
    model: torch.nn.Module,
    split: TokenizedSplit,
    label_names: list[str],
    params: Params,
    *,
    pad_id: int,
    device: torch.device,
    precision: ResolvedPrecision,
) -> Evaluation:
    """Run `model` over `split` (bucketed, inference mode) and score it."""
    model.to(device)
    start = time.perf_counter()
    logits, loss = predict_logits(model, split, params, pad_id, device, precision)
    elapsed = time.perf_counter() - start
    result = score(split.labels, logits, label_names)
    result.metrics["test_loss"] = loss
    result.metrics["eval_samples_per_s"] = len(split) / elapsed
    return result


def evaluate_saved_model(model_dir: Path, tokenized_dir: Path) -> EvaluationResult:
    """Evaluate a model folder written by a trial on the test split, with the params (and task) it was trained with."""
    from transformers import AutoTokenizer

    from pipelines.adapters import load_trained_model
    from pipelines.tasks import get_task
    from pipelines.train.device import resolve_device, resolve_precision

    params = Params.model_validate(json.loads((model_dir / "params.json").read_text(encoding="utf-8")))
    task = get_task(params.task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    device = resolve_device(params)
    model = load_trained_model(model_dir, params, task, tokenizer)
    split = TokenizedSplit.load(tokenized_dir / "test")
    return task.evaluate(model, tokenizer, split, model_dir, params, device, resolve_precision(params, device))


def confusion_rows(confusion: np.ndarray, label_names: list[str]) -> list[dict[str, str]]:
    """The confusion matrix as one row per test row (actual, predicted): DVC's confusion template reads this."""
    rows = []
    for i, actual in enumerate(label_names):
        for j, predicted in enumerate(label_names):
            rows += [{"actual": actual, "predicted": predicted}] * int(confusion[i, j])
    return rows


def per_class_rows(metrics: dict[str, float], label_names: list[str]) -> list[dict[str, float | str]]:
    """One row per class with its precision and recall (DVC plot data)."""
    return [
        {"class": name, "precision": metrics[f"test_precision.{name}"], "recall": metrics[f"test_recall.{name}"]}
        for name in label_names
    ]
