"""The engine is correct: accumulation, checkpointing, optimizer state and bf16, on a tiny model (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator
from pipelines.tasks import classification_scoring as scoring
from pipelines.tasks import get_task
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.memory import SavedActivationMeter, optimizer_state_bytes, parameter_bytes
from pipelines.train.optim import build_optimizer
from pipelines.train.windows import halve_windows, plan_windows
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import cpu_step, loopback_init_method, loopback_process_group, tiny_model, tiny_split

CLASSIFICATION = get_task("classification")

CPU = torch.device("cpu")


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def accumulated_gradients(model, split, batches: list[list[int]], rows_in_window: int) -> dict[str, torch.Tensor]:
    collate = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)
    step = cpu_step(model, CLASSIFICATION, scaler=False)
    model.zero_grad(set_to_none=True)
    for batch in batches:
        step.backward(collate(batch), rows_in_window)
    return gradients(model)


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < atol, worst


@pytest.mark.parametrize("bucketing", [False, True])
def test_k_accumulated_micro_batches_equal_one_big_batch(bucketing):
    split = tiny_split(rows=64)
    model = tiny_model()
    k, b = 4, 8
    micro = LengthGroupedBatchSampler(split.lengths, b, bucketing=bucketing, seed=1).batches(0)[:k]
    rows = sum(len(m) for m in micro)
    assert len({int(split.lengths[m].max()) for m in micro}) > 1  # micro-batches padded to different lengths
    accumulated = accumulated_gradients(model, split, micro, rows)
    one_batch = accumulated_gradients(model, split, [[i for m in micro for i in m]], rows)
    assert_close(accumulated, one_batch, atol=1e-5)


def test_last_partial_window_is_weighted_by_its_own_rows():
    split = tiny_split(rows=40)
    batches = LengthGroupedBatchSampler(split.lengths, 8, seed=2).batches(0)  # 5 batches
    windows = [sum(len(b) for b in window) for window in plan_windows(batches, 2)]
    assert windows == [16, 16, 8]  # the last window holds one batch of 8 rows
    model = tiny_model()
    partial = accumulated_gradients(model, split, batches[4:], windows[-1])
    alone = accumulated_gradients(model, split, [batches[4]], len(batches[4]))
    assert_close(partial, alone, atol=1e-7)


def test_checkpointing_same_gradients_and_at_least_40_percent_fewer_saved_activations():
    split = tiny_split(rows=16, max_len=64)
    batch = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)(list(range(16)))
    results = {}
    for checkpointing in (False, True):
        model = tiny_model(layers=4, hidden=64)
        model.train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        meter = SavedActivationMeter()
        with meter.measure():
            cpu_step(model, CLASSIFICATION, scaler=False).backward(batch, 16)
        results[checkpointing] = (gradients(model), meter.peak_bytes)
    assert_close(results[False][0], results[True][0], atol=1e-6)
    plain, checkpointed = results[False][1], results[True][1]
    assert checkpointed <= 0.6 * plain, (plain, checkpointed)


def optimizer_bytes_after_one_step(name: str) -> tuple[int, int]:
    model = tiny_model(layers=2, hidden=64)
    optimizer = build_optimizer(name, model, 1e-3, 0.01, CPU)
    split = tiny_split(rows=8)
    batch = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)(list(range(8)))
    cpu_step(model, CLASSIFICATION, scaler=False).backward(batch, 8)
    optimizer.step()
    return optimizer_state_bytes(optimizer), parameter_bytes(model)


def test_adamw_state_is_exactly_twice_the_parameters_and_adafactor_at_most_a_quarter_of_it():
    adamw, params = optimizer_bytes_after_one_step("adamw")
    assert adamw == 2 * params
    adafactor, _ = optimizer_bytes_after_one_step("adafactor")
    assert adafactor <= 0.25 * adamw, (adafactor, adamw)


def train_tiny(default_params, **overrides):
    params = tiny_params(
        default_params,
        **{"epochs": 2, "batch_size": 16, "lr": 3e-3, "log_every_n_steps": 1, "warmup_ratio": 0.0, **overrides},
    )
    torch.manual_seed(0)
    model = tiny_model()
    return train_model(
        TrainRequest(
            model,
            tiny_split(rows=160, seed=3),
            tiny_split(rows=48, seed=4),
            params,
            pad_id=0,
            device=CPU,
            precision=params.precision,
        )
    )


# bf16 keeps 8 bits of mantissa; over 20 steps of a tiny model the mean loss drifts by a few hundredths.
BF16_LOSS_TOLERANCE = 0.05


def test_bf16_on_cpu_runs_and_stays_close_to_fp32(default_params):
    fp32 = train_tiny(default_params, precision="fp32")
    bf16 = train_tiny(default_params, precision="bf16")
    assert math.isfinite(bf16.metrics["final_train_loss"])
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(fp32.history, bf16.history, strict=True)]
    assert max(diffs) < BF16_LOSS_TOLERANCE, diffs
    assert fp32.history[-1]["loss"] < fp32.history[0]["loss"]  # it learns


def test_padding_fraction_is_the_share_of_padded_positions(default_params):
    fixed = train_tiny(default_params, **{"data.bucketing": False}).metrics
    rows, tokens = (fixed[k] * fixed["train_time_s"] for k in ("samples_per_s", "tokens_per_s"))
    # Unbucketed batches are padded to max_length: rows x max_length positions.
    max_length = tiny_params(default_params).data.max_length
    assert fixed["padding_fraction"] == pytest.approx(1 - tokens / (rows * max_length))
    bucketed = train_tiny(default_params).metrics
    assert 0 < bucketed["padding_fraction"] < fixed["padding_fraction"]


def test_metrics_are_measured(default_params):
    result = train_tiny(default_params)
    m = result.metrics
    assert m["optimizer_steps"] == 2 * 10 and m["timed_steps"] == 2 * 10 - 1  # the warm-up step is not timed
    assert m["samples_per_s"] > 0 and m["tokens_per_s"] > m["samples_per_s"]
    assert m["samples_per_s"] * m["train_time_s"] == pytest.approx(2 * 160 - 16)  # rows of the timed steps
    assert 0 <= m["data_wait_fraction"] < 1
    assert m["step_time_p90_ms"] >= m["step_time_p50_ms"] > 0
    assert m["optimizer_state_bytes"] == 2 * m["param_bytes"] == 2 * m["grad_bytes"]
    assert m["peak_activation_bytes"] > 0 and m["peak_train_memory_bytes"] > m["param_bytes"]
    assert 0 <= m["val_accuracy"] <= 1


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine", "onecycle", "cyclic", "reduce_on_plateau"])
@pytest.mark.parametrize("optim", ["adamw", "adafactor", "sgd"])
def test_every_optimizer_and_schedule_trains(default_params, optim, schedule):
    result = train_tiny(default_params, optim=optim, lr_schedule=schedule, epochs=1)
    assert all(math.isfinite(h["loss"]) and h["lr"] >= 0 for h in result.history)


def test_grad_accumulation_counts_optimizer_steps_with_a_partial_window(default_params):
    result = train_tiny(default_params, grad_accum_steps=3)
    assert result.metrics["optimizer_steps"] == 2 * math.ceil(10 / 3)


class Killed(Exception):
    """Stands in for a process killed mid-epoch."""


def test_run_killed_mid_epoch_resumes_to_the_same_final_loss(default_params, tmp_path):
    params = tiny_params(
        default_params,
        **{"epochs": 2, "batch_size": 16, "log_every_n_steps": 1, "checkpoint_every_n_steps": 4, "warmup_ratio": 0.0},
    )
    data = tiny_split(rows=160, seed=3), tiny_split(rows=48, seed=4)

    def train(folder, on_log=None, messages=None):
        torch.manual_seed(0)
        model = tiny_model(dropout=0.1)  # dropout: the RNG state must be restored too
        return train_model(
            TrainRequest(
                model,
                *data,
                params,
                pad_id=0,
                device=CPU,
                precision="fp32",
                checkpoint_dir=folder,
                on_log=on_log,
                say=(messages.append if messages is not None else lambda _: None),
            )
        )

    uninterrupted = train(tmp_path / "a")

    def kill_at_step_7(step, _point):
        if step == 7:  # mid-epoch (10 steps per epoch); the last checkpoint is at step 4
            raise Killed

    with pytest.raises(Killed):
        train(tmp_path / "b", on_log=kill_at_step_7)
    messages: list[str] = []
    resumed = train(tmp_path / "b", messages=messages)
    assert "resuming from" in messages[0] and "optimizer step 4" in messages[0]
    assert resumed.metrics["optimizer_steps"] == uninterrupted.metrics["optimizer_steps"] == 20
    assert abs(resumed.metrics["final_train_loss"] - uninterrupted.metrics["final_train_loss"]) < 1e-6
    assert [h["step"] for h in resumed.history] == list(range(1, 21))


def test_checkpoint_made_with_other_params_is_not_resumed(default_params, tmp_path):
    params = tiny_params(default_params, **{"epochs": 1, "batch_size": 16})
    data = tiny_split(rows=64, seed=3), tiny_split(rows=16, seed=4)
    train_model(
        TrainRequest(
            tiny_model(), *data, params, pad_id=0, device=CPU, precision="fp32", checkpoint_dir=tmp_path, say=print
        )
    )
    changed = tiny_params(params, lr=5e-4)
    messages: list[str] = []
    train_model(
        TrainRequest(
            tiny_model(),
            *data,
            changed,
            pad_id=0,
            device=CPU,
            precision="fp32",
            checkpoint_dir=tmp_path,
            say=messages.append,
        )
    )
    assert "different params (lr: 0.001 -> 0.0005): starting fresh" in messages[0]


def test_halving_keeps_every_window_s_rows():
    windows = plan_windows([[0, 1, 2, 3], [4, 5, 6], [7]], 2)
    halved = halve_windows(windows, 1)
    assert halved[0] == [[0, 1, 2, 3], [4, 5, 6]] and halved[1] == [[7]]
    assert halve_windows(windows, 0)[0] == [[0, 1], [2, 3], [4], [5, 6]]


class OutOfMemoryAbove(torch.nn.Module):
    """Wraps a model; raises CUDA's out-of-memory error for micro-batches above `limit` rows (injected OOM)."""

    def __init__(self, model, limit: int):
        super().__init__()
        self.model, self.limit, self.raised = model, limit, 0

    def forward(self, input_ids, attention_mask):
        if len(input_ids) > self.limit:
            self.raised += 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.model(input_ids=input_ids, attention_mask=attention_mask)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()


