"""A checkpoint folder's lock file goes with its run: an interrupted run keeps its checkpoint, not its lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.train.checkpoint import LOCK_FILE, claim_checkpoint_dir, remove_unheld_locks
from tests.conftest import REPO_ROOT, tiny_params
from tests.pipelines.train.test_checkpoint_claims import HOLD


def test_an_interrupted_run_keeps_its_checkpoint_but_not_its_lock(default_params, tmp_path: Path):
    with pytest.raises(KeyboardInterrupt), claim_checkpoint_dir(tmp_path, default_params) as folder:
        (folder / "checkpoint.pt").write_text("x")
        raise KeyboardInterrupt
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.pt"]
    with claim_checkpoint_dir(tmp_path, default_params) as again:  # the next run resumes from the same folder
        assert again == folder
    with claim_checkpoint_dir(tmp_path, tiny_params(default_params, seed=7)) as empty:
        pass  # interrupted before its first checkpoint
    assert not empty.exists()  # nothing to resume, nothing left


def test_the_locks_of_killed_runs_are_removed_and_a_live_runs_kept(default_params, tmp_path: Path):
    def hold() -> tuple[subprocess.Popen, Path]:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), str(REPO_ROOT / "params.yaml")],
                                stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)  # fmt: skip
        return proc, Path(proc.stdout.readline().strip())

    killed, killed_folder = hold()
    live, live_folder = hold()
    try:
        killed.kill()  # as Ray kills a trial: no cleanup of its own
        killed.wait()
        assert (killed_folder / LOCK_FILE).exists()
        still_held = remove_unheld_locks(tmp_path, wait_s=1.0)
        assert still_held == [live_folder]
        assert not (killed_folder / LOCK_FILE).exists() and (killed_folder / "mine").exists()
        assert (live_folder / LOCK_FILE).exists()
    finally:
        live.kill()
        live.wait()
