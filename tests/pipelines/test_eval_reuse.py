"""Evaluation peaks reused across a search's candidates (resolve/eval_memory.reused) equal each candidate's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.adapters import apply_adapter
from pipelines.params import apply_overrides
from pipelines.resolve.eval_memory import shared_evaluations
from pipelines.resolve.memory_plan import plan_memory
from pipelines.resolve.target import CPU_TARGET, target_named
from pipelines.tasks import get_task
from tests.pipelines.tasks.test_causal_lm import WordTokenizer, lm_params, lm_split

# Candidates as a search makes them: the effective batch split two ways, two optimizers, checkpointing on and off.
VARIANTS = [
    {"batch_size": 8, "grad_accum_steps": 1},
    {"batch_size": 4, "grad_accum_steps": 2},
    {"batch_size": 4, "grad_accum_steps": 2, "optim": "adafactor"},
    {"batch_size": 8, "grad_accum_steps": 1, "grad_checkpointing": True},
    {"batch_size": 4, "grad_accum_steps": 2, "grad_checkpointing": True, "optim": "adafactor"},
]


@pytest.mark.parametrize("target", ["cpu", "H100-80GB"])
def test_reused_evaluation_peaks_are_each_candidates_own(default_params, target):
    where = CPU_TARGET if target == "cpu" else target_named(target)
    base = lm_params(
        default_params,
        **{
            "model.config.num_hidden_layers": 2,
            "adapter.type": "lora",
            "fast_dropout": False,
            **({"precision": "bf16"} if target != "cpu" else {}),
        },
    )
    task, split, tokenizer = get_task("causal_lm"), lm_split(rows=32, seed=1), WordTokenizer()

    def plan(params):
        build = lambda: task.build_model(params, tokenizer, Path("."), Path("."), weights=False)  # noqa: E731
        adapt = lambda m: apply_adapter(m, params.adapter, task, params)  # noqa: E731
        return plan_memory(params, task, split, build, adapt, 0, where.precision(params), where)

    candidates = [apply_overrides(base, variant) for variant in VARIANTS]
    own = [plan(params) for params in candidates]  # no store: every evaluation traced
    store: dict = {}
    with shared_evaluations(store, None):
        shared = [plan(params) for params in candidates]
    for variant, alone, reused in zip(VARIANTS, own, shared, strict=True):
        assert (reused.eval_peak, reused.generation_phases) == (alone.eval_peak, alone.generation_phases), variant
        assert reused.peak == alone.peak, variant
    kinds = [key[0] for key in store]
    # Validation: (adamw, adafactor) x checkpointing off/on -> 4 of 5; generation, optimizer-blind: off/on -> 2 of 5.
    assert (kinds.count("validation"), kinds.count("generation")) == (4, 2)
    assert own[0].eval_peak > 0 and max(own[0].generation_phases) > 0  # a causal LM validates and generates
