"""How many trials of this project trained on this host at the same time as this one, recorded beside its times.

Two experiments from `dvc queue start -j 2` (or Ray running trials side by side, or two terminals) share the
host's cores: on 2 cores, a default train stage took 66.5 and 68.0 s each with `-j 2`, against 6.7 s alone, and the
load average alone did not say why. Each training trial registers itself, while it trains, as a small file in a
per-user folder of the system's temporary directory (its pid and project: the repository root, which a DVC
queue's temporary copy resolves to as well). A trial counts the live entries of its project every
`SAMPLE_EVERY_S` and keeps the most it saw: `concurrent_trials` (1 = it trained alone).
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_EVERY_S = 2.0
METRIC = "concurrent_trials"


def registry_dir() -> Path:
    """Where training trials register (one folder per user, so users of a shared host do not count each other)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"pipelines-training-{uid}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def training_now(project: str, folder: Path | None = None) -> int:
    """How many trials of `project` are registered as training on this host now (stale entries are removed)."""
    count = 0
    for entry in (folder or registry_dir()).glob("*.json"):
        try:
            record = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue  # being written or removed
        if not _alive(int(record.get("pid", -1))):
            entry.unlink(missing_ok=True)  # a trial killed without cleanup
        elif record.get("project") == project:
            count += 1
    return count


@dataclass
class ConcurrentTrials:
    """This trial's registration between `start()` and `stop()`, sampling how many of its project train at once."""

    project: str
    every_s: float = SAMPLE_EVERY_S
    folder: Path = field(default_factory=registry_dir)
    most: int = 1
    _entry: Path | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ConcurrentTrials:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._entry = self.folder / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.json"
        self._entry.write_text(json.dumps({"pid": os.getpid(), "project": self.project}))
        self._sample()
        self._thread = threading.Thread(target=self._run, name="concurrent-trials", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        self.most = max(self.most, training_now(self.project, self.folder))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def stop(self) -> dict[str, float]:
        """The metric `concurrent_trials`: the most trials of this project training at once, this one included."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._sample()
        if self._entry is not None:
            self._entry.unlink(missing_ok=True)
        return {METRIC: float(self.most)}


def concurrency_note(count: float) -> str:
    """How a time taken beside other trials is marked (epoch lines, the report)."""
    others = int(count) - 1
    return f"trained beside {others} other trial{'s' if others != 1 else ''} of this project on this host"


@contextmanager
def stopping(trials: ConcurrentTrials) -> Iterator[ConcurrentTrials]:
    """Unregister on the way out, also when training fails (Ray may keep the worker process, and its pid, alive)."""
    try:
        yield trials
    except BaseException:
        trials.stop()
        raise
