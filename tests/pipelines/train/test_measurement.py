"""Every number is what its name says: timed regions, training memory, skipped non-finite steps (CPU)."""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from pipelines.data.batching import LengthGroupedBatchSampler, PadCollator
from pipelines.tasks import classification_scoring as scoring
from pipelines.tasks import get_task
from pipelines.train.engine import TrainRequest, train_model
from pipelines.train.memory import SavedActivationMeter, peak_rss_bytes, reset_peak_rss
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import cpu_step, tiny_model, tiny_split

CLASSIFICATION = get_task("classification")

CPU = torch.device("cpu")


def run(default_params, model=None, validation=True, checkpoint_dir=None, **overrides):
    params = tiny_params(
        default_params,
        **{"epochs": 2, "batch_size": 16, "lr": 3e-3, "log_every_n_steps": 1, "warmup_ratio": 0.0, **overrides},
    )
    torch.manual_seed(0)
    return train_model(
        TrainRequest(
            model or tiny_model(),
            tiny_split(rows=160, seed=3),
            tiny_split(rows=48, seed=4) if validation else None,
            params,
            pad_id=0,
            device=CPU,
            precision=params.precision,
            checkpoint_dir=checkpoint_dir,
            say=lambda _: None,
        )
    )


SLOW_S = 0.4


def test_validation_checkpoints_and_warmup_are_timed_outside_train_time(default_params, monkeypatch, tmp_path):
    import pipelines.train.trainer as trainer

    plain = run(default_params, checkpoint_dir=tmp_path / "plain").metrics
    real_eval, real_save = trainer.evaluate_split, trainer.WHOLE.save

    def slow_eval(*args, **kwargs):
        time.sleep(SLOW_S)
        return real_eval(*args, **kwargs)

    def slow_save(*args, **kwargs):
        time.sleep(SLOW_S)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate_split", slow_eval)
    monkeypatch.setattr(trainer, "WHOLE", dataclasses.replace(trainer.WHOLE, save=slow_save))
    slow = run(default_params, checkpoint_dir=tmp_path / "slow", checkpoint_every_n_steps=5).metrics
    assert slow["val_time_s"] >= 2 * SLOW_S  # two epochs, one validation each
    assert slow["checkpoint_time_s"] >= 6 * SLOW_S  # steps 5, 10, 15, 20 and two epoch ends
    # 3.2 s of sleeping went to other clocks: train time stays that of the plain run.
    assert slow["train_time_s"] < plain["train_time_s"] + SLOW_S, (slow["train_time_s"], plain["train_time_s"])
    for m in (plain, slow):
        assert m["warmup_time_s"] > 0 and m["setup_time_s"] > 0 and m["compile_time_s"] == 0
        assert m["timed_steps"] == m["optimizer_steps"] - 1


def test_the_first_step_is_the_warmup_and_not_in_train_time(default_params, monkeypatch):
    from pipelines.train.step import TrainStep

    real_step = TrainStep.update
    calls = []

    def slow_first_real_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the run's first (warm-up) step, which is also the memory probe
            time.sleep(1.0)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(TrainStep, "update", slow_first_real_step)
    m = run(default_params, validation=False).metrics
    assert m["warmup_time_s"] >= 1.0 and m["train_time_s"] < 1.0, m


def memory_metrics(default_params, **overrides):
    model = tiny_model(layers=4, hidden=128)
    return run(default_params, model=model, validation=False, epochs=1, **overrides).metrics


def test_peak_training_memory_agrees_with_its_exact_breakdown_within_10_percent(default_params):
    m = memory_metrics(default_params)
    # Parameters and optimizer state counted from the tensors themselves, plus what was alive at the peak.
    breakdown = m["param_bytes"] + m["optimizer_state_bytes"] + m["peak.grad_bytes"] + m["peak.activation_bytes"]
    assert abs(breakdown - m["peak_train_memory_bytes"]) <= 0.10 * m["peak_train_memory_bytes"], (breakdown, m)
    assert m["peak.param_bytes"] == pytest.approx(m["param_bytes"], rel=0.01)  # plus the model's buffers
    # The tracker also counts AdamW's one-element step counters, which the exact count leaves out.
    assert m["peak.optimizer_state_bytes"] == pytest.approx(m["optimizer_state_bytes"], rel=0.01)
    # Library memory is not in it: a tiny model's training peak is megabytes, the process's RSS hundreds.
    assert m["peak_train_memory_bytes"] < 0.25 * m["peak_rss_bytes"]


