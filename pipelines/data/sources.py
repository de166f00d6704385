"""Read a data source into train/validation/test tables of (text, label) rows.

Sources: the built-in generator, a local .csv/.jsonl/.parquet file, a folder of
train/validation/test files, or a Hugging Face hub dataset id. Every check that can
fail on user data does so here, naming the file, column or value.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from pipelines.errors import UserError, warn_user
from pipelines.params import GENERATOR_SOURCE, DataParams

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

SPLITS = ("train", "validation", "test")
_SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")
# Accepted spellings of split file names in a folder source, in order of preference.
_SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}


class DataError(UserError):
    """The data source cannot be used as it is."""


def _read_table(path: Path, csv_columns: list[str] | None = None) -> pd.DataFrame:
    if path.suffix not in _SUFFIXES:
        raise DataError(
            f"data.source: {path} has the file type {path.suffix or '(none)'!r}, which cannot be read; supported: "
            f"{', '.join(_SUFFIXES)} files, a folder of train/validation/test files, or a Hugging Face dataset id"
        )
    try:
        if path.suffix == ".csv":
            if csv_columns is None:
                return pd.read_csv(path, encoding="utf-8", keep_default_na=False)
            return pd.read_csv(path, encoding="utf-8", keep_default_na=False, header=None, names=csv_columns)
        if path.suffix in (".jsonl", ".json"):
            return pd.read_json(path, lines=path.suffix == ".jsonl", encoding="utf-8")
        return pd.read_parquet(path)
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not valid UTF-8 (byte {err.start}: {err.reason}); re-encode the file as UTF-8"
        ) from None
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise DataError(f"{path}: cannot be read as {path.suffix[1:]}: {err}") from None


def _find_split_file(folder: Path, split: str) -> Path | None:
    for alias in _SPLIT_ALIASES[split]:
        for suffix in _SUFFIXES:
            candidate = folder / f"{alias}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def _load_hub(dataset_id: str) -> dict[str, pd.DataFrame]:
    import datasets  # deferred: only hub sources need it

    try:
        loaded = datasets.load_dataset(dataset_id)
    except Exception as err:  # noqa: BLE001 - the hub client raises many kinds; all mean "not available"
        raise DataError(
            f"data.source = {dataset_id!r}: not a local file or folder, and the hub dataset could not be "
            f"loaded ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    tables = {}
    for split in SPLITS:
        for alias in _SPLIT_ALIASES[split]:
            if alias in loaded:
                tables[split] = loaded[alias].to_pandas()
                break
    return tables


def read_source(data: DataParams, root: Path, task: Task) -> dict[str, pd.DataFrame]:
    """Read the raw tables the source provides (some splits may be missing); the generator writes the task's rows."""
    if data.source == GENERATOR_SOURCE:
        return {"train": task.generate(data)}
    path = Path(data.source)
    path = path if path.is_absolute() else root / path
    if path.is_dir():
        tables = {s: _read_table(f, data.csv_columns) for s in SPLITS if (f := _find_split_file(path, s)) is not None}
        if "train" not in tables and len(tables) == 1:
            # A folder with one data file (e.g. a benchmark's test split alone): split it like a single file.
            return {"train": next(iter(tables.values()))}
        if "train" not in tables:
            raise DataError(
                f"data.source = {data.source!r}: folder has no train file "
                "(train.csv, train.jsonl or train.parquet) and more than one other split file"
            )
        return tables
    looks_local = path.suffix in _SUFFIXES or data.source.startswith((".", "/", "~"))
    if looks_local or path.exists():
        if not path.is_file():
            raise DataError(f"data.source = {data.source!r}: file not found ({path})")
        return {"train": _read_table(path, data.csv_columns)}
    return _load_hub(data.source)


def rows_named(positions: Sequence[int], shown: int = 5) -> str:
    """Which rows of a source (0-based positions) a refusal means: their count, the first few counted from 1 after
    the header, and the CSV lines those are where no field holds a line break (the header is line 1)."""
    first = [int(p) + 1 for p in positions[:shown]]
    more = f" and {len(positions) - shown} more" if len(positions) > shown else ""
    rows = ", ".join(map(str, first))
    lines = ", ".join(str(r + 1) for r in first)
    noun = "row" if len(positions) == 1 else "rows"
    return (f"{len(positions)} {noun}: {rows}{more}, counted from 1 after the header (lines {lines}{more} of a CSV "
            "whose fields hold no line breaks)")  # fmt: skip


def check_columns(table: pd.DataFrame, wanted: list[str], where: str) -> None:
    """Fail, naming the split, when a wanted column is missing or the split has no rows."""
    missing = [c for c in wanted if c not in table.columns]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}; columns present: {list(table.columns)}")
    if table.empty:
        raise DataError(f"{where}: the split is empty")


