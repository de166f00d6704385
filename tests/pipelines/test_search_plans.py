"""A lean optimizer's candidate judged first by the written optimizer's plan (`pipelines.resolve.search_plans`): the
floor read off that plan is never above the lean optimizer's own planned peak, and the search chooses what it chose
when it planned every candidate, with fewer plans."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import pipelines.resolve.budget as budget
from pipelines.params import Params, apply_overrides
from pipelines.resolve.memory_plan import MemoryPlan
from pipelines.resolve.search_plans import lean_optimizer_floor
from tests.pipelines.test_budget import planner
from tests.pipelines.test_cluster_plan import tiny_llama, tiny_planner
from tests.pipelines.test_memory_plan import bert_case

LEAN = ("adafactor", "adamw_8bit")


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_lean_optimizer_s_peak_is_never_below_the_floor_read_off_the_written_optimizer_s_plan(
    default_params, checkpointing
):
    # Two kinds of plan: a small BERT's, traced whole on the CPU (full fine-tuning: AdamW's state is a third of the
    # peak), and a 12-block Llama's by depth on an A100 (two shallow traces, extrapolated), LoRA and full.
    bert_params, *_ = bert_case(default_params, {"data.bucketing": False, "grad_checkpointing": checkpointing})
    bert_plan, *_ = planner(default_params)
    llama_plan = tiny_planner()
    cases = [(bert_plan, bert_params, ("adafactor",))]  # 8-bit AdamW is planned for a card only
    for adapter in ("none", "lora"):
        params = tiny_llama(default_params, grad_checkpointing=checkpointing, **{"adapter.type": adapter})
        cases.append((lambda p: llama_plan(p)[0], params, LEAN))
    for plan, params, lean in cases:
        written = plan(params)
        assert written.peak_before_update <= written.peak and written.optimizer_state > 0
        for optim in lean:
            own = plan(apply_overrides(params, {"optim": optim}))
            assert lean_optimizer_floor(written) <= own.peak, (optim, params.adapter.type, own.peak)
            assert own.step_flops == written.step_flops  # what the bounded plan keeps of the written one


def test_the_search_chooses_as_before_from_fewer_plans(default_params, monkeypatch):
    params, *_ = bert_case(default_params, {"data.bucketing": False})
    plan, *_ = planner(default_params)
    # Below the written optimizer's leanest plan (one row a micro-batch, every block checkpointed: tier 0 fits
    # nothing), above Adafactor's: AdamW's state is twice the weights, Adafactor's factored.
    leanest = {"grad_checkpointing": True, "batch_size": 1, "grad_accum_steps": params.batch_size}
    adamw, adafactor = (plan(apply_overrides(params, {**leanest, "optim": o})).peak for o in ("adamw", "adafactor"))
    assert adafactor < adamw
    asked = apply_overrides(params, {"memory_budget": (adamw + adafactor) // 2, "strategy": "auto"})

    def search() -> tuple[budget.Choice, list[Params]]:
        made: list[Params] = []

        def counted(candidate: Params) -> MemoryPlan:
            made.append(candidate)
            return plan(candidate)

        return budget.choose_strategy(asked, counted, torch.device("cpu"), lora_allowed=False), made

    bounded, fewer = search()
    monkeypatch.setattr(budget, "bounded_by_written_optimizer", lambda plan, optim, limit: plan)
    unbounded, every = search()
    untimed = [replace(choice.plan, plan_time_s=0.0) for choice in (bounded, unbounded)]
    assert bounded.params == unbounded.params and untimed[0] == untimed[1] and bounded.why == unbounded.why
    assert bounded.params.optim == "adafactor"
    assert len(fewer) < len(every), (len(fewer), len(every))
