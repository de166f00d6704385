"""A label typo is said before training: a class of very few rows is warned of, naming its rows, and a validation or
test label the train split lacks is refused, naming its rows (issue 62: `sprots` in 5 rows trained silently)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pipelines.data.sources import DataError, load_splits
from pipelines.tasks import get_task
from tests.conftest import tiny_params

CLASSIFICATION = get_task("classification")
TOPICS = ("sports", "world", "business", "tech")


def topic_rows(rows: int, typos: dict[int, str] | None = None) -> pd.DataFrame:
    """`rows` rows over four topics in turn; `typos`: row position -> the label written there instead."""
    labels = [TOPICS[i % len(TOPICS)] for i in range(rows)]
    for position, label in (typos or {}).items():
        labels[position] = label
    return pd.DataFrame({"text": [f"row {i} about {label}" for i, label in enumerate(labels)], "label": labels})


def load(tmp_path: Path, default_params, source: str, seed: int = 42) -> dict[str, pd.DataFrame]:
    params = tiny_params(default_params, **{"data.source": source, "seed": seed})
    return load_splits(params.data, params.seed, tmp_path, CLASSIFICATION)


def test_a_label_in_five_rows_of_2000_is_warned_of_with_its_count_and_rows(tmp_path, default_params, capsys):
    typos = dict.fromkeys((17, 230, 901, 1402, 1999), "sprots")
    topic_rows(2000, typos).to_csv(tmp_path / "d.csv", index=False)
    splits = load(tmp_path, default_params, "d.csv")
    assert "sprots" in set(splits["train"]["label"])  # a warning: the run goes on
    err = capsys.readouterr().err
    assert (
        "warning: label 'sprots' has only 5 of 2000 rows (0.25%), in data.source 'd.csv', split 'train': 5 rows: 18, "
        "231, 902, 1403, 2000, counted from 1 after the header (lines 19, 232, 903, 1404, 2001 of the CSV)"
        "; a class with under 10 rows and under 1% of all rows is trained and scored as a class of "
        "its own that the model can barely learn: if it is a typo of another label, correct those rows"
    ) in err
    assert err.count("warning: ") == 1  # the four real topics are not named

    # A small data set's classes have few rows because the data set has: 5 of 100 rows is no typo.
    topic_rows(100, dict.fromkeys(range(0, 100, 20), "rare")).to_csv(tmp_path / "small.csv", index=False)
    load(tmp_path, default_params, "small.csv")
    assert "warning" not in capsys.readouterr().err


def test_a_rare_label_is_named_in_every_file_of_a_folder(tmp_path, default_params, capsys):
    (tmp_path / "f").mkdir()
    topic_rows(1500, {3: "sprots", 700: "sprots"}).to_csv(tmp_path / "f" / "train.csv", index=False)
    topic_rows(500, {9: "sprots"}).to_csv(tmp_path / "f" / "test.csv", index=False)
    load(tmp_path, default_params, "f")
    err = capsys.readouterr().err
    assert (
        "warning: label 'sprots' has only 3 of 2000 rows (0.15%), in data.source 'f', split 'train': 2 rows: 4, 701, "
        "counted from 1 after the header (lines 5, 702 of the CSV) and in data.source "
        "'f', split 'test': 1 row: 10, counted from 1 after the header (lines 11 of the CSV"
    ) in err


@pytest.mark.parametrize("split", ["test", "validation"])
def test_a_label_the_train_split_lacks_is_refused_naming_its_rows(tmp_path, default_params, split):
    (tmp_path / "f").mkdir()
    topic_rows(400).to_csv(tmp_path / "f" / "train.csv", index=False)
    topic_rows(100, {3: "zebra", 50: "zebra", 70: "gnu"}).to_csv(tmp_path / "f" / f"{split}.csv", index=False)
    with pytest.raises(DataError) as refused:
        load(tmp_path, default_params, "f")
    assert str(refused.value) == (
        f"the {split} split has 'gnu', which the train split lacks (data.source 'f', split '{split}': 1 row: 71, "
        "counted from 1 after the header (lines 72 of the CSV)); "
        f"the {split} split has 'zebra', which the train split lacks (data.source 'f', split '{split}': 2 rows: 4, 51, "
        "counted from 1 after the header (lines 5, 52 of the CSV)); a classifier cannot "
        "learn or predict a class it never trains on: correct those labels, or add rows of them to the train split"
    )


def test_a_held_out_split_drawn_from_a_single_file_names_the_rows_of_that_file(tmp_path, default_params, capsys):
    # One row of 'zebra' turns stratification off (a class needs two rows for it), so the split that row lands in
    # follows the seed: where it is not train, the refusal names the row in the file the split was drawn from.
    topic_rows(300, {100: "zebra"}).to_csv(tmp_path / "one.csv", index=False)
    refused = []
    for seed in range(12):
        try:
            splits = load(tmp_path, default_params, "one.csv", seed=seed)
        except DataError as err:
            refused.append(str(err))
            continue
        assert "zebra" in set(splits["train"]["label"])
    assert refused, "in 12 seeds the single 'zebra' row never left the train split"
    for message in refused:
        assert "split has 'zebra', which the train split lacks (drawn from data.source 'one.csv', split 'train': " in (
            message
        )
        assert "1 row: 101, counted from 1 after the header (lines 102 of the CSV" in message
    assert "warning: label 'zebra' has only 1 of 300 rows (0.33%)" in capsys.readouterr().err
