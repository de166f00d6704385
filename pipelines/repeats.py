"""A loop of identical chunks on fake tensors, run twice and counted n times: the memory plan's chunked loss.

The chunked cross-entropy (`pipelines.tasks.linear_ce`) projects the vocabulary a few rows at a time: an 8B-shaped
Llama's 128,256 words at 4 x 2048 targets make 256 chunks, each a dozen ops forward and as many backward. The
memory plan runs the trial's step op by op through five dispatch modes, so that loop was most of a plan's time.
Every chunk allocates and frees alike and writes its own slice in place, so after the second chunk the memory
state repeats: the peak is set by then. On fake tensors, while a plan's counters are registered here
(`counted_repeats`), `chunk_starts` yields the first two chunks only and adds the second's FLOPs and launches once
for every chunk it skipped; real tensors (training, validation, the evaluate stage) run every chunk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol


class RepeatCounter(Protocol):
    """A counter whose counts since a snapshot can be added again."""

    def snapshot(self) -> object: ...

    def add_since(self, snapshot: object, times: int) -> None: ...


_COUNTERS: ContextVar[tuple[RepeatCounter, ...] | None] = ContextVar("repeat_counters", default=None)


@contextmanager
def counted_repeats(*counters: RepeatCounter) -> Iterator[None]:
    """Inside: a loop of `chunk_starts` over fake tensors runs two chunks and `counters` (none: memory only) count
    them all."""
    token = _COUNTERS.set(counters)
    try:
        yield
    finally:
        _COUNTERS.reset(token)


def chunk_starts(rows: int, chunk_rows: int, fake: bool) -> Iterator[int]:
    """`range(0, rows, chunk_rows)`; with `fake` tensors under `counted_repeats`, its first two starts only, the
    second chunk's counts (taken when the loop asks for a third) added once per chunk not run."""
    starts = range(0, rows, chunk_rows)
    counters = _COUNTERS.get()
    if not fake or counters is None or len(starts) <= 2:
        yield from starts
        return
    yield starts[0]
    before = [counter.snapshot() for counter in counters]
    yield starts[1]
    for counter, snapshot in zip(counters, before, strict=True):
        counter.add_since(snapshot, len(starts) - 2)
