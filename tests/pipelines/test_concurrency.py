"""Trials of one project training on one host at once: counted from their registrations, stale ones dropped."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pipelines.concurrency import ConcurrentTrials, concurrency_note, stopping, training_now


def sampled(trials: ConcurrentTrials, most: int, within_s: float = 10.0) -> int:
    """The most `trials` saw at once, once its own sampling thread has seen `most` (or `within_s` has passed)."""
    deadline = time.monotonic() + within_s
    while trials.most < most and time.monotonic() < deadline:
        time.sleep(0.01)
    return trials.most


def test_two_trials_of_a_project_count_each_other_and_not_another_project(tmp_path: Path):
    # Counted as the trial's epoch lines count (`training_now`) and as its metric samples (its thread, every every_s).
    first = ConcurrentTrials("/repo/a", every_s=0.05, folder=tmp_path).start()
    assert training_now("/repo/a", tmp_path) == 1 and first.most == 1
    other_project = ConcurrentTrials("/repo/b", every_s=0.05, folder=tmp_path).start()
    second = ConcurrentTrials("/repo/a", every_s=0.05, folder=tmp_path).start()
    assert training_now("/repo/a", tmp_path) == 2 and training_now("/repo/b", tmp_path) == 1
    assert sampled(first, 2) == 2
    assert second.stop() == {"concurrent_trials": 2.0}
    assert training_now("/repo/a", tmp_path) == 1
    other_project.stop()
    assert first.stop() == {"concurrent_trials": 2.0}  # the most at once, kept after the other left
    assert not list(tmp_path.glob("*.json"))


def test_a_trial_killed_without_cleanup_is_not_counted_and_its_entry_goes(tmp_path: Path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"pid": int(dead.stdout), "project": "/repo/a"}))
    assert training_now("/repo/a", tmp_path) == 0 and not stale.exists()


def test_a_failing_trial_unregisters(tmp_path: Path):
    trials = ConcurrentTrials("/repo/a", folder=tmp_path).start()
    try:
        with stopping(trials):
            raise RuntimeError("training failed")
    except RuntimeError:
        pass
    assert training_now("/repo/a", tmp_path) == 0


def test_the_note_names_how_many_others():
    assert concurrency_note(2) == "trained beside 1 other trial of this project on this host"
    assert concurrency_note(3.0) == "trained beside 2 other trials of this project on this host"
