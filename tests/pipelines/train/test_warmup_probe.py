"""The memory probe is the warm-up step itself: no window runs twice, and training is exactly what it was.

Before, the first window ran twice before training (untracked, to create the optimizer state, then
under MemTracker) and the weights were put back; the warm-up step then ran it a third time. Now the
optimizer's fresh state is made ahead without moving a weight, and the warm-up step is tracked.
"""

from __future__ import annotations

import pytest
import torch

import pipelines.train.trainer as trainer
from pipelines.train.optim import build_optimizer, create_fresh_state
from tests.pipelines.train.helpers import tiny_model
from tests.pipelines.train.test_measurement import run

CPU = torch.device("cpu")


@pytest.mark.parametrize("optim", ["adamw", "adafactor", "sgd", "lion"])
def test_fresh_state_is_made_without_moving_a_weight_and_equals_a_first_steps(default_params, optim):
    torch.manual_seed(0)
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(optim, model, lr=1e-2, weight_decay=0.1, device=CPU)
    assert create_fresh_state(model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # bit for bit
    assert all(p.grad is None for p in model.parameters())
    assert all(g["lr"] == 1e-2 for g in optimizer.param_groups)
    if optim != "sgd":  # torch's SGD with momentum keeps a buffer too; Adam's moments, Adafactor's factors
        assert optimizer.state
    for state in optimizer.state.values():
        for value in state.values():
            assert float(value.abs().sum() if isinstance(value, torch.Tensor) else abs(value)) == 0.0


@pytest.mark.parametrize("optim", ["adamw", "adafactor"])
def test_the_tracked_warmup_trains_exactly_as_the_separate_probe_did(default_params, monkeypatch, optim):
    torch.manual_seed(0)
    tracked_model, probed_model = tiny_model(), tiny_model()
    probed_model.load_state_dict(tracked_model.state_dict())
    tracked = run(default_params, model=tracked_model, validation=False, optim=optim)
    monkeypatch.setattr(trainer, "create_fresh_state", lambda model, optimizer: False)  # the separate probe
    probed = run(default_params, model=probed_model, validation=False, optim=optim)
    assert [h["loss"] for h in tracked.history] == [h["loss"] for h in probed.history]
    for ours, theirs in zip(tracked_model.state_dict().values(), probed_model.state_dict().values(), strict=True):
        assert torch.equal(ours, theirs)
    # The same step measured, so the same peak and breakdown (MemTracker counts tensors, not the allocator).
    for name in ("peak_train_memory_bytes", "peak.optimizer_state_bytes", "peak.grad_bytes", "peak.param_bytes"):
        assert tracked.metrics[name] == pytest.approx(probed.metrics[name], rel=0.01), name
    assert tracked.metrics["peak.optimizer_state_bytes"] > 0  # the state was alive at the peak


def test_the_first_window_runs_once(default_params, monkeypatch):
    windows = []
    from pipelines.train.step import TrainStep

    real = TrainStep.accumulate
    monkeypatch.setattr(TrainStep, "accumulate", lambda *a, **k: windows.append(1) or real(*a, **k))
    result = run(default_params, validation=False, epochs=1)
    assert len(windows) == result.metrics["optimizer_steps"]  # one per optimizer step, no probe runs
