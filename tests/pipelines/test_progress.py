"""A trial's progress: summary lines per epoch from the engine's log points; a bar only when asked."""

from __future__ import annotations

import math

import torch

from pipelines.progress import TrialProgress
from pipelines.train.engine import TrainRequest, train_model
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split


def test_epoch_lines_show_steps_loss_metrics_rate_and_time_left():
    now = [0.0]
    lines: list[str] = []
    progress = TrialProgress(epochs=2, say=lines.append, make_bar=None, clock=lambda: now[0])
    for step, rows in ((5, 0.0), (10, 160.0)):
        now[0] = step * 0.5
        progress.on_log(step, {"loss": 0.9, "lr": 1e-3, "total_steps": 20.0, "rows_timed": rows})
    line = progress.on_epoch_end(1, 10, {"val_accuracy": 0.75, "val_time_s": 0.1})
    assert line == ("epoch 1/2, step 10/20, loss 0.9000, val_accuracy 0.7500, 64 samples/s, 5s elapsed, about 5s left")
    assert lines == [line] and progress._bar is None  # no bar when stdout is not a terminal


def test_an_epoch_line_gives_the_epochs_own_rate_not_the_last_intervals():
    now = [0.0]
    progress = TrialProgress(epochs=2, say=lambda line: None, make_bar=None, clock=lambda: now[0])
    # Slow (a loaded host) for 30 s, then one quick interval just before the epoch ends: 640 rows in 32 s.
    for t, rows in ((0.0, 0.0), (30.0, 320.0), (32.0, 640.0)):
        now[0] = t
        progress.on_log(int(t) + 1, {"loss": 0.9, "total_steps": 66.0, "rows_timed": rows})
    assert progress.rate == 160.0  # the last interval alone
    assert "20 samples/s" in progress.on_epoch_end(1, 33, {})
    for t, rows in ((40.0, 720.0), (42.0, 800.0)):  # the second epoch from its own first log point on
        now[0] = t
        progress.on_log(int(t), {"loss": 0.8, "rows_timed": rows})
    assert "16 samples/s" in progress.on_epoch_end(2, 66, {})  # (800 - 640) / (42 - 32)


def test_the_engine_tells_its_log_callback_the_total_steps_and_rows(default_params):
    params = tiny_params(default_params, epochs=2, batch_size=16, log_every_n_steps=3)
    points: list[tuple[int, dict[str, float]]] = []
    result = train_model(TrainRequest(
        tiny_model(), tiny_split(rows=96), None, params, pad_id=0, device=torch.device("cpu"),
        precision="fp32", on_log=lambda step, point: points.append((step, point)), say=lambda _: None,
    ))  # fmt: skip
    total = result.metrics["optimizer_steps"]
    assert points[-1][0] == total and all(p["total_steps"] == total for _, p in points)
    assert points[-1][1]["rows_timed"] > points[0][1]["rows_timed"]
    assert "total_steps" not in result.history[0]  # the logged curve stays (step, epoch, loss, lr, ...)


def test_without_a_bar_a_progress_line_comes_at_least_every_30_seconds():
    # A slow run (a step every 20 s): the log points come from the engine's 30-second rule, and each one more than
    # 30 s after the last line says where the run is.
    now = [0.0]
    lines: list[str] = []
    progress = TrialProgress(epochs=1, say=lines.append, make_bar=None, clock=lambda: now[0])
    for step in range(1, 7):
        now[0] = 20.0 * step
        progress.on_log(step, {"loss": 2.0 - 0.1 * step, "total_steps": 50.0, "rows_timed": 4.0 * (step - 1)})
    assert lines == [
        "step 2/50, loss 1.8000, 0.2 samples/s, about 16m00s left",
        "step 4/50, loss 1.6000, 0.2 samples/s, about 15m20s left",
        "step 6/50, loss 1.4000, 0.2 samples/s, about 14m40s left",
    ]


def test_the_engine_logs_when_30_seconds_pass_without_a_log_point(default_params, monkeypatch):
    import pipelines.train.trainer as trainer

    monkeypatch.setattr(trainer, "PROGRESS_EVERY_S", 0.0)  # every step is overdue
    params = tiny_params(default_params, epochs=1, batch_size=16, log_every_n_steps=1000)
    steps: list[int] = []
    train_model(TrainRequest(tiny_model(), tiny_split(rows=96), None, params, pad_id=0, device=torch.device("cpu"),
                precision="fp32", on_log=lambda step, point: steps.append(step), say=lambda _: None))  # fmt: skip
    assert steps == list(range(1, 7))  # 96 rows / 16: six steps, each logged although log_every_n_steps is 1000


def test_the_first_epoch_line_of_a_small_run_has_a_real_loss_and_the_total_steps(default_params):
    # 96 rows at batch 16: 6 steps an epoch, fewer than log_every_n_steps; the epoch's end is a log point.
    params = tiny_params(default_params, epochs=2, batch_size=16, log_every_n_steps=10)
    lines: list[str] = []
    progress = TrialProgress(epochs=2, say=lines.append, make_bar=None)
    train_model(TrainRequest(
        tiny_model(), tiny_split(rows=96), None, params, pad_id=0, device=torch.device("cpu"), precision="fp32",
        on_log=progress.on_log, on_epoch_end=progress.on_epoch_end, say=lambda _: None,
    ))  # fmt: skip
    first = lines[0]
    assert first.startswith("epoch 1/2, step 6/12, loss "), first
    assert math.isfinite(float(first.split("loss ")[1].split(",")[0]))


def test_generation_says_rows_done_and_time_left_at_least_every_30_seconds():
    from pipelines.progress import RowsProgress

    now = [0.0]
    lines: list[str] = []
    progress = RowsProgress("generation", 600, say=lines.append, clock=lambda: now[0])
    for _ in range(12):  # 50 rows every 10 s: 2 minutes in all
        now[0] += 10.0
        progress.advance(50)
    assert lines == [
        "generation: 150/600 rows, about 1m30s left",
        "generation: 300/600 rows, about 1m00s left",
        "generation: 450/600 rows, about 30s left",
    ]
