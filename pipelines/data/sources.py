"""Read a data source into train/validation/test tables of (text, label) rows.

Sources: the built-in generator, a local .csv/.jsonl/.parquet file, a folder of
train/validation/test files, or a Hugging Face hub dataset id (at `data.revision`). Every check that can
fail on user data does so here, naming the file, column, value and the rows (a CSV's physical lines).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from pipelines.data.fingerprint import SUFFIXES as _SUFFIXES
from pipelines.data.fingerprint import DataError, resolve_source
from pipelines.errors import warn_user
from pipelines.params import DataParams

if TYPE_CHECKING:
    from pipelines.tasks.base import Task

__all__ = ["DataError", "SPLITS", "load_splits", "rows_named", "check_columns", "drop_or_refuse_empty"]

SPLITS = ("train", "validation", "test")
# Accepted spellings of split file names in a folder source, in order of preference.
_SPLIT_ALIASES = {"train": ("train",), "validation": ("validation", "valid", "val", "dev"), "test": ("test",)}
# Each normalized row's position in its source table (0-based), kept through splitting so a refusal names it.
SOURCE_ROW = "source_row"
CSV_FILE = "csv_file"  # in a raw table's attrs: the CSV it was read from, whose physical lines a refusal names
DROPPED = "dropped_empty_rows"  # in a normalized table's attrs: the rows data.drop_empty left out


def _read_table(path: Path, csv_columns: list[str] | None = None) -> pd.DataFrame:
    if path.suffix not in _SUFFIXES:
        raise DataError(
            f"data.source: {path} has the file type {path.suffix or '(none)'!r}, which cannot be read; supported: "
            f"{', '.join(_SUFFIXES)} files, a folder of train/validation/test files, or a Hugging Face dataset id"
        )
    try:
        if path.suffix == ".csv":
            names = {} if csv_columns is None else {"header": None, "names": csv_columns}
            table = pd.read_csv(path, encoding="utf-8", keep_default_na=False, **names)
            table.attrs[CSV_FILE] = (str(path), csv_columns is None)
            return table
        if path.suffix in (".jsonl", ".json"):
            return pd.read_json(path, lines=path.suffix == ".jsonl", encoding="utf-8")
        return pd.read_parquet(path)
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}: not valid UTF-8 (byte {err.start}: {err.reason}); re-encode the file as UTF-8"
        ) from None
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise DataError(f"{path}: cannot be read as {path.suffix[1:]}: {err}") from None


def csv_record_lines(path: str, header: bool) -> list[int]:
    """The physical line (counted from 1) each data record of a CSV starts on, blank lines skipped as pandas skips
    them: a quoted field may hold line breaks, so record n is not line n + 1. Read only when a refusal names rows."""
    starts, previous = [], 0
    with open(path, newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle)
        for record in reader:
            if record:
                starts.append(previous + 1)
            previous = reader.line_num
    return starts[1:] if header else starts


def _find_split_file(folder: Path, split: str) -> Path | None:
    for alias in _SPLIT_ALIASES[split]:
        for suffix in _SUFFIXES:
            candidate = folder / f"{alias}{suffix}"
            if candidate.is_file():
                return candidate
    return None


def _load_hub(dataset_id: str, revision: str | None) -> dict[str, pd.DataFrame]:
    import datasets  # deferred: only hub sources need it

    try:
        loaded = datasets.load_dataset(dataset_id, revision=revision)
    except Exception as err:  # noqa: BLE001 - the hub client raises many kinds; all mean "not available"
        at = f" at revision {revision!r}" if revision else ""
        raise DataError(
            f"data.source = {dataset_id!r}: no local file or folder has this name, and the hub dataset{at} could not "
            f"be loaded ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
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
    source = resolve_source(data.source, root)
    if source.kind == "generator":
        return {"train": task.generate(data)}
    if source.kind == "hub":
        return _load_hub(data.source, data.revision)
    assert source.path is not None
    if source.kind == "file":
        return {"train": _read_table(source.path, data.csv_columns)}
    found = {s: f for s in SPLITS if (f := _find_split_file(source.path, s)) is not None}
    tables = {s: _read_table(f, data.csv_columns) for s, f in found.items()}
    if "train" not in tables and len(tables) == 1:
        # A folder with one data file (e.g. a benchmark's test split alone): split it like a single file.
        return {"train": next(iter(tables.values()))}
    if "train" not in tables:
        raise DataError(
            f"data.source = {data.source!r}: folder has no train file "
            "(train.csv, train.jsonl or train.parquet) and more than one other split file"
        )
    return tables


def rows_named(positions: Sequence[int], source: Mapping[str, Any] | None = None, shown: int = 5) -> str:
    """Which rows of a source (0-based positions) a refusal means: their count and the first few counted from 1
    after the header, and, for a CSV (`source`: the raw table's attrs), the physical lines they start on."""
    first = [int(p) for p in positions[:shown]]
    more = f" and {len(positions) - shown} more" if len(positions) > shown else ""
    noun = "row" if len(positions) == 1 else "rows"
    rows = ", ".join(str(p + 1) for p in first)
    csv_file = (source or {}).get(CSV_FILE)
    if csv_file is None:
        return f"{len(positions)} {noun}: {rows}{more}, counted from 1"
    starts = csv_record_lines(*csv_file)
    lines = ", ".join(str(starts[p]) if p < len(starts) else "?" for p in first)
    return f"{len(positions)} {noun}: {rows}{more}, counted from 1 after the header (lines {lines}{more} of the CSV)"


def drop_or_refuse_empty(
    out: pd.DataFrame, empty: np.ndarray, what: str, where: str, data: DataParams, source: Mapping[str, Any]
) -> pd.DataFrame:
    """`out` without its `empty` rows where data.drop_empty (their count in its attrs, `DROPPED`), else a refusal
    naming `what` is empty and in which rows. The kept rows keep their index: positions in the source table."""
    empty = np.asarray(empty, dtype=bool)
    if not empty.any():
        return out
    if not data.drop_empty:
        raise DataError(
            f"{where}: empty {what} in {rows_named(list(out.index[empty]), source)}; fill such rows, or drop them with "
            "data.drop_empty: true (their count is recorded)"
        )
    kept = out.loc[~empty]
    kept.attrs[DROPPED] = int(empty.sum()) + int(out.attrs.get(DROPPED, 0))
    return kept


def check_columns(table: pd.DataFrame, wanted: list[str], where: str) -> None:
    """Fail, naming the split, when a wanted column is missing or the split has no rows."""
    missing = [c for c in wanted if c not in table.columns]
    if missing:
        raise DataError(f"{where}: missing column(s) {missing}; columns present: {list(table.columns)}")
    if table.empty:
        raise DataError(f"{where}: the split is empty")


def make_splits(
    tables: dict[str, pd.DataFrame],
    data: DataParams,
    seed: int,
    names: dict[str, str],
    sources: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, pd.DataFrame]:
    """Use the source's own splits; carve missing ones out of train, stratified and seeded. `names`: how a refusal
    names each source table; `sources`: each raw table's attrs (a CSV's path, for its lines)."""
    sources = sources or {}
    # Each row keeps its source table's position (SOURCE_ROW, the index where not given) until the end, so a
    # refusal names that row, whatever was dropped or drawn before.
    tables = {s: t if SOURCE_ROW in t else t.assign(**{SOURCE_ROW: np.asarray(t.index)}) for s, t in tables.items()}
    train = tables["train"].reset_index(drop=True)
    out, origins = {}, {}
    for split, fraction in (("test", data.test_fraction), ("validation", data.val_fraction)):
        if split in tables:
            out[split], origins[split] = tables[split].reset_index(drop=True), (names[split], sources.get(split))
            continue
        share = fraction / (1.0 - (data.test_fraction if split == "validation" and "test" not in tables else 0.0))
        # Stratified by label where there is one (classification) and every label has two rows to split.
        labelled = "label" in train and train["label"].value_counts().min() >= 2
        stratify = train["label"] if labelled else None
        from sklearn.model_selection import train_test_split  # deferred: sklearn takes seconds; only splitting needs it

        train, held = train_test_split(train, test_size=share, random_state=seed, stratify=stratify)
        out[split], origins[split] = held.sort_index(), (f"drawn from {names['train']}", sources.get("train"))
        train = train.sort_index()
    out["train"] = train
    for split in SPLITS:
        if out[split].empty:
            raise DataError(f"split {split!r} is empty; lower data.val_fraction/test_fraction or add rows")
    if "label" in out["train"]:
        check_labels(out, origins)
    return {s: out[s].reset_index(drop=True) for s in SPLITS}


def check_labels(splits: dict[str, pd.DataFrame], origins: dict[str, tuple[str, Mapping[str, Any] | None]]) -> None:
    """Refuse a train split with fewer than two classes (nothing to learn), and a validation or test label the train
    split lacks, naming its rows (SOURCE_ROW: positions in the source table `origins` names, with its attrs)."""
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
        name, source = origins[split]
        for label in sorted(set(labels) - set(counts.index)):
            rows = rows_named(list(splits[split][SOURCE_ROW].to_numpy()[(labels == label).to_numpy()]), source)
            unseen.append(f"the {split} split has {label!r}, which the train split lacks ({name}: {rows})")
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


def warn_rare_labels(
    tables: dict[str, pd.DataFrame], names: dict[str, str], sources: Mapping[str, Mapping[str, Any]]
) -> None:
    """Warn of each label with under `RARE_CLASS_ROWS` rows and under `RARE_CLASS_SHARE` of all the source's rows,
    naming its count and its rows in each source table (`names`; `sources`: their attrs)."""
    counts = pd.concat([table["label"] for table in tables.values()]).value_counts()
    total = int(counts.sum())
    for label, count in counts.items():
        if count >= RARE_CLASS_ROWS or count >= RARE_CLASS_SHARE * total:
            continue
        where = " and in ".join(
            f"{names[split]}: {rows_named(list(table.index[(table['label'] == label).to_numpy()]), sources[split])}"
            for split, table in tables.items()
            if (table["label"] == label).any()
        )
        warn_user(
            f"label {label!r} has only {count} of {total} rows ({count / total:.2%}), in {where}; a class with under "
            f"{RARE_CLASS_ROWS} rows and under {RARE_CLASS_SHARE:.0%} of all rows is trained and scored as a class of "
            "its own that the model can barely learn: if it is a typo of another label, correct those rows"
        )


def load_splits(data: DataParams, seed: int, root: Path, task: Task) -> dict[str, pd.DataFrame]:
    """Read the source, check every split as `task` wants, return the three splits. A split's attrs say how many
    empty rows data.drop_empty left out of its source table (`DROPPED`; a drawn split: none of its own)."""
    raw = read_source(data, root, task)
    names = {s: f"data.source {data.source!r}, split {s!r}" for s in raw}
    sources = {s: dict(t.attrs) for s, t in raw.items()}
    tables = {s: task.normalize_table(t, data, names[s]) for s, t in raw.items()}
    dropped = {s: int(t.attrs.get(DROPPED, 0)) for s, t in tables.items()}
    for split, count in dropped.items():
        if count:
            warn_user(f"{names[split]}: dropped {count} row(s) with empty fields (data.drop_empty: true)")
    if all("label" in table for table in tables.values()):
        warn_rare_labels(tables, names, sources)
    splits = make_splits(tables, data, seed, names, sources)
    for split in SPLITS:
        splits[split].attrs[DROPPED] = dropped.get(split, 0)
    return splits
