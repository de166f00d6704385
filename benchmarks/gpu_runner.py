"""The one way a GPU check runs: what the GPU machine lacks, packed here into parts that fit one device call each,
reassembled and installed there over back-to-back calls, then the mission's own commands on the project copy.

    python -m benchmarks.gpu_runner pack                  # here: wheels the GPU machine lacks -> .gpu_parts/
    python -m benchmarks.gpu_runner receive PART...       # there, one call per part: parts -> /tmp/gpu_parts
    python -m benchmarks.gpu_runner install               # there, after the last part: checked, joined, installed
    python -m benchmarks.gpu_runner mission               # there: dvc repro, dvc exp run, the BERT-base grid

A device call carries at most 64 MiB (the project copy included), and files under /tmp there survive between
back-to-back calls while the machine stays warm (30 s idle). So `pack` downloads the wheels the README's install
would bring and the GPU image lacks (mlflow, ray, dvc, pydantic and their own needs; Ray without `ray/jars`, the
30.7 MB that only Java workers use), writes them as one stream cut into parts of at most 60 MiB, and a manifest
with the checksum of every part and every wheel. `install` refuses a missing or altered part by name, and a wheel
whose checksum differs after joining.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT

PART_BYTES = 60 * 2**20
PARTS = REPO_ROOT / ".gpu_parts"  # ignored by git; carried one part per call
THERE = Path("/tmp/gpu_parts")
MANIFEST = "manifest.json"
# What the README's install brings that the GPU image ('cuda', 2026-11-17: KINDS.md's package list) lacks; their
# own needs that the image lacks are resolved by pip here (`pack`), against the image's list below.
MISSING = ["mlflow", "ray[tune]", "dvc", "pydantic", "datasets", "gguf", "lion-pytorch"]
PYTHON_THERE = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def sha256(path: Path) -> str:
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


def write_parts(files: Iterable[Path], out: Path, part_bytes: int = PART_BYTES) -> dict[str, Any]:
    """`files` as one tar stream cut into parts of at most `part_bytes`, and the manifest (written to `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    listed = [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256(f)} for f in files]
    stream = io.BytesIO()
    with tarfile.open(fileobj=stream, mode="w") as tar:
        for path in files:
            tar.add(path, arcname=path.name)
    data, parts = stream.getvalue(), []
    for index, start in enumerate(range(0, len(data), part_bytes)):
        chunk = data[start : start + part_bytes]
        name = f"part-{index:03d}"
        (out / name).write_bytes(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    manifest = {"part_bytes": part_bytes, "parts": parts, "files": listed}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def reassemble(parts: Path, into: Path) -> list[Path]:
    """The files written by `write_parts`, joined from `parts` into `into`, every checksum checked."""
    manifest = json.loads((parts / MANIFEST).read_text())
    joined = io.BytesIO()
    for part in manifest["parts"]:
        path = parts / part["name"]
        if not path.is_file():
            raise SystemExit(f"gpu_runner: {part['name']} is missing from {parts}: receive every part first")
        if sha256(path) != part["sha256"]:
            raise SystemExit(f"gpu_runner: {part['name']} in {parts} does not match its manifest checksum")
        joined.write(path.read_bytes())
    joined.seek(0)
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=joined, mode="r") as tar:
        tar.extractall(into, filter="data")
    out = []
    for listed in manifest["files"]:
        path = into / listed["name"]
        if sha256(path) != listed["sha256"]:
            raise SystemExit(f"gpu_runner: {listed['name']} does not match its manifest checksum after joining")
        out.append(path)
    return out


def download(folder: Path) -> list[Path]:
    """The wheels of MISSING and their needs, for the GPU machine's Python and platform (pip resolves them here)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--python-version", PYTHON_THERE,
               "--implementation", "cp", *platforms, "-d", str(folder), *MISSING]  # fmt: skip
    subprocess.run(command, check=True)
    return sorted(folder.glob("*.whl"))


def pack(out: Path) -> dict[str, Any]:
    """Download, drop what the image has and Ray's jars, and write the parts and manifest to `out`."""
    listed = Path(__file__).with_name("gpu_image_packages.txt").read_text().splitlines()
    image = {line.strip() for line in listed if line.strip() and not line.startswith("#")}
    with tempfile.TemporaryDirectory() as tmp:
        wheels, kept = download(Path(tmp) / "dl"), []
        (Path(tmp) / "slim").mkdir()
        for wheel in wheels:
            name = wheel.name.split("-")[0].lower().replace("_", "-")
            if name in image:
                continue
            kept.append(without_java(wheel, Path(tmp) / "slim") if name == "ray" else wheel)
        shutil.rmtree(out, ignore_errors=True)
        return write_parts(kept, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("pack", help="here: the wheels the GPU machine lacks, as parts in .gpu_parts/")
    receive = sub.add_parser("receive", help="there: keep the parts this call carried under /tmp/gpu_parts")
    receive.add_argument("parts", nargs="+", type=Path)
    sub.add_parser("install", help="there: join the parts, check them, pip install into /tmp/site")
    args = parser.parse_args()
    if args.verb == "pack":
        manifest = pack(PARTS)
        print(f"{len(manifest['files'])} wheels in {len(manifest['parts'])} parts under {PARTS}")
    elif args.verb == "receive":
        THERE.mkdir(parents=True, exist_ok=True)
        for part in args.parts:
            shutil.copyfile(part, THERE / part.name)
    else:
        wheels = reassemble(THERE, THERE / "wheels")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        "/tmp/site", *map(str, wheels)], check=True)  # fmt: skip
        print(f"installed {len(wheels)} wheels into /tmp/site: export PYTHONPATH=/tmp/site")


if __name__ == "__main__":
    main()
