"""The runtime's choices: bf16 on a CPU detected from its real features (checked against /proc/cpuinfo), taken by
`precision: auto` only where it was also measured faster, and the reason tagged; an explicit bf16 on a CPU that only
emulates it warned about, with the slowdown; the frozen `Runtime` a trial resolves once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipelines.runtime import emulated_bf16_warning

CPU = torch.device("cpu")


def cpuinfo_flags() -> set[str]:
    """The x86 feature flags the kernel lists for this CPU (what `lscpu` shows); skips where there are none."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), None)
    if flags is None:
        pytest.skip("no x86 flags in /proc/cpuinfo (not Linux on x86) to check the detection against")
    return set(flags)


def native_feature_by_the_kernel() -> str | None:
    """The native bf16 feature /proc/cpuinfo lists (AMX first, as the detection prefers it), else None."""
    flags = cpuinfo_flags()
    return next((name for name in ("amx_bf16", "avx512_bf16") if name in flags), None)


def test_native_bf16_is_detected_as_the_kernels_cpu_flags_say():
    expected = native_feature_by_the_kernel()
    # An explicit bf16 is warned about as emulated exactly where the kernel lists no bf16 instructions.
    assert (emulated_bf16_warning("bf16", CPU) is None) == (expected is not None)
    from pipelines.runtime import cpu_bf16, cpu_bf16_feature

    assert cpu_bf16_feature() == expected
    assert cpu_bf16().native == (expected is not None)


def test_auto_takes_bf16_on_a_cpu_only_where_native_and_measured_faster(default_params):
    from pipelines.runtime import CpuBf16, CpuBf16Measurement, cpu_bf16, resolve_runtime

    expected = native_feature_by_the_kernel()
    here = resolve_runtime(default_params, CPU, pad_id=0)  # this host, its real detection and what was measured
    said = (
        f"bf16 supported natively here ({expected}) but not measured faster yet (benchmarks/bench_cpu_bf16.py)"
        if expected == "amx_bf16"
        else "bf16 supported natively here (avx512_bf16) but measured not faster on such a host (default 0.81x, "
        "minilm 2.33x on AMD EPYC, 2 cores; benchmarks/bench_cpu_bf16.py)"
        if expected
        else "no native bf16 on this CPU (torch.cpu.get_capabilities() has none of amx_bf16, avx512_bf16, bf16, "
        "sve_bf16): bf16 is emulated here"
    )
    assert (here.precision, here.notes()["precision.reason"]) == ("fp32", f"auto picked fp32: {said}")
    assert cpu_bf16().fast is False

    faster = CpuBf16Measurement("avx512_bf16", {"default": 1.3, "minilm": 1.8}, "a quiet host")
    slower = CpuBf16Measurement("avx512_bf16", {"default": 0.9, "minilm": 1.8}, "a quiet host")
    cases = [  # (detected feature, measurement for its kind of host) -> what auto picks
        (CpuBf16(None), "fp32"),
        (CpuBf16(None, faster), "fp32"),  # measured on such a host, but this CPU would emulate it
        (CpuBf16("avx512_bf16"), "fp32"),  # native, not measured
        (CpuBf16("avx512_bf16", slower), "fp32"),  # one model measured slower: not taken
        (CpuBf16("avx512_bf16", faster), "bf16"),
    ]
    assert [resolve_runtime(default_params, CPU, 0, bf16=bf16).precision for bf16, _ in cases] == [p for _, p in cases]
    picked = resolve_runtime(default_params, CPU, 0, bf16=CpuBf16("avx512_bf16", faster)).notes()["precision.reason"]
    assert picked == (
        "auto picked bf16: bf16 supported natively here (avx512_bf16) and measured faster on such a host "
        "(default 1.30x, minilm 1.80x on a quiet host; benchmarks/bench_cpu_bf16.py)"
    )
    asked = resolve_runtime(default_params, CPU, 0, precision="bf16", bf16=CpuBf16("avx512_bf16")).notes()
    assert asked["precision.reason"].startswith("bf16 as asked; bf16 supported natively here (avx512_bf16) but not")


