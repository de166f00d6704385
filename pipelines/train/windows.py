"""How an epoch's batches become optimizer steps: accumulation windows, their loss units, and fetching a window.

A window is the micro-batches of one optimizer step (`grad_accum_steps` of them; the last may be partial). Its loss
is divided by its *loss units* (`window_units`), known from the rows before any forward pass. `fetch_window` takes a
window's batches from the loader onto the device and counts what they hold on the host, so the step itself
(`pipelines.train.step.TrainStep`) sees device tensors only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipelines.data.batching import LengthGroupedBatchSampler, Replica
from pipelines.data.loader import to_device
from pipelines.data.tokenization import TokenizedSplit
from pipelines.params import Params


def training_sampler(
    train: TokenizedSplit, params: Params, num_replicas: int = 1, rank: int = 0
) -> LengthGroupedBatchSampler:
    """The training split's sampler as the params set it up (bucketing, seed, token budget, DDP shard)."""
    return LengthGroupedBatchSampler(
        train.lengths,
        params.batch_size,
        bucketing=params.data.bucketing,
        seed=params.seed,
        max_tokens=params.data.max_tokens_per_batch,
        replica=Replica(rank, num_replicas),
    )


def planned_batches(sampler: LengthGroupedBatchSampler, epochs: int) -> list[list[int]]:
    """Every batch of a run over `epochs`, epoch after epoch, as `sampler` plans them before training (its plan is
    deterministic in the seed and the epoch)."""
    return [rows for epoch in range(epochs) for rows in sampler.batches(epoch)]


def optimizer_steps(sampler: LengthGroupedBatchSampler, params: Params) -> int:
    """The optimizer steps of a run over `params.epochs`: each epoch's batches of `sampler` in windows of
    `grad_accum_steps` (an epoch's last window may be partial, and still steps)."""
    return sum(math.ceil(len(sampler.batches(epoch)) / params.grad_accum_steps) for epoch in range(params.epochs))


def plan_windows(batches: list[list[int]], accum: int, halvings: int = 0) -> list[list[list[int]]]:
    """Group an epoch's batches into accumulation windows (the last may be partial).

    Each batch is halved `halvings` times (after out-of-memory): same windows, smaller micro-batches.
    """
    windows = [batches[i : i + accum] for i in range(0, len(batches), accum)]
    for _ in range(halvings):
        windows = halve_windows(windows, 0)
    return windows


def halve_windows(windows: list[list[list[int]]], start: int) -> list[list[list[int]]]:
    """Split every batch of windows[start:] in two: the same rows per window, half per micro-batch."""
    halved = [
        [part for batch in window for part in (batch[: len(batch) // 2], batch[len(batch) // 2 :]) if part]
        for window in windows[start:]
    ]
    return windows[:start] + halved


def window_units(window: list[list[int]], units: np.ndarray | None) -> int:
    """Loss units of a window: the sum of its rows' units (None: one per row)."""
    if units is None:
        return sum(len(batch) for batch in window)
    return int(sum(int(units[batch].sum()) for batch in window))


def global_window_rows(
    sampler: LengthGroupedBatchSampler, epoch: int, accum: int, units: np.ndarray | None = None
) -> list[int]:
    """Loss units (default: rows) of each optimizer step's global window: every rank's window s together.

    Computed from the sampler's global batch plan, which every rank knows, so no communication.
    """
    all_batches = sampler.global_batches(epoch)
    per_rank = [plan_windows(all_batches[r :: sampler.num_replicas], accum) for r in range(sampler.num_replicas)]
    return [sum(window_units(windows[s], units) for windows in per_rank) for s in range(len(per_rank[0]))]


@dataclass
class WindowCounts:
    """What one window's micro-batches held: examples, real tokens, padded positions, and the wait for them."""

    rows: int = 0
    tokens: int = 0
    positions: int = 0  # tokens plus padding: the batch tensors' size
    wait_s: float = 0.0
    rows_key: int = -1  # the window's first row (which rows it held, for the stuck-loss check), -1 if unknown


def fetch_window(
    loader: Iterator[dict[str, torch.Tensor]], micro_batches: int, device: torch.device
) -> tuple[list[dict[str, torch.Tensor]], WindowCounts]:
    """The next `micro_batches` batches of `loader`, on `device`, and what they held (counted on the host copies:
    no device sync) with the time spent waiting for them."""
    counts = WindowCounts()
    batches = []
    for _ in range(micro_batches):
        fetch = time.perf_counter()
        batch = next(loader)
        counts.wait_s += time.perf_counter() - fetch
        counts.rows += int(batch["num_rows"])
        counts.tokens += int(batch["num_tokens"])
        counts.positions += int(batch["num_positions"])
        if not batches and "row_index" in batch and len(batch["row_index"]):
            counts.rows_key = int(batch["row_index"][0])
        batches.append(to_device(batch, device))
    return batches, counts
