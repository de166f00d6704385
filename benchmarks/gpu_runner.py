"""The one way a GPU check runs: what the GPU machine lacks, packed here into parts that fit one device call each,
reassembled and installed there over back-to-back calls; then `python -m benchmarks.gpu_check` runs there.

    python -m benchmarks.gpu_runner pack [--data PATH]...  # here: wheels + data folders -> .gpu_parts/
    python -m benchmarks.gpu_runner plan                   # here: pip's resolver for 3.12 against the parts alone
    python -m benchmarks.gpu_runner receive .gpu_parts/part-NNN  # there, one call per part (+ manifest.json)
    python -m benchmarks.gpu_runner install [--site /tmp/site] [--dest .]  # there, after the last part

The GPU image (benchmarks/gpu_image_packages.txt: `name==version`, or a bare name where the version is unknown,
taken as present and fine) has Python 3.12 and no registry. `pack` takes `[project].dependencies` from
pyproject.toml, keeps what the image has at a version the project accepts, and packs the rest: the missing ones
and those the image has too old (transformers). torch is never packed: the image's CUDA build stays, and a
minimum it misses is printed as a warning. How the wheels are found (pip refuses sdists with --platform):

1. pip resolves the set here, for this Python, sdists allowed (`--prefer-binary`), the image's packages pinned
   to stand-ins: empty wheels named `NAME-VERSION+image`, metadata only, never packed. Nothing pulls torch.
   (Markers are read for this Python, as pip does with --python-version too; a real 3.12's pip resolved
   the same 108 wheels from the parts, 2026-11.)
2. What resolved to an sdist only (antlr4-python3-runtime 4.9.3, hydra-core's need) is built here with
   `pip wheel --no-deps`; it must give a pure-Python wheel (py3-none-any), which installs on 3.12 too.
3. The rest is downloaded at the same versions for cp312/manylinux (`--only-binary=:all: --no-deps`); Ray
   without `ray/jars`, the 30 MB only Java workers load.
4. `check_installable`: pip's resolver for 3.12/manylinux against the wheelhouse and the stand-ins alone
   (`--dry-run --no-index`) must resolve the packed requirements, before any part is written.

The wheels and the data folders (`--data`, by default those of .bench_gpu/ and ../shared/data/ag_news/ that
exist) become one stream in parts of at most 50 MiB (benchmarks/gpu_transport.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from benchmarks.gpu_transport import MANIFEST, PART_BYTES, WHEELS, place_data, reassemble, receive, write_parts
from benchmarks.gpu_transport import without_java as without_java

# benchmarks.common's paths, not imported: it needs pydantic and numpy, and `receive`/`install` run on the bare image.
REPO_ROOT = Path(__file__).resolve().parents[1]
AG_NEWS = REPO_ROOT.parent / "shared" / "data" / "ag_news"
PARTS = REPO_ROOT / ".gpu_parts"  # ignored by git; carried one part (and the manifest) per call
THERE = Path("/tmp/gpu_parts")
IMAGE_LIST = Path(__file__).with_name("gpu_image_packages.txt")
PYTHON_THERE = "3.12"
# The image runs Ubuntu 24.04 (glibc 2.39); pip matches manylinux_2_N exactly, so each N is named.
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
NEVER_PACKED = {"torch"}  # the image's CUDA torch stays; the project's minimum is for its CPU build
STAND_IN = "image"  # the local version label of the stand-ins: torch-2.11.0+image-py3-none-any.whl
DEFAULT_DATA = [REPO_ROOT / ".bench_gpu", AG_NEWS]


def image_packages(listing: Path = IMAGE_LIST) -> dict[str, str | None]:
    """The image's packages, canonical name -> version (None where the list gives none: present, assumed fine)."""
    image: dict[str, str | None] = {}
    for line in listing.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            pins = [s.version for s in req.specifier if s.operator == "=="]
            image[canonicalize_name(req.name)] = pins[0] if pins else None
    return image


def wanted(image: dict[str, str | None], pyproject: Path = REPO_ROOT / "pyproject.toml") -> tuple[list[str], list[str]]:
    """The project's dependencies the image lacks or has below the project's range (to pack), and warning lines."""
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    packed, warnings = [], []
    for line in dependencies:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        have = image.get(name)
        fits = have is not None and req.specifier.contains(have, prereleases=True)
        if name in NEVER_PACKED:
            if not fits:
                warnings.append(f"{name}: the image has {have or 'an unknown version'}, the project asks {line}; "
                                "the image's CUDA build is kept, not packed")  # fmt: skip
        elif name not in image:
            packed.append(str(req))
        elif have is not None and not fits:
            packed.append(str(req))
            warnings.append(f"{name}: the image has {have}, the project asks {line}: packed")
    return packed, warnings


