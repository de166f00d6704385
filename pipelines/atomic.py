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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.errors import UserError


@dataclass
class StagedDir:
    """A stage's output folder being written: `path`, a temporary sibling of `target`, until `put_in_place`."""

    path: Path
    target: Path
    placed: bool = False

    def put_in_place(self) -> None:
        """Replace `target` with `path` (the old copy is removed only after the new one is in place)."""
        _swap(self.path, self.target)
        self.placed = True


@contextmanager
def staged_dir(target: str | os.PathLike[str]) -> Iterator[StagedDir]:
    """Yield an empty temporary folder for `target`, put in place by `put_in_place` (say, before a run is closed as
    finished); removed when the block ends without it."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0700 would outlive the rename: the mode mkdir would give
    staged = StagedDir(tmp, target)
    try:
        yield staged
    finally:
        if not staged.placed:
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_dir(target: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary folder that replaces `target` when the block succeeds."""
    with staged_dir(target) as staged:
        yield staged.path
        staged.put_in_place()


def _swap(tmp: Path, target: Path) -> None:
    """`tmp` renamed to `target`; an existing `target` renamed aside first (via a second rename, so the old output
    is never missing while the new one is incomplete) and put back if the new one cannot take its place."""
    try:
        if not target.exists():
            os.replace(tmp, target)
            return
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        try:
            os.replace(tmp, target)
        except OSError:
            os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    except OSError as err:
        raise UserError(f"{target}: {(err.strerror or str(err)).lower()}, so the new output could not take its place; "
                        f"{UNWRITABLE_FIX.format(path=target)}") from err  # fmt: skip


# What a user does about an output that cannot be replaced: an immutable folder (`chattr +i`, which stops root too)
# or a read-only one.
UNWRITABLE_FIX = (
    "make it writable (`lsattr -d {path}` shows an immutable `i`, removed by `chattr -i {path}`; "
    "`chmod u+w {path}` for a read-only one) or move it away, then run again"
)


def unwritable(target: str | os.PathLike[str]) -> str | None:
    """Why a stage could not put `target` in place at its end by `atomic_dir` or `atomic_write_text` (a sibling
    made, then renamed over it), or None when it can: checked by doing the first (a sibling made and removed) and
    asking the kernel about the second (`os.access`, which answers for an immutable file even to root)."""
    target = Path(target)
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # made by the stage (mkdir -p): what must be writable is the nearest existing one
    if not folder.is_dir():
        return f"{folder} is a file, where {target} needs a folder; move it away, then run again"
    try:
        Path(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=folder)).rmdir()
    except OSError as err:
        why = (err.strerror or str(err)).lower()
        return f"no file can be made in {folder} ({why}); {UNWRITABLE_FIX.format(path=folder)}"
    # A folder's contents are moved and removed too (the old copy, after the swap).
    mode = os.W_OK | os.X_OK if target.is_dir() else os.W_OK
    if target.exists() and not os.access(target, mode):
        return f"{target} is immutable or read-only; {UNWRITABLE_FIX.format(path=target)}"
    return None


def refuse_unwritable(targets: Iterable[str | os.PathLike[str]], stage: str) -> None:
    """Refuse, before a stage does its work, outputs it could not put in place at its end, naming each and what to
    do."""
    reasons = [reason for target in targets if (reason := unwritable(target))]
    if reasons:
        raise UserError(
            f"the {stage} stage could not put its outputs in place, so it stops before doing anything: "
            + "; ".join(reasons)
        )


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
