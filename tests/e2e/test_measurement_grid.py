"""One `dvc repro` of a strategy grid on a BERT of a few million parameters: the numbers mean what they say."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipelines.tracking.status import display_rounded
from tests.conftest import run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

GRID = {
    "vanilla": {},
    "grad_checkpointing": {"grad_checkpointing": True},
    "adafactor": {"optim": "adafactor"},
    "accumulation": {"batch_size": 8, "grad_accum_steps": 4},
}
# ~3.7M parameters: big enough that activations and optimizer state dominate what training allocates.
BERT_3M = {
    "model.config.hidden_size": 256,
    "model.config.num_hidden_layers": 4,
    "model.config.num_attention_heads": 4,
    "model.config.intermediate_size": 1024,
}


def report_rows(markdown: str) -> dict[str, dict[str, str]]:
    """The comparison table of reports/report.md (its first table; the per-class one follows) as {trial: {header:
    cell}}."""
    from_first = itertools.dropwhile(lambda line: not line.startswith("|"), markdown.splitlines())
    lines = list(itertools.takewhile(lambda line: line.startswith("|"), from_first))
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    return {cells[0]: dict(zip(header, cells, strict=True)) for cells in rows}


def percent(cell: str) -> int:
    return int(re.search(r"\((\d+)%", cell).group(1))


def test_grid_memory_time_and_noise_are_each_trials_own(project_copy: Path):
    root = project_copy
    write_params(
        root,
        {
            "tune.variants": GRID,
            "batch_size": 32,
            "epochs": 1,
            "data.generator.num_rows": 2000,
            "checkpoint_every_n_steps": None,
            **BERT_3M,
        },
    )
    run(["dvc", "repro"], root, timeout=1200)

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune").experiment_id
    trials = {
        r.data.tags["variant"]: r
        for r in client.search_runs([experiment], "attributes.status = 'FINISHED'")
        if "mlflow.parentRunId" in r.data.tags
    }
    assert set(trials) == set(GRID)
    m = {name: t.data.metrics for name, t in trials.items()}
    validation_rows = json.loads((root / "metrics" / "tokenize.json").read_text())["validation"]["rows"]
    vanilla = m["vanilla"]
    assert 3e6 < vanilla["param_bytes"] / 4 < 5e6  # a BERT of a few million parameters

    # Memory: what training allocates, each trial's own.
    for name in ("grad_checkpointing", "accumulation"):
        assert m[name]["peak_train_memory_bytes"] < 0.8 * vanilla["peak_train_memory_bytes"], name
    assert m["adafactor"]["optimizer_state_bytes"] < 0.05 * vanilla["optimizer_state_bytes"]
    assert len({t.data.tags["pid"] for t in trials.values()}) == len(GRID)  # a fresh process per trial
    assert all(t.data.tags["peak_rss"] == "reset at trial start" for t in trials.values())
    assert len({metrics["peak_train_memory_bytes"] for metrics in m.values()}) == len(GRID)

    # Checkpointing recomputes the forward pass: its step executes a third more FLOPs (the plan counts what runs).
    # Whether it is also slower on a shared 2-core host is a benchmark's question: as a timed assert it flaked
    # (16.4 s against vanilla's 16.7 s in one CI run, on a host whose matmul speed moved 3x within the hour).
    assert m["grad_checkpointing"]["predicted_step_flops"] > 1.2 * vanilla["predicted_step_flops"]
    for metrics in m.values():
        regions = sum(metrics[k] for k in ("setup_time_s", "warmup_time_s", "train_time_s", "val_time_s"))
        assert metrics["wall_time_s"] > regions and metrics["val_time_s"] > 0
        assert 0 < metrics["val_accuracy"] <= 1 and metrics["val_rows"] == validation_rows  # as tokenize counted
    # Four trials: compared and chosen on validation; the test split scored once, for the chosen model, by the
    # evaluate stage, into that trial's run (issue 69), never into the others'.
    best = json.loads((root / "metrics" / "train.json").read_text())["variant"]
    assert {name for name, metrics in m.items() if any(k.startswith("test_") for k in metrics)} == {best}

    # The report says the same, on validation.
    rows = report_rows((root / "reports" / "report.md").read_text())
    assert set(rows) == set(GRID)
    for name in ("grad_checkpointing", "accumulation"):
        assert percent(rows[name]["Peak train memory"]) < 80, rows[name]
    assert percent(rows["adafactor"]["Optimizer state"]) < 5
    for name, cells in rows.items():
        assert cells["Validation accuracy"] == f"{100 * m[name]['val_accuracy']:.2f}%", cells
    # The chosen model's card gives its validation figure as such, never as a test figure (no trial scored test).
    card = (root / "models" / "best" / "README.md").read_text()
    assert "| Test metric |" not in card and f"| val_accuracy | {m[best]['val_accuracy']:.4g} |" in card, card
    evaluate = json.loads((root / "metrics" / "evaluate.json").read_text())
    # The experiment's row on MLflow's runs page (its parent run) shows the chosen model's test accuracy, rounded.
    parent = client.get_run(trials[best].data.tags["mlflow.parentRunId"])
    assert parent.data.metrics["test_accuracy"] == display_rounded(evaluate["test_accuracy"])
    assert evaluate["test_accuracy_ci_low"] < evaluate["test_accuracy"] < evaluate["test_accuracy_ci_high"]
