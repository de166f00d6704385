"""What a running trial shows: a progress bar (on a terminal) and one summary line per epoch.

Both follow the engine's log points (every `log_every_n_steps` optimizer steps), which are also the
loop's only host syncs, so watching costs no extra synchronization. The bar shows steps done of
the total, the loss, samples/s and the time left; inside Ray the trials pass `ray.experimental.tqdm_ray`'s bar,
which Ray draws on the driver's terminal. When the driver's stdout is not a terminal (CI, a log
file) there is no bar: a progress line (step, loss, samples/s, time left) at least every 30 s, and the epoch lines.
The engine adds a log point when 30 s passed without one (`pipelines.train.trainer.PROGRESS_EVERY_S`), so a run
of slow steps is never silent for long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

LINE_EVERY_S = 30.0  # without a bar, a progress line at least this often (at the log points)


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class TrialProgress:
    """Turns the engine's log points and epoch ends into a bar and summary lines for one trial."""

    def __init__(
        self,
        epochs: int,
        say: Callable[[str], None],
        make_bar: Callable[..., Any] | None,
        label: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # make_bar: a tqdm-like class (inside Ray, the trials pass ray.experimental.tqdm_ray's); None: no bar.
        self.epochs, self.say, self.make_bar, self.label, self.clock = epochs, say, make_bar, label, clock
        self.start = clock()
        self.step, self.total, self.loss, self.rows, self.rate = 0, 0, float("nan"), 0.0, float("nan")
        self._last: tuple[float, float] | None = None  # (time, rows) at the previous log point
        # (time, rows) at the first log point of the epoch: the epoch line's samples/s is the epoch's own, from
        # here to its last log point, not the last interval's (which read 652 for an epoch that ran at 155)
        self._epoch_mark: tuple[float, float] | None = None
        self._last_line = self.start  # when the last progress line was said (no bar)
        self._bar: Any = None

    def on_log(self, step: int, point: dict[str, float]) -> None:
        """A log point: step, loss, and the run's total steps and rows timed so far."""
        now = self.clock()
        self.step, self.loss = step, point["loss"]
        self.total = int(point.get("total_steps", self.total))
        rows = point.get("rows_timed", self.rows)
        if self._last is not None and now > self._last[0]:
            self.rate = (rows - self._last[1]) / (now - self._last[0])
        self._last, self.rows = (now, rows), rows
        if self._epoch_mark is None:
            self._epoch_mark = self._last
        if self.make_bar is not None:
            self._draw()
        elif now - self._last_line >= LINE_EVERY_S:
            self._last_line = now
            self.say(self.line())

    def line(self) -> str:
        """Where the trial is: step of total, loss, samples/s, time left."""
        parts = [f"step {self.step}/{self.total or '?'}", f"loss {self.loss:.4f}"]
        if self.rate == self.rate:  # not NaN
            parts.append(f"{self.rate:.1f} samples/s")
        if self.eta_s() == self.eta_s():
            parts.append(f"about {_duration(self.eta_s())} left")
        return ", ".join(parts)

    def eta_s(self) -> float:
        """Seconds left at the pace so far (every step alike)."""
        if not self.step or not self.total:
            return float("nan")
        return (self.clock() - self.start) / self.step * (self.total - self.step)

    def on_epoch_end(self, epoch: int, step: int, metrics: dict[str, float]) -> str:
        """Say (and return) the epoch's summary line."""
        parts = [f"epoch {epoch}/{self.epochs}", f"step {step}/{self.total or '?'}"]
        parts += [f"loss {self.loss:.4f}"] if self.loss == self.loss else []  # none until a log point gives one
        parts += [f"{k} {v:.4f}" for k, v in metrics.items() if not k.endswith("_s")]
        rate = self.epoch_rate()
        if rate == rate:  # not NaN
            parts.append(f"{rate:.0f} samples/s")
        parts.append(f"{_duration(self.clock() - self.start)} elapsed")
        if epoch < self.epochs and self.eta_s() == self.eta_s():
            parts.append(f"about {_duration(self.eta_s())} left")
        line = ", ".join(parts)
        self.say(line)
        self._epoch_mark = self._last  # the next epoch is timed from here
        return line

    def epoch_rate(self) -> float:
        """Samples/s over this epoch's log points (NaN before two of them)."""
        if self._epoch_mark is None or self._last is None or self._last[0] <= self._epoch_mark[0]:
            return float("nan")
        return (self._last[1] - self._epoch_mark[1]) / (self._last[0] - self._epoch_mark[0])

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _draw(self) -> None:
        if self._bar is None:
            assert self.make_bar is not None
            self._bar = self.make_bar(total=self.total, desc=self.label, unit="step")
        self._bar.update(self.step - self._bar.n)
        rate = f"{self.rate:.0f}" if self.rate == self.rate else "?"
        self._bar.set_postfix({"loss": f"{self.loss:.4f}", "samples/s": rate})


class RowsProgress:
    """A long loop over rows (generation, which runs minutes for a language model's test split) says where it is:
    a line at least every `every_s` seconds with rows done of the total and the time left at the pace so far."""

    def __init__(
        self,
        what: str,
        total: int,
        say: Callable[[str], None] = print,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.say, self.every_s, self.clock = what, total, say, every_s, clock
        self.done, self.start = 0, clock()
        self._last_line = self.start

    def advance(self, rows: int) -> None:
        """`rows` more are done; a line when `every_s` passed since the last one (or since the start)."""
        self.done += rows
        now = self.clock()
        if now - self._last_line < self.every_s or self.done >= self.total:
            return
        self._last_line = now
        left = (now - self.start) / self.done * (self.total - self.done)
        self.say(f"{self.what}: {self.done}/{self.total} rows, about {_duration(left)} left")
