"""FSDP2's step of `pipelines.train.parallel.parallelize`: `fully_shard` per block and for the root, and the way
back (`gather_full_weights`).

The blocks are the ones transformers itself never splits across devices (`_no_split_modules`); the rest
(embeddings, final norm, head) is one more unit at the root. Each unit is sharded with:

- the mixed-precision policy of the run: in bf16/fp16 the all-gathered weights are cast to the compute dtype and
  gradients are reduced in fp32; in fp32 nothing is cast. Frozen weights (a LoRA base) are stored in the compute
  dtype already (`store_frozen_weights`), so they are sharded and gathered in 16 bits; only the trained weights
  (one dtype per unit, as FSDP2 asks) keep fp32 masters.
- `reshard_after_forward` (the knob): free the gathered weights after the forward and gather again for backward
  (less memory), or keep them to backward (one all-gather fewer per block). Every unit alike: torchtitan keeps the
  last block gathered, its backward coming straight after the forward, but a forward without backward (validation)
  would then leave it gathered until the next step, which neither the memory plan nor `param_bytes` expects.
- `cpu_offload`: FSDP2's `CPUOffloadPolicy`, the shards, their gradients and the optimizer step on the host,
  copied to the device per unit. On a CPU run they are on the host already: the policy changes no placement.

The mesh is always built for the run's device type: `fully_shard` without one builds it on CUDA whenever a GPU is
visible, so a CPU run over gloo on a GPU machine would get its shards moved to the GPU and crash in the gloo
collectives (pytorch/pytorch#132471).

The gradients are averaged over the ranks by the reduce-scatter (ReduceOp.AVG, which gloo implements in torch
2.13; pytorch/pytorch#162338 was a gloo that summed instead): tests/pipelines/train/test_fsdp_gradients.py holds
every reduced gradient to one process's on the same global batch, and shows a summing reduction fails it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipelines.params import Params
from pipelines.runtime import ResolvedPrecision


@dataclass(frozen=True)
class ParallelConfig:
    """What the parallelizing steps read: the world, where it computes, in which precision, and the FSDP knobs."""

    world_size: int
    device: torch.device
    precision: ResolvedPrecision  # resolved: fp32, bf16 or fp16
    grad_checkpointing: bool = False
    grad_checkpointing_every: int = 1
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    @classmethod
    def of(cls, params: Params, precision: ResolvedPrecision, device: torch.device, world_size: int) -> ParallelConfig:
        """The config of a run of `params` on `device`, `precision` already resolved."""
        return cls(
            world_size=world_size,
            device=device,
            precision=precision,
            grad_checkpointing=params.grad_checkpointing,
            grad_checkpointing_every=params.grad_checkpointing_every,
            reshard_after_forward=params.distributed.reshard_after_forward,
            cpu_offload=params.distributed.cpu_offload,
        )


# What a 16-bit run computes its matmuls in (and stores its frozen weights in).
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The blocks FSDP shards one at a time: modules whose class transformers lists in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in names and module is not model]


def on_meta_device(model: nn.Module) -> bool:
    """Whether `model`'s weights have no storage yet (built on the meta device, for each rank to load its shard)."""
    return any(param.is_meta for param in model.parameters())


def shard_options(config: ParallelConfig) -> dict[str, object]:
    """`fully_shard`'s keyword arguments for every unit of a run under `config` (the mesh, precision, offload)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    compute = COMPUTE_DTYPES.get(config.precision)
    # Pinned host memory needs CUDA (it is what the host-to-device copies overlap with compute from).
    offload = CPUOffloadPolicy(pin_memory=config.device.type == "cuda") if config.cpu_offload else OffloadPolicy()
    return {
        "mesh": init_device_mesh(config.device.type, (config.world_size,)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32 if compute else None),
        "offload_policy": offload,
    }


def apply_fsdp(model: nn.Module, config: ParallelConfig) -> nn.Module:
    """Step: `fully_shard` each block, then the root (which takes what no block holds), in place; returns `model`.

    The shards go to the mesh's device (the host with `cpu_offload`); weights still on the meta device stay there,
    sharded, for the caller to materialise.
    """
    from torch.distributed.fsdp import fully_shard

    options = {**shard_options(config), "reshard_after_forward": config.reshard_after_forward}
    for block in sharding_units(model):
        fully_shard(block, **options)  # type: ignore[arg-type]
    fully_shard(model, **options)  # type: ignore[arg-type]
    return model


def gather_full_weights(sharded: nn.Module, model: nn.Module, rank: int, device: torch.device) -> None:
    """Every rank joins the all-gather; rank 0 loads the trained weights into the whole `model`, on `device`.

    Only the weights that trained travel (a LoRA run's adapters, not its frozen base, which `model` holds already).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    trained = get_model_state_dict(sharded, options=options)
    if rank == 0:
        missing, unexpected = model.load_state_dict(trained, strict=False)
        assert not unexpected, f"FSDP gave back weights the whole model lacks: {unexpected[:5]}"
        frozen = {name for name, param in model.named_parameters(remove_duplicate=False) if not param.requires_grad}
        untrained = frozen | {name for name, _ in model.named_buffers(remove_duplicate=False)}
        assert set(missing) <= untrained, f"FSDP gave back no weights for {sorted(set(missing) - untrained)[:5]}"
        model.to(device)
