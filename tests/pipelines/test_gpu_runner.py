"""The GPU runner's packing step: parts within the limit, a manifest of checksums, and reassembly equal to the input;
Ray's Java jars left out of its wheel."""

from __future__ import annotations

import os
import zipfile

import pytest

from benchmarks.gpu_runner import MANIFEST, reassemble, without_java, write_parts


def test_parts_stay_within_the_limit_and_reassemble_to_the_input(tmp_path):
    files = []
    for name, size in (("a-1.0-py3-none-any.whl", 2500), ("b-2.0-py3-none-any.whl", 7000), ("c.whl", 10)):
        path = tmp_path / "in" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
        files.append(path)
    manifest = write_parts(files, tmp_path / "parts", part_bytes=4096)
    assert len(manifest["parts"]) >= 3
    assert all((tmp_path / "parts" / p["name"]).stat().st_size <= 4096 for p in manifest["parts"])
    assert [f["name"] for f in manifest["files"]] == [f.name for f in files]
    joined = reassemble(tmp_path / "parts", tmp_path / "out")
    assert [p.read_bytes() for p in joined] == [f.read_bytes() for f in files]


def test_a_missing_or_altered_part_is_refused_by_name(tmp_path):
    source = tmp_path / "w.whl"
    source.write_bytes(os.urandom(9000))
    write_parts([source], tmp_path / "parts", part_bytes=4096)
    (tmp_path / "parts" / "part-001").write_bytes(b"x" * 4096)
    with pytest.raises(SystemExit, match="part-001 .* does not match its manifest checksum"):
        reassemble(tmp_path / "parts", tmp_path / "out")
    (tmp_path / "parts" / "part-001").unlink()
    with pytest.raises(SystemExit, match="part-001 is missing"):
        reassemble(tmp_path / "parts", tmp_path / "out")
    assert (tmp_path / "parts" / MANIFEST).is_file()


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