def test_out_of_memory_halves_micro_batches_and_keeps_the_effective_batch(default_params, monkeypatch):
    params = tiny_params(default_params, **{"epochs": 2, "batch_size": 32, "log_every_n_steps": 1, "warmup_ratio": 0.0})
    data = tiny_split(rows=160, seed=3), None  # training only: the wrapper would also refuse big eval batches
    torch.manual_seed(0)
    reference = train_model(
        TrainRequest(tiny_model(), *data, params, pad_id=0, device=CPU, precision="fp32", say=lambda _: None)
    )
    torch.manual_seed(0)
    wrapped = OutOfMemoryAbove(tiny_model(), limit=8)
    monkeypatch.setattr(
        scoring,
        "forward_logits",
        lambda model, batch: model(batch["input_ids"], batch["attention_mask"]).logits,
    )
    messages: list[str] = []
    result = train_model(
        TrainRequest(wrapped, *data, params, pad_id=0, device=CPU, precision="fp32", say=messages.append)
    )
    # Twice in the warm-up step, which is also the memory probe (tracked): 32 -> 16 -> 8 rows.
    assert wrapped.raised == 2 and result.metrics["oom_halvings"] == 2
    assert sum("micro-batches halved, accumulation doubled" in m for m in messages) == 2, messages
    assert result.metrics["peak_train_memory_bytes"] > 0  # measured on the warm-up step that fitted
    assert result.metrics["optimizer_steps"] == reference.metrics["optimizer_steps"]  # same effective batch
    for ours, theirs in zip(result.history, reference.history, strict=True):
        assert abs(ours["loss"] - theirs["loss"]) < 1e-5


