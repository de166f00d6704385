"""Ray Tune trials tracked in MLflow's sqlite store: ASHA, variant grids, DVC's queue. A real `mlflow server` that
goes away mid-run: tests/e2e/test_outage_sqlite.py; a real team server (PostgreSQL, a bucket, auth), its outages and
restarts: tests/e2e/test_team_server.py."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import FINAL_METRICS, FOUR_VARIANTS, QUICK, run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Student's t two-sided 95% quantile at 1 degree of freedom (two seeds): t with 1 df is the standard Cauchy
# distribution, whose quantile function is tan(pi (p - 1/2)), so this is tan(0.475 pi); printed tables give 12.706.
# Written here, not taken from pipelines.noise, so the interval the test expects does not come from the code it tests.
T975_ONE_DF = 12.706204736174696


def run_stages(root: Path, *stages: str) -> subprocess.CompletedProcess[str]:
    out = None
    for stage in stages:
        out = run([sys.executable, "-m", f"stages.{stage}"], root, timeout=800)
    return out


def runs_by_kind(client: MlflowClient, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return runs, parents, children


def t_interval_of_two(values: list[float]) -> tuple[float, float]:
    """The 95% t-interval of the mean of two seeds' values, by hand: mean -/+ t(0.975, 1 df) * s / sqrt(2), s the
    sample standard deviation (n - 1 in the denominator)."""
    assert len(values) == 2, values  # tune.num_samples: 2, so one degree of freedom
    mean, half = statistics.fmean(values), T975_ONE_DF * statistics.stdev(values) / math.sqrt(len(values))
    return mean - half, mean + half


def assert_complete_grid(client: MlflowClient, experiment: str, variants: set[str]) -> None:
    runs, parents, children = runs_by_kind(client, experiment)
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert parents[0].data.tags["params_hash"] and parents[0].data.tags["git_commit"]
    assert {c.data.tags["variant"] for c in children} == variants and len(children) == len(variants)
    assert all(c.data.tags["mlflow.parentRunId"] == parents[0].info.run_id for c in children)
    for child in children:
        assert child.info.status == "FINISHED", (child.data.tags.get("variant"), child.data.tags.get("error"))
        assert child.data.params["optim"] in ("adamw", "adafactor") and "data.max_length" in child.data.params
        for name in FINAL_METRICS:  # the test split's are the evaluate stage's, for the chosen trial alone
            assert (name in child.data.metrics) != name.startswith("test_"), (child.data.tags["variant"], name)
        assert "tokenize.train.pad_fraction_fixed" in child.data.metrics
        assert child.data.tags["env.torch"] and child.data.tags["env.device"]
    assert not [r for r in runs if r.info.status == "RUNNING"]


@pytest.mark.parametrize("concurrent", [2, 4])
def test_same_grid_on_the_sqlite_store_concurrently(project_copy: Path, concurrent: int):
    # Half a core per trial lets 4 trials run at once on a 2-core machine.
    write_params(
        project_copy,
        {
            **QUICK,
            "tune.variants": FOUR_VARIANTS,
            "tune.max_concurrent_trials": concurrent,
            "tune.resources_per_trial.cpu": 2 / concurrent,
        },
    )
    out = run_stages(project_copy, "tokenize", "train")
    assert "database is locked" not in out.stdout + out.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    assert_complete_grid(client, "finetune", set(FOUR_VARIANTS))
    for child in runs_by_kind(client, "finetune")[2]:
        assert len(client.get_metric_history(child.info.run_id, "train_loss")) >= 5  # nothing lost


def test_asha_stops_at_least_one_of_six_trials_early(project_copy: Path):
    write_params(
        project_copy,
        {
            "data.generator.num_rows": 1500,
            "epochs": 3,
            "tune.num_samples": 6,
            "tune.scheduler": "asha",
            "tune.grace_period": 1,
            "tune.max_concurrent_trials": 2,
            "tune.search_space": {"lr": {"type": "loguniform", "low": 1e-5, "high": 3e-2}},
        },
    )
    run_stages(project_copy, "tokenize", "train")
    summary = json.loads((project_copy / "models/trials.json").read_text())
    assert len(summary["trials"]) + len(summary["stopped_early"]) == 6 and not summary["failed"]
    assert summary["stopped_early"], "ASHA stopped no trial"
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    _, _, children = runs_by_kind(client, "finetune")
    killed = [c for c in children if c.info.status == "KILLED"]
    assert len(killed) == len(summary["stopped_early"]) and "stopped early" in killed[0].data.tags["stopped"]
    lrs = {c.data.params["lr"] for c in children}
    assert len(lrs) == 6  # six different samples of the search space
    metrics = json.loads((project_copy / "metrics/train.json").read_text())
    assert metrics["trials.stopped_early"] == len(summary["stopped_early"]) and "best.lr" in metrics


def test_invalid_combination_fails_its_trial_alone_and_is_recorded(project_copy: Path):
    # Each part is valid on its own (so the schema accepts it at load); together they are not.
    write_params(
        project_copy,
        {
            **QUICK,
            "tune.max_concurrent_trials": 2,
            "tune.variants": {"fixed": {}, "auto": {"batch_size": "auto", "effective_batch_size": 32}},
            "tune.search_space": {"grad_accum_steps": {"type": "grid", "values": [1, 2]}},
        },
    )
    run_stages(project_copy, "tokenize", "train")
    summary = json.loads((project_copy / "models/trials.json").read_text())
    assert len(summary["trials"]) == 3 and len(summary["failed"]) == 1
    assert summary["failed"][0]["config"] == {"variant": "auto", "grad_accum_steps": 2}
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    _, _, children = runs_by_kind(client, "finetune")
    failed = [c for c in children if c.info.status == "FAILED"]
    assert len(failed) == 1 and "set grad_accum_steps: 1" in failed[0].data.tags["error"]


def test_same_params_and_seed_give_identical_metrics(project_copy: Path):
    write_params(project_copy, QUICK)
    run_stages(project_copy, "tokenize", "train")
    first = json.loads((project_copy / "metrics/train.json").read_text())
    run_stages(project_copy, "train")
    second = json.loads((project_copy / "metrics/train.json").read_text())
    for key in ("final_train_loss", "val_accuracy", "val_loss", "test_accuracy", "optimizer_steps"):
        assert first[key] == second[key], key


def test_repeats_run_each_variant_over_seeds_and_the_report_shows_mean_sd(project_copy: Path):
    write_params(
        project_copy,
        {
            **QUICK,
            "data.generator.num_rows": 800,
            "tune.num_samples": 2,
            "tune.variants": {"vanilla": {}, "adafactor": {"optim": "adafactor"}},
            "tune.max_concurrent_trials": 2,
        },
    )
    run_stages(project_copy, "tokenize", "train", "evaluate", "report")
    client = MlflowClient(tracking_uri=f"sqlite:///{project_copy / 'mlflow.db'}")
    _, _, children = runs_by_kind(client, "finetune")
    seeds = sorted((c.data.tags["variant"], c.data.params["seed"], c.data.tags["repeat"]) for c in children)
    assert seeds == [("adafactor", "42", "0"), ("adafactor", "43", "1"), ("vanilla", "42", "0"), ("vanilla", "43", "1")]
    assert all(c.info.status == "FINISHED" for c in children)
    report = (project_copy / "reports/report.md").read_text()
    vanilla = next(line for line in report.splitlines() if line.startswith("| vanilla |"))
    adafactor = next(line for line in report.splitlines() if line.startswith("| adafactor |"))
    assert "(n=2)" in vanilla and "(n=2)" in adafactor
    assert "*" in adafactor.split("|")[7] or "within noise" in adafactor.split("|")[7]  # optimizer state: marked
    # `dvc exp show`'s time carries its noise: the 95% interval of the evaluated variant's mean time over its seeds,
    # and the mark of trials that shared the cores.
    figures = json.loads((project_copy / "metrics/evaluate.json").read_text())
    best_run = json.loads((project_copy / "models/trials.json").read_text())["best"]["mlflow_run_id"]
    best_variant = client.get_run(best_run).data.tags["variant"]
    times = [c.data.metrics["train_time_s"] for c in children if c.data.tags["variant"] == best_variant]
    low, high = t_interval_of_two(times)
    assert figures["train_time_s_ci_low"] == pytest.approx(low, rel=1e-9), (figures, low, high)
    assert figures["train_time_s_ci_high"] == pytest.approx(high, rel=1e-9), (figures, low, high)
    assert ("shared by" in figures["timing"]) == (figures["concurrent_trials"] > 1), figures
