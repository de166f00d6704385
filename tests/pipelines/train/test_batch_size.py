"""`batch_size: auto` keeps the effective batch exactly, and incompatible combinations are refused."""

from __future__ import annotations

import pytest
import torch

from pipelines.params import ParamsError
from pipelines.train import batch_size as auto
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import tiny_model


def test_largest_fitting_divisor_is_chosen():
    assert auto.divisors_descending(48) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert auto.largest_fitting(48, lambda rows: rows <= 20) == 16
    with pytest.raises(Exception, match="not even one row"):
        auto.largest_fitting(8, lambda rows: False)


def test_auto_on_cpu_keeps_the_effective_batch(default_params, monkeypatch):
    params = tiny_params(default_params, batch_size="auto", effective_batch_size=64)
    model = tiny_model()
    resolved = auto.resolve_batch_size(params, model, 40, torch.device("cpu"), "fp32")
    assert resolved.batch_size * resolved.grad_accum_steps == 64 and resolved.batch_size == 64  # plenty of RAM
    # With little memory available, the micro-batch shrinks and accumulation makes up the rest.
    meter_row = auto.SavedActivationMeter()
    with meter_row.measure():
        auto.backward_micro_batch(
            model,
            auto.probe_batch(1, 40, 120, torch.device("cpu")),
            1,
            "fp32",
            torch.device("cpu"),
            torch.amp.GradScaler("cpu", enabled=False),
        )
    fixed = auto.parameter_bytes(model) * 4
    available = (fixed + 10 * meter_row.peak_bytes) / auto.CPU_MEMORY_SHARE

    class FakeMemory:
        pass

    FakeMemory.available = available
    monkeypatch.setattr(auto.psutil, "virtual_memory", lambda: FakeMemory)
    small = auto.resolve_batch_size(params, model, 40, torch.device("cpu"), "fp32")
    assert (small.batch_size, small.grad_accum_steps) == (8, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"batch_size": "auto"}, "batch_size: auto needs effective_batch_size"),
        ({"batch_size": "auto", "effective_batch_size": 64, "grad_accum_steps": 2}, "set grad_accum_steps: 1"),
        ({"effective_batch_size": 64}, "effective_batch_size (64) is only used with batch_size: auto"),
        ({"optim": "adamw_8bit", "device": "cpu"}, "optim: adamw_8bit runs on CUDA only"),
        ({"precision": "fp16", "device": "cpu"}, "precision: fp16 (with loss scaling) is for GPUs"),
        ({"persistent_workers": True, "num_workers": 0}, "persistent_workers: true needs num_workers > 0"),
        ({"batch_size": "auto", "effective_batch_size": 64, "data.max_tokens_per_batch": 4096}, "choose one"),
    ],
)
def test_incompatible_combinations_name_both_keys(default_params, overrides, message):
    with pytest.raises(ParamsError) as info:
        tiny_params(default_params, **overrides)
    assert message in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cuda_only_choices_fail_before_training_without_cuda(default_params):
    from pipelines.errors import UserError
    from pipelines.train.device import check_runtime

    for overrides, message in (
        ({"device": "cuda"}, "no CUDA device is visible"),
        ({"optim": "adamw_8bit"}, "needs CUDA"),
        ({"precision": "fp16"}, "is for GPUs"),
    ):
        with pytest.raises(UserError, match=message):
            check_runtime(tiny_params(default_params, **overrides))
