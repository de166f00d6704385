"""Achieved model FLOP/s and, on known GPUs, model FLOPs utilization (MFU).

Model FLOPs come from the memory plan's step (`pipelines.resolve.memory_plan`): torch's
`FlopCounterMode` counts the matmuls, convolutions and attention of one optimizer step of the
trial's own code (forward, backward and LoRA's skipped weight gradients as they run), without
checkpointing's recomputed forward, which is not model work. Divided by the step's positions it
gives the FLOPs one token costs the model, and the run's *real* (non-pad) tokens per second of the
timed steps turn that into model FLOP/s (MFU as PaLM's appendix defines it): padding is work the
hardware does but not model work, so a padded run gets no credit for it, and the same tokens give
the same figure padded or not, whatever time the padding costs. The planned step is the longest
window, so attention's quadratic share is that of the longest rows: for bucketed short batches the
figure is a slight over-estimate.

Attention is counted on every SDPA kernel: torch's counter has formulas for the CUDA kernels but none
for the CPU flash kernel (torch 2.13: a CPU step counted no attention at all), so `flop_counter` adds
it. Attention is counted in full, causal masks included (no halving for the masked half), as torch's
counter and PaLM's appendix count it. Model work is forward plus twice the forward in the backward;
the hardware count keeps the flash kernels' backward recompute of the scores, as torch counts it.

MFU divides by the dense peak of the device for the precision the matmuls ran in (16-bit, TF32 or
plain fp32), from NVIDIA's data sheets; an unknown GPU or a CPU gets no MFU rather than a guess.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import flop_counter as torch_flops
from torch.utils._python_dispatch import TorchDispatchMode

from pipelines.gpu_profiles import GPU_PROFILES


def _profile_peaks(name: str) -> tuple[float, float, float]:
    card = GPU_PROFILES[name]
    return card.fp16_flops / 1e12, (card.tf32_flops or card.fp32_flops) / 1e12, card.fp32_flops / 1e12


# Dense (no sparsity) peak TFLOP/s from NVIDIA's data sheets: (16-bit, TF32, fp32). The cards a plan can target
# come from their profiles (pipelines.gpu_profiles), one table for both; the rest are here for MFU only.
GPU_PEAK_TFLOPS = {
    "H200": _profile_peaks("H200"),
    "H100 SXM": _profile_peaks("H100-80GB"),
    "H100 80GB HBM3": _profile_peaks("H100-80GB"),  # the SXM part's device name
    "H100 NVL": (835.0, 417.5, 60.0),
    "H100 PCIe": (756.0, 378.0, 51.2),
    "A100": _profile_peaks("A100-80GB"),
    "L40S": (362.1, 183.0, 91.6),
    "L4": _profile_peaks("L4"),
    "A10G": _profile_peaks("A10G"),
    "A10": (125.0, 62.5, 31.2),
    "V100": (125.0, 15.7, 15.7),  # no TF32: fp32 matmuls run at the fp32 rate
    "T4": _profile_peaks("T4"),
    "GeForce RTX 4090": _profile_peaks("RTX4090"),
}


def gpu_model(name: str) -> str | None:
    """The table's entry for a CUDA device name ("NVIDIA L40S" -> "L40S", "NVIDIA A100-SXM4-80GB" -> "A100"),
    matched as a whole model name, never a prefix of another ("L4" is not "L40S"); None when not in the table."""
    bare = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip())
    for key in GPU_PEAK_TFLOPS:  # most specific names first
        if bare == key or bare.startswith((key + " ", key + "-")):
            return key
    return None


def gpu_peak_flops(name: str, precision: str, tf32: bool) -> float | None:
    """The dense peak FLOP/s of the named GPU for the matmul precision, or None for a GPU not in the table."""
    key = gpu_model(name)
    if key is None:
        return None
    half, tf32_peak, fp32 = GPU_PEAK_TFLOPS[key]
    return (half if precision in ("bf16", "fp16") else tf32_peak if tf32 else fp32) * 1e12


def _sdpa_forward(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    return torch_flops.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward_hardware(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return torch_flops.sdpa_backward_flop_count(grad_out, query, key, value)


def _sdpa_backward_model(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    # The gradients of both products (scores and output) w.r.t. both inputs: twice the forward's work.
    return 2 * torch_flops.sdpa_flop_count(query, key, value)


class _Recomputing:
    """How many checkpointed recomputes are running (`recomputing`): a plain count, not thread-local, because
    autograd may run a backward on its own threads."""

    depth = 0


@contextmanager
def recomputing() -> Iterator[None]:
    """Marks checkpointing's recomputed forward (enter it in torch checkpoint's recompute context: `context_fn`), which
    the model-work counter leaves out: it is hardware work, not the model's."""
    _Recomputing.depth += 1
    try:
        yield
    finally:
        _Recomputing.depth -= 1


