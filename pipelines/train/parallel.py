"""How the model is spread over data-parallel workers: DDP replicas, or FSDP2 shards.

Under DDP every rank holds the whole model, its gradients and its optimizer state, and the
gradients are all-reduced once per accumulation window. Under FSDP (`distributed.strategy:
fsdp`, PyTorch's FSDP2 `fully_shard`) each rank holds 1/N of every weight, gradient and
optimizer-state tensor; a transformer block's weights are all-gathered just before it runs and
freed after, and its gradients are reduce-scattered. The blocks are the ones transformers
itself never splits across devices (`_no_split_modules`); the rest (embeddings, head) is one
more unit at the root.

FSDP shards a copy: the caller's model stays whole on the host, untouched, and gets the trained
weights back at the end (`gather_full_weights`), so rank 0 evaluates and saves it as under DDP.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pipelines.params import Params
from pipelines.runtime import ResolvedPrecision


def uses_fsdp(params: Params, world_size: int) -> bool:
    """FSDP when asked for and there is more than one worker to shard over."""
    return params.distributed.strategy == "fsdp" and world_size > 1


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one at a time: modules whose class transformers lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names and module is not model]


def shard(model: nn.Module, precision: ResolvedPrecision, device: torch.device, world_size: int) -> nn.Module:
    """A copy of `model` sharded with FSDP2 over the process group's ranks, its shards on `device`.

    In bf16/fp16 the all-gathered weights are cast for compute (FSDP's MixedPrecisionPolicy) and
    gradients are reduced in fp32; the sharded weights and optimizer state stay fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    sharded = copy.deepcopy(model)
    mesh = init_device_mesh(device.type, (world_size,))
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None)
    for block in sharding_units(sharded):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(sharded, mesh=mesh, mp_policy=policy)  # moves the shards to the mesh's device
    return sharded


def gather_full_weights(sharded: nn.Module, model: nn.Module, rank: int, device: torch.device) -> None:
    """Every rank joins the all-gather; rank 0 loads the whole trained weights into `model`, on `device`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.load_state_dict(full)
        model.to(device)


def replicate(model: nn.Module, device: torch.device) -> nn.Module:
    """The DDP wrapper that all-reduces `model`'s gradients."""
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
