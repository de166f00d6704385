"""Weights that are not trained are stored in a 16-bit run's compute dtype; trained ones keep fp32 (issue 46)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.adapters import apply_adapter
from pipelines.tasks import get_task
from pipelines.train.engine import train_model
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
        result = train_model(model, lm_split(rows=64, seed=2), None, params, pad_id=0, device=CPU,
                             precision=precision, task=task)  # fmt: skip
        curves[precision] = [point["loss"] for point in result.history]
        frozen_bytes[precision] = (result.metrics["frozen_param_bytes"], frozen)
    assert curves["bf16"][-1] < 0.98 * curves["bf16"][0]  # it learns through a frozen bf16 base (16 steps)...
    assert curves["bf16"][-1] == pytest.approx(curves["fp32"][-1], rel=0.01)  # ...as through the fp32 one
    assert frozen_bytes["bf16"][0] == 2 * frozen_bytes["bf16"][1] and frozen_bytes["fp32"][0] == 4 * frozen
