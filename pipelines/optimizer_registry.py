"""The optimizers by name: one entry each, what the rest of the project needs to know about it.

Light on purpose (no torch), like `task_registry`: the params schema takes its allowed `optim` values and the FSDP
rule from here, the runtime check its CUDA and package needs, `strategy: auto` its lean candidates, and the engine
its fresh-state rule. The builder itself is `pipelines.train.optim.BUILDERS[name]` (a test holds the two in step):
adding an optimizer is its entry here and its builder there.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerEntry:
    """What one optimizer needs and offers."""

    description: str  # the params reference's words for it
    fresh_state_is_zeros: bool  # its lazily made first-step state is all zeros (the warm-up probe can make it ahead)
    elementwise: bool = False  # its update is elementwise: runs unchanged on FSDP's sharded (DTensor) weights
    lean: bool = False  # `strategy: auto` offers it as a leaner optimizer than the one asked for
    package: str | None = None  # the pip package it needs beyond the core dependencies
    cuda_only: bool = False  # its kernels run on CUDA only


OPTIMIZERS: dict[str, OptimizerEntry] = {
    "adamw": OptimizerEntry("two moments per parameter", fresh_state_is_zeros=True, elementwise=True),
    "adafactor": OptimizerEntry("factored second moment", fresh_state_is_zeros=True, lean=True),
    "adamw_8bit": OptimizerEntry(
        "bitsandbytes, CUDA", fresh_state_is_zeros=False, lean=True, package="bitsandbytes", cuda_only=True
    ),  # fmt: skip
    "lion": OptimizerEntry("one moment: half of AdamW's state; use a 3-10x lower lr", fresh_state_is_zeros=True),
    "sgd": OptimizerEntry("momentum", fresh_state_is_zeros=True, elementwise=True),
}

# Optimizers whose update is elementwise, so they run unchanged on FSDP's sharded (DTensor) weights.
FSDP_OPTIMIZERS = tuple(name for name, entry in OPTIMIZERS.items() if entry.elementwise)


def optimizers_described() -> str:
    """`name (what it is), ...` for the params reference."""
    return ", ".join(f"{name} ({entry.description})" for name, entry in OPTIMIZERS.items())
