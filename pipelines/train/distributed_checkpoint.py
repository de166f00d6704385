"""Checkpoints of a run on several ranks (FSDP, DDP): every rank writes its part with `torch.distributed.checkpoint`.

Under FSDP no rank holds the whole model or optimizer state, so the single-file checkpoint of a single process
(`torch.save`, `pipelines.train.checkpoint`) cannot be written. As torchtitan and Ray Train's FSDP2 example do, each
rank saves its shards of the model's and the optimizer's sharded state dicts (`get_state_dict`, DTensors) with
`dcp.save`, and loads them back into its own shards with `dcp.load` + `set_state_dict`. Under DDP every rank holds
the same tensors: DCP writes each once. DDP used the single file that rank 0 wrote, whose RNG and loop state every
rank then restored: with dropout, a resumed DDP run's losses differed from the uninterrupted run's by 5e-3
(tests/pipelines/train/test_distributed_resume.py). Only trained weights are saved
(`ignore_frozen_params`): with LoRA the adapters (and the head) and their optimizer state, not the frozen base, which
the next run loads from the model as it did the first time. Beside the shards: rank 0's loop file (the schedule,
the scaler, as in the single-file checkpoint) and each rank's own file: its RNG (dropout draws as many numbers as
its own batches hold, so each rank's stream is its own) and its loop state (its loss summed since the last log point,
which the log point sums over the ranks, and its own counters and clocks).

Atomic as the single file is: a checkpoint is written whole into one of two slots (`sharded-a`, `sharded-b`), the one
the `sharded` link does not name, and only then does rank 0 point the link at it (`os.replace` of a link). A kill
mid-write leaves the link at the previous, complete checkpoint.

The folder must be one that every rank reads and writes at the same path: on one machine, the repository's
`checkpoints/`; on a cluster, a shared path (docs/how-to/ray-cluster.md). A run with another number of workers does
not resume (its checkpoint key differs, `checkpoint_key`): DCP could reshard the weights and the optimizer state,
but each rank's batches and RNG stream are a function of the world size, so its losses could not be the
uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipelines.params import Params
from pipelines.train.checkpoint import (
    CheckpointFormat,
    LoopState,
    refuse_resume,
    rng_state,
    set_rng_state,
    write_params,
)

if TYPE_CHECKING:
    from pipelines.train.step import TrainStep

LINK = "sharded"  # names the newest complete checkpoint's slot
SLOTS = ("sharded-a", "sharded-b")
LOOP_FILE = "loop.pt"  # rank 0's: schedule, scaler, its loop state (what the message says), the world size


def _options(strict: bool = True) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _rank_file(slot: Path, rank: int) -> Path:
    return slot / f"rank{rank}.pt"


def _next_slot(folder: Path) -> Path:
    """The slot the link does not name (every rank reads the link before rank 0 moves it, see `save_every_rank`)."""
    current = os.readlink(folder / LINK) if (folder / LINK).is_symlink() else None
    return folder / (SLOTS[1] if current == SLOTS[0] else SLOTS[0])


def save_every_rank(folder: Path, params: Params, state: LoopState, step: TrainStep, scheduler: Any) -> None:
    """Every rank: write its shards (DDP: rank 0 the replicated tensors), RNG and loop state, and rank 0 the loop
    file, into the free slot; then rank 0 points the link at it. Collective: every rank calls it at the same step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank = dist.get_rank()
    slot = _next_slot(folder)
    if rank == 0:
        shutil.rmtree(slot, ignore_errors=True)  # a kill mid-write left it half-written; the link never named it
        slot.mkdir(parents=True)
    dist.barrier()  # the slot is empty and every rank has read the link
    torch.save({"rng": rng_state(), "state": json.dumps(asdict(state))}, _rank_file(slot, rank))
    model_state, optimizer_state = get_state_dict(step.model, step.optimizer, options=_options())
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(slot))
    if rank == 0:
        loop = {"scheduler": scheduler.state_dict(), "scaler": step.scaler.state_dict(),
                "state": json.dumps(asdict(state)), "world_size": dist.get_world_size()}  # fmt: skip
        torch.save(loop, slot / LOOP_FILE)
        write_params(folder, params)
        link = folder / f"{LINK}.tmp"
        link.unlink(missing_ok=True)
        link.symlink_to(slot.name)
        os.replace(link, folder / LINK)
    dist.barrier()  # no rank goes on to the next checkpoint before the link names this one


def find_every_rank(folder: Path, params: Params) -> tuple[dict[str, Any] | None, str]:
    """(the loop file's payload with the slot it is in, or None; the sentence saying what happens and why)."""
    slot = folder / LINK
    refused = refuse_resume(folder, params, slot / LOOP_FILE)
    if refused:
        return None, refused
    slot = slot.resolve()  # this slot, even if a later checkpoint moves the link
    payload = torch.load(slot / LOOP_FILE, map_location="cpu", weights_only=True)
    state = LoopState(**json.loads(payload["state"]))
    return {**payload, "slot": str(slot)}, (
        f"resuming from {slot} ({payload['world_size']} ranks) at epoch {state.epoch + 1}, optimizer step {state.step}"
    )


def restore_every_rank(payload: dict[str, Any], step: TrainStep, scheduler: Any) -> LoopState:
    """Every rank: load its shards of the trained weights and the optimizer state, then the schedule, the scaler and
    its own RNG; return its own loop state to continue from."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(step.model, step.optimizer, options=_options())
    saved = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(saved, checkpoint_id=payload["slot"])
    # Not strict: the frozen weights were not saved. Any other weight missing is a checkpoint that does not fit.
    keys = set_state_dict(step.model, step.optimizer, model_state_dict=saved["model"],
                          optim_state_dict=saved["optimizer"], options=_options(strict=False))  # fmt: skip
    frozen = {name for name, weight in step.model.named_parameters() if not weight.requires_grad}
    missing = set(keys.missing_keys) - frozen
    assert not keys.unexpected_keys and not missing, (keys.unexpected_keys[:5], sorted(missing)[:5])
    scheduler.load_state_dict(payload["scheduler"])
    step.scaler.load_state_dict(payload["scaler"])
    own = torch.load(_rank_file(Path(payload["slot"]), dist.get_rank()), weights_only=True)
    set_rng_state(own["rng"])
    return LoopState(**json.loads(own["state"]))


DISTRIBUTED = CheckpointFormat(save_every_rank, find_every_rank, restore_every_rank, every_rank_writes=True)
