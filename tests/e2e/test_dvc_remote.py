"""A DVC remote: push every output, clone fresh, pull, and the clone is complete and up to date."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

from tests.conftest import QUICK, run, up_to_date, write_params

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def outputs(root: Path) -> list[str]:
    """Every out, metric and plot path of every stage, as dvc.lock records them."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    return sorted({out["path"] for stage in lock["stages"].values() for out in stage.get("outs", [])})


def digest(path: Path) -> dict[str, str]:
    """Relative file path -> sha256, for a file or every file under a folder."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f.relative_to(path.parent)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def test_push_then_pull_into_a_fresh_clone_restores_every_output(project_copy: Path, tmp_path: Path):
    root = project_copy
    remote = tmp_path / "dvc-remote"
    write_params(root, QUICK)
    run(["dvc", "remote", "add", "-d", "local", str(remote)], root)
    run(["dvc", "repro"], root, timeout=800)
    # What a user commits after a run: the lock file, params and the (uncached) metrics and plots.
    run(["git", "add", "-A"], root)
    run(["git", "commit", "-qm", "run"], root)
    pushed = run(["dvc", "push"], root)
    assert "pushed" in pushed.stdout.lower() or "Everything is up to date" in pushed.stdout

    paths = outputs(root)
    assert {"data/tokenized", "models", "predictions/test.csv", "reports"} <= set(paths)
    assert {"metrics/train.json", "metrics/evaluate.json", "plots/train_loss.json"} <= set(paths)
    before = {p: digest(root / p) for p in paths}

    clone = tmp_path / "clone"
    run(["git", "clone", "-q", str(root), str(clone)], tmp_path)
    assert not (clone / "models").exists() and not (clone / "data" / "tokenized").exists()
    run(["dvc", "pull"], clone, timeout=300)
    for path in paths:
        assert digest(clone / path) == before[path], path
    status = run(["dvc", "status"], clone)
    assert up_to_date(status.stdout), status.stdout
