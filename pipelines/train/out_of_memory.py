"""Out-of-memory recovery: halve the micro-batches and redo the step, keeping the effective batch.

Recovery runs after the `except` block that caught the error, never inside it: there the
traceback's frames still hold the failed step's activations, so `torch.cuda.empty_cache()`
would free nothing and the redone step would run out of memory again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipelines.errors import UserError
from pipelines.train.checkpoint import LoopState
from pipelines.train.windows import halve_windows

# Out-of-memory errors that training recovers from by halving micro-batches.
OUT_OF_MEMORY: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)


def recover_from_out_of_memory(
    optimizer: torch.optim.Optimizer,
    windows: list[list[list[int]]],
    state: LoopState,
    device: torch.device,
    world_size: int,
    say: Callable[[str], None],
) -> list[list[list[int]]]:
    """Halve the micro-batches from the failed window on (accumulation doubles; the effective batch is kept).

    Refused under DDP: the other ranks are already waiting in the gradient all-reduce of a step
    this rank will not finish, so one rank cannot change its micro-batches alone.
    """
    optimizer.zero_grad(set_to_none=True)  # a partial backward may have left gradients behind
    rows = max(len(b) for b in windows[state.window])
    if world_size > 1:
        raise UserError(
            f"out of memory on a micro-batch of {rows} rows under DDP ({world_size} workers): one rank cannot "
            "halve its micro-batches alone; lower batch_size (raising grad_accum_steps keeps the effective "
            "batch), or set memory_budget with strategy: auto to plan one that fits"
        )
    if rows == 1:
        raise UserError("out of memory with one row per micro-batch; lower data.max_length")
    halved = halve_windows(windows, state.window)
    state.oom_halvings += 1
    say(
        f"out of memory on a micro-batch of {rows} rows: micro-batches halved, accumulation doubled "
        f"(x{2**state.oom_halvings} since the start); the step is redone"
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the failed step's tensors are released by now
    return halved
