"""The report: built from a real MLflow store; every value is the stored metric, % against the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from pipelines.comparison import COLUMNS, DELTA_HEADER, TrialRow
from pipelines.params import TrackingParams
from pipelines.report import build_report, comparison_table, format_metric, format_relative, load_rows
from pipelines.tracking.runs import RunLogger, open_experiment, start_run

RUNS = {
    "fast": {"train_time_s": 30.0, "peak_train_memory_bytes": 3e8, "test_accuracy": 0.81},
    "vanilla": {"train_time_s": 60.0, "peak_train_memory_bytes": 4e8, "test_accuracy": 0.80},
    "lean": {"train_time_s": 75.0, "peak_train_memory_bytes": 1e8, "test_accuracy": 0.79},
}


def make_store(tmp_path: Path):
    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///r.db", experiment="report", registered_model=None, upload_retry_s=1), tmp_path
    )
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
                "padding_fraction": 0.25,
                "test_macro_f1": 0.7,
                "optimizer_state_bytes": 2e6,
                "peak_activation_bytes": 5e6,
                "wall_time_s": metrics["train_time_s"] + 5.0,
                "peak_rss_bytes": 9e8,
                "test_accuracy_ci_low": metrics["test_accuracy"] - 0.03,
                "test_accuracy_ci_high": metrics["test_accuracy"] + 0.03,
                "test_rows": 600.0,
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
        for column, cell in zip(COLUMNS, cells[1:], strict=False):
            assert cell.startswith(format_metric(stored[cells[0]][column.metric], column)), (header, cells)
            if column.relative:
                relative = format_relative(stored[cells[0]][column.metric], stored["vanilla"][column.metric])
                assert f"({relative}" in cell, (column, cell)
    vanilla, fast, lean = (dict(zip(header, cells, strict=True)) for cells in body)
    # One run per variant: time has no noise estimate (no mark); exact byte counts differ beyond noise (*).
    assert fast["Train time"] == "30.0 s (50%)" and lean["Peak train memory"] == "95.4 MiB (25%*)"
    assert vanilla["Accuracy"] == "80.00% [77.0, 83.0]" and vanilla[DELTA_HEADER] == "–"
    # 1 point on 600 test rows: the binomial noise is about 2.3 points at 95%.
    assert fast[DELTA_HEADER] == "+1.00, within noise"


def test_report_files_are_written_with_real_plots(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    assert "| vanilla | 60.0 s (100%)" in markdown and "broken (FAILED): boom" in markdown
    assert "Train time is the optimizer steps only" in markdown and "noise is unknown" in markdown
    for png in ("comparison.png", "loss_curves.png"):
        image = mpimg.imread(out / png)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert image[..., :3].std() > 0.05  # not blank


def test_the_evaluated_models_confusion_matrix_is_drawn_into_the_report(tmp_path: Path):
    # `dvc plots show` draws it with Vega from a CDN (blank offline); the report carries its own.
    client, experiment_id, parent = make_store(tmp_path)
    out = tmp_path / "reports"
    out.mkdir()
    pairs = [{"actual": a, "predicted": p} for a, p in [("World", "World")] * 9 + [("World", "Sports")] * 3
             + [("Sports", "Sports")] * 8 + [("Business", "Sci/Tech")] * 2]  # fmt: skip
    markdown = build_report(client, experiment_id, parent, out, evaluated={"confusion": pairs})
    assert "![Confusion matrix (test split, the evaluated model)](confusion.png)" in markdown
    assert colored_pixels(out / "confusion.png") > 2000  # the cells, shaded by count
    assert "Confusion matrix" in (out / "report.html").read_text()
    empty = tmp_path / "no-pairs"
    empty.mkdir()
    assert "confusion.png" not in build_report(client, experiment_id, parent, empty)  # none given: no figure


def colored_pixels(png: Path) -> int:
    """Pixels with clear colour (plot bars and lines), as opposed to black, grey and white text and page."""
    image = mpimg.imread(png)[..., :3]
    return int(((image.max(axis=2) - image.min(axis=2)) > 0.25).sum())


def screenshot(chromium: str, page: Path, out: Path) -> Path:
    import subprocess

    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={out.parent / ('profile-' + out.stem)}",
            "--window-size=1300,3000",
            f"--screenshot={out}",
            page.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def test_html_report_is_self_contained_and_shows_its_images_in_chromium(tmp_path: Path):
    import re
    import shutil

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:  # as the MLflow UI test does: .ci/run installs it; a machine without one skips, saying why
        pytest.skip("Chromium not installed (Debian's chromium; .ci/run installs it)")
    client, experiment_id, parent = make_store(tmp_path)
    out = tmp_path / "reports"
    out.mkdir()
    build_report(client, experiment_id, parent, out)
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 4 and not re.search(r'src="(?!data:)', page)
    # Move the page away from its PNGs: it must not need them.
    alone = tmp_path / "alone" / "report.html"
    alone.parent.mkdir()
    alone.write_text(page)
    broken = tmp_path / "alone" / "broken.html"
    broken.write_text(re.sub(r'src="data:image/png;base64,[^"]*"', 'src="missing.png"', page))
    with_images = colored_pixels(screenshot(chromium, alone, tmp_path / "shot.png"))
    without = colored_pixels(screenshot(chromium, broken, tmp_path / "broken.png"))
    assert with_images > 20_000 and with_images > 20 * max(without, 1), (with_images, without)


def test_repeated_variants_show_mean_sd_and_mark_differences_beyond_the_noise(tmp_path: Path):
    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///r.db", experiment="noise", registered_model=None, upload_retry_s=1), tmp_path
    )
    parent = start_run(client, experiment_id, "train", {})
    times = {"vanilla": [60.0, 62.0, 61.0], "slower": [90.0, 92.0, 91.0], "same": [60.5, 61.5, 62.5]}
    for name, values in times.items():
        for seed, seconds in enumerate(values):
            run_id = start_run(client, experiment_id, f"{name}-{seed}", {"variant": name}, parent_run_id=parent)
            client.log_metric(run_id, "train_time_s", seconds)
            client.log_metric(run_id, "test_accuracy", 0.80 + 0.01 * seed)
            client.set_terminated(run_id, "FINISHED")
    header, *body = comparison_table(load_rows(client, experiment_id, parent))
    rows = {cells[0]: dict(zip(header, cells, strict=True)) for cells in body}
    assert list(rows) == ["vanilla", "slower", "same"]  # one row per variant, baseline first
    assert rows["vanilla"]["Train time"] == "61.0 s ± 1.0 (n=3) (100%)"
    assert rows["slower"]["Train time"] == "91.0 s ± 1.0 (n=3) (149%*)"
    assert rows["same"]["Train time"] == "61.5 s ± 1.0 (n=3) (101%, within noise)"
    assert rows["same"]["Accuracy"] == "81.00% ± 1.00 (n=3)" and rows["same"][DELTA_HEADER] == "+0.00, within noise"


def test_quality_columns_follow_the_task_and_trainable_params_show_once():
    from pipelines.comparison import TrialRow, columns_for, delta_header

    lora = TrialRow("lora", "r", "FINISHED", {"frozen_param_bytes": 1e6, "trainable_param_bytes": 1e4}, {})
    for task, first in (("classification", "Accuracy"), ("causal_lm", "Exact match"), ("seq2seq", "BLEU")):
        headers = [c.header for c in columns_for(task, [lora])]
        assert headers.count("Trainable param memory") == 1 and first in headers
        assert "Trainable param memory" not in [c.header for c in columns_for(task, [])]
    assert delta_header("seq2seq") == "Δ BLEU vs baseline" and delta_header("causal_lm") == "Δ exact match vs baseline"


def test_rows_follow_the_declared_variant_order_not_the_start_order(tmp_path: Path):
    # Concurrent trials start in any order; each trial tags its variant's place in tune.variants.
    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///o.db", experiment="order", registered_model=None, upload_retry_s=1), tmp_path
    )
    parent = start_run(client, experiment_id, "train", {})
    declared = ["vanilla", "bf16", "accumulation", "checkpointing"]
    for name in ["checkpointing", "bf16", "accumulation", "vanilla"]:  # the order they happened to start
        tags = {"variant": name, "variant_order": str(declared.index(name))}
        run_id = start_run(client, experiment_id, name, tags, parent_run_id=parent)
        client.set_terminated(run_id, "FINISHED")
    assert [row.name for row in load_rows(client, experiment_id, parent)] == declared


def test_a_planned_trial_shows_its_predicted_peak_and_the_error(tmp_path: Path):
    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///p.db", experiment="plan", registered_model=None, upload_retry_s=1), tmp_path
    )
    parent = start_run(client, experiment_id, "train", {})
    for name, predicted in (("vanilla", 4e8), ("lean", 1.1e8)):
        run_id = start_run(client, experiment_id, name, {"variant": name}, parent_run_id=parent)
        logger = RunLogger(client, run_id)
        metrics = {**RUNS["vanilla" if name == "vanilla" else "lean"], "samples_per_s": 1.0, "tokens_per_s": 1.0}
        metrics.update(padding_fraction=0.1, optimizer_state_bytes=1.0, peak_activation_bytes=1.0, wall_time_s=1.0)
        metrics.update(peak_rss_bytes=1.0, test_macro_f1=0.7, predicted_peak_train_memory_bytes=predicted)
        logger.log_dict(metrics)
        logger.close()
    header, *body = comparison_table(load_rows(client, experiment_id, parent))
    cells = {row[0]: dict(zip(header, row, strict=True)) for row in body}
    assert cells["vanilla"]["Predicted peak"] == "381.5 MiB (+0.0% vs measured)"
    assert cells["lean"]["Predicted peak"] == "104.9 MiB (+10.0% vs measured)"


def test_noise_marks_use_welchs_t_at_the_repeats_degrees_of_freedom():
    from pipelines.noise import critical_value, exceeds_noise, repeats_se

    # Two seeds a side, a difference of 3 standard errors: beyond 1.96 (a normal quantile would mark it), but
    # within t's 4.30 at 2 degrees of freedom: not marked.
    a, b = [10.0, 12.0], [13.0, 15.0]
    se, df = repeats_se(b, a)
    assert se == pytest.approx(1.0 * 2**0.5) and df == pytest.approx(2.0)
    assert critical_value(df) == pytest.approx(4.303, abs=1e-3)
    assert not exceeds_noise(3.0, se, df) and exceeds_noise(3.0, se)  # t says within; the normal would mark it
    # Far apart (10 standard errors): marked by t too.
    assert exceeds_noise(10 * se, se, df)
    # Many seeds: t approaches the normal's 1.96.
    assert critical_value(1000) == pytest.approx(1.962, abs=1e-3)
    # Repeats that agree to the byte: any difference is real, none is not.
    assert repeats_se([5.0, 5.0], [6.0, 6.0]) == (0.0, None) and exceeds_noise(1.0, 0.0) and not exceeds_noise(0.0, 0.0)


def test_a_cuda_memory_peak_is_not_treated_as_exact(tmp_path: Path):
    from pipelines.comparison import SPEED_MEMORY_COLUMNS, VariantGroup, noise_mark

    peak = next(c for c in SPEED_MEMORY_COLUMNS if c.metric == "peak_train_memory_bytes")

    def group(name: str, device: str, value: float) -> VariantGroup:
        row = TrialRow(name, "run", "FINISHED", {peak.metric: value}, {"device.resolved": device})
        return VariantGroup(name, [row])

    assert noise_mark(peak, group("lean", "cpu", 1e9), group("vanilla", "cpu", 2e9)) == "*"  # exact bytes
    assert noise_mark(peak, group("lean", "cuda:0", 1e9), group("vanilla", "cuda:0", 2e9)) == ""  # one run: unknown


TASK_RUNS = {  # one trial per task, with its headline quality on the scale the task logs it
    "classification": ({"test_accuracy": 0.81, "test_macro_f1": 0.8}, "Test accuracy (%)", 81.0),
    "causal_lm": (
        {"test_exact_match": 0.42, "test_token_accuracy": 0.7, "test_perplexity": 3.1},
        "Test exact match (%)",
        42.0,
    ),  # fmt: skip
    "seq2seq": (
        {"test_bleu": 4.71, "test_chrf": 20.5, "test_exact_match": 0.02, "test_perplexity": 9.0},
        "Test bleu",
        4.71,
    ),  # fmt: skip
}


@pytest.mark.parametrize("task", list(TASK_RUNS))
def test_each_tasks_report_renders_its_own_numbers_on_their_own_scale(tmp_path: Path, monkeypatch, task):
    from matplotlib.figure import Figure

    quality, axis_label, shown = TASK_RUNS[task]
    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///r.db", experiment="report", registered_model=None, upload_retry_s=1), tmp_path
    )
    parent = start_run(client, experiment_id, "train", {})
    run_id = start_run(client, experiment_id, "vanilla", {"variant": "vanilla", "task": task}, parent_run_id=parent)
    logger = RunLogger(client, run_id)
    logger.log_dict({"train_loss": 1.0}, step=1)
    logger.log_dict({"train_time_s": 12.0, "peak_train_memory_bytes": 2e8, "padding_fraction": 0.125, **quality})
    logger.close()
    drawn: dict[str, dict[str, list[float]]] = {}
    save = Figure.savefig

    def record(fig, path, *args, **kwargs):  # what each chart draws: bar lengths and points, by axis label
        for ax in fig.axes:
            bars = [patch.get_width() for patch in ax.patches if hasattr(patch, "get_width")]
            points = [float(y) for collection in ax.collections for _, y in collection.get_offsets()]
            for label in (ax.get_xlabel(), ax.get_ylabel()):
                drawn.setdefault(label, {"bars": [], "points": []})
                drawn[label]["bars"] += bars if label == ax.get_xlabel() else []
                drawn[label]["points"] += points if label == ax.get_ylabel() else []
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    assert drawn[axis_label]["bars"] == [pytest.approx(shown)]  # the comparison chart's quality panel
    assert drawn[axis_label]["points"] == [pytest.approx(shown)]  # the time-vs-quality chart
    row = next(line for line in markdown.splitlines() if line.startswith("| vanilla |"))
    assert "12.5%" in row  # padding: a share of the positions, in [0, 100]%


def test_times_taken_under_load_are_marked_and_the_load_is_named(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    fast = next(r for r in client.search_runs([experiment_id]) if r.info.run_name == "fast")
    vanilla = next(r for r in client.search_runs([experiment_id]) if r.info.run_name == "vanilla")
    for run, load in ((fast, 3.4), (vanilla, 1.9)):
        client.log_metric(run.info.run_id, "host_load_mean", load)
        client.log_metric(run.info.run_id, "host_cores", 2.0)
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    rows = {line.split(" | ")[0].strip("| "): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "30.0 s † (50%)" in rows["fast"] and "†" not in rows["vanilla"]  # 1.9 on 2 cores: no thread waited
    assert "†: timed under load (fast: load 3.4 on 2 cores)" in markdown


def test_times_taken_on_a_shared_card_are_marked_with_the_count(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    fast = next(r for r in client.search_runs([experiment_id]) if r.info.run_name == "fast")
    client.log_metric(fast.info.run_id, "card_sharing", 4.0)  # gpu: auto packed it with 3 other trials
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    rows = {line.split(" | ")[0].strip("| "): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "30.0 s † (50%)" in rows["fast"] and "†" not in rows["vanilla"]
    assert "†: timed under load (fast: card shared by 4 trials)" in markdown


def test_times_taken_beside_other_trials_of_the_project_are_marked_with_the_count(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    fast = next(r for r in client.search_runs([experiment_id]) if r.info.run_name == "fast")
    client.log_metric(fast.info.run_id, "concurrent_trials", 2.0)  # dvc queue start -j 2: another experiment trained
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, parent, out)
    rows = {line.split(" | ")[0].strip("| "): line for line in markdown.splitlines() if line.startswith("| ")}
    assert "30.0 s † (50%)" in rows["fast"] and "†" not in rows["vanilla"]
    assert "†: timed under load (fast: trained beside 1 other trial of this project on this host)" in markdown


def test_a_one_variant_run_is_compared_with_the_last_commits_best_trial(tmp_path: Path):
    client, experiment_id, parent = make_store(tmp_path)
    before = next(r for r in client.search_runs([experiment_id]) if r.info.run_name == "vanilla")
    experiment = start_run(client, experiment_id, "train", {})
    run_id = start_run(client, experiment_id, "adafactor", {"variant": "default"}, parent_run_id=experiment)
    logger = RunLogger(client, run_id)
    logger.log_dict({"train_time_s": 45.0, "peak_train_memory_bytes": 2e8, "test_accuracy": 0.80})
    logger.close()
    out = tmp_path / "reports"
    out.mkdir()
    markdown = build_report(client, experiment_id, experiment, out, (before.info.run_id, "0123456789abcdef"))
    assert "relative to the baseline trial `last commit 0123456: vanilla`" in markdown
    assert "| last commit 0123456: vanilla | 60.0 s (100%)" in markdown and "| default | 45.0 s (75%)" in markdown
    # A run id the store does not have (a fresh clone's store): the run's own table, no baseline row.
    alone = build_report(client, experiment_id, experiment, out, ("0" * 32, "0123456789abcdef"))
    assert "last commit" not in alone and "| default | 45.0 s (100%)" in alone


def test_a_search_spaces_configurations_are_rows_of_their_own_with_their_seeds_as_repeats(tmp_path: Path):
    """A search space of two learning rates x two seeds on one variant: four trials, two configurations. Only the
    trials that drew the same lr are repeats (`pipelines.baseline.configuration`'s rule, as the train time's interval
    counts them); one row of n=4 would mix the two configurations into one mean."""
    from pipelines.trials.trial import trial_overrides

    client, experiment_id = open_experiment(
        TrackingParams(uri="sqlite:///s.db", experiment="search", registered_model=None, upload_retry_s=1), tmp_path
    )
    parent = start_run(client, experiment_id, "train", {})
    times = {(1e-3, 1): 60.0, (1e-3, 2): 62.0, (3e-3, 1): 40.0, (3e-3, 2): 44.0}  # the faster lr converges sooner
    for (lr, seed), seconds in times.items():
        config = {"variant": "vanilla", "lr": lr, "seed": seed}  # as Ray's grid over search_space draws it
        tags = {"variant": "vanilla", "overrides": json.dumps(trial_overrides(config, {"vanilla": {}}), sort_keys=True)}
        run_id = start_run(client, experiment_id, f"vanilla · seed {seed} · lr={lr:.3g}", tags, parent_run_id=parent)
        client.log_metric(run_id, "train_time_s", seconds)
        client.set_terminated(run_id, "FINISHED")
    header, *body = comparison_table(load_rows(client, experiment_id, parent))
    rows = {cells[0]: dict(zip(header, cells, strict=True)) for cells in body}
    assert list(rows) == ["vanilla · lr=0.001", "vanilla · lr=0.003"]
    # Each configuration's own seeds, by hand: mean 61.0, sd sqrt(2) = 1.4; mean 42.0, sd sqrt(8) = 2.8.
    assert rows["vanilla · lr=0.001"]["Train time"] == "61.0 s ± 1.4 (n=2) (100%)"
    assert rows["vanilla · lr=0.003"]["Train time"].startswith("42.0 s ± 2.8 (n=2) (69%")


def test_the_per_class_table_shows_each_label_as_written_beside_its_metric_key():
    from pipelines.report import markdown_table, per_class_table
    from pipelines.tasks.classification_scoring import per_class_rows

    names = ["  Spaced  ", "A | B", "経済"]
    metrics = {f"test_{kind}.{key}": 0.5 for kind in ("precision", "recall") for key in ("Spaced", "A_B", "経済")}
    table = per_class_table(per_class_rows(metrics, names))
    assert [row[:2] for row in table[1:]] == [
        ['"  Spaced  "', "test_precision.Spaced, test_recall.Spaced"],
        ['"A | B"', "test_precision.A_B, test_recall.A_B"],
        ['"経済"', "test_precision.経済, test_recall.経済"],
    ]
    assert '| "A \\| B" |' in markdown_table(table)  # a `|` in a label is no column of its own
    assert per_class_table([{"class": "0 words", "recall": 1.0}]) == []  # a generation task's rows: no keys, no table