def saved_activation_bytes(default_params, checkpointing: bool) -> int:
    """What autograd saves for backward on the tiny runs' first batch, counted by saved-tensor hooks."""
    split = tiny_split(rows=160, seed=3)
    model = tiny_model(layers=4, hidden=128)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    rows = LengthGroupedBatchSampler(split.lengths, 16, seed=default_params.seed).batches(0)[0]
    batch = PadCollator(split, pad_id=0, fixed_length=None, pad_to_multiple_of=None)(rows)
    meter = SavedActivationMeter()
    with meter.measure():
        cpu_step(model, CLASSIFICATION, scaler=False).backward(batch, 16)
    return meter.peak_bytes


def test_activations_count_what_checkpointing_recomputes_and_the_peak_drops(default_params):
    vanilla = memory_metrics(default_params)
    checkpointed = memory_metrics(default_params, grad_checkpointing=True)
    # Without checkpointing the tracker's activations are what autograd saves (hooks see the same tensors),
    # less the few that backward has already freed when the peak comes (it comes early in backward).
    saved = saved_activation_bytes(default_params, False)
    assert 0.8 * saved <= vanilla["peak_activation_bytes"] <= saved
    # With it, saved-tensor hooks see only the layer boundaries; the tracker also sees a layer recomputed.
    assert checkpointed["peak_activation_bytes"] > 1.5 * saved_activation_bytes(default_params, True)
    assert checkpointed["peak_activation_bytes"] < 0.7 * vanilla["peak_activation_bytes"]
    assert checkpointed["peak_train_memory_bytes"] < vanilla["peak_train_memory_bytes"]


def test_adafactor_state_is_counted_at_the_peak(default_params):
    adamw = memory_metrics(default_params)
    adafactor = memory_metrics(default_params, optim="adafactor")
    assert adafactor["optimizer_state_bytes"] < 0.05 * adamw["optimizer_state_bytes"]
    assert adamw["peak_train_memory_bytes"] - adafactor["peak_train_memory_bytes"] == pytest.approx(
        adamw["optimizer_state_bytes"] - adafactor["optimizer_state_bytes"], rel=0.05
    )


