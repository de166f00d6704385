"""A trial's MLflow run name says what it varies."""

from __future__ import annotations

from pipelines.trials.trial import trial_run_name


def test_a_trial_is_named_by_its_variant_seed_and_searched_values():
    assert trial_run_name({"variant": "default"}, 42) == "default · seed 42"
    assert trial_run_name({"variant": "adafactor", "seed": 43, "repeat": 1}, 42) == "adafactor · seed 43"
    searched = {"variant": "lean", "lr": 0.000312345, "batch_size": 16}
    assert trial_run_name(searched, 7) == "lean · seed 7 · lr=0.000312 · batch_size=16"
