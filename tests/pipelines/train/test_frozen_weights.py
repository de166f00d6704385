"""Weights that are not trained are stored in a 16-bit run's compute dtype; trained ones keep fp32 (issue 46)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.adapters import apply_adapter
from pipelines.tasks import get_task
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.memory_levers import apply_memory_levers
from tests.pipelines.tasks.test_causal_lm import WordTokenizer, lm_params, lm_split

CPU = torch.device("cpu")


def lora_model(params):
    task = get_task("causal_lm")
    torch.manual_seed(params.seed)
    model = task.build_model(params, WordTokenizer(), Path("."), Path("."))
    return apply_adapter(model, params.adapter, task, params), task


@pytest.mark.parametrize(("precision", "frozen"), [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                                   ("fp32", torch.float32)])  # fmt: skip
def test_a_lora_base_is_stored_in_the_compute_dtype_and_the_adapters_in_fp32(default_params, precision, frozen):
    params = lm_params(default_params, **{"adapter.type": "lora"})
    model, _ = lora_model(params)
    apply_memory_levers(model, params, CPU, precision=precision)
    trained = [p for p in model.parameters() if p.requires_grad]
    base = [p for p in model.parameters() if not p.requires_grad]
    assert trained and base and {p.dtype for p in trained} == {torch.float32}
    assert {p.dtype for p in base} == {frozen}


def test_lora_on_a_bf16_base_learns_as_on_the_fp32_base_and_counts_it_at_2_bytes_a_weight(default_params):
    curves, frozen_bytes = {}, {}
    for precision in ("fp32", "bf16"):
        settings = {"adapter.type": "lora", "adapter.r": 8, "precision": precision, "epochs": 8, "lr": 0.03,
                    "log_every_n_steps": 1}  # fmt: skip
        params = lm_params(default_params, **settings)
        model, task = lora_model(params)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        result = train_model(TrainRequest(model, lm_split(rows=64, seed=2), None, params, pad_id=0, device=CPU,
                             precision=precision, task=task))  # fmt: skip
        curves[precision] = [point["loss"] for point in result.history]
        frozen_bytes[precision] = (result.metrics["frozen_param_bytes"], frozen)
    assert curves["bf16"][-1] < 0.98 * curves["bf16"][0]  # it learns through a frozen bf16 base (16 steps)...
    assert curves["bf16"][-1] == pytest.approx(curves["fp32"][-1], rel=0.01)  # ...as through the fp32 one
    assert frozen_bytes["bf16"][0] == 2 * frozen_bytes["bf16"][1] and frozen_bytes["fp32"][0] == 4 * frozen


def test_pure_bf16_weights_train_the_default_classifier_at_2_bytes_a_weight_and_state(default_params):
    from tests.conftest import tiny_params
    from tests.pipelines.train.helpers import tiny_model, tiny_split

    curves, figures = {}, {}
    for weights in ("fp32", "bf16"):
        params = tiny_params(default_params, precision="bf16", weights_dtype=weights, epochs=6, batch_size=16,
                             lr=0.003, log_every_n_steps=3, fast_dropout=False)  # fmt: skip
        torch.manual_seed(0)
        model = tiny_model()
        weights_count = sum(p.numel() for p in model.parameters())
        result = train_model(
            TrainRequest(
                model,
                tiny_split(rows=96),
                None,
                params,
                pad_id=0,
                device=CPU,
                precision="bf16",
                task=get_task("classification"),
            )
        )
        curves[weights] = [point["loss"] for point in result.history]
        figures[weights] = {p.dtype for p in model.parameters()}, result.metrics, weights_count
    dtypes, metrics, count = figures["bf16"]
    assert dtypes == {torch.bfloat16} and figures["fp32"][0] == {torch.float32}
    assert metrics["param_bytes"] == 2 * count and metrics["optimizer_state_bytes"] == 2 * 2 * count  # AdamW's two
    assert figures["fp32"][1]["optimizer_state_bytes"] == 2 * 4 * count
    assert curves["bf16"][-1] < 0.7 * curves["bf16"][0]  # the loss still falls with bf16 weights (36 steps)...
    assert curves["bf16"][-1] == pytest.approx(curves["fp32"][-1], rel=0.05)  # ...near the fp32 masters' curve


def test_pure_bf16_weights_need_bf16_compute(default_params):
    from pipelines.errors import UserError
    from pipelines.params import ParamsError
    from tests.conftest import tiny_params

    with pytest.raises(ParamsError, match="weights_dtype: bf16 .* precision: fp32"):
        tiny_params(default_params, weights_dtype="bf16", precision="fp32")
    params = tiny_params(default_params, weights_dtype="bf16", precision="auto")
    model, _ = lora_model(lm_params(params))
    with pytest.raises(UserError, match="weights_dtype: bf16 .* precision: auto resolved to fp32 here"):
        apply_memory_levers(model, params, CPU, precision="fp32")


def test_a_pure_bf16_model_is_saved_in_bf16_and_reloads_as_it_was_trained(default_params, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from pipelines.adapters import save_trained
    from tests.conftest import tiny_params
    from tests.pipelines.train.helpers import tiny_model

    params = tiny_params(default_params, precision="bf16", weights_dtype="bf16")
    model = tiny_model()
    apply_memory_levers(model, params, CPU, precision="bf16")
    save_trained(model, tmp_path, params)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)  # the usual one-liner
    assert {p.dtype for p in reloaded.parameters()} == {torch.bfloat16}
    for (name, saved), loaded in zip(model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(saved, loaded), name
