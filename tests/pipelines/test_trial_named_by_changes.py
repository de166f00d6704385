"""A trial of the default variant is named by what its experiment changed from the baseline commit's params.yaml
(`optim=adafactor`, as `dvc exp show`'s `changed` column says it), in its MLflow run name and in the report."""

from __future__ import annotations

from pathlib import Path

from pipelines.params import TrackingParams
from pipelines.report import build_report
from pipelines.tracking.runs import RunLogger, open_experiment, start_run
from pipelines.trial_context import TRIAL_NAME_TAG
from pipelines.trials.trial import trial_name, trial_run_name


def test_the_default_variant_is_named_by_the_experiments_changes():
    assert trial_run_name({"variant": "default"}, 42, "exp-1a2b3", "optim=adafactor") == (
        "optim=adafactor · seed 42 · exp-1a2b3"
    )
    assert trial_name("default", "optim=adafactor lr=0.002") == "optim=adafactor lr=0.002"
    # Nothing changed ('-'), no committed params.yaml ('no baseline'), outside DVC (''): `default`, as before.
    assert [trial_name("default", changed) for changed in ("-", "no baseline", "")] == ["default"] * 3
    assert trial_name("adafactor", "lr=0.002") == "adafactor"  # a declared variant's name says what it changes


def test_the_report_names_a_trial_by_its_name_tag_not_default(tmp_path: Path):
    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///r.db", experiment="report", registered_model=None, upload_retry_s=1), tmp_path
    )
    parent = start_run(client, experiment_id, "train", {})
    tags = {"variant": "default", TRIAL_NAME_TAG: "optim=adafactor"}
    run_id = start_run(client, experiment_id, "optim=adafactor · seed 42", tags, parent_run_id=parent)
    logger = RunLogger(client, run_id)
    logger.log_dict({"train_time_s": 30.0, "peak_train_memory_bytes": 3e8, "test_accuracy": 0.8, "samples_per_s": 1.0})
    logger.close()
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    assert "| optim=adafactor |" in markdown and "default" not in markdown
    assert "<td>optim=adafactor</td>" in (out / "report.html").read_text()
