"""An output a stage cannot put in place is found before the stage works, named with what to do; one that becomes
unwritable while it works fails its swap cleanly: the old output intact, no temporary folder left behind."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pipelines.atomic import atomic_dir, refuse_unwritable, unwritable
from pipelines.errors import UserError


@contextmanager
def immutable(path: Path) -> Iterator[None]:
    """`path` made immutable (`chattr +i`: root cannot write through it either, as it can through a chmod), or, where
    that is not possible and this is not root, read-only; undone afterwards (else its temp folder stays)."""
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
    if not made:
        if os.geteuid() == 0:
            pytest.skip("chattr +i is not available here, and root writes through a chmod")
        path.chmod(0o555)
    try:
        yield
    finally:
        if made:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        else:
            path.chmod(0o755)


def test_an_immutable_output_folder_is_refused_naming_it_and_what_to_do(tmp_path):
    models = tmp_path / "models"
    (models / "best").mkdir(parents=True)
    metrics = tmp_path / "metrics" / "train.json"
    assert unwritable(models) is None and unwritable(metrics) is None  # writable, and one made by the stage
    with immutable(models):
        with pytest.raises(UserError) as refused:
            refuse_unwritable([models, metrics], "train")
    message = str(refused.value)
    assert message.startswith("the train stage could not put its outputs in place, so it stops before doing anything")
    assert f"{models} is immutable or read-only" in message and f"chattr -i {models}" in message
    assert str(metrics) not in message  # only the output at fault is named
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]  # the probe left nothing


def test_a_file_where_an_output_needs_a_folder_is_refused(tmp_path):
    (tmp_path / "plots").write_text("not a folder")
    plot = tmp_path / "plots" / "train_loss.json"
    assert unwritable(plot) == f"{plot.parent} is a file, where {plot} needs a folder; move it away, then run again"


def test_a_folder_made_immutable_while_the_stage_worked_is_kept_whole_and_no_temporary_folder_stays(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "weights.bin").write_bytes(b"old")
    with immutable(models):
        with pytest.raises(UserError) as failed:
            with atomic_dir(models) as new:
                (new / "weights.bin").write_bytes(b"new")
    # Before: a raw PermissionError ('models' -> '.models.old-<pid>'), and a `.models.tmp-*` left beside it.
    assert str(failed.value).startswith(
        f"{models}: operation not permitted, so the new output could not take its place"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
    assert (models / "weights.bin").read_bytes() == b"old"
