"""lr: auto: the range test's rule reads the curve, the sweep leaves the model as it found it."""

from __future__ import annotations

import numpy as np
import torch

from pipelines.params import apply_overrides
from pipelines.resolve.lr_range import pick_lr, resolve_lr, smooth
from pipelines.runtime import resolve_runtime
from pipelines.tasks import get_task
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split


def curve() -> tuple[list[float], list[float]]:
    """Flat, then falling between 1e-4 and 1e-2, then blowing up: the textbook range-test shape."""
    lrs = list(np.geomspace(1e-6, 1.0, 61))
    losses = [1.0 if lr < 1e-4 else max(0.2, 1.0 - 0.4 * np.log10(lr / 1e-4)) if lr < 1e-1 else 5.0 for lr in lrs]
    return lrs, losses


def test_every_rule_picks_a_rate_where_the_loss_falls():
    lrs, losses = curve()
    for rule in ("valley", "steepest", "min_divided"):
        chosen = pick_lr(lrs, losses, rule)
        assert 1e-4 <= chosen <= 1e-2, (rule, chosen)


def test_smoothing_is_bias_corrected():
    assert smooth([2.0, 2.0, 2.0], 0.9) == [2.0, 2.0, 2.0]


def test_the_sweep_stops_on_divergence_and_restores_the_model(default_params):
    params = tiny_params(default_params, **{"lr": "auto", "batch_size": 16, "fast_dropout": False})
    params = apply_overrides(params, {"lr_range_test.num_steps": 40, "lr_range_test.max_lr": 0.9})
    torch.manual_seed(0)
    model = tiny_model(layers=2, hidden=32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    task = get_task("classification")

    resolved, sweep = resolve_lr(
        params, model, tiny_split(rows=320, seed=1), resolve_runtime(params, torch.device("cpu"), 0, "fp32"), task
    )

    assert sweep is not None and resolved.lr == sweep.chosen
    assert params.lr_range_test.min_lr <= sweep.chosen <= 0.9
    assert len(sweep.lrs) <= 40 and sweep.lrs == sorted(sweep.lrs)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # weights put back
    assert torch.equal(torch.get_rng_state(), rng)  # and the RNG: training starts as with a fixed rate


def test_a_fixed_rate_runs_no_sweep(default_params):
    params = tiny_params(default_params, lr=0.01)
    same, sweep = resolve_lr(
        params,
        tiny_model(),
        tiny_split(),
        resolve_runtime(params, torch.device("cpu"), 0, "fp32"),
        get_task("classification"),
    )
    assert sweep is None and same.lr == 0.01
