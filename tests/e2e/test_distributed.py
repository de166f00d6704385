"""Data-parallel trials: 2 Ray Train workers (DDP over gloo, CPU) inside a Ray Tune trial."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import run, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Dropout off so the two runs see the same arithmetic (ranks draw their own dropout masks).
COMMON = {
    "data.generator.num_rows": 1280,  # 896 train rows: 56 global batches of 16, none split across ranks
    "epochs": 2,
    "batch_size": 8,
    "log_every_n_steps": 1,
    "lr": 0.001,
    "model.config.dropout": 0.0,
    "checkpoint_every_n_steps": None,
}
# Loss points may differ by float rounding only: DDP averages per-rank gradients where one
# process sums them, so Adam's updates differ in the last bits and drift slowly.
LOSS_TOLERANCE = 1e-5  # measured: at most 1.8e-7 over 112 steps


def train_run(root: Path, experiment: str, overrides: dict) -> tuple[MlflowClient, list]:
    write_params(root, {**COMMON, "tracking.experiment": experiment, **overrides})
    run([sys.executable, "-m", "stages.train"], root, timeout=800)
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    return client, client.search_runs([exp.experiment_id])


def loss_curve(client: MlflowClient, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train_loss"))


def test_two_workers_match_one_worker_with_the_same_global_batch_and_log_one_run(project_copy):
    root = project_copy
    write_params(root, COMMON)
    run([sys.executable, "-m", "stages.tokenize"], root)

    # 2 workers x 8 rows = 16 rows per step; 1 worker x 8 rows x 2 accumulated = the same 16 rows.
    client, runs = train_run(root, "two-workers", {"distributed.num_workers": 2, "grad_accum_steps": 1})
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 2 and len(children) == 1, "one parent and one run per trial, not one per worker"
    trial = children[0]
    assert trial.info.status == "FINISHED", trial.data.tags.get("error")
    assert trial.data.metrics["world_size"] == 2
    assert trial.data.params["distributed.num_workers"] == "2"
    for name in ("train_time_s", "samples_per_s", "test_accuracy", "val_accuracy", "peak_train_memory_bytes"):
        assert name in trial.data.metrics, name
    two = loss_curve(client, trial.info.run_id)
    trials = json.loads((root / "models" / "trials.json").read_text())
    assert trials["best"]["mlflow_run_id"] == trial.info.run_id
    assert (root / "models" / "best" / "model.safetensors").is_file()

    client, runs = train_run(root, "one-worker", {"distributed.num_workers": 1, "grad_accum_steps": 2})
    single = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    one = loss_curve(client, single.info.run_id)

    assert [s for s, _ in two] == [s for s, _ in one] and len(one) >= 100
    worst = max(abs(a - b) for (_, a), (_, b) in zip(two, one, strict=True))
    assert worst < LOSS_TOLERANCE, f"largest loss difference {worst:.2e}"
    # Every row of the split is seen once per epoch either way.
    assert trial.data.metrics["samples_per_s"] * trial.data.metrics["train_time_s"] == pytest.approx(
        single.data.metrics["samples_per_s"] * single.data.metrics["train_time_s"], rel=1e-6
    )

    # FSDP through the same Ray Train workers: DDP's curve, and rank 0 saves the whole trained model.
    client, runs = train_run(
        root, "two-workers-fsdp", {"distributed.num_workers": 2, "grad_accum_steps": 1, "distributed.strategy": "fsdp"}
    )
    sharded = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    assert sharded.info.status == "FINISHED", sharded.data.tags.get("error")
    fsdp = loss_curve(client, sharded.info.run_id)
    assert [s for s, _ in fsdp] == [s for s, _ in two]
    worst = max(abs(a - b) for (_, a), (_, b) in zip(fsdp, two, strict=True))
    assert worst < LOSS_TOLERANCE, f"FSDP vs DDP: largest loss difference {worst:.2e}"
    assert sharded.data.metrics["test_accuracy"] == pytest.approx(trial.data.metrics["test_accuracy"], abs=0.01)
    assert sharded.data.metrics["param_bytes"] < 0.6 * trial.data.metrics["param_bytes"]  # each worker: its half


def test_a_causal_lm_experiment_on_two_workers_completes_and_reports_its_own_metrics(project_copy):
    """`dvc exp run -S task=causal_lm -S distributed.num_workers=2`: rank 0's final metrics are the task's own.

    The workers' final report once read `test_accuracy`, a key only classification writes: every causal_lm or
    seq2seq trial on two workers failed after training.
    """
    root = project_copy
    write_params(root, {"data.generator.num_rows": 300, "epochs": 1, "batch_size": 8, "eval.max_new_tokens": 8})
    run(["git", "commit", "-qam", "small causal_lm run"], root)

    run(["dvc", "exp", "run", "-S", "task=causal_lm", "-S", "distributed.num_workers=2"], root, timeout=800)

    evaluate = json.loads((root / "metrics/evaluate.json").read_text())
    assert {"test_loss", "test_exact_match", "test_token_accuracy"} <= set(evaluate), evaluate
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("finetune")
    trial = next(r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags)
    assert trial.info.status == "FINISHED", trial.data.tags.get("error")
    assert trial.data.metrics["world_size"] == 2
    assert "test_exact_match" in trial.data.metrics and "test_accuracy" not in trial.data.metrics


# Ray's lines a distributed trial printed besides ours (issue 71): the placement group cleaner's warning every second
# and its traceback (no State API without a dashboard), Ray Train's INFO lines, the preemption watcher's core_worker
# error. Warnings and errors of Ray's own still print.
RAY_NOISE = ("PlacementGroupCleaner", "Failed to query Ray Train Controller", "Reporting training result",
             "Requesting resources", "Started training worker group", "Setting up process group",
             "PreemptionWatcher")  # fmt: skip


def assert_ray_quiet(output: str) -> None:
    """No line of RAY_NOISE, and none of the trial's own lines printed twice (Ray Train's print patch did that)."""
    noisy = [line for line in output.splitlines() if any(noise in line for noise in RAY_NOISE)]
    assert not noisy, "\n".join(noisy[:10])
    ours = [
        line for line in output.splitlines() if "RayTrainWorker" in line and ("epoch " in line or "warning:" in line)
    ]
    assert ours and len(ours) == len(set(ours)), "\n".join(ours)


def test_fsdp_lora_on_two_workers_trains_through_dvc_exp_run(project_copy):
    """`dvc exp run -S distributed.strategy=fsdp -S adapter.type=lora -S distributed.num_workers=2` on the CPU: two
    Ray Train workers shard the frozen base and train the adapters; rank 0 saves the adapter, which evaluate scores.
    (Its gradients against one process's: tests/pipelines/train/test_fsdp_gradients.py.)"""
    root = project_copy
    write_params(root, {"data.generator.num_rows": 300, "epochs": 1, "batch_size": 8, "log_every_n_steps": 1})
    run(["git", "commit", "-qam", "small fsdp lora run"], root)

    # fast_dropout off: its CPU check runs the model before sharding, so rank 1 builds on meta only without it.
    overrides = ["distributed.strategy=fsdp", "adapter.type=lora", "distributed.num_workers=2", "fast_dropout=false"]
    done = run(["dvc", "exp", "run", *(arg for o in overrides for arg in ("-S", o))], root, timeout=800)
    assert_ray_quiet(done.stdout + done.stderr)  # on the test session's cluster: joined by address, no dashboard

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("finetune")
    trial = next(r for r in client.search_runs([exp.experiment_id]) if "mlflow.parentRunId" in r.data.tags)
    assert trial.info.status == "FINISHED", trial.data.tags.get("error")
    assert trial.data.metrics["world_size"] == 2
    assert trial.data.params["distributed.strategy"] == "fsdp" and trial.data.params["adapter.type"] == "lora"
    losses = loss_curve(client, trial.info.run_id)
    assert len(losses) > 3 and all(loss == loss for _, loss in losses)  # logged, and finite
    assert (root / "models" / "best" / "adapter_config.json").is_file()  # rank 0 saved the adapter, not a full model
    # Rank 1 never built the whole model: it got its shards of the base and adapters from rank 0.
    assert trial.data.tags["fsdp.shard_loading"].startswith("1 of 2 ranks built on the meta device"), trial.data.tags
    assert "test_accuracy" in json.loads((root / "metrics/evaluate.json").read_text())
