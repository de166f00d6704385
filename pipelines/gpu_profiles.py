"""The GPUs a plan can target: memory, compute capability and dense peak FLOP/s per precision, as data.

`target_device` and `memory_budget` name them; `pipelines.resolve.cuda_plan` applies a card's rules to the fake step
and `pipelines.resolve.budget` weighs precisions by the card's peaks. Pure data (no torch), so params validation can
list the names.

Sources: memory is `nvidia-smi`'s memory.total for the card (MiB), the usable device memory before the CUDA
context; compute capability from NVIDIA's CUDA GPUs table; peaks are the vendor data sheets' dense tensor-core
figures (no 2:4 sparsity) and the non-tensor FP32 figure, in TFLOP/s. None are measured here. `None` marks a
precision the card has no fast path for (bf16 on the T4 is refused, as on every pre-Ampere card; TF32 there
is plain FP32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MIB = 2**20


def mib(n_bytes: float) -> float:
    """`n_bytes` in MiB (2**20 bytes) to one decimal: how a figure in MiB is stored beside its exact byte count
    (`peak_train_memory_mib` in DVC's metrics and the runs' figures)."""
    return round(n_bytes / MIB, 1)


# What a card holds that the plan's allocated peak does not count, stated separately beside it
# (docs/how-to/plan-memory.md), as measured on an H100 (torch 2.11, benchmarks/RESULTS.md, GPU): the CUDA context
# took 619 MiB at the first allocation and 787 MiB after a dozen trials (kernels and libraries loaded as used); the
# caching allocator's reserved peak was 4-14% above the allocated peak for BERT-base and 7-28% for a bucketed
# 125M Llama (offloading the most).
CONTEXT_RESERVE_BYTES = 800 * MIB
FRAGMENTATION_SHARE = 0.30  # of the predicted peak: the allocator's rounding to 2 MiB blocks and split segments


@dataclass(frozen=True)
class GpuProfile:
    """One card: `memory_bytes` as nvidia-smi reports its total, capability (major, minor), peaks in FLOP/s."""

    name: str
    memory_bytes: int
    capability: tuple[int, int]
    fp32_flops: float
    tf32_flops: float | None
    bf16_flops: float | None
    fp16_flops: float

    def peak_flops(self, precision: str, tf32: bool = True) -> float:
        """Dense peak for a precision's matmuls (fp32 with TF32 on uses the TF32 peak where the card has one)."""
        if precision == "bf16" and self.bf16_flops is not None:
            return self.bf16_flops
        if precision == "fp16":
            return self.fp16_flops
        return self.tf32_flops if tf32 and self.tf32_flops is not None else self.fp32_flops

    def reserve_bytes(self, peak: int) -> int:
        """What the card needs beyond `peak` allocated bytes: the CUDA context and the allocator's slack."""
        return CONTEXT_RESERVE_BYTES + int(peak * FRAGMENTATION_SHARE)

    def fits(self, peak: int) -> bool:
        """Whether a step of `peak` allocated bytes fits the card with its reserve."""
        return peak + self.reserve_bytes(peak) <= self.memory_bytes

    def budget_bytes(self) -> int:
        """The largest allocated peak that fits (`memory_budget: <card>`): memory less the reserve at that peak."""
        return int((self.memory_bytes - CONTEXT_RESERVE_BYTES) / (1 + FRAGMENTATION_SHARE))


def _tflops(value: float | None) -> float | None:
    return None if value is None else value * 1e12


def _card(name: str, mib: int, capability: tuple[int, int], fp32: float, tf32: float | None, bf16: float | None,
          fp16: float) -> GpuProfile:  # fmt: skip
    return GpuProfile(name, mib * MIB, capability, fp32 * 1e12, _tflops(tf32), _tflops(bf16), fp16 * 1e12)


GPU_PROFILES: dict[str, GpuProfile] = {
    card.name: card
    for card in (
        _card("H100-80GB", 81_559, (9, 0), 67.0, 494.7, 989.4, 989.4),  # SXM5
        _card("H200", 143_771, (9, 0), 67.0, 494.7, 989.4, 989.4),  # SXM
        _card("A100-40GB", 40_960, (8, 0), 19.5, 156.0, 312.0, 312.0),  # SXM4
        _card("A100-80GB", 81_920, (8, 0), 19.5, 156.0, 312.0, 312.0),
        _card("L4", 23_034, (8, 9), 30.3, 60.0, 121.0, 121.0),
        _card("A10G", 23_028, (8, 6), 31.2, 35.0, 70.0, 70.0),  # AWS's A10 variant: half the A10's tensor rate
        _card("T4", 15_360, (7, 5), 8.1, None, None, 65.0),
        _card("RTX4090", 24_564, (8, 9), 82.6, 82.6, 165.2, 165.2),  # fp32 accumulate
    )
}
# torch.cuda.get_device_name() words (e.g. "NVIDIA A100-SXM4-80GB", "Tesla T4"), for `target_device: auto`.
_CHIPS = {"H100": "H100-80GB", "H200": "H200", "L4": "L4", "A10G": "A10G", "T4": "T4", "4090": "RTX4090"}


def gpu_profile(name: str) -> GpuProfile:
    """The profile called `name`; an unknown name is refused listing the known ones."""
    if name not in GPU_PROFILES:
        raise ValueError(f"unknown GPU profile {name!r}; known: {', '.join(GPU_PROFILES)}")
    return GPU_PROFILES[name]


# `target_device` and `--target` name a cluster as `<gpus>x<card>` (one node) or `<nodes>x<gpus>x<card>`.
CLUSTER_FORMS = "<gpus>x<card> (one node, e.g. 8xA100-80GB) or <nodes>x<gpus>x<card> (e.g. 2x8xH100-80GB)"
_CLUSTER = re.compile(r"^(?:([1-9][0-9]*)x)?([1-9][0-9]*)x(.+)$")


def parse_cluster(name: str) -> tuple[int, int, str] | None:
    """(nodes, GPUs per node, card) of a cluster name (`8xA100-80GB`, `2x8xH100-80GB`), or None when `name` does not
    have that form or its card is not a profile."""
    found = _CLUSTER.match(name)
    if found is None or found.group(3) not in GPU_PROFILES:
        return None
    return int(found.group(1) or 1), int(found.group(2)), found.group(3)


def profile_for_device(device_name: str) -> GpuProfile | None:
    """The profile of a card as CUDA names it ("NVIDIA H100 80GB HBM3"), or None for a card not listed."""
    words = device_name.upper().replace("-", " ").split()
    if "A100" in words:
        return GPU_PROFILES["A100-80GB" if "80GB" in words else "A100-40GB"]
    for chip, name in _CHIPS.items():
        if chip in words:
            return GPU_PROFILES[name]
    return None