class _ModelWorkCounter(torch_flops.FlopCounterMode):
    """torch's counter, skipping what runs inside `recomputing()`: a checkpointed step counts the model's FLOPs in the
    same fake step as the hardware's (before, a third fake step without checkpointing counted them)."""

    def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
        if _Recomputing.depth:
            return out
        return super()._count_flops(func_packet, out, args, kwargs)


def flop_counter(model_work: bool) -> torch_flops.FlopCounterMode:
    """torch's FLOP counter with attention on every SDPA kernel, the CPU's included.

    `model_work`: count the model's FLOPs (an attention backward is twice its forward; checkpointing's recomputed
    forward, marked by `recomputing()`, left out) rather than the hardware's (the flash kernels recompute the scores
    in the backward)."""
    aten = torch.ops.aten
    backward = _sdpa_backward_model if model_work else _sdpa_backward_hardware
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: backward,
    }
    if model_work:
        for op in (
            aten._scaled_dot_product_flash_attention_backward,
            aten._scaled_dot_product_efficient_attention_backward,
            aten._scaled_dot_product_cudnn_attention_backward,
        ):
            mapping[op] = backward
    return (_ModelWorkCounter if model_work else torch_flops.FlopCounterMode)(display=False, custom_mapping=mapping)


def flops_metrics(
    flops_per_position: float, metrics: dict[str, float], device: torch.device, precision: str, tf32: bool,
    world_size: int = 1,
) -> dict[str, float]:  # fmt: skip
    """`model_tflops_per_s` from the run's real (non-pad) tokens per second, and `mfu` on a GPU the table knows.

    `flops_per_position`: the model FLOPs one position costs (the plan's); a pad position costs as much but
    is no model work, so only real tokens count."""
    achieved = flops_per_position * metrics.get("tokens_per_s", float("nan"))
    out = {"model_tflops_per_s": achieved / 1e12}
    if device.type == "cuda":
        peak = gpu_peak_flops(torch.cuda.get_device_name(device), precision, tf32)
        if peak is not None:
            out["mfu"] = achieved / (peak * world_size)
    return out


class KernelCounter(TorchDispatchMode):
    """Counts the ATen ops a step dispatches that launch work (views, allocations and metadata queries excluded), per
    phase and per step: what an eager step launches, one kernel each (`pipelines.resolve.step_time` prices them at
    the host's cost per launch).

    `phase(name)` names the ops counted inside it (`accumulate`: forwards and backwards; `update`: clipping and the
    optimizer's step); `step` is set by the caller (the first step creates the optimizer's state, so its update is
    not the steady state's)."""

    NOT_LAUNCHED = frozenset({"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "device",
                              "_local_scalar_dense", "new_empty", "new_empty_strided", "_record_function_enter_new",
                              "_record_function_exit"})  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[tuple[str, int], int] = {}
        self.current, self.step = "other", 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the ops inside the block under `name`."""
        previous, self.current = self.current, name
        try:
            yield
        finally:
            self.current = previous

    def count(self, phase: str, step: int = 0) -> int:
        """Ops counted in `phase` of step `step`."""
        return self.counts.get((phase, step), 0)

    def snapshot(self) -> dict[tuple[str, int], int]:
        """The counts now (`pipelines.repeats`: a loop's skipped chunks are counted from one that ran)."""
        return dict(self.counts)

    def add_since(self, snapshot: object, times: int) -> None:
        """Add the ops counted since `snapshot` `times` more times."""
        before: dict[tuple[str, int], int] = snapshot  # type: ignore[assignment]
        for key, value in list(self.counts.items()):
            self.counts[key] = value + (value - before.get(key, 0)) * times

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view and func.overloadpacket.__name__ not in self.NOT_LAUNCHED:
            key = (self.current, self.step)
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


class FlopRepeats:
    """torch's FLOP counter as a `pipelines.repeats.RepeatCounter`: its per-module counts since a snapshot, added
    again."""

    def __init__(self, mode: torch_flops.FlopCounterMode) -> None:
        self.mode = mode

    def snapshot(self) -> dict[str, dict[Any, int]]:
        return self.mode.get_flop_counts()

    def add_since(self, snapshot: object, times: int) -> None:
        before: dict[str, dict[Any, int]] = snapshot  # type: ignore[assignment]
        for module, ops in self.mode.flop_counts.items():
            for op, value in list(ops.items()):
                ops[op] = value + (value - before.get(module, {}).get(op, 0)) * times
