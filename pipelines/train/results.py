"""A run's final metrics from its loop state, and their reduction across data-parallel ranks."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipelines.train.checkpoint import LoopState
from pipelines.train.memory import optimizer_state_bytes, parameter_bytes, peak_rss_bytes, tensor_bytes

# The clocks every run reports (seconds), each its own region; see pipelines/train/timing.py.
CLOCKS = ("train_time_s", "warmup_time_s", "val_time_s", "checkpoint_time_s", "setup_time_s")


def world() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed process group, else (0, 1)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(values: list[float], op: str, device: torch.device) -> list[float]:
    """Reduce host numbers across ranks (a no-op without a process group)."""
    if world()[1] == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return tensor.tolist()


def _percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1000) if values else 0.0


def final_metrics(
    state: LoopState, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> dict[str, float]:
    """Speed over the timed steps only (the warm-up step is excluded), the clocks, counters and memory."""
    clocks = {name: state.clocks.get(name, 0.0) for name in CLOCKS}
    train_time = clocks["train_time_s"] or float("nan")  # nan: a run of a single (warm-up) step
    metrics: dict[str, float] = {
        **clocks,
        "compile_time_s": state.clocks.get("compile_time_s", 0.0),
        "samples_per_s": state.rows_timed / train_time,
        "tokens_per_s": state.tokens_timed / train_time,
        "step_time_p50_ms": _percentile_ms(state.step_times, 50),
        "step_time_p90_ms": _percentile_ms(state.step_times, 90),
        "data_wait_fraction": state.data_wait_s / train_time,
        # Share of the batch tensors' positions that were padding, over the timed steps.
        "padding_fraction": 1.0 - state.tokens_timed / state.positions_timed if state.positions_timed else 0.0,
        "optimizer_steps": state.step,
        "timed_steps": len(state.step_times),
        "oom_halvings": state.oom_halvings,
        "nonfinite_steps": state.nonfinite_total,
        "skipped_steps": state.skipped_total,
        "final_train_loss": state.history[-1]["loss"] if state.history else float("nan"),
        "param_bytes": parameter_bytes(model),
        "trainable_param_bytes": tensor_bytes(p for p in model.parameters() if p.requires_grad),
        "frozen_param_bytes": tensor_bytes(p for p in model.parameters() if not p.requires_grad),
        "grad_bytes": state.peak_grad_bytes,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "peak_rss_bytes": peak_rss_bytes(),
        **state.memory,
        **state.val_metrics,
    }
    if device.type == "cuda":
        # The allocator's peak over the training segments only (validation and the probe excluded),
        # gathered by the engine each time training pauses, the last time before these metrics.
        metrics["peak_train_memory_bytes"] = state.cuda_peak_allocated
        metrics["peak_reserved_bytes"] = state.cuda_peak_reserved
    return {k: float(v) for k, v in metrics.items()}


# Under DDP: rows and tokens add up over ranks; times, memory peaks and the compiles that cost timed steps take the
# slowest/largest rank (every rank waits for the one that recompiled).
_MAXED = (
    *CLOCKS,
    "compile_time_s",
    "data_wait_fraction",
    "peak_rss_bytes",
    "peak_train_memory_bytes",
    "peak_reserved_bytes",
    "timed_recompiles",
    "timed_cudagraph_skips",
)


def reduce_final_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """The run's global metrics: rows and tokens of every rank over the slowest rank's time."""
    tokens = metrics["tokens_per_s"] * metrics["train_time_s"]
    positions = tokens / (1.0 - metrics["padding_fraction"]) if metrics["padding_fraction"] < 1.0 else 0.0
    rows, tokens, positions = all_reduce(
        [metrics["samples_per_s"] * metrics["train_time_s"], tokens, positions], "sum", device
    )
    maxed = [k for k in _MAXED if k in metrics]
    reduced = dict(zip(maxed, all_reduce([metrics[k] for k in maxed], "max", device), strict=True))
    out = {**metrics, **reduced}
    out["samples_per_s"] = rows / out["train_time_s"]
    out["tokens_per_s"] = tokens / out["train_time_s"]
    out["padding_fraction"] = 1.0 - tokens / positions if positions else 0.0
    out["world_size"] = float(world()[1])
    if "peak_train_memory_bytes" in metrics:  # the max above hides which rank peaked, and by how much over the rest
        out.update(per_rank_values("peak_train_memory_bytes", metrics["peak_train_memory_bytes"], device))
    return out


def per_rank_values(name: str, value: float, device: torch.device) -> dict[str, float]:
    """Every rank's own `value`, as `{name}_rank_{i}`: each rank adds its value at its own index of a zero vector,
    so one sum gives them all."""
    rank, size = world()
    values = [0.0] * size
    values[rank] = float(value)
    return {f"{name}_rank_{i}": v for i, v in enumerate(all_reduce(values, "sum", device))}
