"""Each FSDP rank loads only its shard: the model is built on the meta device, sharded, then filled.

Building the whole model on every rank and deep-copying it into FSDP (what `parallel.shard` does) costs
N whole copies of host RAM for N ranks on a node (LLaMA-Factory #257: over 1 TB for 8 ranks of a 70B).
Here, as torchtitan does, the model arrives on the meta device (no storage), FSDP2's `fully_shard`
turns each parameter into a DTensor sharded on dim 0, and only then each rank allocates and fills its
own rows:

- from a safetensors checkpoint (one file or several with `model.safetensors.index.json`): DCP's
  `HuggingFaceStorageReader` reads, for each parameter, `safe_open(...).get_slice(name)[rows]` of exactly
  the rows this rank's DTensor holds (FSDP2 shards dim 0 like `torch.chunk`: ceil(rows / N) per rank, the
  last ranks get fewer or none; the padding FSDP keeps for its all-gather is never read or written here);
- or, for a model with no checkpoint (random weights from a config), rank 0 builds it whole once and
  broadcasts it tensor by tensor (`set_model_state_dict(..., broadcast_from_rank0=True)`): each other rank
  holds at most one whole tensor at a time besides its shards.

The caller builds the model inside `build_on_meta`, applies `fully_shard` per block and for the root,
then calls `load_sharded_safetensors` or `broadcast_from_rank0` once on every rank. In a trial, ranks > 0 build
on meta when `builds_on_meta` says so (the recipe), rank 0 builds whole, and the Trainer broadcasts after sharding.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from pipelines.params import Params
from pipelines.train.fsdp_steps import on_meta_device
from pipelines.train.parallel import ParallelConfig, parallelize, uses_fsdp
from pipelines.train.results import all_reduce

ModelT = TypeVar("ModelT", bound=nn.Module)
INDEX_FILE = "model.safetensors.index.json"


def build_on_meta(build: Callable[[], ModelT]) -> ModelT:
    """`build()` with its parameters on the meta device (no storage, no init) and its buffers real.

    Buffers stay real because non-persistent ones (rotary `inv_freq`, BERT's `position_ids`) are in no
    checkpoint and no state dict: their values come only from the constructor. accelerate's context
    re-creates a parameter each time one is registered, which unties tied weights (measured on Llama
    with `tie_word_embeddings`), so they are tied again here, by transformers' own `tie_weights`.
    """
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = build()
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model


def builds_on_meta(params: Params, rank: int, world_size: int, device: torch.device) -> bool:
    """Whether this rank of a trial builds its model without storage: a rank > 0 under FSDP, unless the model
    must run or change before the Trainer shards it.

    Rank 0 always builds whole: it evaluates and saves the trained model, and is the broadcast's source.
    What runs the model before sharding, on every rank: the `batch_size: auto` probe, the `lr: auto` range
    test, packing's isolation check, and the CPU fast-dropout attention check (`fast_dropout`). `strategy`
    other than manual may change the adapter after the model is built. `cpu_offload`'s host-resident shards
    are not materialised here (unverified with NCCL), so it keeps the whole build.
    """
    if rank == 0 or not uses_fsdp(params, world_size):
        return False
    runs_early = params.batch_size == "auto" or params.lr == "auto" or params.data.packing
    fast_dropout_probe = params.fast_dropout and device.type == "cpu" and params.compile is not True
    return not (runs_early or fast_dropout_probe or params.strategy != "manual" or params.distributed.cpu_offload)


def shard_model(model: nn.Module, config: ParallelConfig, rank: int) -> tuple[nn.Module, dict[str, str]]:
    """`model` sharded (`parallelize`), its shards filled from rank 0's whole model where any rank built on meta;
    with a note saying so (empty when every rank built whole). Every rank calls it.

    Rank 0's model is whole (sharded as a copy, then refilled by the broadcast it sends); a rank's meta model
    is sharded in place, so that rank never holds more than one whole tensor at a time.
    """
    built_on_meta = on_meta_device(model)
    if built_on_meta and rank == 0:
        raise ValueError("FSDP: rank 0 builds the whole model (it evaluates, saves and broadcasts it)")
    sharded = parallelize(model, config)
    # Every rank joins the count: the broadcast is collective, so all of them call it or none.
    on_meta = int(all_reduce([float(built_on_meta)], "sum", config.device)[0])
    if not on_meta:
        return sharded, {}
    broadcast_from_rank0(sharded, model if rank == 0 else None, config.device)
    note = f"{on_meta} of {config.world_size} ranks built on the meta device and received their shards from rank 0"
    return sharded, {"fsdp.shard_loading": note}


def materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate this rank's local shards on `device` (uninitialised), keeping every buffer's value.

    `to_empty` is the call FSDP2 hooks to re-point its sharded parameters at new storage; it also
    replaces the buffers with empty ones, so their values are put back from the tensors it dropped.
    """
    kept = dict(model.named_buffers())
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in kept.items():
            model.get_buffer(name).copy_(value)


def load_sharded_safetensors(model: nn.Module, folder: Path, device: torch.device) -> None:
    """Fill a `fully_shard`-ed meta model with its rows of the safetensors checkpoint in `folder`; every rank calls.

    The checkpoint's names are the model's state-dict names (what `save_pretrained` writes for the same
    class). A tied parameter saved once (lm_head tied to the embeddings) is filled through its saved name.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    files, saved = checkpoint_files(folder)
    wanted = names_to_read(model, saved)  # checked before any storage is allocated
    materialise(model, device)
    # The DTensor parameters themselves, not copies: DCP plans each one's rows from its placement and
    # copies them in place (casting a bf16 checkpoint to the model's dtype).
    state = {name: value for name, value in get_model_state_dict(model).items() if name in wanted}
    with tempfile.TemporaryDirectory() as view:
        # DCP's reader takes every *.safetensors in its folder; a folder with an index may hold others
        # (a `consolidated.safetensors` beside the shards, adapters), so it reads links to the indexed ones.
        for file in files:
            (Path(view) / file.name).symlink_to(file.resolve())
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(view))


def names_to_read(model: nn.Module, saved: set[str]) -> set[str]:
    """The state-dict names to read from a checkpoint holding `saved`: all of them but a tied parameter's
    second name when the checkpoint holds the first. Any other name it lacks is an error.

    The names are torch's (`get_model_state_dict`: without the `_checkpoint_wrapped_module.` or `_orig_mod.`
    that activation checkpointing and compile add), the ties transformers' own ({tied: source}).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    ties: dict[str, str] = getattr(model, "all_tied_weights_keys", None) or {}
    names = {name for name in get_model_state_dict(model) if not (name in ties and name not in saved)}
    if missing := sorted(names - saved):
        raise ValueError(
            f"the checkpoint has no tensor for {missing[:5]} ({len(missing)} missing): a new head, or another "
            "architecture's checkpoint; load it whole on rank 0 and use broadcast_from_rank0 instead"
        )
    return names


def checkpoint_files(folder: Path) -> tuple[list[Path], set[str]]:
    """The safetensors files of the checkpoint in `folder` (those its index names, else `model.safetensors`)
    and the tensor names they hold."""
    from safetensors import safe_open

    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted({folder / name for name in weight_map.values()}), set(weight_map)
    single = folder / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: neither {INDEX_FILE} nor model.safetensors")
    with safe_open(str(single), framework="pt") as f:  # reads the header only
        return [single], set(f.keys())


def broadcast_from_rank0(model: nn.Module, whole: nn.Module | None, device: torch.device) -> None:
    """Fill a `fully_shard`-ed meta model from `whole`, the model rank 0 built (None on the other ranks).

    For models with no checkpoint to read (random weights from a config): only rank 0 holds a whole
    copy; the others receive each tensor in turn and keep their rows.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if (dist.get_rank() == 0) != (whole is not None):
        raise ValueError("broadcast_from_rank0: rank 0, and only rank 0, passes the whole model")
    materialise(model, device)
    # torch's names (no activation checkpointing's wrapper prefix), as set_model_state_dict reads them.
    full = get_model_state_dict(whole) if whole is not None else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
