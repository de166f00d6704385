"""`batch_size: auto` keeps the effective batch exactly, and incompatible combinations are refused."""

from __future__ import annotations

import pytest
import torch

from pipelines.params import ParamsError
from pipelines.resolve import batch_size as auto
from pipelines.runtime import resolve_runtime
from pipelines.tasks import classification_scoring as scoring
from pipelines.tasks import get_task
from tests.conftest import tiny_params
from tests.pipelines.train.helpers import cpu_runtime, cpu_step, tiny_model

CLASSIFICATION = get_task("classification")


def test_largest_fitting_divisor_is_chosen():
    assert auto.divisors_descending(48) == [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]
    assert auto.largest_fitting(48, lambda rows: rows <= 20) == 16
    with pytest.raises(Exception, match="not even one row"):
        auto.largest_fitting(8, lambda rows: False)


def test_auto_on_cpu_keeps_the_effective_batch(default_params, monkeypatch):
    params = tiny_params(default_params, batch_size="auto", effective_batch_size=64)
    model = tiny_model()
    resolved = auto.resolve_batch_size(
        params, model, 40, resolve_runtime(params, torch.device("cpu"), 0, "fp32"), CLASSIFICATION
    )
    assert resolved.batch_size * resolved.grad_accum_steps == 64 and resolved.batch_size == 64  # plenty of RAM
    # With little memory available, the micro-batch shrinks and accumulation makes up the rest.
    meter_row = auto.SavedActivationMeter()
    with meter_row.measure():
        cpu_step(model, CLASSIFICATION, scaler=False).backward(
            auto.probe_batch(1, 40, 120, torch.device("cpu"), CLASSIFICATION), 1
        )
    fixed = auto.parameter_bytes(model) * 4
    available = (fixed + 10 * meter_row.peak_bytes) / auto.CPU_MEMORY_SHARE

    class FakeMemory:
        pass

    FakeMemory.available = available
    monkeypatch.setattr(auto.psutil, "virtual_memory", lambda: FakeMemory)
    small = auto.resolve_batch_size(
        params, model, 40, resolve_runtime(params, torch.device("cpu"), 0, "fp32"), CLASSIFICATION
    )
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
    from pipelines.runtime import check_runtime

    for overrides, message in (
        ({"device": "cuda"}, "no CUDA device is visible"),
        ({"optim": "adamw_8bit"}, "needs CUDA"),
        ({"precision": "fp16"}, "is for GPUs"),
    ):
        with pytest.raises(UserError, match=message):
            check_runtime(tiny_params(default_params, **overrides))


class OutOfMemoryWithState(torch.nn.Module):
    """A classifier that raises CUDA's out-of-memory error when rows x (1 + optimizer state present) > limit.

    `state_seen` reads the optimizer state through `optimizer_has_state`, set by the test: the probe
    must already hold the state when its first candidate runs.
    """

    def __init__(self, limit: int):
        super().__init__()
        self.model, self.limit = tiny_model(), limit
        self.state_present = lambda: False
        self.first_call_had_state: bool | None = None

    def forward(self, input_ids, attention_mask=None, **_):
        if self.first_call_had_state is None:
            self.first_call_had_state = self.state_present()
        if len(input_ids) * (2 if self.state_present() else 1) > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.model(input_ids=input_ids, attention_mask=attention_mask)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()


def test_the_cuda_probe_runs_full_steps_beside_the_optimizer_state_and_puts_the_weights_back(
    default_params, monkeypatch
):
    # The CUDA probe's logic, run on the CPU with an injected out-of-memory error.
    params = tiny_params(default_params, batch_size="auto", effective_batch_size=32, optim="adamw")
    model = OutOfMemoryWithState(limit=20)
    built: list[torch.optim.Optimizer] = []
    real_build = auto.build_optimizer

    def build_and_watch(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(auto, "build_optimizer", build_and_watch)
    monkeypatch.setattr(scoring, "forward_logits", lambda m, batch: m(batch["input_ids"]).logits)
    model.state_present = lambda: bool(built and built[0].state)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with auto.restored_after(model):
        fits = auto.cuda_fits(model, 30, 120, cpu_runtime(), params, CLASSIFICATION)
        rows = auto.largest_fitting(32, fits)
        assert built[0].state, "the probe's optimizer holds its state"
    # 16 rows fit without optimizer state (16 <= 20), not beside it (32 > 20): the probe says 8.
    assert model.first_call_had_state is True and rows == 8
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "the probe's steps were undone"
    assert all(p.grad is None for p in model.parameters())
