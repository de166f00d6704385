"""The memory plan: predicted before training (nothing allocated), checked against what the trial measures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.adapters import apply_adapter
from pipelines.memory_plan import plan_memory
from pipelines.params import Params
from pipelines.tasks import get_task
from pipelines.train.engine import train_model
from tests.conftest import tiny_params
from tests.pipelines.tasks.test_causal_lm import WordTokenizer, lm_params, lm_split
from tests.pipelines.train.helpers import tiny_model, tiny_split

CPU = torch.device("cpu")
# The bar; the plan runs the measured step's own code, so it is usually exact.
PEAK_TOLERANCE = 0.15
STRATEGIES = {
    "vanilla": {"data.bucketing": False},
    "bf16": {"precision": "bf16"},
    "checkpointing": {"grad_checkpointing": True},
    "accumulation": {"batch_size": 8, "grad_accum_steps": 4},
    "adafactor": {"optim": "adafactor"},
    "lora": {"adapter.type": "lora"},
}


def bert_case(default_params: Params, overrides: dict) -> tuple:
    settings = {"epochs": 1, "batch_size": 32, "fast_dropout": False, "adapter.target_modules": ["query", "value"]}
    params = tiny_params(default_params, **{**settings, **overrides})
    return params, get_task("classification"), tiny_split(rows=160, seed=3), lambda: tiny_model(layers=2, hidden=64)


def llama_case(default_params: Params, overrides: dict) -> tuple:
    params = lm_params(default_params, **{"epochs": 1, "batch_size": 16, "fast_dropout": False, **overrides})
    task = get_task("causal_lm")
    return (
        params,
        task,
        lm_split(rows=64, seed=2),
        lambda: task.build_model(params, WordTokenizer(), Path("."), Path(".")),
    )


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("case", [bert_case, llama_case], ids=["bert", "llama"])
def test_predicted_peak_is_within_15_percent_and_optimizer_state_is_exact(default_params, case, strategy):
    params, task, train, build = case(default_params, STRATEGIES[strategy])
    precision = params.precision if params.precision != "auto" else "fp32"

    def adapt(model: torch.nn.Module) -> torch.nn.Module:
        return apply_adapter(model, params.adapter, task, params)

    plan = plan_memory(params, task, train, build, adapt, 0, precision)
    torch.manual_seed(params.seed)
    model = adapt(build())
    measured = train_model(model, train, None, params, pad_id=0, device=CPU, precision=precision, task=task).metrics
    error = plan.peak / measured["peak_train_memory_bytes"] - 1
    assert abs(error) <= PEAK_TOLERANCE, f"{strategy}: predicted {plan.peak}, measured {measured}"
    assert plan.optimizer_state == measured["optimizer_state_bytes"]
    assert plan.trainable_parameters == measured["trainable_param_bytes"]
    assert plan.parameters == measured["param_bytes"]


def test_a_packed_causal_lm_is_planned_on_its_packs(default_params):
    params, task, train, build = llama_case(default_params, {"data.packing": True, "data.max_length": 48})
    model = build()
    packed = task.training_split(train, params, model)
    plan = plan_memory(params, task, packed, build, lambda model: model, 0, "fp32")
    assert plan.batch_width == 48  # packs of the full length, not rows
    torch.manual_seed(params.seed)
    measured = train_model(build(), train, None, params, pad_id=0, device=CPU, precision="fp32", task=task).metrics
    assert abs(plan.peak / measured["peak_train_memory_bytes"] - 1) <= PEAK_TOLERANCE


def test_every_variant_is_planned_from_the_tokenized_split(default_params, tmp_path):
    from pipelines.data.prepare import prepare_dataset
    from pipelines.memory_plan import plan_table, plan_variants

    variants = {"vanilla": {}, "adafactor": {"optim": "adafactor"}, "checkpointing": {"grad_checkpointing": True}}
    params = tiny_params(default_params, **{"data.generator.num_rows": 600, "tune.variants": variants})
    prepare_dataset(params, tmp_path, tmp_path / "tokenized")
    plans = plan_variants(params, tmp_path, tmp_path / "tokenized")
    assert list(plans) == list(variants)
    vanilla, adafactor, checkpointing = plans.values()
    assert adafactor.optimizer_state < vanilla.optimizer_state / 10
    assert checkpointing.activations < vanilla.activations and checkpointing.peak < vanilla.peak
    table = plan_table(plans)
    assert all(f"| {name} |" in table for name in variants)
