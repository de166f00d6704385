"""Seq2seq end to end: `dvc exp run -S task=seq2seq` offline, its BLEU and chrF in MLflow and the report."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_seq2seq_experiment_runs_offline_and_reports_bleu(project_copy: Path):
    root = project_copy
    run(["dvc", "exp", "run", "-S", "task=seq2seq"], root, timeout=600)

    evaluate = json.loads((root / "metrics/evaluate.json").read_text())
    for name in ("test_bleu", "test_chrf", "test_exact_match", "test_perplexity", "test_token_accuracy"):
        assert name in evaluate, evaluate
    assert evaluate["test_token_accuracy"] > 0.15 and evaluate["test_chrf"] > 10  # learns part of the rule
    predictions = pd.read_csv(root / "predictions/test.csv", keep_default_na=False)
    assert list(predictions.columns) == ["row_id", "source", "reference", "generated", "exact_match"]
    assert predictions["row_id"].tolist() == list(range(len(predictions)))

    best = json.loads((root / "metrics/train.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    stored = client.get_run(best["mlflow_run_id"]).data
    assert stored.tags["task"] == "seq2seq"
    assert stored.metrics["test_bleu"] == evaluate["test_bleu"] and "val_token_accuracy" in stored.metrics

    header = next(line for line in (root / "reports/report.md").read_text().splitlines() if line.startswith("| Trial"))
    for column in ("BLEU", "chrF", "Exact match", "Perplexity", "Δ BLEU vs baseline"):
        assert column in header, header
