"""The runtime's choices: an explicit bf16 on a CPU that only emulates it is warned about, with the slowdown; the
frozen `Runtime` a trial resolves once."""

from __future__ import annotations

import pytest
import torch

from pipelines.runtime import emulated_bf16_warning

CPU = torch.device("cpu")


def test_bf16_on_an_avx2_only_cpu_is_warned_about_naming_the_missing_feature(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    warning = emulated_bf16_warning("bf16", CPU)
    assert warning is not None and "torch reports AVX2: no AVX-512 BF16, no AMX" in warning and "17x" in warning
    assert emulated_bf16_warning("fp32", CPU) is None


def test_no_warning_where_bf16_is_native_or_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512_BF16")
    assert emulated_bf16_warning("bf16", CPU) is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert emulated_bf16_warning("bf16", torch.device("cuda")) is None


def test_a_torch_without_the_internals_we_use_is_refused_by_name(default_params, monkeypatch):
    from torch.distributed._tools.mem_tracker import MemTracker

    from pipelines.errors import UserError
    from pipelines.runtime import check_runtime

    check_runtime(default_params)  # this torch and transformers have them all
    monkeypatch.delattr(MemTracker, "_update_peak_stats")
    with pytest.raises(UserError, match=r"lacks what pipelines relies on: torch MemTracker._update_peak_stats.*"
                                        r"checked on torch 2.13"):  # fmt: skip
        check_runtime(default_params)


def test_the_runtime_is_resolved_once_frozen_and_what_the_engine_reports(default_params, monkeypatch):
    import dataclasses

    from pipelines.runtime import resolve_runtime
    from pipelines.train.engine import TrainRequest, train_model
    from tests.conftest import tiny_params
    from tests.pipelines.train.helpers import tiny_model, tiny_split

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    params = tiny_params(default_params, epochs=1)
    runtime = resolve_runtime(params, CPU, pad_id=0)
    # On a CPU: auto precision is fp32 without native bf16, no TF32, no pad rounding (it only pads there).
    assert (runtime.device, runtime.precision, runtime.tf32, runtime.pad_multiple, runtime.pad_id) == (
        CPU, "fp32", False, None, 0,
    )  # fmt: skip
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.precision = "bf16"  # type: ignore[misc]
    explicit = tiny_params(default_params, **{"data.pad_to_multiple_of": 16})
    assert resolve_runtime(explicit, CPU, pad_id=1, precision="bf16").pad_multiple == 16
    result = train_model(
        TrainRequest(
            tiny_model(), tiny_split(rows=64), None, params, pad_id=0, device=CPU, precision="fp32", say=lambda _: None
        )
    )
    assert {k: result.notes[k] for k in runtime.notes()} == runtime.notes() == {
        "tf32.resolved": "false", "pad_to_multiple_of.resolved": "None", "loss_impl.resolved": "full",
    }  # fmt: skip
