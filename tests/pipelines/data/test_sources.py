"""Data sources: formats, splits, and a clear error for every kind of bad data."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pipelines.data.sources import DataError, load_splits
from pipelines.data.synthetic import generate_corpus
from pipelines.tasks import get_task
from tests.conftest import tiny_params

CLASSIFICATION = get_task("classification")


def write_csv(path: Path, rows: int = 60, labels=("a", "b", "c")) -> Path:
    frame = pd.DataFrame(
        {
            "text": [f"row {i} about {labels[i % len(labels)]}" for i in range(rows)],
            "label": [labels[i % len(labels)] for i in range(rows)],
        }
    )
    frame.to_csv(path, index=False)
    return path


def test_generator_is_deterministic_and_not_trivial(default_params):
    a = generate_corpus(default_params.data.generator)
    b = generate_corpus(default_params.data.generator)
    pd.testing.assert_frame_equal(a, b)
    assert a["label"].nunique() == default_params.data.generator.num_classes
    lengths = a["text"].str.split().str.len()
    assert lengths.max() > 4 * lengths.median()  # a spread of lengths, so bucketing matters


def test_single_file_is_split_stratified_and_deterministic(tmp_path, default_params):
    params = tiny_params(default_params, **{"data.source": str(write_csv(tmp_path / "d.csv", 300))})
    splits = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [210, 30, 60]
    assert splits["test"]["label"].value_counts().nunique() == 1  # stratified: 20 of each
    again = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    pd.testing.assert_frame_equal(splits["test"], again["test"])


@pytest.mark.parametrize("suffix", ["csv", "jsonl", "parquet"])
def test_folder_with_given_splits_and_formats(tmp_path, default_params, suffix):
    frame = pd.read_csv(write_csv(tmp_path / "x.csv", 30))
    for split in ("train", "validation", "test"):
        path = tmp_path / f"{split}.{suffix}"
        {
            "csv": lambda p: frame.to_csv(p, index=False),
            "jsonl": lambda p: frame.to_json(p, orient="records", lines=True),
            "parquet": lambda p: frame.to_parquet(p),
        }[suffix](path)
    (tmp_path / "x.csv").unlink()
    params = tiny_params(default_params, **{"data.source": str(tmp_path)})
    splits = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert all(len(splits[s]) == 30 for s in splits)


def test_several_text_columns_are_kept_per_row(tmp_path, default_params):
    pd.DataFrame({"title": ["t1", "t2"] * 20, "body": ["b1", "b2"] * 20, "y": [1, 2] * 20}).to_csv(
        tmp_path / "d.csv", index=False
    )
    params = tiny_params(
        default_params, **{"data.source": "d.csv", "data.text_column": ["title", "body"], "data.label_column": "y"}
    )
    splits = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert set(splits["train"]["texts"]) == {("t1", "b1"), ("t2", "b2")}
    assert set(splits["train"]["label"]) == {"1", "2"}


def expect_error(tmp_path, default_params, match: str, **overrides) -> None:
    params = tiny_params(default_params, **overrides)
    with pytest.raises(DataError, match=match):
        load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)


def test_missing_file(tmp_path, default_params):
    expect_error(tmp_path, default_params, r"data.source = 'nope.csv': no such local file or folder",
                 **{"data.source": "nope.csv"})  # fmt: skip


def test_a_misspelled_local_folder_is_named_as_missing_before_any_hub_lookup(tmp_path, default_params):
    (tmp_path / "mydata" / "csv").mkdir(parents=True)
    # `mydata/csvv` has a hub id's shape (user/dataset), but mydata/ is here: a typo of a local path.
    expect_error(tmp_path, default_params, r"data.source = 'mydata/csvv': no such local file or folder .*holds: csv/"
                 r"\).*; did you mean 'mydata/csv'\?", **{"data.source": "mydata/csvv"})  # fmt: skip


def test_missing_columns(tmp_path, default_params):
    write_csv(tmp_path / "d.csv")
    expect_error(
        tmp_path,
        default_params,
        r"missing column\(s\) \['body'\]",
        **{"data.source": "d.csv", "data.text_column": "body"},
    )
    expect_error(
        tmp_path, default_params, r"missing column\(s\) \['y'\]", **{"data.source": "d.csv", "data.label_column": "y"}
    )


def test_empty_split(tmp_path, default_params):
    write_csv(tmp_path / "train.csv")
    pd.DataFrame({"text": [], "label": []}).to_csv(tmp_path / "test.csv", index=False)
    expect_error(tmp_path, default_params, r"split 'test'.*the split is empty", **{"data.source": str(tmp_path)})


def test_label_only_in_test_is_refused_naming_it(tmp_path, default_params):
    write_csv(tmp_path / "train.csv", labels=("a", "b"))
    write_csv(tmp_path / "test.csv", labels=("a", "zebra"))
    expect_error(tmp_path, default_params, r"the test split has 'zebra', which the train split lacks",
                 **{"data.source": str(tmp_path)})  # fmt: skip


def test_a_single_class_in_train_is_refused_with_its_counts(tmp_path, default_params):
    write_csv(tmp_path / "d.csv", labels=("only",))
    expect_error(
        tmp_path, default_params, r"train split has 1 class\(es\) \('only': \d+ rows\)", **{"data.source": "d.csv"}
    )


def test_an_unknown_file_type_names_the_supported_ones(tmp_path, default_params):
    (tmp_path / "something.txt").write_text("text,label\na,b\n")
    expect_error(tmp_path, default_params, r"file type '.txt'.*supported: .csv, .jsonl, .json, .parquet",
                 **{"data.source": "something.txt"})  # fmt: skip


def test_non_utf8_bytes(tmp_path, default_params):
    (tmp_path / "d.csv").write_bytes(b"text,label\nok,a\n\xff\xfe bad,b\n")
    expect_error(tmp_path, default_params, r"d.csv: not valid UTF-8", **{"data.source": "d.csv"})


def test_empty_text_row(tmp_path, default_params):
    (tmp_path / "d.csv").write_text("text,label\nfine,a\n   ,b\nalso fine,a\n")
    expect_error(tmp_path, default_params, r"empty text in \['text'\] in 1 row: 2, counted from 1 after the header "
                 r"\(lines 3 of the CSV\); fill such rows, or drop them with data.drop_empty: true",
                 **{"data.source": "d.csv"})  # fmt: skip


def test_twelve_empty_texts_are_counted_and_the_first_lines_named(tmp_path, default_params):
    lines = ["text,label"] + [("" if i % 3 == 1 else f"row {i}") + ",a" for i in range(36)]
    (tmp_path / "d.csv").write_text("\n".join(lines) + "\n")
    # Rows 2, 5, 8, ... (counted from 1 after the header) are empty: 12 of them, on lines 3, 6, 9, ...
    expect_error(tmp_path, default_params, r"in 12 rows: 2, 5, 8, 11, 14 and 7 more, counted from 1 after the header "
                 r"\(lines 3, 6, 9, 12, 15 and 7 more of the CSV", **{"data.source": "d.csv"})  # fmt: skip


def test_unreachable_hub_dataset_offline(tmp_path, default_params, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    expect_error(
        tmp_path, default_params, r"hub dataset could not be loaded", **{"data.source": "someone/no-such-dataset"}
    )


def test_headerless_csv_with_named_columns(tmp_path, default_params):
    (tmp_path / "d.csv").write_text("".join(f'"{1 + i % 2}","title {i}","body {i}"\n' for i in range(40)))
    params = tiny_params(
        default_params,
        **{
            "data.source": "d.csv",
            "data.csv_columns": ["y", "title", "body"],
            "data.text_column": ["title", "body"],
            "data.label_column": "y",
        },
    )
    splits = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert sum(len(s) for s in splits.values()) == 40  # no row lost to a header
    assert set(splits["train"]["label"]) == {"1", "2"}


def test_folder_with_a_single_split_file_is_split_like_a_file(tmp_path, default_params):
    write_csv(tmp_path / "test.csv", 100)
    params = tiny_params(default_params, **{"data.source": str(tmp_path)})
    splits = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert [len(splits[s]) for s in ("train", "validation", "test")] == [70, 10, 20]


def test_folder_without_train_and_several_files_is_an_error(tmp_path, default_params):
    write_csv(tmp_path / "test.csv")
    write_csv(tmp_path / "validation.csv")
    expect_error(tmp_path, default_params, r"folder has no train file", **{"data.source": str(tmp_path)})


def test_token_budget_requires_bucketing(default_params):
    from pipelines.params import ParamsError

    with pytest.raises(ParamsError, match="data.max_tokens_per_batch needs data.bucketing: true"):
        tiny_params(default_params, **{"data.max_tokens_per_batch": 4096, "data.bucketing": False})


def test_csv_positions_are_physical_lines_where_quoted_fields_hold_line_breaks(tmp_path, default_params):
    # Rows 6, 56 and 106 (counted from 1) are empty; a quoted field with one line break sits before row 56, and one
    # with two before row 106: their records start on lines 7, 58 and 110 (the case, measured by hand).
    rows = [f"row {i}" for i in range(120)]
    rows[5] = rows[55] = rows[105] = ""
    rows[30] = "two\nlines"
    rows[80] = "three\nlines\nhere"
    pd.DataFrame({"text": rows, "label": ["a", "b"] * 60}).to_csv(tmp_path / "d.csv", index=False)
    assert (tmp_path / "d.csv").read_text().splitlines()[57].startswith(",")  # line 58: row 56's empty text
    expect_error(tmp_path, default_params, r"in 3 rows: 6, 56, 106, counted from 1 after the header "
                 r"\(lines 7, 58, 110 of the CSV\)", **{"data.source": "d.csv"})  # fmt: skip


def test_drop_empty_drops_and_counts_empty_rows_and_later_refusals_still_name_source_rows(tmp_path, default_params):
    rows = [f"row {i}" for i in range(60)]
    rows[2] = rows[9] = " "
    labels = ["a", "b", "c"] * 20
    labels[40] = ""
    pd.DataFrame({"text": rows, "label": labels}).to_csv(tmp_path / "train.csv", index=False)
    test = pd.DataFrame({"text": ["x", "", "y", "z"], "label": ["a", "b", "zebra", "c"]})
    test.to_csv(tmp_path / "test.csv", index=False)
    params = tiny_params(default_params, **{"data.source": ".", "data.drop_empty": True})
    with pytest.raises(DataError) as refused:  # row 3 of test.csv (line 4), though its row 2 was dropped before it
        load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert "'zebra', which the train split lacks (data.source '.', split 'test': 1 row: 3," in str(refused.value)
    assert "(lines 4 of the CSV)" in str(refused.value)
    test.drop(index=2).to_csv(tmp_path / "test.csv", index=False)
    splits = load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)
    assert len(splits["test"]) == 2 and splits["test"].attrs["dropped_empty_rows"] == 1
    assert splits["train"].attrs["dropped_empty_rows"] == 3  # two empty texts and one empty label of 60
    assert len(splits["train"]) + len(splits["validation"]) == 57
