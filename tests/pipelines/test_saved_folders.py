"""A trial's saved folder reloads with the standard Hugging Face one-liners, offline, and carries a model card.

Each test trains a real (tiny, config-built) trial in process and then does exactly what a user would:
`AutoPeftModelFor...from_pretrained(folder)` on an adapter folder, `pipeline(task, folder, truncation=True)` on a
long text for a full model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipelines.params import Params
from pipelines.prepare import prepare_dataset
from pipelines.recipe import NullLogger, Trial, TrialContext, train_and_save
from tests.conftest import tiny_params

pytestmark = pytest.mark.timeout(600)


def train_one(params: Params, tmp_path: Path, score_test: bool = True) -> Path:
    """Tokenize, then train, evaluate and save one trial in this process (`score_test=False`: as one of several
    trials, scored on validation only); its folder."""
    tokenized = tmp_path / "tokenized"
    prepare_dataset(params, tmp_path, tokenized)
    context = TrialContext(
        params=params.model_dump(mode="json"), root=str(tmp_path), variants={}, tokenized_dir=str(tokenized),
        staging_dir=str(tmp_path / "staging"), checkpoint_root=str(tmp_path / "checkpoints"), tracking_uri="",
        experiment_id="0", parent_run_id="parent", threads=2, scheduler="fifo", tokenize_stats={},
        score_test=score_test,
    )  # fmt: skip
    trial = Trial(context, "default", "t1", "run", NullLogger(), lambda _: None, tmp_path / "checkpoints" / "t1")
    train_and_save(trial, params)
    return trial.out


def small(default_params: Params, **overrides) -> Params:
    return tiny_params(default_params, **{"epochs": 1, "data.generator.num_rows": 300, **overrides})


def test_a_lora_classifier_reloads_with_auto_peft_and_says_what_it_is(default_params, tmp_path):
    from peft import AutoPeftModelForSequenceClassification

    folder = train_one(small(default_params, **{"adapter.type": "lora"}), tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((folder / "base").resolve())  # was null
    model = AutoPeftModelForSequenceClassification.from_pretrained(folder)
    assert model.peft_config["default"].r == default_params.adapter.r
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\npipeline_tag: text-classification")
    assert "| test_accuracy |" in card and "digest `" in card and "classification" in card
    # What the hub's own reader makes of it (huggingface_hub.ModelCard, as the hub and its tools load a card).
    from huggingface_hub import ModelCard

    read = ModelCard.load(folder / "README.md").data
    assert (read.library_name, read.pipeline_tag, read.tags) == ("peft", "text-classification",
                                                                 ["pipelines", "classification", "lora"])  # fmt: skip
    assert read.base_model is None  # built from model.config: no hub id to name, and never a local path


def test_the_card_of_one_of_several_trials_gives_its_validation_figure_as_such(default_params, tmp_path):
    folder = train_one(small(default_params), tmp_path, score_test=False)
    card = (folder / "README.md").read_text()
    val_accuracy = json.loads((folder / "metrics.json").read_text())["val_accuracy"]  # the trial's own figure
    assert "| Validation metric | Value |" in card and f"| val_accuracy | {val_accuracy:.4g} |" in card, card
    assert "Test metric" not in card and "test_accuracy" not in card  # it scored no test split: no test figure
    assert "`metrics/evaluate.json`" in card  # where the test figure is


def test_a_lora_causal_lm_reloads_with_auto_peft_and_generates(default_params, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    folder = train_one(small(default_params, task="causal_lm", **{"adapter.type": "lora"}), tmp_path)
    model = AutoPeftModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("Q:", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_a_classifier_folder_runs_in_a_pipeline_and_truncates_at_the_models_maximum(default_params, tmp_path):
    from transformers import AutoConfig, AutoTokenizer, pipeline

    folder = train_one(small(default_params), tmp_path)
    limit = AutoConfig.from_pretrained(folder).max_position_embeddings
    assert AutoTokenizer.from_pretrained(folder).model_max_length == limit  # was 1e30
    classify = pipeline("text-classification", str(folder), truncation=True)
    answer = classify(" ".join(["word"] * 700))  # longer than the model's positions
    assert answer[0]["label"] and 0.0 <= answer[0]["score"] <= 1.0
    assert "pipeline_tag: text-classification" in (folder / "README.md").read_text()


def test_the_logged_model_carries_its_code_and_pins_what_serving_imports(default_params, tmp_path):
    import mlflow.pyfunc
    import pandas as pd

    from pipelines.tracking.mlflow_model import save_trial_model

    params = small(default_params)
    folder = train_one(params, tmp_path)
    local = save_trial_model(folder, params, ["alpha beta gamma"], tmp_path / "logged")
    requirements = (local / "requirements.txt").read_text().split()
    assert "pipelines" not in [r.split("==")[0] for r in requirements]  # on the index, an unrelated project
    assert any(r.startswith("torch==") and "+" not in r for r in requirements), requirements
    assert (local / "code" / "pipelines" / "recipe.py").is_file()  # this package travels with the model
    served = mlflow.pyfunc.load_model(str(local))
    assert len(served.predict(pd.DataFrame({"text": ["alpha beta gamma", "delta"]}))) == 2