def stand_ins(image: dict[str, str], folder: Path) -> Path:
    """An empty wheel per image package (`NAME-VERSION+image-py3-none-any.whl`, metadata only, no needs) in
    `folder`, and a constraints file pinning each: how pip learns here what the image already holds."""
    folder.mkdir(parents=True, exist_ok=True)
    pins = []
    for name, version in sorted(image.items()):
        local = f"{version}+{STAND_IN}"
        dist = f"{re.sub(r'[-_.]+', '_', name)}-{local}"
        info = {
            f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {local}\n"
            f"Summary: stand-in for the GPU image's {name} {version}; never packed or installed\n",
            f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: gpu_runner\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        }
        with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
            for path, text in info.items():
                wheel.writestr(path, text)
            wheel.writestr(f"{dist}.dist-info/RECORD", "".join(f"{p},,\n" for p in [*info, f"{dist}.dist-info/RECORD"]))
        pins.append(f"{name}=={local}\n")
    constraints = folder / "constraints.txt"
    constraints.write_text("".join(pins))
    return constraints


def pip(*args: str, offline: bool = False) -> subprocess.CompletedProcess[str]:
    """`python -m pip ARGS`, failing with pip's own last lines. Offline runs ignore this machine's pip settings
    (its find-links, indexes, constraints), so that they see the wheelhouse alone."""
    env = dict(os.environ)
    if offline:
        env = {k: v for k, v in env.items() if not k.startswith("PIP_")} | {"PIP_CONFIG_FILE": os.devnull}
    done = subprocess.run([sys.executable, "-m", "pip", *args], env=env, capture_output=True, text=True)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-25:])
        raise SystemExit(f"gpu_runner: pip {args[0]} failed:\n{tail}")
    return done


def _target(python_version: str, platforms: Sequence[str]) -> list[str]:
    return ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            *[arg for p in platforms for arg in ("--platform", p)]]  # fmt: skip


def resolve(requirements: Sequence[str], image: dict[str, str], work: Path) -> list[dict[str, Any]]:
    """Step 1: pip's resolution here (this Python, sdists allowed, the image as stand-ins): the report's items."""
    constraints = stand_ins(image, work / "stand-ins")
    report = work / "resolved.json"
    pip("install", "--dry-run", "--ignore-installed", "--quiet", "--prefer-binary", "--report", str(report),
        "--find-links", str(work / "stand-ins"), "-c", str(constraints), *requirements)  # fmt: skip
    return json.loads(report.read_text())["install"]


def build_pure(name: str, version: str, wheelhouse: Path) -> Path:
    """Step 2: the wheel of a dependency that has only an sdist, built here; refused unless pure Python."""
    with tempfile.TemporaryDirectory() as tmp:
        pip("wheel", "--quiet", "--no-deps", "--no-binary", name, "-w", tmp, f"{name}=={version}")
        (built,) = Path(tmp).glob("*.whl")
        if any(tag.abi != "none" or tag.platform != "any" for tag in parse_wheel_filename(built.name)[3]):
            raise SystemExit(f"gpu_runner: {name} {version} has no wheel for the GPU machine and builds a "
                             f"platform wheel here ({built.name}): it cannot be carried")  # fmt: skip
        return Path(shutil.move(built, wheelhouse / built.name))


def gather(
    requirements: Sequence[str],
    image: dict[str, str | None],
    wheelhouse: Path,
    python_version: str = PYTHON_THERE,
    platforms: Sequence[str] = PLATFORMS,
) -> dict[str, Any]:
    """Steps 1-3: the wheels of `requirements` and their needs, less what the image has, for `python_version`
    on `platforms`, into `wheelhouse`. Returns the plan: requirements, the image versions taken, what was built."""
    wheelhouse.mkdir(parents=True, exist_ok=True)
    own = {canonicalize_name(Requirement(r).name) for r in requirements}
    known = {n: v for n, v in image.items() if v is not None and n not in own}
    plan: dict[str, Any] = {"python": python_version, "platforms": list(platforms),
                            "requirements": list(requirements), "image": {}, "assumed": [], "built": []}  # fmt: skip
    pins = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in resolve(requirements, known, Path(tmp)):
            name, version = canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"]
            if name in known:
                plan["image"][name] = known[name]
            elif name in image and name not in own:  # in the image at an unknown version: assumed fine
                plan["image"][name] = version
                plan["assumed"].append(name)
            elif not item["download_info"]["url"].endswith(".whl"):
                build_pure(name, version, wheelhouse)
                plan["built"].append(f"{name}=={version}")
            else:
                pins.append(f"{name}=={version}")
    if pins:  # the versions resolved here, as the GPU machine's wheels; no resolution, so no backtracking
        pip("download", "--quiet", "--no-deps", *_target(python_version, platforms), "-d", str(wheelhouse), *pins)
    return plan


