"""Causal-LM instruction tuning end to end: `dvc exp run -S task=causal_lm`, full, LoRA and packed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_causal_lm_experiment_runs_offline_with_lora_and_reports_generation_quality(project_copy: Path):
    root = project_copy
    variants = {"full": {}, "lora": {"adapter.type": "lora", "lr": 0.003}, "packed": {"data.packing": True}}
    write_params(root, {"tune.variants": variants})
    run(["git", "commit", "-qam", "full, lora and packed variants"], root)

    run(["dvc", "exp", "run", "-S", "task=causal_lm"], root, timeout=900)
    assert_packing_re_trains(root)

    tokenize = json.loads((root / "metrics/tokenize.json").read_text())
    assert tokenize["train"]["truncated_fraction"] == 0.0  # the generator's rows fit data.max_length
    evaluate = json.loads((root / "metrics/evaluate.json").read_text())
    for name in ("test_loss", "test_perplexity", "test_token_accuracy", "test_exact_match"):
        assert name in evaluate, evaluate
    assert evaluate["test_exact_match_ci_low"] <= evaluate["test_exact_match"] <= evaluate["test_exact_match_ci_high"]
    assert 0.5 < evaluate["test_token_accuracy"] and 0.05 < evaluate["test_exact_match"]  # it learns the rules

    predictions = pd.read_csv(root / "predictions/test.csv", keep_default_na=False)
    assert list(predictions.columns) == ["row_id", "prompt", "reference", "generated", "exact_match"]
    assert predictions["row_id"].tolist() == list(range(len(predictions)))  # in row order
    assert predictions["exact_match"].mean() == pytest.approx(evaluate["test_exact_match"])
    confusion = json.loads((root / "plots/confusion.json").read_text())
    assert len(confusion) == len(predictions)  # one row per test row, never an empty chart
    per_class = json.loads((root / "plots/per_class.json").read_text())
    assert per_class and all(0.0 <= row["recall"] <= 1.0 for row in per_class)

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    trials = {
        r.data.tags["variant"]: r
        for r in client.search_runs([experiment.experiment_id])
        if "mlflow.parentRunId" in r.data.tags and r.info.status == "FINISHED"
    }
    assert set(trials) == {"full", "lora", "packed"}
    best = json.loads((root / "metrics/train.json").read_text())
    for variant, trial in trials.items():
        assert trial.data.tags["task"] == "causal_lm" and trial.data.params["task"] == "causal_lm"
        for name in ("val_loss", "val_token_accuracy", "tokens_per_s"):
            assert name in trial.data.metrics, name
        # Compared on validation: the test split is scored once, for the chosen model, by the evaluate stage.
        scored = {name for name in trial.data.metrics if name.startswith("test_")}
        assert bool(scored) == (variant == best["variant"]), (variant, scored)
    full, lora, packed = (trials[name].data.metrics for name in ("full", "lora", "packed"))

    # Packing: several examples per row (batch_size counts rows), so more examples per step and fewer steps.
    def examples_per_step(m: dict[str, float]) -> float:
        return m["samples_per_s"] * m["train_time_s"] / m["timed_steps"]

    assert examples_per_step(packed) > 1.5 * examples_per_step(full)
    assert packed["optimizer_steps"] < full["optimizer_steps"] and packed["padding_fraction"] < 0.05
    assert full["frozen_param_bytes"] == 0 and lora["frozen_param_bytes"] > 10 * lora["trainable_param_bytes"]
    assert lora["optimizer_state_bytes"] == 2 * lora["trainable_param_bytes"] < full["optimizer_state_bytes"] / 10
    assert client.get_run(best["mlflow_run_id"]).data.metrics["test_exact_match"] == evaluate["test_exact_match"]
    if best["variant"] == "lora":
        assert (root / "models/best/adapter_config.json").is_file() and (root / "models/best/base").is_dir()

    report = (root / "reports/report.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| Trial"))
    columns = (
        "Validation token accuracy",
        "Trainable param memory",
        "Padding",
        "Δ validation token accuracy vs baseline",
    )
    for column in columns:
        assert column in header, header
    assert "Accuracy" not in header and "| full |" in report and "| lora |" in report


def assert_packing_re_trains(root: Path) -> None:
    """On this causal_lm baseline, `-S data.packing=true` re-runs train (it once re-ran only tokenize).

    DVC's own re-run decision, read with `dvc status` after the change: train must list data.packing
    among its changed params (tokenize's outputs do not change with it, so nothing else would re-run train).
    """
    params = (root / "params.yaml").read_text()
    write_params(root, {"data.packing": True})
    try:
        status = json.loads(run(["dvc", "status", "--json"], root).stdout)
    finally:
        (root / "params.yaml").write_text(params)
    # DVC 3 lists a stage's changed params among its changed deps: {"changed deps": {"params.yaml": {key: ...}}}.
    changed = [entry.get("changed deps", {}).get("params.yaml", {}) for entry in status.get("train", [])]
    assert any("data.packing" in entry for entry in changed), status