def test_peak_rss_is_reset_at_a_trial_start():
    assert reset_peak_rss()  # Linux >= 4.0
    block = np.ones(300 * 2**20 // 8)  # 300 MB, touched
    high = peak_rss_bytes()
    del block
    reset_peak_rss()
    assert peak_rss_bytes() < high - 200 * 2**20


class NaNOnCalls(torch.nn.Module):
    """Wraps a model; its logits are NaN on the given forward calls (counted from 1)."""

    def __init__(self, model, bad_calls: set[int]):
        super().__init__()
        self.model, self.bad_calls, self.seen = model, bad_calls, 0

    def forward(self, input_ids, attention_mask):
        self.seen += 1
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        return logits * float("nan") if self.seen in self.bad_calls else logits


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("optim", ["adamw", "adafactor"])
def test_a_nonfinite_window_is_skipped_not_applied(default_params, monkeypatch, precision, optim):
    monkeypatch.setattr(
        scoring,
        "forward_logits",
        lambda model, batch: model(batch["input_ids"], batch["attention_mask"]),
    )
    inner = tiny_model()
    # Call 1 is step 1 (the warm-up, tracked as the memory probe). Steps 4 and 5 (calls 4, 5) see NaN logits.
    wrapped = NaNOnCalls(inner, bad_calls={4, 5})
    weights = {}

    def snapshot(step, _point):
        weights[step] = {k: v.detach().clone() for k, v in inner.state_dict().items()}

    params = tiny_params(
        default_params,
        **{"epochs": 1, "batch_size": 16, "log_every_n_steps": 1, "precision": precision, "optim": optim},
    )
    torch.manual_seed(0)
    result = train_model(
        TrainRequest(
            wrapped,
            tiny_split(rows=160, seed=3),
            None,
            params,
            pad_id=0,
            device=CPU,
            precision=precision,
            on_log=snapshot,
            say=lambda _: None,
        )
    )
    assert result.metrics["skipped_steps"] == 2 and result.metrics["nonfinite_steps"] == 2
    for name, value in weights[3].items():
        assert torch.equal(weights[5][name], value), name  # steps 4 and 5 changed nothing
        assert not torch.equal(weights[6][name], value) or "position_ids" in name or "token_type" in name
    assert all(torch.isfinite(v).all() for v in inner.state_dict().values() if v.is_floating_point())
    # Optimizer state is internal to the run; its finiteness shows in finite, still-learning losses afterwards.
    after = [h["loss"] for h in result.history if h["step"] > 5]
    assert after and all(math.isfinite(loss) for loss in after)
    assert [h["skipped_steps"] for h in result.history][3:5] == [1.0, 2.0]


@pytest.mark.parametrize("optim", ["adamw", "adafactor"])
def test_the_memory_probe_leaves_training_exactly_as_without_it(default_params, monkeypatch, optim):
    import pipelines.train.trainer as trainer

    probed = run(default_params, model=tiny_model(dropout=0.1), optim=optim).history
    monkeypatch.setattr(trainer, "probe_memory", lambda *args, **kwargs: None)
    unprobed = run(default_params, model=tiny_model(dropout=0.1), optim=optim).history
    # Weights, optimizer state, scaler and RNG (dropout masks) are put back: the same losses, bit for bit.
    assert [h["loss"] for h in probed] == [h["loss"] for h in unprobed]


def test_the_cuda_peak_keeps_the_warmup_step_and_leaves_out_what_follows_a_pause(monkeypatch, default_params):
    """The allocator's peak bookkeeping, with its counters faked: warm-up, timed steps, validation."""
    from pipelines.train.checkpoint import LoopState
    from pipelines.train.trainer import Trainer

    allocator = {"peak": 0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: allocator["peak"] + 1)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: allocator.update(peak=0))

    class Clock:
        running = False

        def start(self) -> None:
            self.running = True

        def stop(self) -> None:
            self.running = False

    from pipelines.train.measurement import TrainingMeter

    trainer = object.__new__(Trainer)  # only the bookkeeping: no model, no CUDA
    trainer.state, trainer.device = LoopState(), torch.device("cuda")
    trainer.meter = TrainingMeter(trainer.device, trainer.state, setup_start=0.0)
    trainer.meter.clock = Clock()
    trainer.params = default_params.model_copy(update={"log_every_n_steps": 100, "checkpoint_every_n_steps": None})
    trainer.counters, trainer.logged_loss = torch.zeros(4, dtype=torch.long), torch.zeros(())
    trainer.previous_loss, trainer.previous_rows, trainer.last_log = torch.tensor(float("nan")), -2, float("inf")
    trainer.world_size, trainer.compiled = 1, False
    trainer.per_epoch_schedule, trainer.total_steps = True, 100
    allocator["peak"] = 900  # the warm-up step: the longest batch, and the optimizer state created
    from pipelines.train.step import StepOutcome
    from pipelines.train.trainer import WindowStep
    from pipelines.train.windows import WindowCounts

    trainer.after_step(0, WindowStep(StepOutcome(torch.tensor(1.0), torch.tensor(False)), WindowCounts(), warmup=True))
    trainer.meter.resume()  # the next step resets the allocator's peak
    allocator["peak"] = 600
    trainer.meter.pause()  # validation follows: its allocations must not count
    allocator["peak"] = 5000
    trainer.meter.resume()
    allocator["peak"] = 700
    trainer.meter.pause()
    assert (trainer.state.cuda_peak_allocated, trainer.state.cuda_peak_reserved) == (900, 901)
