"""What an experiment changed from its baseline commit, and the marks on its time (`pipelines.baseline`), as
`dvc exp show`'s first columns show them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from pipelines.baseline import (
    BASELINE_ENV,
    CHANGED_WIDTH,
    baseline_commit,
    changed_params,
    changed_since_baseline,
    committed_json,
    repeat_times,
    timing_columns,
    timing_note,
)
from pipelines.noise import mean_interval
from tests.conftest import REPO_ROOT

DEFAULTS = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())


def with_changes(**changes: object) -> dict:
    """The default params with dotted keys set, as `dvc exp run -S key=value` sets them."""
    params = json.loads(json.dumps(DEFAULTS))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = params
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return params


def test_one_knob_changed_is_named_with_its_value():
    assert changed_params(with_changes(optim="adafactor"), DEFAULTS) == "optim=adafactor"
    assert changed_params(with_changes(tune__num_samples=3), DEFAULTS) == "tune.num_samples=3"
    assert (
        changed_params(with_changes(adapter__target_modules=["q", "v"]), DEFAULTS) == 'adapter.target_modules=["q","v"]'
    )
    assert changed_params(with_changes(memory_budget=None, compile=True), DEFAULTS) == "compile=true"
    assert changed_params(DEFAULTS, DEFAULTS) == "-"
    assert changed_params(DEFAULTS, None) == "no baseline"


def test_many_changes_fit_the_column_and_count_the_rest():
    changed = with_changes(optim="adafactor", lr=0.0003, batch_size=16, epochs=5, seed=7)
    shown = changed_params(changed, DEFAULTS)
    assert len(shown) <= CHANGED_WIDTH
    assert shown == "optim=adafactor batch_size=16 +3"  # in params.yaml's order
    removed = {k: v for k, v in DEFAULTS.items() if k != "fast_dropout"}
    assert changed_params(removed, DEFAULTS) == "fast_dropout=(unset)"
    long = changed_params(
        with_changes(model__name_or_path="HuggingFaceTB/SmolLM2-135M-Instruct", adapter__r=16), DEFAULTS
    )
    assert len(long) <= CHANGED_WIDTH and long.startswith("model.name_or_path=") and long.endswith("… +1")


def test_the_time_is_marked_where_it_cannot_stand_beside_the_baseline():
    here = {"timed_on": "box: cpu (AVX512), 2 cores", "host_load_per_core": 0.98, "concurrent_trials": 1.0}
    assert timing_note(here, dict(here)) == "ok"
    assert timing_note(here, {**here, "timed_on": "laptop: cpu (AVX2), 8 cores"}) == "baseline: other host"
    assert timing_note(here, {"test_accuracy": 0.7}) == "baseline: host unknown"  # committed before it was recorded
    assert timing_note(here, None) == "no baseline"
    queued = {**here, "concurrent_trials": 2.0, "host_load_per_core": 1.31}  # dvc queue start -j 2 on 2 cores
    assert timing_note(queued, here) == "shared by 2, load 1.31/core"
    assert timing_note(here, queued, width=10**6) == "baseline: shared by 2, baseline: load 1.31/core"
    # At most 28 characters in `dvc exp show`'s column (so the README's line fits 120 columns), the rest counted;
    # timing_full has them all.
    assert timing_note(here, queued) == "baseline: shared by 2 +1"
    both = timing_note(queued, {**queued, "timed_on": "laptop"}, width=10**6)
    assert both == "shared by 2, load 1.31/core, baseline: other host, baseline: shared by 2, baseline: load 1.31/core"
    # Two marks and "+3" would be 30 characters: one mark, and the four others counted.
    assert timing_note(queued, {**queued, "timed_on": "laptop"}) == "shared by 2 +4"
    columns = timing_columns(queued, [], {**queued, "timed_on": "laptop"})
    assert len(columns["timing"]) <= 28 and columns["timing_full"] == both
    assert "timing_full" not in timing_columns(here, [], dict(here))  # nothing left out: no second column


def test_repeats_give_the_time_an_interval_of_their_mean():
    times = [6.1, 6.7, 6.4]
    low, high = mean_interval(times)
    assert low < sum(times) / 3 < high and high - low == pytest.approx(2 * 4.303 * 0.3 / 3**0.5, rel=1e-3)
    summary = {  # tune.num_samples: 3 without a search space: one variant over seeds 42, 43, 44
        "best": {"mlflow_run_id": "r1", "variant": "fast", "config": {"variant": "fast", "seed": 42, "repeat": 0}},
        "trials": [{"variant": "fast", "mlflow_run_id": f"r{i}", "metrics": {"train_time_s": t},
                    "config": {"variant": "fast", "seed": 41 + i, "repeat": i - 1}}
                   for i, t in enumerate(times, start=1)]
                  + [{"variant": "slow", "metrics": {"train_time_s": 60.0}, "config": {"variant": "slow", "seed": 42}}],
    }  # fmt: skip
    assert repeat_times(summary, "r1") == times
    assert repeat_times(summary, "a-registered-version's-run") == []  # eval.model_uri: not these trials
    here = {"timed_on": "box", "host_load_per_core": 0.5}
    assert timing_columns(here, times, dict(here)) == {
        "timing": "ok", "train_time_s_ci_low": low, "train_time_s_ci_high": high}  # fmt: skip
    assert timing_columns(here, times[:1], dict(here)) == {"timing": "ok"}  # one run: no interval to give


def test_with_a_search_space_the_interval_is_over_the_evaluated_configurations_repeats_only(tmp_path: Path):
    """Five trials of one variant, a search space drawing lr from two values: the three that drew 1e-3 are repeats
    of the evaluated trial, the two that drew 3e-4 (slower) are another configuration and stay out of its interval.
    The runs are real MLflow runs, as the evaluate stage reads them; the summary is what the train stage writes."""
    from mlflow.tracking import MlflowClient
    from scipy import stats

    from pipelines.tracking.status import training_figures

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("search")
    drawn = [(1e-3, 6.1), (3e-4, 9.0), (1e-3, 6.7), (3e-4, 12.0), (1e-3, 6.4)]  # (sampled lr, train time), in order
    trials = []
    for i, (lr, seconds) in enumerate(drawn):
        run_id = client.create_run(experiment, tags={"variant": "default", "host": "box", "env.device": "cpu"},
                                   run_name=f"default · seed 42 · lr={lr:.3g}").info.run_id  # fmt: skip
        client.log_param(run_id, "lr", lr)
        client.log_metric(run_id, "train_time_s", seconds)
        client.set_terminated(run_id)
        run = client.get_run(run_id)
        trials.append({"trial_id": f"t{i}", "variant": run.data.tags["variant"], "mlflow_run_id": run_id,
                       "config": {"variant": "default", "lr": float(run.data.params["lr"])},
                       "metrics": dict(run.data.metrics)})  # fmt: skip
    summary = json.loads(json.dumps({"best": trials[0], "trials": trials}))  # as models/trials.json holds it
    evaluated = trials[0]["mlflow_run_id"]

    repeats = repeat_times(summary, evaluated)
    assert sorted(repeats) == [6.1, 6.4, 6.7]
    same = [client.get_run(t["mlflow_run_id"]).data.metrics["train_time_s"] for t in trials[::2]]
    mean, sem = sum(same) / 3, stats.tstd(same) / 3**0.5
    half = stats.t.ppf(0.975, df=2) * sem  # Student's t, 2 degrees of freedom: 4.303
    columns = timing_columns(training_figures(client, evaluated), repeats, None)
    assert columns["train_time_s_ci_low"] == pytest.approx(mean - half)
    assert columns["train_time_s_ci_high"] == pytest.approx(mean + half)
    assert (columns["train_time_s_ci_low"], columns["train_time_s_ci_high"]) == pytest.approx((5.655, 7.145), abs=1e-3)
    # A configuration drawn once has no repeats to give it an interval.
    alone = {**summary, "trials": trials[:2] + trials[3:4]}
    assert repeat_times(alone, evaluated) == [6.1]
    assert "train_time_s_ci_low" not in timing_columns(training_figures(client, evaluated), [6.1], None)


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def test_the_baseline_is_dvcs_baseline_commit_else_head(tmp_path, monkeypatch):
    monkeypatch.delenv(BASELINE_ENV, raising=False)
    assert baseline_commit(tmp_path) is None and committed_json("metrics/evaluate.json", tmp_path) is None  # no git
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "metrics").mkdir()
    for optim, accuracy in (("adamw", 0.7), ("lion", 0.8)):
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(with_changes(optim=optim), sort_keys=False))
        (tmp_path / "metrics/evaluate.json").write_text(json.dumps({"test_accuracy": accuracy}))
        git(tmp_path, "add", "-A")
        git(tmp_path, "commit", "-qm", optim)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(with_changes(optim="adafactor"), sort_keys=False))
    assert baseline_commit(tmp_path) == git(tmp_path, "rev-parse", "HEAD")
    assert committed_json("metrics/evaluate.json", tmp_path) == {"test_accuracy": 0.8}
    assert changed_since_baseline("params.yaml", tmp_path) == "optim=adafactor"
    monkeypatch.setenv(BASELINE_ENV, git(tmp_path, "rev-parse", "HEAD~1"))  # a queued experiment's baseline
    assert committed_json("metrics/evaluate.json", tmp_path) == {"test_accuracy": 0.7}
    assert baseline_commit(tmp_path) == git(tmp_path, "rev-parse", "HEAD~1")