def check_installable(
    wheelhouse: Path,
    requirements: Sequence[str],
    image: dict[str, str],
    python_version: str = PYTHON_THERE,
    platforms: Sequence[str] = PLATFORMS,
) -> dict[str, str]:
    """Step 4: pip's resolver for `python_version`/`platforms` against `wheelhouse` and the image's stand-ins
    alone (no index, this machine's pip settings ignored), as a dry run. Returns name -> version resolved (the
    stand-ins with `+image`); raises SystemExit with pip's reason where the wheelhouse does not suffice."""
    with tempfile.TemporaryDirectory() as tmp:
        constraints = stand_ins(image, Path(tmp) / "stand-ins")
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--quiet", "--no-index", "--find-links", str(wheelhouse), "--find-links",
            str(Path(tmp) / "stand-ins"), "-c", str(constraints), *_target(python_version, platforms),
            "--target", str(Path(tmp) / "target"), "--report", str(report), *requirements, offline=True)  # fmt: skip
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in items}


def host_platforms() -> list[str]:
    """This machine's platform tags, most specific first (to gather wheels that install here)."""
    return list(dict.fromkeys(tag.platform for tag in sys_tags() if tag.platform != "any"))


def pack(
    out: Path,
    requirements: Sequence[str] | None = None,
    image: dict[str, str | None] | None = None,
    data: Iterable[Path] = (),
    part_bytes: int = PART_BYTES,
    python_version: str = PYTHON_THERE,
    platforms: Sequence[str] = PLATFORMS,
) -> dict[str, Any]:
    """Gather the wheels the GPU machine lacks (the project's needs by default), check that pip resolves them
    there, and write them with the `data` folders as parts and a manifest to `out` (replaced)."""
    image = image_packages() if image is None else image
    warnings: list[str] = []
    if requirements is None:
        requirements, warnings = wanted(image)
    with tempfile.TemporaryDirectory() as tmp:
        wheelhouse = Path(tmp) / "wheels"
        plan = gather(requirements, image, wheelhouse, python_version, platforms)
        check_installable(wheelhouse, requirements, plan["image"], python_version, platforms)
        (Path(tmp) / "slim").mkdir()
        wheels = [without_java(w, Path(tmp) / "slim") if w.name.startswith("ray-") else w
                  for w in sorted(wheelhouse.glob("*.whl"))]  # fmt: skip
        shutil.rmtree(out, ignore_errors=True)
        return write_parts(wheels, out, part_bytes, data=data, warnings=warnings, **plan)


def plan_check(parts: Path = PARTS) -> dict[str, str]:
    """`check_installable` on the wheels the parts in `parts` hold, with the plan their manifest records."""
    manifest = json.loads((parts / MANIFEST).read_text())
    with tempfile.TemporaryDirectory() as tmp:
        reassemble(parts, Path(tmp))
        return check_installable(
            Path(tmp) / WHEELS, manifest["requirements"], manifest["image"], manifest["python"], manifest["platforms"]
        )


def install(parts: Path = THERE, site: Path = Path("/tmp/site"), dest: Path = Path(".")) -> list[Path]:
    """There: join and check the parts, install their wheels into `site` and copy the data folders to `dest`."""
    joined = parts / "joined"
    shutil.rmtree(joined, ignore_errors=True)
    files = reassemble(parts, joined)
    wheels = [str(path) for path in files if path.parent == joined / WHEELS]
    if wheels:
        pip(
            "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--upgrade", "--target", str(site), *wheels
        )
    return place_data(joined, dest)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (see the module's docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    packer = sub.add_parser("pack", help="here: the wheels the GPU machine lacks and data folders, as .gpu_parts/")
    packer.add_argument("--data", action="append", type=Path, help="a folder to carry (repeatable)")
    sub.add_parser("plan", help="here: check that pip resolves the packed requirements for 3.12 from the parts")
    receiver = sub.add_parser("receive", help="there: keep the parts this call carried (and their manifest)")
    receiver.add_argument("parts", nargs="+", type=Path)
    installer = sub.add_parser("install", help="there: join the parts, check them, pip install into --site")
    installer.add_argument("--site", type=Path, default=Path("/tmp/site"))
    installer.add_argument("--dest", type=Path, default=Path("."), help="where the data folders go")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        data = args.data if args.data is not None else [d for d in DEFAULT_DATA if d.is_dir()]
        manifest = pack(PARTS, data=data)
        for line in manifest["warnings"]:
            print(f"warning: {line}")
        total = sum(p["bytes"] for p in manifest["parts"]) / 2**20
        print(f"{len(manifest['files'])} files ({total:.1f} MiB) in {len(manifest['parts'])} parts under {PARTS}")
    elif args.verb == "plan":
        print(f"pip resolves {len(plan_check())} distributions for Python {PYTHON_THERE} from the parts")
    elif args.verb == "receive":
        print(f"kept {', '.join(receive(args.parts, THERE))} and {MANIFEST} in {THERE}")
    else:
        placed = install(THERE, args.site, args.dest)
        for line in json.loads((THERE / MANIFEST).read_text()).get("warnings", []):
            print(f"warning: {line}")
        print(f"installed into {args.site}; data: {', '.join(map(str, placed)) or 'none'}")
        print(f"next: export PYTHONPATH={args.site}; python -m benchmarks.gpu_check")


if __name__ == "__main__":
    main()
