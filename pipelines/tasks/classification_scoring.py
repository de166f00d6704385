"""A classifier's forward, its scoring of a split, and its test metrics: accuracy and macro-F1 with their intervals,
per-class precision and recall, the confusion matrix, and per-row predictions in the split's own row order."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from pipelines.data.loader import score_batches
from pipelines.data.tokenization import TokenizedSplit, class_keys
from pipelines.noise import bootstrap_macro_f1_interval, confusion_counts, per_class_scores, wilson_interval
from pipelines.params import Params
from pipelines.runtime import Runtime

if TYPE_CHECKING:
    from pipelines.tasks.base import Task


def forward_logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logits of a batch already on the model's device."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def predict_logits(
    model: nn.Module, split: TokenizedSplit, params: Params, runtime: Runtime, task: Task
) -> tuple[np.ndarray, float]:
    """A classifier's (logits in the split's row order, mean loss), from length-bucketed batches."""

    def score(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = forward_logits(model, batch).float()
        with torch.autocast(runtime.device.type, enabled=False):  # the fp32 loss, as before autocast's region
            loss = F.cross_entropy(out, batch["labels"], reduction="sum")
        return out, loss, batch["row_index"]

    scored = score_batches(model, split, params, runtime, task, score)
    width = scored[0][0].shape[1] if scored else 0
    logits = np.zeros((len(split), width), dtype=np.float32)
    total_loss = torch.zeros((), device=runtime.device)
    for out, loss, rows in scored:
        total_loss += loss
        # Scatter back by row index: bucketing reorders rows, predictions must not move.
        logits[rows.cpu().numpy()] = out.cpu().numpy()
    return logits, float(total_loss) / len(split)


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
    confusion = confusion_counts(labels, predicted, len(label_names))
    precision, recall, f1 = per_class_scores(confusion)
    correct = int((predicted == labels).sum())
    accuracy_low, accuracy_high = wilson_interval(correct, len(labels))
    f1_low, f1_high = bootstrap_macro_f1_interval(labels, predicted, len(label_names))
    metrics = {
        "test_accuracy": correct / len(labels) if len(labels) else 0.0,
        "test_accuracy_ci_low": accuracy_low,
        "test_accuracy_ci_high": accuracy_high,
        "test_macro_f1": float(f1.mean()),
        "test_macro_f1_ci_low": f1_low,
        "test_macro_f1_ci_high": f1_high,
        "test_rows": float(len(labels)),
    }
    # Keyed by each label's metric key: label text with a comma or `&` is no legal MLflow metric name.
    for key, p, r in zip(class_keys(label_names), precision, recall, strict=True):
        metrics[f"test_precision.{key}"] = float(p)
        metrics[f"test_recall.{key}"] = float(r)
    probabilities = softmax(logits)
    predictions = pd.DataFrame(
        {
            "row_id": np.arange(len(labels)),
            "label": [label_names[i] for i in labels],
            "predicted": [label_names[i] for i in predicted],
            **{f"p_{name}": probabilities[:, i].round(6) for i, name in enumerate(label_names)},
        }
    )
    return Evaluation(metrics, confusion, predictions)


def evaluate_model(
    model: torch.nn.Module, split: TokenizedSplit, label_names: list[str], params: Params, runtime: Runtime, task: Task
) -> Evaluation:
    """Run `model` over `split` (bucketed, inference mode) and score it."""
    model.to(runtime.device)
    start = time.perf_counter()
    logits, loss = predict_logits(model, split, params, runtime, task)
    elapsed = time.perf_counter() - start
    result = score(split.labels, logits, label_names)
    result.metrics["test_loss"] = loss
    result.metrics["eval_samples_per_s"] = len(split) / elapsed
    return result


def confusion_rows(confusion: np.ndarray, label_names: list[str]) -> list[dict[str, str]]:
    """The confusion matrix as one row per test row (actual, predicted): DVC's confusion template reads this."""
    rows = []
    for i, actual in enumerate(label_names):
        for j, predicted in enumerate(label_names):
            rows += [{"actual": actual, "predicted": predicted}] * int(confusion[i, j])
    return rows


def per_class_rows(metrics: dict[str, float], label_names: list[str]) -> list[dict[str, float | str]]:
    """One row per class: the label as written, its metric key in MLflow, its precision and recall (DVC plot data,
    and the report's per-class table)."""
    return [
        {"class": name, "key": key, "precision": metrics[f"test_precision.{key}"],
         "recall": metrics[f"test_recall.{key}"]}
        for name, key in zip(label_names, class_keys(label_names), strict=True)
    ]  # fmt: skip
