"""Lion: it trains, and its state is one moment per trainable parameter (half of AdamW's)."""

from __future__ import annotations

import torch

from pipelines.train.engine import TrainRequest, train_model
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split

CPU = torch.device("cpu")


def test_lion_trains_and_keeps_half_of_adamws_state(default_params):
    split = tiny_split(rows=192, seed=5)
    results = {}
    for optim, lr in (("adamw", 3e-3), ("lion", 3e-3)):
        params = tiny_params(default_params, optim=optim, lr=lr, epochs=4, batch_size=16, log_every_n_steps=4)
        torch.manual_seed(0)
        results[optim] = train_model(
            TrainRequest(tiny_model(), split, split, params, pad_id=0, device=CPU, precision="fp32")
        )
    lion, adamw = results["lion"].metrics, results["adamw"].metrics
    assert lion["optimizer_state_bytes"] == adamw["optimizer_state_bytes"] / 2 == lion["param_bytes"]
    losses = [point["loss"] for point in results["lion"].history]
    assert losses[-1] < 0.8 * losses[0], losses  # it learns
    assert lion["val_accuracy"] > 0.6


def test_every_registered_optimizer_has_a_builder_and_the_schema_allows_exactly_those():
    """Adding an optimizer is one registry entry and one builder: the schema, the FSDP rule, the runtime check,
    strategy: auto's lean tier and the warm-up's fresh-state rule all read the registry."""
    from typing import get_args

    from pipelines.optimizer_registry import FSDP_OPTIMIZERS, OPTIMIZERS
    from pipelines.params import Optimizer
    from pipelines.train.optim import BUILDERS, _zero_fresh_optimizers

    assert list(BUILDERS) == list(OPTIMIZERS) == list(get_args(Optimizer))
    assert FSDP_OPTIMIZERS == ("adamw", "sgd")
    fresh = {t.__name__ for t in _zero_fresh_optimizers()}
    assert fresh == {"AdamW", "Adafactor", "Lion", "SGD"}  # not bitsandbytes' 8-bit AdamW (its maps are not zeros)
