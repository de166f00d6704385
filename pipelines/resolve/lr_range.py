"""`lr: auto`: an LR range test (Smith, "Cyclical Learning Rates", 2015) before training.

A short sweep trains on the training split with the run's optimizer, precision and batches while
the learning rate grows exponentially from `lr_range_test.min_lr` to `max_lr`, one optimizer
step per window. The loss is smoothed (bias-corrected exponential average) and the sweep stops
once it exceeds `divergence` x its minimum. The rate is read off the curve by `rule`:

- `min_divided` (the default): the rate at the minimum smoothed loss, divided by 10 (fastai's
  older `lr_min / 10`). A model trained from scratch keeps a flat loss until just before it
  diverges, so slope-based rules read noise; the minimum is robust to that (see
  `benchmarks/RESULTS.md`, "LR range test");
- `valley`: fastai's newer rule (its `valley` suggestion): the longest stretch over which the
  smoothed loss keeps decreasing, and a point about halfway down it;
- `steepest`: the most negative slope of the smoothed loss against log(lr), before its minimum.

The weights, buffers and RNG are put back afterwards, so training starts from the
same initialization as with a fixed rate. The sweep is timed on its own (`lr_range_time_s`), out
of every other clock. Hand-written: torch has no range test, and the one maintained finder
(pytorch-lightning's tuner) needs a LightningModule.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipelines.data.loader import in_process, make_loader, to_device
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import LrRangeTestParams, Params, apply_overrides
from pipelines.runtime import Runtime
from pipelines.tasks.base import Task
from pipelines.train.measurement import rng_preserved
from pipelines.train.optim import build_optimizer
from pipelines.train.step import TrainStep, make_scaler
from pipelines.train.windows import plan_windows, training_sampler, window_units


@dataclass(frozen=True)
class LrRangeResult:
    """The sweep's curve (one point per optimizer step), the chosen rate and what the sweep cost."""

    lrs: list[float]
    losses: list[float]
    smoothed: list[float]
    chosen: float
    rule: str
    time_s: float

    def as_metrics(self) -> dict[str, float]:
        """The found rate and the sweep's cost, as MLflow metrics."""
        return {"lr_found": self.chosen, "lr_range_time_s": self.time_s, "lr_range_steps": float(len(self.lrs))}

    def as_json(self) -> dict[str, object]:
        """The curve, for the MLflow artifact."""
        return {
            "rule": self.rule,
            "chosen": self.chosen,
            "lr": self.lrs,
            "loss": self.losses,
            "smoothed": self.smoothed,
        }


def exponential_rates(settings: LrRangeTestParams) -> np.ndarray:
    """The sweep's rate at each step: min_lr to max_lr, evenly spaced in log."""
    return np.geomspace(settings.min_lr, settings.max_lr, settings.num_steps)


def smooth(losses: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (as Adam corrects its moments)."""
    average, out = 0.0, []
    for step, loss in enumerate(losses, start=1):
        average = beta * average + (1 - beta) * loss
        out.append(average / (1 - beta**step) if beta else loss)
    return out


def pick_lr(lrs: list[float], smoothed: list[float], rule: str) -> float:
    """The rate the rule reads off a (smoothed) curve; see the module docstring."""
    n = len(smoothed)
    if n < 3:
        return lrs[0]
    if rule == "min_divided":
        return lrs[int(np.argmin(smoothed))] / 10
    if rule == "steepest":
        slopes = np.gradient(np.asarray(smoothed), np.log(np.asarray(lrs)))
        return lrs[int(np.argmin(slopes[: int(np.argmin(smoothed)) + 1]))]
    # valley (fastai.callback.schedule.valley): longest decreasing subsequence, a point 1/2 of the way down.
    lds, max_end = [1] * n, 0
    for i in range(1, n):
        for j in range(i):
            if smoothed[i] < smoothed[j] and lds[i] < lds[j] + 1:
                lds[i] = lds[j] + 1
        if lds[max_end] < lds[i]:
            max_end = i
    max_start = max_end - lds[max_end]
    sections = (max_end - max_start) / 3
    return lrs[max_start + int(sections) + int(sections / 2)]


def lr_range_test(
    model: nn.Module,
    train: TokenizedSplit,
    params: Params,
    runtime: Runtime,
    task: Task,
) -> LrRangeResult:
    """Run the sweep of `params.lr_range_test` on `train`; the model comes back as it went in."""
    start = time.perf_counter()
    device = runtime.device
    settings = params.lr_range_test
    model.to(device).train()
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}

    rates = exponential_rates(settings)
    optimizer = build_optimizer(params.optim, model, float(rates[0]), params.weight_decay, device)
    step = TrainStep(model, optimizer, task, runtime, make_scaler(runtime), params.max_grad_norm)
    sampler = training_sampler(train, params)
    units = task.loss_units(train, params)
    windows: list[list[list[int]]] = []
    epoch = 0
    while len(windows) < len(rates):  # a small split repeats its epochs
        windows += plan_windows(sampler.batches(epoch), params.grad_accum_steps)
        epoch += 1
    lrs: list[float] = []
    losses: list[float] = []
    smoothed: list[float] = []
    best = math.inf
    try:
        with rng_preserved(device):  # the sweep draws no dropout mask of the run's
            for rate, window in zip(rates, windows, strict=False):
                for group in optimizer.param_groups:
                    group["lr"] = float(rate)
                batches = [to_device(b, device) for b in make_loader(train, window, in_process(params), runtime, task)]
                outcome = step(batches, window_units(window, units))
                value = float(outcome.loss)  # one sync per step: the sweep needs the value to decide whether to stop
                lrs.append(float(rate))
                losses.append(value)
                smoothed = smooth(losses, settings.smoothing)
                if not math.isfinite(value) or smoothed[-1] > settings.divergence * best:
                    break
                best = min(best, smoothed[-1])
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in trainable:
                    p.copy_(trainable[name])
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        model.zero_grad(set_to_none=True)
    finite = [i for i, s in enumerate(smoothed) if math.isfinite(s)]
    curve_lrs, curve = [lrs[i] for i in finite], [smoothed[i] for i in finite]
    chosen = pick_lr(curve_lrs, curve, settings.rule) if curve else float(rates[0])
    return LrRangeResult(lrs, losses, smoothed, min(chosen, 0.999), settings.rule, time.perf_counter() - start)


def resolve_lr(
    params: Params,
    model: nn.Module,
    train: TokenizedSplit,
    runtime: Runtime,
    task: Task,
) -> tuple[Params, LrRangeResult | None]:
    """Params with a concrete `lr` (the range test's pick under `lr: auto`; unchanged otherwise), and the sweep."""
    if params.lr != "auto":
        return params, None
    result = lr_range_test(model, train, params, runtime, task)
    return apply_overrides(params, {"lr": result.chosen}), result
