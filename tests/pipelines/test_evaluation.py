"""Predictions stay in the test split's row order even though batches are bucketed by length."""

from __future__ import annotations

import numpy as np
import torch

from pipelines.tasks import get_task
from pipelines.tasks.classification_scoring import confusion_rows, evaluate_model, score
from tests.pipelines.train.helpers import cpu_runtime, tiny_model, tiny_split


def test_each_prediction_matches_a_single_row_forward_pass(default_params):
    split = tiny_split(rows=70, max_len=60, seed=9)  # lengths shuffled: bucketing reorders rows
    model = tiny_model(seed=3).eval()
    result = evaluate_model(
        model,
        split,
        ["a", "b", "c"],
        default_params,
        cpu_runtime(),
        get_task("classification"),
    )
    offsets = split.offsets
    with torch.inference_mode():
        for row in range(len(split)):
            ids = torch.from_numpy(split.input_ids[offsets[row] : offsets[row] + split.lengths[row]].astype(np.int64))[
                None
            ]
            probs = torch.softmax(model(input_ids=ids).logits, -1)[0].numpy()
            got = result.predictions.iloc[row]
            assert got["row_id"] == row
            assert got["label"] == "abc"[split.labels[row]]
            np.testing.assert_allclose([got["p_a"], got["p_b"], got["p_c"]], probs, atol=1e-5)
            assert got["predicted"] == "abc"[int(probs.argmax())]


def test_scores_and_confusion_rows():
    labels = np.array([0, 0, 1, 1, 2])
    logits = np.eye(3)[[0, 1, 1, 1, 0]]
    result = score(labels, logits, ["x", "y", "z"])
    assert result.metrics["test_accuracy"] == 0.6
    assert result.metrics["test_recall.x"] == 0.5 and result.metrics["test_precision.y"] == 2 / 3
    assert result.confusion.tolist() == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    rows = confusion_rows(result.confusion, ["x", "y", "z"])
    assert len(rows) == 5 and rows.count({"actual": "z", "predicted": "x"}) == 1


def test_scores_from_counts_equal_sklearns_including_classes_never_seen_or_never_predicted():
    from sklearn.metrics import confusion_matrix, f1_score, precision_recall_fscore_support

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, size=500)  # class 4 never occurs; class 3 is never predicted
    logits = rng.normal(size=(500, 5)) + 2 * np.eye(5)[labels]
    logits[:, 3] = -10
    result = score(labels, logits, list("abcde"))
    predicted, ids = logits.argmax(axis=1), list(range(5))
    precision, recall, _, _ = precision_recall_fscore_support(labels, predicted, labels=ids, zero_division=0)
    assert result.confusion.tolist() == confusion_matrix(labels, predicted, labels=ids).tolist()
    assert result.metrics["test_macro_f1"] == f1_score(labels, predicted, labels=ids, average="macro", zero_division=0)
    assert [result.metrics[f"test_precision.{n}"] for n in "abcde"] == precision.tolist()
    assert [result.metrics[f"test_recall.{n}"] for n in "abcde"] == recall.tolist()


def test_the_dvc_metrics_file_opens_on_what_changed_then_quality_time_and_memory():
    from pipelines.evaluation import dvc_metrics

    evaluated = {"test_loss": 0.8, "test_accuracy": 0.74, "eval_samples_per_s": 3900.0, "test_accuracy.world": 0.9,
                 "test_macro_f1": 0.73, "test_rows": 1200.0}  # fmt: skip
    trained = {"train_time_s": 5.7, "peak_train_memory_mib": 21.0, "samples_per_s": 650.0, "host_load_per_core": 0.9,
               "timed_on": "box: cpu (AVX512), 2 cores"}  # fmt: skip
    compared = {"changed": "optim=adafactor", "timing": "ok", "train_time_s_ci_low": 5.1, "train_time_s_ci_high": 6.3}
    figures = dvc_metrics("test_accuracy", evaluated, trained, compared)
    assert list(figures) == ["changed", "test_accuracy", "train_time_s", "peak_train_memory_mib", "timing",
                             "train_time_s_ci_low", "train_time_s_ci_high", "samples_per_s", "host_load_per_core",
                             "timed_on", "eval_samples_per_s", "test_loss", "test_macro_f1", "test_rows"]  # fmt: skip
    generated = {"test_token_accuracy": 0.5, "test_exact_match": 0.3}
    assert list(dvc_metrics("test_exact_match", generated, trained, {}))[:2] == ["test_exact_match", "train_time_s"]
