"""A compiled run's row count is one shape (a padded partial batch trains as the unpadded one), and what compiles
after the warm-up is counted and said (issue 60)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from pipelines.data.loader import make_collator, pad_rows
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params
from pipelines.runtime import resolve_runtime
from pipelines.tasks import get_task
from pipelines.train.compiled_step import graphs_built
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.trainer import Trainer
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split
from tests.pipelines.train.test_golden_steps import WordTokenizer, golden_params, rows

CPU = torch.device("cpu")


def loss_and_gradients(model: torch.nn.Module, task_name: str, batch: dict[str, torch.Tensor]) -> tuple[float, list]:
    model.zero_grad(set_to_none=True)
    total = get_task(task_name).loss(model, batch)[0]
    total.backward()
    return float(total.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("task_name", ["classification", "causal_lm", "seq2seq"])
def test_padding_rows_leaves_each_tasks_loss_and_gradients_as_they_were(default_params, task_name):
    params = golden_params(default_params, task_name, **{"model.config.dropout": 0.0})
    task, split = get_task(task_name), rows(12, 5, task_name)
    torch.manual_seed(0)
    classifier = task_name == "classification"
    model = tiny_model(seed=0) if classifier else task.build_model(params, WordTokenizer(), None, None)  # type: ignore[arg-type]
    collator = make_collator(split, params, resolve_runtime(params, CPU, 0), task)
    short = collator([3, 7, 1])
    padded = pad_rows(short, 8)
    assert padded["input_ids"].shape[0] == 8 and all(t.shape[0] == 8 for t in padded.values() if t.dim())
    assert padded["row_index"].tolist() == [3, 7, 1] + [-1] * 5
    assert int(padded["num_rows"]) == 3 and int(padded["num_tokens"]) == int(short["num_tokens"])
    assert int(padded["num_positions"]) == int(short["num_positions"]) * 8 // 3
    loss, gradients = loss_and_gradients(model, task_name, short)
    padded_loss, padded_gradients = loss_and_gradients(model, task_name, padded)
    assert loss > 0 and padded_loss == pytest.approx(loss, rel=1e-6)
    assert len(padded_gradients) == len(gradients)
    for plain, grown in zip(gradients, padded_gradients, strict=True):
        torch.testing.assert_close(grown, plain, rtol=1e-5, atol=1e-7)


def run(params: Params, split: TokenizedSplit, say: list[str]) -> tuple[dict[str, float], list[float]]:
    losses: list[float] = []
    torch.manual_seed(0)
    request = TrainRequest(tiny_model(), split, None, params, pad_id=0, device=CPU, precision="fp32",
                           on_log=lambda step, point: losses.append(point["loss"]), say=say.append)  # fmt: skip
    result = train_model(request)
    return result.metrics, losses


def test_a_short_last_batch_compiles_no_graph_of_its_own_and_trains_as_eager(default_params):
    # 100 rows in batches of 16: mega-batches of 16 rows, so the last one is a batch of 4. Accumulating 2 micro-batches
    # also runs the accumulation path compiled (its own gradient buffers; warmed before the clocks).
    params = tiny_params(default_params, epochs=1, batch_size=16, grad_accum_steps=2, lr=3e-3, log_every_n_steps=1,
                         warmup_ratio=0.0, **{"data.bucketing": True})  # fmt: skip
    split = tiny_split(rows=100, seed=4)
    eager_said: list[str] = []
    eager, eager_losses = run(params.model_copy(update={"compile": False}), split, eager_said)
    said: list[str] = []
    before = graphs_built()
    compiled, losses = run(params.model_copy(update={"compile": True}), split, said)
    assert graphs_built() - before == 1, said
    assert compiled["compile_graphs"] == 1 and compiled["compile_graphs_in_loop"] == 0
    assert compiled["timed_recompiles"] == 0 and compiled["timed_cudagraph_skips"] == 0
    assert not any("recompiles" in line for line in said), said
    assert len(losses) == 4 and losses == pytest.approx(eager_losses, rel=1e-5)
    assert compiled["final_train_loss"] == pytest.approx(eager["final_train_loss"], rel=1e-5)
    # The padding rows are padding: samples/s counts the 100 real rows only.
    assert compiled["timed_steps"] == 3 and eager["timed_recompiles"] == 0


def two_width_split(rows: int = 256, seed: int = 0) -> TokenizedSplit:
    """Rows of length 6 or 14: bucketed batches of 8 come in two widths (8 x 14, 8 x 6), none short."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([6, 14], size=rows).astype(np.int32)
    labels = rng.integers(0, 3, size=rows)
    ids = np.concatenate([rng.integers(10, 100, size=length) for length in lengths]).astype(np.int32)
    return TokenizedSplit(ids, lengths, labels.astype(np.int64))


def test_a_shape_the_warm_up_missed_is_counted_as_a_timed_recompile_and_said(default_params):
    # Widths as the rows are (no width set): the step compiles static, one graph per shape. The warm-up is given the
    # first batch's shape only (the widest: longest first), so the narrow batches compile in a timed step.
    params = tiny_params(default_params, epochs=1, batch_size=8, compile=True, log_every_n_steps=50,
                         warmup_ratio=0.0, **{"data.bucketing": True})  # fmt: skip
    task = get_task("classification")
    said: list[str] = []
    request = TrainRequest(tiny_model(), two_width_split(), None, params, pad_id=0, device=CPU, precision="fp32",
                           say=said.append, task=task)  # fmt: skip
    trainer = Trainer(request, resolve_runtime(params, CPU, 0))
    assert len(trainer.shape_batches) == 2  # 8 x 14 first (the longest batch leads), then 8 x 6
    trainer.shape_batches = trainer.shape_batches[:1]
    metrics, _, _ = trainer.run(time.perf_counter())
    assert metrics["compile_graphs"] == 1
    assert metrics["timed_recompiles"] == 1 and metrics["timed_cudagraph_skips"] == 0
    warnings = [line for line in said if line.startswith("warning: compile: 1 recompiles")]
    assert warnings and "the step times" in warnings[0] and "include them" in warnings[0], said
