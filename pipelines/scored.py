"""A trial's scoring of the test split, kept beside its saved model, and its reuse by the evaluate stage.

The trial that trained a model has it in memory and scores the test split once (`recipe.evaluate_and_save`). The
evaluate stage then scored the same weights on the same rows again: on 2 cores, 8 s for 0.2 s of inference, the rest
importing torch and transformers to load the model (benchmarks/RESULTS.md, issue 69), and twice the generation for
causal LMs and seq2seq. Now the trial writes what it scored (`test_scoring.json`, `test_predictions.csv`) with a
key: the MD5 of every file of the model folder, of the tokenized test split, and of this package's source. The
evaluate stage reuses them only when the key it computes is the same, so a model replaced, re-tokenized data or
changed scoring code is scored again. Light on purpose (no torch): reading it must not cost what it saves.
The key's cost is reading the weights once per side: MD5 ran at 0.69 GB/s on this 2-core host, so a 16 GB full
fine-tune adds about 25 s to the trial and to the stage, against loading and scoring that model again. An adapter
folder whose config is rewritten when it moves (a base saved beside it: `model_card.follow_move`) no longer matches
and is scored by the stage, as before.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.data.fingerprint import file_md5

RECORD = "test_scoring.json"
PREDICTIONS = "test_predictions.csv"
# Files of a model folder that are not the model: written after scoring, or rewritten when the folder moves.
NOT_MODEL = frozenset({RECORD, PREDICTIONS, "README.md", "history.json", "metrics.json", "input_examples.json"})
PACKAGE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Scoring:
    """What a trial scored on the test split: metrics, the predictions file's text, the plot rows, the task's
    headline metric, and where it ran (device, precision)."""

    metrics: dict[str, float]
    predictions_csv: str
    plots: dict[str, list[dict[str, Any]]]
    headline: str
    scored_on: str


def _tree(folder: Path, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    return {str(p.relative_to(folder)): file_md5(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).parts[0] not in skip}  # fmt: skip


def scoring_key(model_dir: Path, test_dir: Path) -> dict[str, Any]:
    """What a scoring depends on: each model file's MD5, each test split file's, and one MD5 of the package's
    source (the tasks' scoring code included)."""
    code = hashlib.md5(usedforsecurity=False)
    for path in sorted(PACKAGE.rglob("*.py")):
        code.update(f"{path.relative_to(PACKAGE)}:{file_md5(path)};".encode())
    return {"model": _tree(model_dir, NOT_MODEL), "test": _tree(test_dir), "code": code.hexdigest()}


def save_scoring(model_dir: Path, test_dir: Path, scoring: Scoring) -> None:
    """Write the scoring beside the model, keyed by what it depends on (call once the folder is complete)."""
    (model_dir / PREDICTIONS).write_text(scoring.predictions_csv, encoding="utf-8")
    record = {"key": scoring_key(model_dir, test_dir), "metrics": scoring.metrics, "plots": scoring.plots,
              "headline": scoring.headline, "scored_on": scoring.scored_on}  # fmt: skip
    (model_dir / RECORD).write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")


def reusable_scoring(model_dir: Path, test_dir: Path) -> Scoring | None:
    """The trial's scoring of this model on this test split, when its key is still what the files give; else None
    (no record, an unreadable one, or a model, data or code that changed since)."""
    try:
        record = json.loads((model_dir / RECORD).read_text(encoding="utf-8"))
        predictions = (model_dir / PREDICTIONS).read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != scoring_key(model_dir, test_dir):
        return None
    return Scoring(record["metrics"], predictions, record["plots"], record["headline"], record["scored_on"])
