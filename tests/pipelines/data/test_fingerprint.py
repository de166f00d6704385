"""The source fingerprint: what changes it (an edited, added or removed file) and what does not (a touch, a copy
of the same bytes), checked against MD5s computed here with hashlib."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pipelines.data.fingerprint import HASH_STATE, file_hashes, fingerprint, local_model_folder, resolve_source


def test_a_folder_is_hashed_file_by_file_and_an_edit_changes_only_that_file(tmp_path: Path):
    (tmp_path / ".dvc").mkdir()
    folder = tmp_path / "mydata"
    folder.mkdir()
    (folder / "train.csv").write_text("text,label\na,b\n")
    (folder / "test.csv").write_text("text,label\nc,d\n")
    first = fingerprint(resolve_source("mydata", tmp_path), None, tmp_path)
    assert first["kind"] == "folder"
    assert first["files"]["train.csv"] == {"md5": hashlib.md5(b"text,label\na,b\n").hexdigest(), "size": 15}
    os.utime(folder / "train.csv", ns=(1, 1))  # touched, same bytes: the same fingerprint (the MD5 is re-read)
    assert fingerprint(resolve_source("mydata", tmp_path), None, tmp_path) == first
    (folder / "train.csv").write_text("text,label\na,B\n")
    edited = fingerprint(resolve_source("mydata", tmp_path), None, tmp_path)
    assert edited["files"]["train.csv"]["md5"] == hashlib.md5(b"text,label\na,B\n").hexdigest()
    assert edited["files"]["test.csv"] == first["files"]["test.csv"]
    (folder / "valid.csv").write_text("text,label\ne,f\n")  # a new split file is new data
    assert set(fingerprint(resolve_source("mydata", tmp_path), None, tmp_path)["files"]) == {
        "train.csv", "test.csv", "valid.csv"}  # fmt: skip
    assert (tmp_path / HASH_STATE).is_file()


def test_the_generator_and_a_hub_id_are_named_not_hashed(tmp_path: Path, capsys):
    assert fingerprint(resolve_source("generator", tmp_path), None, tmp_path) == {
        "source": "generator", "kind": "generator"}  # fmt: skip
    pinned = fingerprint(resolve_source("someone/news", tmp_path), "0123abc", tmp_path)
    assert pinned == {"source": "someone/news", "kind": "hub", "revision": "0123abc"}
    assert "warning" not in capsys.readouterr().err
    fingerprint(resolve_source("someone/news", tmp_path), None, tmp_path)
    assert "no data.revision: DVC cannot see when it changes on the hub" in capsys.readouterr().err


def test_a_local_model_folder_is_hashed_and_a_hub_id_is_not(tmp_path: Path):
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "model.safetensors").write_bytes(b"\0" * 10)
    folder = local_model_folder("my-model", tmp_path)
    assert folder is not None and file_hashes(folder, tmp_path)["model.safetensors"]["size"] == 10
    assert local_model_folder("someone/model", tmp_path) is None and local_model_folder(None, tmp_path) is None