def make_splits(
    tables: dict[str, pd.DataFrame], data: DataParams, seed: int, names: dict[str, str]
) -> dict[str, pd.DataFrame]:
    """Use the source's own splits; carve missing ones out of train, stratified and seeded. `names`: how a refusal
    names each source table."""
    # Each split keeps its source table's row positions as its index until the end, so a refusal names those rows.
    train = tables["train"].reset_index(drop=True)
    out, origins = {}, {}
    for split, fraction in (("test", data.test_fraction), ("validation", data.val_fraction)):
        if split in tables:
            out[split], origins[split] = tables[split].reset_index(drop=True), names[split]
            continue
        share = fraction / (1.0 - (data.test_fraction if split == "validation" and "test" not in tables else 0.0))
        # Stratified by label where there is one (classification) and every label has two rows to split.
        labelled = "label" in train and train["label"].value_counts().min() >= 2
        stratify = train["label"] if labelled else None
        from sklearn.model_selection import train_test_split  # deferred: sklearn takes seconds; only splitting needs it

        train, held = train_test_split(train, test_size=share, random_state=seed, stratify=stratify)
        out[split], origins[split] = held.sort_index(), f"drawn from {names['train']}"
        train = train.sort_index()
    out["train"] = train
    for split in SPLITS:
        if out[split].empty:
            raise DataError(f"split {split!r} is empty; lower data.val_fraction/test_fraction or add rows")
    if "label" in out["train"]:
        check_labels(out, origins)
    return {s: out[s].reset_index(drop=True) for s in SPLITS}


def check_labels(splits: dict[str, pd.DataFrame], origins: dict[str, str]) -> None:
    """Refuse a train split with fewer than two classes (nothing to learn), and a validation or test label the train
    split lacks, naming its rows (each split's index: row positions in the source table `origins` names)."""
    counts = splits["train"]["label"].value_counts()
    if len(counts) < 2:
        per_class = ", ".join(f"{k!r}: {v} rows" for k, v in counts.items())
        raise DataError(
            f"the train split has {len(counts)} class(es) ({per_class}); a classifier needs at least two: "
            "check data.label_column, or the source's labels"
        )
    # Refused, not warned of: such a label gets no class id (the classifier has no output for it), so validation's
    # loss and the test split's scoring would fail on its rows (cross-entropy's target out of range) once training
    # has run.
    unseen = []
    for split in ("validation", "test"):
        labels = splits[split]["label"]
        for label in sorted(set(labels) - set(counts.index)):
            rows = rows_named(list(splits[split].index[(labels == label).to_numpy()]))
            unseen.append(f"the {split} split has {label!r}, which the train split lacks ({origins[split]}: {rows})")
    if unseen:
        raise DataError(
            f"{'; '.join(unseen)}; a classifier cannot learn or predict a class it never trains on: correct those "
            "labels, or add rows of them to the train split"
        )


# A class this rare is most likely a mistyped label (`sprots` among thousands of `sports`): under 10 rows the test
# split gets about 2 of them (its recall is 0, 50% or 100% by chance) and training too few to learn the class. The
# share keeps small data sets quiet, where every class has few rows because the data set has.
RARE_CLASS_ROWS = 10
RARE_CLASS_SHARE = 0.01


def warn_rare_labels(tables: dict[str, pd.DataFrame], names: dict[str, str]) -> None:
    """Warn of each label with under `RARE_CLASS_ROWS` rows and under `RARE_CLASS_SHARE` of all the source's rows,
    naming its count and its rows in each source table (`names`)."""
    counts = pd.concat([table["label"] for table in tables.values()]).value_counts()
    total = int(counts.sum())
    for label, count in counts.items():
        if count >= RARE_CLASS_ROWS or count >= RARE_CLASS_SHARE * total:
            continue
        where = " and in ".join(
            f"{names[split]}: {rows_named(list((table['label'] == label).to_numpy().nonzero()[0]))}"
            for split, table in tables.items()
            if (table["label"] == label).any()
        )
        warn_user(
            f"label {label!r} has only {count} of {total} rows ({count / total:.2%}), in {where}; a class with under "
            f"{RARE_CLASS_ROWS} rows and under {RARE_CLASS_SHARE:.0%} of all rows is trained and scored as a class of "
            "its own that the model can barely learn: if it is a typo of another label, correct those rows"
        )


def load_splits(data: DataParams, seed: int, root: Path, task: Task) -> dict[str, pd.DataFrame]:
    """Read the source, check every split as `task` wants, return the three splits."""
    raw = read_source(data, root, task)
    names = {s: f"data.source {data.source!r}, split {s!r}" for s in raw}
    tables = {s: task.normalize_table(t, data, names[s]) for s, t in raw.items()}
    if all("label" in table for table in tables.values()):
        warn_rare_labels(tables, names)
    return make_splits(tables, data, seed, names)
