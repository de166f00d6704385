"""The evaluate stage's generation memory, planned (`predicted_generation_peak_bytes`) against real generation.

The plan runs the prefill of the largest batch and the last decoding step with the key/value cache grown to
its final length, on fake tensors; real greedy generation (beam search for seq2seq) is measured with the same
tracker, one forward at a time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.data.loader import eval_batch_rows
from pipelines.resolve.memory_plan import plan_memory
from pipelines.tasks import get_task
from pipelines.train.memory import track_step
from tests.pipelines.tasks.test_causal_lm import WordTokenizer, lm_params, lm_split
from tests.pipelines.tasks.test_seq2seq import WordTokenizer as S2STokenizer
from tests.pipelines.tasks.test_seq2seq import s2s_params, s2s_split

TOLERANCE = 0.10
CPU = torch.device("cpu")


def measured_generation(model: torch.nn.Module, generate: object) -> int:
    """MemTracker's peak over a real `generate` call (its per-module statistics reset after every forward)."""
    idle = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)

    def run(meter: object) -> None:
        handle = model.register_forward_hook(lambda *_: meter.tracker.reset_mod_stats())  # type: ignore[attr-defined]
        try:
            with torch.no_grad():
                generate()  # type: ignore[operator]
        finally:
            handle.remove()

    model.eval()
    return track_step(model, idle, CPU, run).total


def left_padded(prompts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.from_numpy(prompt), 1
    return ids, mask


@pytest.mark.parametrize("new_tokens", [8, 64])
def test_causal_lm_generation_is_planned_within_10_percent(default_params, new_tokens):
    params = lm_params(default_params, **{"batch_size": 16, "fast_dropout": False, "eval.max_new_tokens": new_tokens})
    task, split = get_task("causal_lm"), lm_split(rows=64, seed=2)
    build = lambda: task.build_model(params, WordTokenizer(), Path("."), Path("."))  # noqa: E731
    plan = plan_memory(params, task, split, build, lambda m: m, 0, "fp32")
    model = build()
    prompts = [np.asarray(split.input_ids[split.offsets[i] : split.offsets[i] + split.prompt_lengths[i]], np.int64)
               for i in range(len(split))]  # fmt: skip
    longest = sorted(prompts, key=len, reverse=True)[: eval_batch_rows(params)]
    ids, mask = left_padded(longest)
    measured = measured_generation(model, lambda: model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        pad_token_id=0))  # fmt: skip
    print(f"generation planned {plan.generation_peak} measured {measured} ({plan.generation_peak / measured:.3f})")
    assert abs(plan.generation_peak / measured - 1) <= TOLERANCE, (plan.generation_peak, measured)
    assert plan.as_metrics()["predicted_generation_peak_bytes"] == plan.generation_peak


def test_seq2seq_beam_search_is_planned_within_10_percent(default_params):
    params = s2s_params(default_params, **{"batch_size": 4, "eval.num_beams": 3, "eval.max_new_tokens": 12})
    task, split = get_task("seq2seq"), s2s_split(rows=16)
    build = lambda: task.build_model(params, S2STokenizer(), Path("."), Path("."))  # noqa: E731
    plan = plan_memory(params, task, split, build, lambda m: m, 0, "fp32")
    model = build()
    rows = eval_batch_rows(params)
    source = int(np.max(split.prompt_lengths))
    ids, mask = torch.zeros(rows, source, dtype=torch.long) + 5, torch.ones(rows, source, dtype=torch.long)
    measured = measured_generation(model, lambda: model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False,
        early_stopping=False))  # fmt: skip
    print(f"generation planned {plan.generation_peak} measured {measured} ({plan.generation_peak / measured:.3f})")
    assert abs(plan.generation_peak / measured - 1) <= TOLERANCE, (plan.generation_peak, measured)


def test_a_classifier_plans_no_generation(default_params):
    from tests.pipelines.train.helpers import tiny_model, tiny_split

    task = get_task("classification")
    plan = plan_memory(default_params, task, tiny_split(rows=32), lambda: tiny_model(), lambda m: m, 0, "fp32")
    assert plan.generation_peak == 0
