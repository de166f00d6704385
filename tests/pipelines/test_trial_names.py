"""A trial's MLflow run name says what it varies."""

from __future__ import annotations

from pipelines.trials.trial import trial_run_name


def test_a_trial_is_named_by_its_variant_seed_and_searched_values():
    assert trial_run_name({"variant": "default"}, 42) == "default · seed 42"
    assert trial_run_name({"variant": "default"}, 42, "exp-1a2b3") == "default · seed 42 · exp-1a2b3"
    assert trial_run_name({"variant": "adafactor", "seed": 43, "repeat": 1}, 42) == "adafactor · seed 43"
    searched = {"variant": "lean", "lr": 0.000312345, "batch_size": 16}
    assert trial_run_name(searched, 7) == "lean · seed 7 · lr=0.000312 · batch_size=16"


def test_the_peak_is_also_in_mib_and_the_figures_stay_exact():
    from pipelines.trials.trial import shown_figures

    shown = shown_figures({"samples_per_s": 2059.711872173761, "train_time_s": 6.101824322999164,
                           "peak_train_memory_bytes": 21998080.0})  # fmt: skip
    assert shown == {"samples_per_s": 2059.711872173761, "train_time_s": 6.101824322999164,
                     "peak_train_memory_bytes": 21998080.0, "peak_train_memory_mib": 21.0}  # fmt: skip


def test_a_parent_run_is_named_by_what_it_changes_and_its_experiment_the_baseline_as_such():
    """Issue 71: parents were named after the DVC experiment alone, so the baseline's row looked like the others."""
    from pipelines.trials.parent_run import parent_run_name

    assert parent_run_name("-", "", "0123456789") == "baseline"  # `dvc repro` at the committed params
    assert parent_run_name("-", "gusty-gram", "0123456789") == "baseline · gusty-gram"
    assert parent_run_name("optim=adafactor", "gusty-gram", "0123456789") == "optim=adafactor · gusty-gram"
    assert parent_run_name("no baseline", "", "0123456789") == "train-01234567"  # no committed params.yaml
    assert parent_run_name("", "", "0123456789") == "train-01234567"
