"""How the model is spread over data-parallel workers: DDP replicas, or FSDP2 shards, as a few steps in order.

Under DDP every rank holds the whole model, its gradients and its optimizer state, and the gradients are
all-reduced once per accumulation window (`replicate`). Under FSDP (`distributed.strategy: fsdp`, PyTorch's FSDP2
`fully_shard`) each rank holds 1/N of every weight, gradient and optimizer-state tensor; a transformer block's
weights are all-gathered just before it runs and freed after, and its gradients are reduce-scattered.

`parallelize` reads as torchtitan's `parallelize_llama` (GUIDE rule 24): activation checkpointing, then
`fully_shard` per block and for the root (`pipelines.train.fsdp_steps`), each a small function over the model and
its `ParallelConfig`. What cannot combine with FSDP (compile: true, Adafactor, a chunked loss) is refused by the
rule table (`pipelines.params.rules`) before any step runs, not by branches here.

A model built whole is sharded as a copy: the caller's stays on the host and is given the trained weights at the
end (`gather_full_weights`), so rank 0 evaluates and saves it as under DDP. A model whose weights are still on the
meta device (built without storage, for each rank to load only its shard) is sharded in place, no copy made.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipelines.params import Params
from pipelines.train.fsdp_steps import (
    ParallelConfig,
    apply_fsdp,
    gather_full_weights,
    on_meta_device,
    sharding_units,
)

__all__ = [
    "ParallelConfig",
    "apply_checkpointing",
    "gather_full_weights",
    "parallelize",
    "replicate",
    "sharding_units",
    "uses_fsdp",
]


def uses_fsdp(params: Params, world_size: int) -> bool:
    """FSDP when asked for and there is more than one worker to shard over."""
    return params.distributed.strategy == "fsdp" and world_size > 1


def apply_checkpointing(model: nn.Module, config: ParallelConfig) -> nn.Module:
    """Step 1: activation checkpointing of the blocks (non-reentrant, which FSDP2 recomputes under), when asked.

    The trainer's memory levers (`apply_memory_levers`) have usually switched it on already, so what the memory
    plan counts is what trains; then this step leaves it as it is. It must come before `fully_shard`: the
    checkpointed call is the block's own `__call__`, inside which FSDP's hooks gather the weights again for the
    recompute.
    """
    if not config.grad_checkpointing or getattr(model, "is_activation_checkpointing", True):
        return model
    model.activation_checkpointing_enable(  # type: ignore[operator]
        activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=config.grad_checkpointing_every
    )
    return model


def parallelize(model: nn.Module, config: ParallelConfig) -> nn.Module:
    """`model` sharded with FSDP2 over the process group's ranks: the steps in order; returns the sharded model.

    No compile step: `compile: true` with FSDP is refused by the rule table (see its message), and
    `compile: auto` chooses eager under FSDP (`compile_decision`).
    A model on the meta device comes back sharded in place with its shards still on the meta device; each
    rank's shards are then filled from rank 0's whole model (`shard_loading.shard_model`, which calls this, before
    the optimizer is built).
    """
    sharded = model if on_meta_device(model) else _copy(model)
    for step in (apply_checkpointing, apply_fsdp):
        sharded = step(sharded, config)
    return sharded


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def replicate(model: nn.Module, device: torch.device) -> nn.Module:
    """The DDP wrapper that all-reduces `model`'s gradients."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
