"""A trial's test scoring is reused by the evaluate stage only while the model, the test split and the code are
what it scored (pipelines/scored.py): each change below must make the stage score again."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import pipelines.scored as scored
from pipelines.scored import PREDICTIONS, RECORD, Scoring, reusable_scoring, save_scoring, scoring_key

PLOTS = {"confusion": [{"actual": "Économie", "predicted": "Fun 😀"}]}
SCORING = Scoring({"test_accuracy": 0.75}, "row_id,label,predicted\n0,Économie,Fun 😀\n", PLOTS, "test_accuracy",
                  "cpu, fp32")  # fmt: skip


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    model, test = tmp_path / "best", tmp_path / "tokenized" / "test"
    for folder, files in ((model, ("model.safetensors", "config.json", "labels.json", "README.md", "history.json")),
                          (test, ("input_ids.npy", "labels.npy"))):  # fmt: skip
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_bytes(name.encode() * 100)
    (model / "base").mkdir()  # an adapter's base saved beside it is part of the model
    (model / "base" / "model.safetensors").write_bytes(b"base" * 100)
    save_scoring(model, test, SCORING)
    return model, test


def test_an_unchanged_model_and_split_give_back_what_the_trial_scored(folders):
    model, test = folders
    assert reusable_scoring(model, test) == SCORING
    key = scoring_key(model, test)  # MD5s as hashlib computes them, the non-model files left out
    assert key["model"]["config.json"] == hashlib.md5(b"config.json" * 100).hexdigest()
    assert sorted(key["model"]) == ["base/model.safetensors", "config.json", "labels.json", "model.safetensors"]
    assert sorted(key["test"]) == ["input_ids.npy", "labels.npy"]


@pytest.mark.parametrize("changed", ["model.safetensors", "labels.json", "base/model.safetensors", "test:labels.npy",
                                     "test:new.npy"])  # fmt: skip
def test_a_changed_model_or_test_split_is_scored_again(folders, changed):
    model, test = folders
    folder, name = (test, changed[5:]) if changed.startswith("test:") else (model, changed)
    (folder / name).write_bytes(b"x")  # one file edited, or one added
    assert reusable_scoring(model, test) is None


def test_the_card_and_history_rewritten_after_scoring_do_not_count(folders):
    model, test = folders
    (model / "README.md").write_text("the card, rewritten when the folder moved")
    (model / "history.json").write_text("[]")
    assert reusable_scoring(model, test) == SCORING


def test_changed_code_is_scored_again(folders, tmp_path, monkeypatch):
    model, test = folders
    package = tmp_path / "package"
    shutil.copytree(scored.PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(scored, "PACKAGE", package)
    save_scoring(model, test, SCORING)
    assert reusable_scoring(model, test) == SCORING
    (package / "pipelines_extra.pyc").write_bytes(b"compiled files are not the code")
    assert reusable_scoring(model, test) == SCORING
    scoring_code = package / "tasks" / "classification_scoring.py"
    scoring_code.write_text(scoring_code.read_text() + "\n# changed\n")
    assert reusable_scoring(model, test) is None


@pytest.mark.parametrize("damage", ["no record", "no predictions", "not json"])
def test_a_missing_or_unreadable_record_is_scored_again(folders, damage):
    model, test = folders
    if damage == "not json":
        (model / RECORD).write_text("{")
    else:
        (model / (RECORD if damage == "no record" else PREDICTIONS)).unlink()
    assert reusable_scoring(model, test) is None
