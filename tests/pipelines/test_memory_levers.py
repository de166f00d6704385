"""The memory levers of issue 26 on the CPU: chunked cross-entropy (same loss and gradients, one chunk of logits),
selective checkpointing, their plans against the measured peak, and the CUDA-only levers refused with the reason."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.data.loader import make_loader
from pipelines.data.tokenization import TokenizedSplit
from pipelines.errors import UserError
from pipelines.params import ParamsError
from pipelines.resolve.budget import choose_strategy
from pipelines.resolve.eval_memory import largest_eval_batch, validation_peak
from pipelines.resolve.memory_plan import plan_memory
from pipelines.runtime import LossImpl
from pipelines.tasks import get_task
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.memory_levers import apply_memory_levers, resolve_loss
from pipelines.train.optim import build_optimizer
from tests.conftest import tiny_params
from tests.pipelines.tasks.test_causal_lm import WordTokenizer, lm_params, lm_split
from tests.pipelines.tasks.test_seq2seq import WordTokenizer as S2STokenizer
from tests.pipelines.tasks.test_seq2seq import s2s_params, s2s_split
from tests.pipelines.train.helpers import cpu_runtime, cpu_step

CPU = torch.device("cpu")
VOCAB = 40_000  # above CHUNKED_FROM_VOCAB: loss_impl auto chunks it
PLAN_TOLERANCE = 0.10  # the bar for each lever


def llama(default_params, **overrides):
    params = lm_params(
        default_params,
        **{"epochs": 1, "batch_size": 16, "fast_dropout": False, "train_on_prompt": True,
           "model.config.num_hidden_layers": 4, **overrides},
    )  # fmt: skip
    task = get_task("causal_lm")
    return params, task, lambda: task.build_model(params, WordTokenizer(VOCAB), Path("."), Path("."))


def long_rows(rows: int, length: int) -> TokenizedSplit:
    rng = np.random.default_rng(0)
    ids = np.concatenate([np.append(rng.integers(10, 120, size=length - 1), 3) for _ in range(rows)])
    lengths, prompts = np.full(rows, length, np.int32), np.full(rows, 8, np.int32)
    return TokenizedSplit(ids.astype(np.int32), lengths, prompt_lengths=prompts)


def one_backward(model, task, batch, loss_impl=None):
    model.zero_grad(set_to_none=True)
    step = cpu_step(model, task)
    if loss_impl is not None:
        step = replace(step, runtime=replace(step.runtime, loss=loss_impl))
    loss = step.backward(batch, 1.0)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("task_name", ["causal_lm", "seq2seq"])
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_chunked_loss_has_the_full_losss_value_and_gradients(default_params, task_name, train_on_prompt):
    task = get_task(task_name)
    torch.manual_seed(0)
    if task_name == "causal_lm":
        params = lm_params(default_params, train_on_prompt=train_on_prompt)
        model, split = task.build_model(params, WordTokenizer(500), Path("."), Path(".")), lm_split(rows=6)
    else:
        params = s2s_params(default_params)
        model, split = task.build_model(params, S2STokenizer(500), Path("."), Path(".")), s2s_split(rows=6)
    batch = next(iter(make_loader(split, [list(range(len(split)))], params, cpu_runtime(), task)))
    batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    full_loss, full_grads = one_backward(model, task, batch)
    chunked_loss, chunked_grads = one_backward(model, task, batch, LossImpl(5))  # several chunks, the last short
    assert chunked_loss.item() == pytest.approx(full_loss.item(), rel=1e-5)
    assert full_grads.keys() == chunked_grads.keys()
    for name, grad in full_grads.items():  # 1e-5 of each tensor's largest gradient: fp32 sums in another order
        assert (chunked_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name


LEVERS = {
    "vanilla": {"loss_impl": "full"},
    "chunked": {"loss_impl": "chunked"},
    "every_2nd_block": {"loss_impl": "full", "grad_checkpointing": True, "grad_checkpointing_every": 2},
    "every_block": {"loss_impl": "full", "grad_checkpointing": True},
    "all_lean": {"loss_impl": "chunked", "grad_checkpointing": True, "optim": "adafactor"},
}


def test_each_lever_is_planned_within_10_percent_and_chunking_removes_the_logits(default_params):
    measured: dict[str, dict[str, float]] = {}
    losses = {}
    train = lm_split(rows=64, seed=2)
    for name, overrides in LEVERS.items():
        params, task, build = llama(default_params, **overrides)
        plan = plan_memory(params, task, train, build, lambda model: model, 0, "fp32")
        torch.manual_seed(params.seed)
        result = train_model(
            TrainRequest(build(), train, None, params, pad_id=0, device=CPU, precision="fp32", task=task)
        )
        measured[name] = result.metrics
        losses[name] = result.metrics["final_train_loss"]
        peak = result.metrics["peak_train_memory_bytes"]
        assert abs(plan.peak / peak - 1) <= PLAN_TOLERANCE, f"{name}: planned {plan.peak}, measured {peak}"
    peaks = {name: m["peak_train_memory_bytes"] for name, m in measured.items()}
    assert peaks["chunked"] < peaks["vanilla"] and peaks["every_block"] < peaks["every_2nd_block"] < peaks["vanilla"]
    assert peaks["all_lean"] == min(peaks.values())
    # The same training: chunking and recomputation change how the step is computed, not what it computes.
    for name in ("chunked", "every_2nd_block", "every_block"):
        assert losses[name] == pytest.approx(losses["vanilla"], rel=1e-4), (name, losses)


def test_loss_impl_auto_chunks_a_large_vocabulary_only(default_params):
    params, task, build = llama(default_params)
    assert params.loss_impl == "auto"
    model = build()
    assert resolve_loss(model, params, task).chunk_rows == 16 * 1024 * 1024 // (4 * VOCAB)
    small = get_task("causal_lm").build_model(params, WordTokenizer(120), Path("."), Path("."))
    assert (
        resolve_loss(small, params, task).chunk_rows is None
    )  # a 120-word vocabulary's logits are small: full is faster
    classifier_params = tiny_params(default_params, loss_impl="auto")
    assert not get_task(classifier_params.task).projects_vocabulary


def test_chunked_is_refused_where_the_model_changes_logits_after_its_head(default_params):
    params, task, build = llama(default_params, loss_impl="chunked")
    model = build()
    model.config.final_logit_softcapping = 30.0  # as Gemma-2 does
    with pytest.raises(UserError, match=r"loss_impl: chunked: LlamaForCausalLM transforms its logits after the "
                                        r"projection \(final_logit_softcapping\)"):  # fmt: skip
        resolve_loss(model, params, task)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"grad_checkpointing_every": 2}, r"grad_checkpointing_every: 2 .* needs grad_checkpointing: true"),
        ({"activation_offload": True, "device": "cpu"}, r"activation_offload: true .* device: cpu"),
        ({"kernels": "liger", "device": "cpu"}, r"kernels: liger .* need CUDA"),
        ({"loss_impl": "chunked"}, r"loss_impl: chunked .* task: classification has none"),
        ({"loss_impl": "fast"}, r"loss_impl"),
        ({"kernels": "triton"}, r"kernels"),
    ],
)
def test_bad_lever_settings_are_refused_naming_the_key(default_params, overrides, message):
    with pytest.raises(ParamsError, match=message):
        tiny_params(default_params, **overrides)


def test_cuda_only_levers_are_refused_when_auto_resolves_to_the_cpu(default_params):
    params, task, build = llama(default_params, activation_offload=True)
    with pytest.raises(UserError, match="activation_offload: true .* this trial trains on cpu"):
        apply_memory_levers(build(), params, CPU)
    params, task, build = llama(default_params, kernels="liger")
    with pytest.raises(UserError, match="kernels: liger needs CUDA"):
        apply_memory_levers(build(), params, CPU)


def test_strategy_auto_picks_selective_checkpointing_when_it_is_the_fastest_that_fits(default_params):
    # One row per optimizer step: accumulation cannot stand in for checkpointing (it would, at no FLOP cost).
    params, task, build = llama(default_params, batch_size=1, loss_impl="full", **{"data.max_length": 512})
    train = long_rows(rows=4, length=384)  # long enough that activations, not weights, set the peak

    def plan(candidate):
        return plan_memory(candidate, task, train, build, lambda model: model, 0, "fp32")

    every = {n: plan(tiny_params(params, grad_checkpointing=n > 0, grad_checkpointing_every=max(n, 1))).peak
             for n in (0, 1, 2)}  # fmt: skip
    assert every[1] < every[2] < every[0]
    budgeted = tiny_params(params, strategy="auto", memory_budget=(every[2] + every[0]) // 2,
                           batch_size="auto", effective_batch_size=1)  # fmt: skip
    choice = choose_strategy(budgeted, plan, CPU, lora_allowed=False)
    assert choice.plan.peak <= budgeted.memory_budget
    assert choice.params.grad_checkpointing and choice.params.grad_checkpointing_every == 2, choice.why


@pytest.mark.parametrize("loss_impl", ["full", "chunked"])
def test_validation_memory_is_planned_within_10_percent(default_params, loss_impl):
    # Validation scores twice a step's rows with the optimizer state resident: on a large vocabulary with the
    # full projection it peaks above the training step, which is where users run out of memory.
    params, task, build = llama(default_params, loss_impl=loss_impl)
    train = lm_split(rows=64, seed=2)
    plan = plan_memory(params, task, train, build, lambda model: model, 0, "fp32")
    torch.manual_seed(params.seed)
    model = build()
    apply_memory_levers(model, params, CPU)
    runtime = replace(cpu_runtime(), loss=resolve_loss(model, params, task))
    optimizer = build_optimizer(params.optim, model, 1e-3, 0.0, CPU)
    batch = largest_eval_batch(train, params, task, runtime)
    replace(cpu_step(model, task, optimizer=optimizer), runtime=runtime).backward(batch, 1.0)
    optimizer.step()  # the state exists, as at an epoch's end
    measured = validation_peak(model, optimizer, batch, runtime, task)
    assert abs(plan.eval_peak / measured - 1) <= PLAN_TOLERANCE, (plan.eval_peak, measured)
    if loss_impl == "full":
        assert plan.eval_peak > plan.peak  # the logits of 32 rows x the vocabulary, all at once
    else:
        assert plan.eval_peak < plan.peak