def test_bf16_on_a_cpu_without_it_is_warned_about_naming_the_missing_features():
    from pipelines.runtime import CpuBf16

    warning = emulated_bf16_warning("bf16", CPU, CpuBf16(None))
    assert warning is not None and "has no amx_bf16, avx512_bf16, bf16, sve_bf16)" in warning and "17x" in warning
    assert emulated_bf16_warning("fp32", CPU, CpuBf16(None)) is None
    assert emulated_bf16_warning("bf16", CPU, CpuBf16("avx512_bf16")) is None  # native: not emulated
    assert emulated_bf16_warning("bf16", torch.device("cuda"), CpuBf16(None)) is None


def test_a_torch_without_the_internals_we_use_is_refused_by_name(default_params, monkeypatch):
    from torch.distributed._tools.mem_tracker import MemTracker

    from pipelines.errors import UserError
    from pipelines.runtime import check_runtime

    check_runtime(default_params)  # this torch and transformers have them all
    monkeypatch.delattr(MemTracker, "_update_peak_stats")
    with pytest.raises(UserError, match=r"lacks what pipelines relies on: torch MemTracker._update_peak_stats.*"
                                        r"checked on torch 2.13"):  # fmt: skip
        check_runtime(default_params)


def test_the_runtime_is_resolved_once_frozen_and_what_the_engine_reports(default_params):
    import dataclasses

    from pipelines.runtime import CpuBf16, cpu_bf16, resolve_runtime
    from pipelines.train.engine import TrainRequest, train_model
    from tests.conftest import tiny_params
    from tests.pipelines.train.helpers import tiny_model, tiny_split

    params = tiny_params(default_params, epochs=1)
    runtime = resolve_runtime(params, CPU, pad_id=0, bf16=CpuBf16(None))
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
    expected = resolve_runtime(params, CPU, pad_id=0, precision="fp32").notes()
    assert {k: result.notes[k] for k in expected} == expected == {
        "tf32.resolved": "false", "pad_to_multiple_of.resolved": "None", "loss_impl.resolved": "full",
        "precision.reason": f"fp32 as asked; {cpu_bf16().describe()}",
    }  # fmt: skip


def test_ray_trains_internals_are_found_once_imported_and_a_moved_one_is_named(monkeypatch):
    """Read as source text before Ray Train is imported, asked of the modules after: both must find them (a method
    looked up on the module instead of its class failed every later check in CI's process that had imported Ray)."""
    import ray.train.v2._internal.callbacks.placement_group_callback  # noqa: F401
    import ray.train.v2._internal.exceptions  # noqa: F401
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from pipelines.library_check import missing_internals

    assert missing_internals() == []
    monkeypatch.delattr(DataParallelTrainer, "_create_default_callbacks")
    assert missing_internals() == ["ray DataParallelTrainer._create_default_callbacks"]


def test_the_plan_prices_cpu_bf16_as_measured_on_such_a_host_and_as_emulated_only_where_it_is():
    from pipelines.resolve.step_time import peak_flops
    from pipelines.resolve.target import CPU_TARGET
    from pipelines.runtime import CpuBf16, CpuBf16Measurement, cpu_bf16, cpu_bf16_speed

    epyc = CpuBf16Measurement("avx512_bf16", {"default": 0.81, "minilm": 2.33}, "AMD EPYC, 2 cores")  # RESULTS.md
    assert cpu_bf16_speed(CpuBf16(None, epyc)) == pytest.approx(1 / 17)  # emulated: a MiniLM step took 17x as long
    assert cpu_bf16_speed(CpuBf16("avx512_bf16", epyc)) == 0.81  # native: the slowest model measured, not 1/17
    assert cpu_bf16_speed(CpuBf16("amx_bf16")) == 1.0  # native, never measured: no claim either way
    # This host's plan: bf16's peak is fp32's times what was measured on its kind of host.
    here = cpu_bf16()
    ratio = peak_flops("bf16", CPU_TARGET) / peak_flops("fp32", CPU_TARGET)
    assert ratio == pytest.approx(cpu_bf16_speed(here))
    if here.native and here.measured is not None:
        assert ratio == pytest.approx(min(here.measured.speedups.values()))
