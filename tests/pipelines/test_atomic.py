"""Atomic outputs keep the mode a plain mkdir or open would give (mkdtemp's and mkstemp's 0700/0600 do not leak)."""

from __future__ import annotations

import os
import stat

from pipelines.atomic import atomic_dir, atomic_write_json


def test_outputs_get_the_modes_of_the_umask_not_of_a_temporary_file(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_dir(tmp_path / "models") as folder:
            (folder / "weights.bin").write_bytes(b"x")
        atomic_write_json(tmp_path / "metrics.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "models").stat().st_mode) == 0o755
    assert stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode) == 0o644
