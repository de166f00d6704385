"""Atomic writes: outputs appear whole or not at all.

Every file or folder a stage produces is written to a temporary sibling first and
renamed into place, so an interrupted or failed stage never leaves a half-written
output for DVC (or a user) to pick up.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces `target` when the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename: the mode mkdir would give
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        # Swap via a second rename so the old output is never missing while the new one
        # is incomplete; the old copy is removed only after the new one is in place.
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def atomic_write_text(target: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `target` through a temporary file and a rename."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would outlive the rename: the mode open() would give
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (read by setting it, then put back: there is no getter)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_json(target: str | os.PathLike[str], data: Any, sort_keys: bool = True) -> None:
    """Write `data` as indented JSON atomically; key-sorted (stable bytes for DVC) unless its order means something
    (a metrics file's first keys are `dvc exp show`'s first columns)."""
    atomic_write_text(target, json.dumps(data, indent=2, sort_keys=sort_keys) + "\n")
