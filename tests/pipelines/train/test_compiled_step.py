"""`compile`: the compiled step trains as eager does, its graphs stay within its shapes, `auto` decides by prediction,
and a loss that stops changing stops the run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pipelines.data.batching import WidthSet, width_set
from pipelines.errors import UserError
from pipelines.params import ParamsError
from pipelines.runtime import resolve_runtime
from pipelines.train.compile_decision import CompilePrediction, decide_compile
from pipelines.train.trainer import StuckLoss
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split
from tests.pipelines.train.test_golden_steps import train_five_steps

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("task_name", "bucketing"),
    [("classification", False), ("classification", True), ("causal_lm", True), ("seq2seq", True)],
)
def test_the_compiled_step_gives_eager_losses_and_weights(default_params, task_name, bucketing):
    # Unbucketed: one static shape (every batch padded to max_length); bucketed: one graph with a dynamic width over
    # every padded width. No dropout (Inductor draws its own masks).
    same = {"data.bucketing": bucketing, "model.config.dropout": 0.0}
    eager_losses, eager_weights = train_five_steps(default_params, task_name, compile=False, **same)
    losses, weights = train_five_steps(default_params, task_name, compile=True, **same)
    assert len(losses) == 5
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert weights == pytest.approx(eager_weights, rel=1e-5)


def test_width_sets_come_from_the_length_histogram():
    lengths = tiny_split(rows=400, max_len=120, seed=1).lengths
    widths = width_set(lengths, None)
    assert len(widths.widths) <= 8 and widths.widths == tuple(sorted(widths.widths))
    assert widths.widths[-1] >= lengths.max() and all(w % 8 == 0 for w in widths.widths)
    assert widths.width(int(lengths.min())) == widths.widths[0]
    assert WidthSet((16, 32), 8).width(33) == 40  # longer than the widest (a test row): rounded to the multiple


def test_compile_auto_is_off_for_a_short_run_and_says_why(default_params):
    params = tiny_params(default_params, compile="auto")
    runtime = resolve_runtime(params, CPU, 0)
    prediction = CompilePrediction(eager_step_s=0.050, compiled_step_s=0.030, compile_s=78.0, warm_compile_s=6.0,
                                   blob_compile_s=40.0, shape_s=0.5)  # fmt: skip
    off = decide_compile(params, runtime, steps=10, shapes=4, prediction=prediction)
    assert not off.enabled
    saving = "10 steps x 20.0 ms predicted saving per step = 0.2 s"
    assert off.tag() == f"off: {saving} <= 80.0 s predicted to compile cold and warm 4 batch shapes"
    assert off.predicted_s == 80.0
    # Warm (the fingerprint in the cache): 6 s + 4 x 0.5 s, repaid by 500 steps of 20 ms where cold needs 4,000.
    warm = replace(prediction, found="cache")
    assert decide_compile(params, runtime, steps=500, shapes=4, prediction=warm).tag() == (
        "on: 500 steps x 20.0 ms predicted saving per step = 10.0 s > 8.0 s predicted to compile warm (from the "
        "cache) and warm 4 batch shapes"
    )
    assert not decide_compile(params, runtime, steps=500, shapes=4, prediction=prediction).enabled
    on = decide_compile(params, runtime, steps=10_000, shapes=4, prediction=prediction)
    assert on.enabled and on.tag().startswith("on: 10000 steps x 20.0 ms")
    assert decide_compile(params, runtime, 10_000, 4, None).tag() == "off: no memory plan to predict its saving from"
    assert decide_compile(params, runtime, 10_000, 40, prediction).tag().startswith("off: 40 batch shapes, over")


def test_compile_auto_on_the_default_pipeline_resolves_off_with_the_plans_arithmetic(default_params):
    # The plan's own prediction (pipelines.resolve.step_time) for the tiny model, a 10-step run.
    from pipelines.resolve.memory_plan import plan_memory
    from pipelines.resolve.step_time import predict_compile
    from pipelines.resolve.target import target_named
    from pipelines.tasks import get_task
    from pipelines.train.compile_decision import resolve_compile

    params = tiny_params(default_params, task="classification", compile="auto", batch_size=16, epochs=1)
    task, train = get_task("classification"), tiny_split(rows=160, seed=3)
    plan = plan_memory(params, task, train, lambda: tiny_model(), lambda model: model, 0, "fp32")
    assert plan.step_kernels > 100 and plan.update_kernels > 0 and plan.mean_positions > 0
    step, prediction = predict_compile(plan, "fp32", CPU)
    assert step.eager_s > 0 and step.compiled_s > 0
    runtime = resolve_runtime(params, CPU, 0)
    resolved, trained_with, choice = resolve_compile(params, runtime, train, task, tiny_model(), prediction)
    assert resolved.compile is False and trained_with.widths is None
    # On a CPU a compiled step with a dynamic width ran slower than eager (benchmarks/RESULTS.md, issue 52).
    assert choice.tag().startswith("off: a compiled step is predicted no faster here")
    # On an H100 it is predicted faster, but 10 steps do not repay compiling.
    _, on_h100 = predict_compile(plan, "bf16", target_named("H100-80GB"))
    assert on_h100.compiled_step_s < on_h100.eager_step_s
    _, _, choice = resolve_compile(params, runtime, train, task, tiny_model(), on_h100)
    assert choice.tag().startswith("off: 10 steps x ") and "predicted to compile" in choice.tag()


def test_liger_with_compile_true_is_refused_before_training(default_params):
    with pytest.raises(ParamsError, match="kernels: liger with compile: true trains a broken model"):
        tiny_params(default_params, kernels="liger", compile=True, device="cuda")


def test_a_model_whose_output_is_constant_stops_with_the_reason(default_params):
    params = tiny_params(default_params, epochs=1, batch_size=8, lr=3e-3, log_every_n_steps=5, warmup_ratio=0.0)
    model = tiny_model()
    # Uniform predictions whatever the input, as compile + Liger gave on an H100: the loss is ln(3) at every step.
    model.classifier.register_forward_hook(lambda module, inputs, output: output * 0)
    from pipelines.train.engine import TrainRequest, train_model

    with pytest.raises(StuckLoss, match=r"the training loss stayed at 1\.09861 .* for 5 optimizer steps in a row"):
        train_model(
            TrainRequest(
                model,
                tiny_split(rows=96, seed=3),
                None,
                params,
                pad_id=0,
                device=CPU,
                precision="fp32",
                say=lambda _: None,
            )
        )
    assert issubclass(StuckLoss, UserError)
