"""Checkpoints are keyed by the params they resume, and never shared by two live runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from pipelines.train.checkpoint import LOCK_FILE, checkpoint_key, claim_checkpoint_dir, discard
from tests.conftest import REPO_ROOT, tiny_params

HOLD = """
import sys, time
from pathlib import Path
from pipelines.params import load_params
from pipelines.train.checkpoint import claim_checkpoint_dir
params = load_params(sys.argv[2])
with claim_checkpoint_dir(Path(sys.argv[1]), params) as folder:
    (folder / "mine").write_text("other experiment")
    print(folder, flush=True)
    time.sleep(60)
"""


def test_key_follows_training_params_only(default_params):
    assert checkpoint_key(default_params) == checkpoint_key(tiny_params(default_params, **{"tracking.experiment": "x"}))
    assert checkpoint_key(default_params) != checkpoint_key(tiny_params(default_params, lr=5e-4))
    assert checkpoint_key(default_params) != checkpoint_key(tiny_params(default_params, seed=7))


def test_two_live_runs_with_the_same_params_get_different_folders(default_params, tmp_path: Path):
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), str(REPO_ROOT / "params.yaml")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    try:
        theirs = Path(other.stdout.readline().strip())  # the other experiment holds its folder
        assert theirs.name == checkpoint_key(default_params)
        with claim_checkpoint_dir(tmp_path, default_params) as mine:
            assert mine != theirs and mine.name == f"{theirs.name}-1"
            (mine / "checkpoint.pt").write_text("x")
            discard(mine)  # a finished run deletes only its own folder
        assert (theirs / "mine").read_text() == "other experiment"
    finally:
        other.kill()
        other.wait()
    # kill -9 released the lock: a re-run with the same params finds (and may resume) that checkpoint.
    time.sleep(0.1)
    with claim_checkpoint_dir(tmp_path, default_params) as again:
        assert again == theirs and (again / LOCK_FILE).exists()
