"""Trials of an experiment of several are compared on validation (issue 69): the report's quality columns are the
ones the trials recorded (`Task.validation_quality`), and a share's binomial noise counts the validation rows."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

from pipelines.comparison import TrialRow, VariantGroup, difference_se, quality_columns
from pipelines.tasks import get_task
from pipelines.trial_context import QUALITY_TAG


def trial(name: str, accuracy: float, rows: float) -> TrialRow:
    tag = json.dumps([asdict(q) for q in get_task("classification").validation_quality])
    metrics = {"val_accuracy": accuracy, "val_rows": rows, "test_rows": 10_000.0}  # test_rows must not be read
    return TrialRow(name, f"run-{name}", "FINISHED", metrics, {QUALITY_TAG: tag, "task": "classification"})


def test_trials_compared_on_validation_set_accuracy_against_the_validation_rows_noise():
    vanilla, adafactor = trial("vanilla", 0.70, 600.0), trial("adafactor", 0.80, 400.0)
    headline = quality_columns("classification", [vanilla, adafactor])[0]
    assert (headline.header, headline.metric, headline.noise) == ("Validation accuracy", "val_accuracy", "binomial")
    se, dof = difference_se(headline, VariantGroup("adafactor", [adafactor]), VariantGroup("vanilla", [vanilla]))
    # By hand: each side's binomial variance p(1 - p)/n over its own validation rows.
    assert se == math.sqrt(0.8 * 0.2 / 400 + 0.7 * 0.3 / 600) and dof is None
