"""What `data.source` names, resolved once, and a fingerprint of its contents that DVC can see.

`data.source` is a param, and DVC hashes params by value: a path's *contents* are invisible to it, so after a row
of `mydata/train.csv` was corrected, `dvc exp run` skipped tokenize and trained on the old arrays. DVC's own
templated dependency (`deps: [${data.source}]`) cannot stand in: the default `generator` and a hub dataset id are
no paths, and DVC fails a stage whose dependency is missing (checked with DVC 3.67: `No such file or directory`),
and a dependency cannot be interpolated conditionally or from a list. So the `source` stage (always run: DVC's
`always_changed`) writes this module's fingerprint, a few hundred bytes, into `metrics/data_source.json`, which the
tokenize stage depends on: DVC re-runs tokenize exactly when the data it reads changed, and `dvc exp show` tells
experiments on different data apart by that file's hash. A local `model.name_or_path` folder is hashed the same
way (`local_model_folder`, `file_hashes`): its weights are as invisible to DVC as the data.

A file's MD5 is reused while its size, modification time and inode are unchanged (as DVC's own state database
does), so a large source is read once, not on every run. Imports stay light (no pandas): the stage runs every time.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.atomic import atomic_write_text
from pipelines.errors import UserError, warn_user
from pipelines.params import GENERATOR_SOURCE

SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
HASH_STATE = Path(".dvc/tmp/data_source_hashes.json")  # DVC's own tmp folder: ignored by git and DVC
_SKIPPED_DIRS = {".git", ".dvc", "__pycache__"}


def file_md5(path: Path) -> str:
    """A file's MD5, read in 1 MiB blocks: the data fingerprint's, and the test scoring's key (pipelines/scored.py)."""
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class DataError(UserError):
    """The data source cannot be used as it is."""


@dataclass(frozen=True)
class Source:
    """`data.source` resolved: the generator, a local file or folder (`path`), or a hub dataset id."""

    kind: str  # "generator", "file", "folder" or "hub"
    name: str  # data.source as written
    path: Path | None = None


def _looks_local(source: str, path: Path, root: Path) -> bool:
    """A source meant as a local path: a data file's suffix, a leading `.`, `/` or `~`, or a first folder that
    exists here (`mydata/csvv` where `mydata/` exists: a typo of a local path, not a hub id `user/dataset`)."""
    if path.suffix in SUFFIXES or source.startswith((".", "/", "~")):
        return True
    parts = Path(source).parts
    return len(parts) > 1 and (root / parts[0]).is_dir()


def _missing(source: str, path: Path) -> DataError:
    """A local-looking path that is not there, with what its nearest existing folder holds."""
    folder = path.parent
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    present = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.startswith("."))
    close = difflib.get_close_matches(path.name, [p.rstrip("/") for p in present], n=1)
    hint = f"; did you mean {str(Path(source).parent / close[0])!r}?" if close else ""
    shown = ", ".join(present[:12]) + (f" and {len(present) - 12} more" if len(present) > 12 else "")
    return DataError(
        f"data.source = {source!r}: no such local file or folder ({path} does not exist; {folder} holds: "
        f"{shown or 'nothing'}), and a path meant as local is never looked up on the hub{hint}"
    )


def resolve_source(source: str, root: Path) -> Source:
    """What `source` names: the generator, an existing local file or folder, or else a hub dataset id. A path meant
    as local that does not exist is refused here, before any hub lookup (whose offline error would hide the typo)."""
    if source == GENERATOR_SOURCE:
        return Source("generator", source)
    path = Path(source).expanduser()
    path = path if path.is_absolute() else root / path
    if path.is_dir():
        return Source("folder", source, path)
    if path.is_file():
        return Source("file", source, path)
    if _looks_local(source, path, root):
        raise _missing(source, path)
    return Source("hub", source)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    found = []
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
        found += [Path(folder) / n for n in sorted(names)]
    return found


def local_model_folder(name_or_path: str | None, root: Path) -> Path | None:
    """`model.name_or_path` where it names a local folder (its weights and tokenizer DVC cannot see either), else
    None (a hub id, pinned by model.revision, or a model built from model.config)."""
    if name_or_path is None:
        return None
    path = Path(name_or_path).expanduser()
    path = path if path.is_absolute() else root / path
    return path if path.is_dir() else None


def _load_state(root: Path) -> dict[str, Any]:
    try:
        state = json.loads((root / HASH_STATE).read_text(encoding="utf-8"))
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def fingerprint(source: Source, revision: str | None, root: Path) -> dict[str, Any]:
    """The source's identity and contents: each local file's MD5 and size (relative names), or a hub id with its
    pinned revision. Equal fingerprints mean equal data; the generator's data is a function of its params alone."""
    if source.kind == "generator":
        return {"source": source.name, "kind": source.kind}
    if source.kind == "hub":
        if revision is None:
            warn_user(
                f"data.source = {source.name!r} is a hub dataset with no data.revision: DVC cannot see when it "
                "changes on the hub; pin a commit (data.revision) to make every experiment's data reproducible"
            )
        return {"source": source.name, "kind": source.kind, "revision": revision}
    assert source.path is not None
    return {"source": source.name, "kind": source.kind, "files": file_hashes(source.path, root)}


def file_hashes(path: Path, root: Path) -> dict[str, dict[str, Any]]:
    """Each file of `path` (a file, or a folder walked whole) by its name relative to the folder: MD5 and size.
    An MD5 is reused while the file's size, modification time and inode are unchanged."""
    state, seen = _load_state(root), {}
    files: dict[str, dict[str, Any]] = {}
    for file in _files(path):
        stat = file.stat()
        key = str(file.resolve())
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        known = state.get(key)
        md5 = known["md5"] if isinstance(known, dict) and known.get("stamp") == stamp else file_md5(file)
        seen[key] = {"stamp": stamp, "md5": md5}
        name = str(file.relative_to(path)) if path.is_dir() else file.name
        files[name] = {"md5": md5, "size": stat.st_size}
    _save_state(root, {k: v for k, v in {**state, **seen}.items() if k in seen or Path(k).exists()})
    return files


def _save_state(root: Path, seen: dict[str, Any]) -> None:
    target = root / HASH_STATE
    if not target.parent.parent.is_dir():  # no .dvc folder: not a DVC repository, nothing to keep
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, json.dumps(seen))