class NaNAfter(torch.nn.Module):
    """Wraps a model; its logits become NaN after `calls` forward passes (a diverging run)."""

    def __init__(self, model, calls: int):
        super().__init__()
        self.model, self.calls, self.seen = model, calls, 0

    def forward(self, input_ids, attention_mask):
        self.seen += 1
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits * float("nan") if self.seen > self.calls else logits


def test_nonfinite_loss_stops_the_run_with_a_clear_reason(default_params, monkeypatch):
    from pipelines.train.trainer import NonFiniteLoss

    params = tiny_params(
        default_params, **{"epochs": 2, "batch_size": 16, "log_every_n_steps": 1, "max_nonfinite_steps": 3}
    )
    monkeypatch.setattr(
        scoring,
        "forward_logits",
        lambda model, batch: model(batch["input_ids"], batch["attention_mask"]),
    )
    logged = []
    with pytest.raises(NonFiniteLoss, match="not finite for 3 optimizer steps in a row .* up to step 7"):
        train_model(
            TrainRequest(
                NaNAfter(tiny_model(), calls=4),  # four good steps (the first, the warm-up, is also the memory probe)
                tiny_split(rows=160, seed=3),
                None,
                params,
                pad_id=0,
                device=CPU,
                precision="fp32",
                on_log=lambda step, point: logged.append(point["loss"]),
            )
        )
    assert all(math.isfinite(loss) for loss in logged[:4]) and all(math.isnan(loss) for loss in logged[4:])


