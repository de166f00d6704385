"""LoRA on a base built from model.config (random weights) is said before training: it trains to chance otherwise
without a word (issue 62: 25.6% on 4 classes)."""

from __future__ import annotations

from pathlib import Path

import torch

from pipelines.adapters import apply_adapter
from pipelines.model import build_model
from pipelines.resolve.memory_plan import plan_memory
from pipelines.tasks import get_task
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split

CLASSIFICATION = get_task("classification")
LABELS = ["a", "b", "c"]


def test_lora_on_a_base_built_from_its_config_is_warned_of_once_and_not_by_the_memory_plan(default_params, capsys):
    params = tiny_params(default_params, **{"adapter.type": "lora", "epochs": 1, "batch_size": 16})
    assert params.model.name_or_path is None  # the default offline model

    def build() -> torch.nn.Module:
        return build_model(params.model, LABELS, 120, params.data.max_length, Path("."))

    def adapt(model: torch.nn.Module) -> torch.nn.Module:
        return apply_adapter(model, params.adapter, CLASSIFICATION, params)

    # What a trial does before training: its memory plan (the model under FakeTensorMode), then the model itself.
    plan_memory(params, CLASSIFICATION, tiny_split(rows=64), build, adapt, 0, "fp32")
    assert "warning" not in capsys.readouterr().err
    model = adapt(build())
    trained = sum(w.numel() for w in model.parameters() if w.requires_grad)
    total = sum(w.numel() for w in model.parameters())
    assert capsys.readouterr().err == (
        "warning: adapter.type = 'lora' with model.name_or_path: null: the base is built from model.config with random "
        f"weights and stays frozen: only {trained:,} of the model's {total:,} weights ({trained / total:.1%}: the "
        "adapters and any new head) train, so it learns almost nothing (near chance); set model.name_or_path to a "
        "pretrained model, or adapter.type: none to train every weight\n"
    )


def test_lora_on_a_pretrained_base_is_not_warned_of(default_params, tmp_path, capsys):
    tiny_model().save_pretrained(tmp_path / "base")
    params = tiny_params(default_params, **{"adapter.type": "lora", "model.name_or_path": str(tmp_path / "base")})
    base = build_model(params.model, LABELS, 120, params.data.max_length, tmp_path)
    apply_adapter(base, params.adapter, CLASSIFICATION, params)
    # The random base is warned of, the pretrained one not: the warning follows model.name_or_path.
    random = tiny_params(default_params, **{"adapter.type": "lora"})
    apply_adapter(build_model(random.model, LABELS, 120, 64, tmp_path), random.adapter, CLASSIFICATION, random)
    assert capsys.readouterr().err.count("warning: adapter.type = 'lora' with model.name_or_path: null") == 1
