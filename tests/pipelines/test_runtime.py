"""The runtime's choices: an explicit bf16 on a CPU that only emulates it is warned about, with the slowdown."""

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
