"""The report: built from a real MLflow store; every value is the stored metric, % against the baseline."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg

from pipelines.params import TrackingParams
from pipelines.report import COLUMNS, build_report, comparison_table, format_metric, format_relative, load_rows
from pipelines.tracking import RunLogger, open_experiment, start_run

RUNS = {
    "fast": {"train_time_s": 30.0, "peak_memory_bytes": 3e8, "test_accuracy": 0.81},
    "vanilla": {"train_time_s": 60.0, "peak_memory_bytes": 4e8, "test_accuracy": 0.80},
    "lean": {"train_time_s": 75.0, "peak_memory_bytes": 1e8, "test_accuracy": 0.79},
}


def make_store(tmp_path: Path):
    client, experiment_id = open_experiment(TrackingParams(uri="sqlite:///r.db", experiment="report"), tmp_path)
    parent = start_run(client, experiment_id, "train", {})
    for name, metrics in RUNS.items():
        run_id = start_run(client, experiment_id, name, {"variant": name}, parent_run_id=parent)
        logger = RunLogger(client, run_id)
        for step in range(1, 6):
            logger.log_dict({"train_loss": 1.5 / step}, step=step)
        logger.log_dict(
            {
                **metrics,
                "samples_per_s": 100.0,
                "tokens_per_s": 2500.0,
                "test_macro_f1": 0.7,
                "optimizer_state_bytes": 2e6,
                "peak_activation_bytes": 5e6,
            }
        )
        logger.close()
    failed = start_run(client, experiment_id, "broken", {"variant": "broken", "error": "boom"}, parent_run_id=parent)
    client.set_terminated(failed, "FAILED")
    return client, experiment_id, parent


def test_every_table_value_is_the_stored_metric_and_relative_to_vanilla(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    rows = load_rows(client, experiment_id, parent)
    table = comparison_table(rows)
    header, body = table[0], table[1:]
    assert [r[0] for r in body] == ["vanilla", "fast", "lean"]  # baseline first, failed run left out
    stored = {r.info.run_name: r.data.metrics for r in client.search_runs([experiment_id]) if r.info.run_name in RUNS}
    for cells in body:
        for column, cell in zip(COLUMNS, cells[1:], strict=True):
            expected = format_metric(stored[cells[0]][column.metric], column)
            if column.relative:
                expected += f" ({format_relative(stored[cells[0]][column.metric], stored['vanilla'][column.metric])})"
            assert cell == expected, (header, cells)
    assert body[1][1] == "30.0 s (50%)" and body[2][4].endswith("(25%)")


def test_report_files_are_written_with_real_plots(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    assert "| vanilla | 60.0 s (100%)" in markdown and "broken (FAILED): boom" in markdown
    for png in ("comparison.png", "loss_curves.png"):
        image = mpimg.imread(out / png)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert image[..., :3].std() > 0.05  # not blank
