"""A checkpointed plan's model FLOPs leave out the recomputed forward, counted in the same fake step (counted_step)."""

from __future__ import annotations

import pytest

from pipelines.resolve.target import CPU_TARGET, target_named
from tests.pipelines.tasks.test_causal_lm import lm_params
from tests.pipelines.test_plan_depth import planner


@pytest.mark.parametrize("target", ["cpu", "H100-80GB"])
@pytest.mark.parametrize("every", [1, 2])
def test_checkpointing_adds_hardware_flops_but_no_model_flops(default_params, target, every):
    # A full fine-tune: with LoRA, checkpointing also makes the inputs require gradients (peft), which is model work.
    settings = {"model.config.num_hidden_layers": 4, "batch_size": 8}
    if target != "cpu":
        settings["precision"] = "bf16"
    where = CPU_TARGET if target == "cpu" else target_named(target)
    plain = planner(lm_params(default_params, **settings), where)(None)
    checkpointed = planner(
        lm_params(default_params, **settings, grad_checkpointing=True, grad_checkpointing_every=every), where
    )(None)
    assert checkpointed.model_flops == plain.model_flops > 0
    # The recomputed forward: every block's (every 2nd block's) forward matmuls run twice on the hardware.
    assert plain.step_flops < checkpointed.step_flops < plain.step_flops * (1.5 if every == 1 else 1.3)