def test_ddp_all_reduces_once_per_accumulation_window():
    with loopback_process_group(0, 1, loopback_init_method()):
        per_backward, per_window = _ddp_all_reduce_counts()
    assert per_backward >= 1  # all-reduces of one synchronised backward (one per gradient bucket)
    assert per_window == per_backward  # once per window of 4 micro-batches, not 4 times


def _ddp_all_reduce_counts() -> tuple[int, int]:
    """All-reduces for one backward, then for a window of 4 micro-batches (DDP is freed on return)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(tiny_model())
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, counting_hook)
    split = tiny_split(rows=32)
    window = [list(range(i, i + 8)) for i in range(0, 32, 8)]  # 4 micro-batches
    collate = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)
    step = cpu_step(ddp.module, CLASSIFICATION, scaler=False).through(ddp)
    step.accumulate([collate(window[0])], len(window[0]))
    per_backward = len(calls)
    calls.clear()
    step.accumulate([collate(b) for b in window], sum(len(b) for b in window))
    return per_backward, len(calls)


def test_reduce_on_plateau_halves_the_lr_when_validation_loss_stalls(default_params):
    # lr far too high: validation loss does not improve, so the lr is halved after the second epoch.
    result = train_tiny(default_params, lr_schedule="reduce_on_plateau", lr=0.5, epochs=3, optim="sgd")
    lrs = [h["lr"] for h in result.history]
    assert lrs[0] == 0.5 and min(lrs) < 0.5


def test_out_of_memory_under_ddp_is_refused_with_a_clear_message(default_params):
    # One rank cannot halve alone: the others wait in the gradient all-reduce of the step it will not finish.
    from pipelines.errors import UserError
    from pipelines.train.checkpoint import LoopState
    from pipelines.train.out_of_memory import recover_from_out_of_memory

    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    windows = plan_windows([[0, 1, 2, 3], [4, 5, 6, 7]], 1)
    with pytest.raises(UserError, match=r"out of memory on a micro-batch of 4 rows under DDP \(2 workers\)"):
        recover_from_out_of_memory(optimizer, windows, LoopState(), CPU, 2, print)
    state = LoopState()
    assert recover_from_out_of_memory(optimizer, windows, state, CPU, 1, lambda _: None)[0] == [[0, 1], [2, 3]]
    assert state.oom_halvings == 1
