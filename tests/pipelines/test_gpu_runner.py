"""The GPU runner's transport, tested for real here: parts within the limit, the manifest travelling with every
part, a part altered on the way or a second pack refused by name, data folders round-tripping; and, with real pip
against PyPI (the `slow` tests), a source-only need (antlr4-python3-runtime, hydra-core's) built into a wheel, the
project's whole set resolved for the GPU machine's Python 3.12 from the parts alone, and pydantic + dvc gathered
the same way for this machine's Python, installed from the parts and imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.gpu_runner import (
    NEVER_PACKED,
    REPO_ROOT,
    check_installable,
    host_platforms,
    image_packages,
    install,
    pack,
    plan_check,
    wanted,
)
from benchmarks.gpu_transport import MANIFEST, PART_BYTES, reassemble, receive, without_java, write_parts


def _files(folder: Path, sizes: dict[str, int]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in sizes.items():
        (folder / name).write_bytes(os.urandom(size))
    return [folder / name for name in sizes]


def _carry(parts: Path, name: str, call: Path) -> Path:
    """What one device call brings: one part and the manifest, in a folder of its own."""
    call.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(parts / MANIFEST, call / MANIFEST)
    return Path(shutil.copyfile(parts / name, call / name))


def test_parts_stay_within_the_limit_and_reassemble_to_the_input_with_the_data(tmp_path):
    files = _files(tmp_path / "in", {"a-1.0-py3-none-any.whl": 2500, "b-2.0-py3-none-any.whl": 7000, "c.whl": 10})
    data = tmp_path / "ag_news"
    _files(data / "sub", {"test.csv": 3000})
    manifest = write_parts(files, tmp_path / "parts", part_bytes=4096, data=[data], python="3.12")
    assert PART_BYTES == 50 * 2**20 and manifest["python"] == "3.12"
    assert len(manifest["parts"]) >= 4
    assert all((tmp_path / "parts" / p["name"]).stat().st_size <= 4096 for p in manifest["parts"])
    assert [f["path"] for f in manifest["files"]] == [f"wheels/{f.name}" for f in files] + ["data/ag_news/sub/test.csv"]
    joined = reassemble(tmp_path / "parts", tmp_path / "out")
    assert [p.read_bytes() for p in joined] == [f.read_bytes() for f in [*files, data / "sub" / "test.csv"]]


def test_every_part_travels_with_the_manifest_and_install_places_the_data(tmp_path):
    data = tmp_path / ".bench_gpu"
    _files(data, {"train.bin": 6000})
    write_parts([], tmp_path / "parts", part_bytes=4096, data=[data])
    there = tmp_path / "there"
    names = sorted(p.name for p in (tmp_path / "parts").glob("part-*"))
    for index, name in enumerate(names):
        assert receive([_carry(tmp_path / "parts", name, tmp_path / f"call{index}")], there) == [name]
        assert (there / MANIFEST).read_bytes() == (tmp_path / "parts" / MANIFEST).read_bytes()
    placed = install(there, tmp_path / "site", tmp_path / "project")
    assert placed == [tmp_path / "project" / ".bench_gpu"]
    assert (tmp_path / "project" / ".bench_gpu" / "train.bin").read_bytes() == (data / "train.bin").read_bytes()


def test_a_part_without_its_manifest_altered_or_from_another_pack_is_refused_by_name(tmp_path):
    write_parts(_files(tmp_path / "in", {"w.whl": 9000}), tmp_path / "parts", part_bytes=4096)
    lone = tmp_path / "lone" / "part-000"
    lone.parent.mkdir()
    shutil.copyfile(tmp_path / "parts" / "part-000", lone)
    with pytest.raises(SystemExit, match="part-000 came without manifest.json"):
        receive([lone], tmp_path / "there")
    altered = _carry(tmp_path / "parts", "part-001", tmp_path / "call1")
    altered.write_bytes(b"x" * 4096)
    with pytest.raises(SystemExit, match="part-001 does not match its manifest checksum"):
        receive([altered], tmp_path / "there")
    receive([_carry(tmp_path / "parts", "part-000", tmp_path / "call0")], tmp_path / "there")
    write_parts(_files(tmp_path / "in2", {"v.whl": 9000}), tmp_path / "other", part_bytes=4096)
    with pytest.raises(SystemExit, match="part-001 belongs to another pack"):
        receive([_carry(tmp_path / "other", "part-001", tmp_path / "call2")], tmp_path / "there")


def test_install_refuses_a_missing_altered_or_unlisted_part_by_name(tmp_path):
    write_parts(_files(tmp_path / "in", {"w.whl": 9000}), tmp_path / "parts", part_bytes=4096)
    (tmp_path / "parts" / "part-001").write_bytes(b"x" * 4096)
    with pytest.raises(SystemExit, match="part-001 .* does not match its manifest checksum"):
        reassemble(tmp_path / "parts", tmp_path / "out")
    (tmp_path / "parts" / "part-001").unlink()
    with pytest.raises(SystemExit, match="part-001 is missing"):
        reassemble(tmp_path / "parts", tmp_path / "out")
    (tmp_path / "parts" / "part-009").write_bytes(b"x")
    with pytest.raises(SystemExit, match="part-009 in .* not in its manifest"):
        reassemble(tmp_path / "parts", tmp_path / "out")


def test_rays_wheel_travels_without_its_java_jars(tmp_path):
    wheel = tmp_path / "in" / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    wheel.parent.mkdir()
    record = "ray/__init__.py,sha256=x,1\nray/jars/ray_dist.jar,sha256=y,2\nray-2.60.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("ray/__init__.py", "")
        z.writestr("ray/jars/ray_dist.jar", b"\0" * 1000)
        z.writestr("ray-2.60.0.dist-info/RECORD", record)
    (tmp_path / "out").mkdir()
    slim = without_java(wheel, tmp_path / "out")
    with zipfile.ZipFile(slim) as z:
        assert sorted(z.namelist()) == ["ray-2.60.0.dist-info/RECORD", "ray/__init__.py"]
        assert "jars" not in z.read("ray-2.60.0.dist-info/RECORD").decode()


def test_the_runner_needs_only_the_standard_library_and_packaging():
    # receive and install run on the bare image, before anything is installed: no pydantic, numpy or pipelines.
    code = "import sys, benchmarks.gpu_runner; print(sorted(m.split('.')[0] for m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    assert not {"pydantic", "numpy", "pipelines", "yaml", "mlflow", "ray", "dvc"} & set(eval(done.stdout))


def test_the_image_below_the_projects_minimum_is_packed_and_torch_only_warned():
    image = image_packages()
    assert image["torch"] == "2.11.0" and image["transformers"] == "5.17.0" and image["peft"] is None
    packed, warnings = wanted(image)
    names = [line.split(">")[0].split("<")[0] for line in packed]
    assert {"transformers", "mlflow", "ray[tune]", "dvc", "pydantic", "datasets"} <= set(names)
    assert not {"torch", "numpy", "peft", "tokenizers", "safetensors"} & set(names)
    assert any(w.startswith("torch: the image has 2.11.0") for w in warnings)
    assert any(w.startswith("transformers: the image has 5.17.0") for w in warnings)


@pytest.fixture(scope="module")
def hydra_parts(tmp_path_factory) -> Path:
    """hydra-core packed for the GPU machine (3.12, manylinux) with a data folder: needs the sdist-only antlr4."""
    out = tmp_path_factory.mktemp("hydra")
    _files(out / "ag_news", {"test.csv": 5000})
    pack(out / "parts", ["hydra-core>=1.3"], image_packages(), data=[out / "ag_news"])
    return out


@pytest.mark.slow
def test_a_source_only_need_travels_as_a_wheel_built_here(hydra_parts, tmp_path):
    manifest = json.loads((hydra_parts / "parts" / MANIFEST).read_text())
    assert manifest["built"] == ["antlr4-python3-runtime==4.9.3"]
    wheels = {Path(f["path"]).name for f in manifest["files"] if f["path"].startswith("wheels/")}
    assert "antlr4_python3_runtime-4.9.3-py3-none-any.whl" in wheels
    assert any(w.startswith("hydra_core-1.3.") for w in wheels)  # not hydra-core 0.11, which needs no antlr4
    assert not {"packaging", "pyyaml"} & {w.split("-")[0].lower() for w in wheels}  # the image has them
    resolved = plan_check(hydra_parts / "parts")
    assert resolved["antlr4-python3-runtime"] == "4.9.3" and resolved["pyyaml"].endswith("+image")
    reassemble(hydra_parts / "parts", tmp_path)
    (tmp_path / "wheels" / "antlr4_python3_runtime-4.9.3-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match="antlr4-python3-runtime"):  # what pip says without the built wheel
        check_installable(tmp_path / "wheels", ["hydra-core>=1.3"], manifest["image"])


@pytest.mark.slow
def test_the_hydra_parts_install_here_with_their_data(hydra_parts, tmp_path):
    for name in sorted(p.name for p in (hydra_parts / "parts").glob("part-*")):
        receive([_carry(hydra_parts / "parts", name, tmp_path / name)], tmp_path / "there")
    placed = install(tmp_path / "there", tmp_path / "site", tmp_path / "project")
    assert (placed[0] / "test.csv").read_bytes() == (hydra_parts / "ag_news" / "test.csv").read_bytes()
    code = "import hydra, antlr4; print(hydra.__file__, antlr4.__file__)"  # pure wheels: they install on 3.11 too
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.count(str(tmp_path / "site")) == 2


@pytest.mark.slow
def test_the_projects_whole_set_resolves_for_the_gpu_machine_from_the_parts_alone(tmp_path):
    manifest = pack(tmp_path / "parts")
    assert 2 <= len(manifest["parts"]) and all(p["bytes"] <= PART_BYTES for p in manifest["parts"])
    wheels = {Path(f["path"]).name.split("-")[0].lower() for f in manifest["files"]}
    assert {"mlflow", "ray", "dvc", "pydantic", "transformers", "antlr4_python3_runtime"} <= wheels
    assert not (NEVER_PACKED | {"numpy", "pyarrow", "tokenizers"}) & wheels
    assert not any(w.startswith(("nvidia", "triton")) for w in wheels)  # nothing pulled torch's CUDA stack
    resolved = plan_check(tmp_path / "parts")
    assert resolved["torch"] == "2.11.0+image" and resolved["transformers"].startswith("5.")
    assert not resolved["transformers"].endswith("+image")
    assert {"mlflow", "ray", "dvc", "pydantic", "datasets"} <= set(resolved)


@pytest.mark.slow
def test_pydantic_and_dvc_gathered_the_same_way_install_and_import_on_this_python(tmp_path):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    pack(tmp_path / "parts", ["pydantic>=2.7", "dvc>=3.50"], {}, python_version=version, platforms=host_platforms())
    for name in sorted(p.name for p in (tmp_path / "parts").glob("part-*")):
        receive([_carry(tmp_path / "parts", name, tmp_path / name)], tmp_path / "there")
    install(tmp_path / "there", tmp_path / "site", tmp_path / "project")
    # -S: without this machine's site-packages (which has dvc), so every import comes from the installed parts.
    code = (f"import site; site.addsitedir({str(tmp_path / 'site')!r}); import dvc.repo, pydantic, hydra; "
            "from dvc.cli import main; print(dvc.repo.__file__, pydantic.__file__, hydra.__file__); "
            "main(['version'])")  # fmt: skip
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[0].count(str(tmp_path / "site")) == 3
