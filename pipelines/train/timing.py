"""Clocks for the trial's separate regions: training steps, warm-up, validation, checkpoints.

One timed region per number: `train_time_s` is optimizer steps only, the same region for every
strategy. On CUDA, kernels run asynchronously, so a region's clock is read only after a
synchronize at its boundaries (which already exist: validation, checkpoints, the end); per-step
times come from CUDA events recorded after each step and read at log points, so the hot loop
gains no host sync and p50/p90 mean the same for fp32, bf16 and fp16.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def timed(device: torch.device, totals: dict[str, float], name: str) -> Iterator[None]:
    """Add the wall time of the block (device work included) to `totals[name]`."""
    synchronize(device)
    start = time.perf_counter()
    try:
        yield
    finally:
        synchronize(device)
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - start


class StepClock:
    """Times optimizer steps in segments: `start`, one `lap` per step, `stop` at a pause.

    A segment's duration goes to `totals["train_time_s"]`; each lap's duration to `step_times`.
    """

    def __init__(self, device: torch.device, totals: dict[str, float], step_times: list[float]) -> None:
        self.device = device
        self.totals = totals
        self.step_times = step_times
        self._marks: list[object] = []
        self._running = False
        self._started_at = 0.0

    @property
    def running(self) -> bool:
        return self._running

    def _mark(self) -> object:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """Begin a segment (after a pause): everything queued before it is not counted."""
        if self._running:
            return
        synchronize(self.device)
        self._started_at = time.perf_counter()
        self._marks = [self._mark()]
        self._running = True

    def lap(self) -> None:
        """One optimizer step ended (no host sync: CUDA events are read at `read_laps`)."""
        self._marks.append(self._mark())

    def read_laps(self) -> None:
        """Turn the marks so far into step times (syncs on CUDA; call at log points only)."""
        if len(self._marks) < 2:
            return
        if self.device.type == "cuda":
            self._marks[-1].synchronize()  # type: ignore[attr-defined]
            laps = [a.elapsed_time(b) / 1000 for a, b in zip(self._marks, self._marks[1:], strict=False)]  # type: ignore[attr-defined]
        else:
            laps = [b - a for a, b in zip(self._marks, self._marks[1:], strict=False)]  # type: ignore[operator]
        self.step_times.extend(laps)
        self._marks = self._marks[-1:]

    def stop(self) -> None:
        """End the segment: its wall time (device work included) is added to train time."""
        if not self._running:
            return
        synchronize(self.device)
        self.read_laps()
        self.totals["train_time_s"] = self.totals.get("train_time_s", 0.0) + time.perf_counter() - self._started_at
        self._running = False
