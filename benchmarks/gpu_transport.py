"""The transport under `gpu_runner`: files and folders as one tar stream cut into parts that fit one device call
each, a manifest that travels with every part, and the checked joining of the parts on the other side.

A part never travels alone: the call that carries `part-003` also carries `manifest.json`, so `receive` checks the
part against it at once, and refuses a manifest that lists other parts than the one already received (two packs
mixed). `reassemble` refuses a missing or altered part by name, a part the manifest does not list, and a file whose
checksum differs after joining.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# A device call carries at most 64 MiB, the project copy (about 2 MiB) and the manifest included.
PART_BYTES = 50 * 2**20
MANIFEST = "manifest.json"
WHEELS = "wheels"  # the stream's prefix for wheels
DATA = "data"  # and for the data folders
STREAM = ".stream.tar"


def sha256(path: Path) -> str:
    """The hex SHA-256 of a file, read in blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def without_java(wheel: Path, out: Path) -> Path:
    """A copy of Ray's wheel without `ray/jars/` (and their RECORD lines): what Python workers never load."""
    target = out / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as copy:
        for item in source.infolist():
            if item.filename.startswith("ray/jars/"):
                continue
            data = source.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not line.startswith("ray/jars/")]
                data = ("\n".join(kept) + "\n").encode()
            copy.writestr(item, data)
    return target


def _members(files: Iterable[Path], data: Iterable[Path]) -> list[tuple[Path, str]]:
    """(file, name in the stream): wheels under `wheels/`, each data folder's files under `data/<folder name>/`."""
    members = [(path, f"{WHEELS}/{path.name}") for path in files]
    for folder in data:
        folder = Path(folder).resolve()
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            members.append((path, f"{DATA}/{folder.name}/{path.relative_to(folder).as_posix()}"))
    names = [name for _, name in members]
    if len(set(names)) != len(names):
        raise SystemExit("gpu_transport: two files would travel under one name (two data folders of one name?)")
    return members


def _writable(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Sources such as ../shared/data are read-only; a second install over read-only copies would fail.
    info.mode, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, "", ""
    return info


def write_parts(
    files: Iterable[Path], out: Path, part_bytes: int = PART_BYTES, data: Iterable[Path] = (), **plan: Any
) -> dict[str, Any]:
    """`files` (wheels) and the `data` folders as one tar stream cut into parts of at most `part_bytes` in `out`,
    and the manifest beside them (returned); `plan` (what was resolved, for `check_installable`) joins it."""
    out.mkdir(parents=True, exist_ok=True)
    members = _members(files, data)
    stream = out / STREAM
    with tarfile.open(stream, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, name in members:
            tar.add(path, arcname=name, recursive=False, filter=_writable)
    parts = []
    with stream.open("rb") as handle:
        for index, chunk in enumerate(iter(lambda: handle.read(part_bytes), b"")):
            name = f"part-{index:03d}"
            (out / name).write_bytes(chunk)
            parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    stream.unlink()
    listed = [{"path": name, "bytes": path.stat().st_size, "sha256": sha256(path)} for path, name in members]
    manifest = {"part_bytes": part_bytes, "parts": parts, "files": listed, **plan}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def receive(parts: Iterable[Path], there: Path) -> list[str]:
    """Keep the parts one call carried in `there`, each checked against the manifest that travelled beside it;
    that manifest is kept too. Refuses a part without its manifest, an altered part, and a second pack."""
    there.mkdir(parents=True, exist_ok=True)
    kept = []
    for part in parts:
        beside = part.with_name(MANIFEST)
        if not beside.is_file():
            raise SystemExit(f"gpu_transport: {part.name} came without {MANIFEST}: carry {beside} with every part")
        manifest = json.loads(beside.read_text())
        listed = {p["name"]: p for p in manifest["parts"]}
        if part.name not in listed:
            raise SystemExit(f"gpu_transport: {part.name} is not among the parts its {MANIFEST} lists")
        if sha256(part) != listed[part.name]["sha256"]:
            raise SystemExit(f"gpu_transport: {part.name} does not match its manifest checksum (altered on the way)")
        held = there / MANIFEST
        if held.is_file() and json.loads(held.read_text())["parts"] != manifest["parts"]:
            raise SystemExit(
                f"gpu_transport: {part.name} belongs to another pack than the parts already in {there} (their "
                f"manifests list different parts): `rm -r {there}` and receive every part of one pack"
            )
        shutil.copyfile(part, there / part.name)
        shutil.copyfile(beside, held)
        kept.append(part.name)
    return kept


def _join(parts: Path, manifest: dict[str, Any], stream: Path) -> None:
    """The parts, each checked by name, concatenated into `stream`."""
    listed = {p["name"] for p in manifest["parts"]}
    strays = sorted(p.name for p in parts.glob("part-*") if p.name not in listed)
    if strays:
        raise SystemExit(f"gpu_transport: {', '.join(strays)} in {parts} are not in its manifest: parts of two packs")
    with stream.open("wb") as joined:
        for part in manifest["parts"]:
            path = parts / part["name"]
            if not path.is_file():
                raise SystemExit(f"gpu_transport: {part['name']} is missing from {parts}: receive every part first")
            if sha256(path) != part["sha256"]:
                raise SystemExit(f"gpu_transport: {part['name']} in {parts} does not match its manifest checksum")
            with path.open("rb") as handle:
                shutil.copyfileobj(handle, joined)


def reassemble(parts: Path, into: Path) -> list[Path]:
    """The files written by `write_parts`, joined from `parts` into `into` (under their stream names), every
    checksum checked."""
    manifest = json.loads((parts / MANIFEST).read_text())
    into.mkdir(parents=True, exist_ok=True)
    stream = into / STREAM
    try:
        _join(parts, manifest, stream)
        with tarfile.open(stream, mode="r") as tar:
            tar.extractall(into, filter="data")
    finally:
        stream.unlink(missing_ok=True)
    out = []
    for listed in manifest["files"]:
        path = into / listed["path"]
        if not path.is_file() or sha256(path) != listed["sha256"]:
            raise SystemExit(f"gpu_transport: {listed['path']} does not match its manifest checksum after joining")
        out.append(path)
    return out


def place_data(joined: Path, dest: Path) -> list[Path]:
    """Copy the data folders that travelled (`joined/data/<name>/`) to `dest/<name>/`; returns those folders."""
    placed = []
    for folder in sorted((joined / DATA).glob("*")) if (joined / DATA).is_dir() else []:
        shutil.copytree(folder, dest / folder.name, dirs_exist_ok=True)
        placed.append(dest / folder.name)
    return placed
