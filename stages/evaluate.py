"""DVC stage `evaluate`: score the best model on the test split; metrics, plots, per-row predictions.
Its metrics file opens on what the experiment changed in params.yaml (read whole) from the commit it ran from, and
marks the train time where that commit's was taken on another host or under other load (`pipelines.baseline`).
It writes nothing unless the model was trained with params.yaml's values (`pipelines.workspace`).
"""

from __future__ import annotations

import os

# No per-tensor progress bars while the model loads (transformers' GGUF de-quantization); tqdm reads TQDM_*
# once, at import, so this comes before anything that imports it.
os.environ.setdefault("TQDM_DISABLE", "1")

import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402

from pipelines.atomic import atomic_write_json, atomic_write_text
from pipelines.errors import run_cli
from pipelines.params import load_params, resolve_repo_root
from pipelines.workspace import check_trained, claim_workspace

if TYPE_CHECKING:
    from pipelines.scored import Scoring

TOKENIZED = Path("data/tokenized")
BEST_MODEL = Path("models/best")
TRIALS = Path("models/trials.json")
METRICS = Path("metrics/evaluate.json")
CONFUSION = Path("plots/confusion.json")
PER_CLASS = Path("plots/per_class.json")
PREDICTIONS = Path("predictions/test.csv")
DATA_SOURCE = Path("metrics/data_source.json")  # the source stage's record of the data


def main() -> None:
    params = load_params()
    from pipelines.baseline import changed_since_baseline, committed_json, repeat_times, timing_columns
    from pipelines.evaluation import dvc_metrics
    from pipelines.tracking.mlflow_model import model_to_evaluate
    from pipelines.tracking.runs import log_evaluation_files, log_evaluation_metrics, open_store
    from pipelines.tracking.status import log_test_headline_on_parent, training_figures

    # The store first: it closes runs whose process died (kill -9) even if evaluation fails below.
    client, _ = open_store(params.tracking, resolve_repo_root())
    claim_workspace("evaluate")
    check_trained(BEST_MODEL.parent, "evaluate")  # before scoring: refused in seconds, not after it
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, run_id = model_to_evaluate(params, resolve_repo_root(), BEST_MODEL, TRIALS, Path(tmp))
        scoring = score_test_split(model_dir)
    check_trained(BEST_MODEL.parent, "evaluate", quiet=True)  # again: params.yaml may have changed while scoring
    # Into the store first: a result the store refuses (or cannot take) is not written either, so DVC records none.
    log_evaluation_metrics(client, run_id, scoring.metrics)
    # Its parent run (the experiment's row on MLflow's runs page) shows the evaluated test headline too: with several
    # trials, the chosen one's was not there to copy when the train stage closed it (they scored validation).
    if scoring.headline in scoring.metrics:
        log_test_headline_on_parent(client, run_id, scoring.headline, scoring.metrics[scoring.headline])
    atomic_write_text(PREDICTIONS, scoring.predictions_csv)
    # DVC declares both plots for every task; each task fills them its own way (generation: see answer_plots).
    atomic_write_json(CONFUSION, scoring.plots.get("confusion", []))
    atomic_write_json(PER_CLASS, scoring.plots.get("per_class", []))
    # `dvc exp show`'s and `dvc metrics diff`'s one metrics file: what changed from the baseline commit, quality,
    # time and memory first, the time marked where the baseline's was taken on another host or under other load.
    trained = training_figures(client, run_id)
    repeats = repeat_times(json.loads(TRIALS.read_text()), run_id) if TRIALS.is_file() else []
    compared = {"changed": changed_since_baseline(), **timing_columns(trained, repeats, committed_json(METRICS)),
                **data_column()}  # fmt: skip
    figures = dvc_metrics(scoring.headline, scoring.metrics, trained, compared)
    atomic_write_json(METRICS, figures, sort_keys=False)
    log_evaluation_files(client, run_id, [METRICS, PREDICTIONS], params.tracking.upload_retry_s)


def score_test_split(model_dir: Path) -> Scoring:
    """The test split scored once per experiment: the trial's scoring of this very model (its files, the test split
    and the code hashing as when it scored; `pipelines.scored`), else this stage's own, which loads the model."""
    from pipelines.scored import Scoring, reusable_scoring

    reused = reusable_scoring(model_dir, TOKENIZED / "test")
    if reused is not None:
        print(f"evaluate: the test split as its trial scored it ({reused.scored_on}); the model, the test split and "
              "the code are unchanged (MD5s), so it is not scored again", flush=True)  # fmt: skip
        return reused
    from pipelines.evaluation import evaluate_saved_model
    from pipelines.tasks import get_task

    print("evaluate: scoring the test split (no trial's scoring of this model to reuse: an experiment of several "
          "trials compares them on validation, or the model, the split or the code changed)", flush=True)  # fmt: skip
    result = evaluate_saved_model(model_dir, TOKENIZED)
    params = json.loads((model_dir / "params.json").read_text(encoding="utf-8"))
    headline = get_task(params["task"]).quality[0].metric
    return Scoring(result.metrics, result.predictions.to_csv(index=False), result.plots, headline, "this stage")


def data_column() -> dict[str, str]:
    """`data`: the first 8 hex digits of the MD5 of what the `source` stage recorded of the data (and a local model
    folder), so `dvc exp show` and `dvc metrics diff` tell experiments on different data apart (DVC shows no hash for
    that file, a dependency of tokenize: its column is empty in `dvc exp show`, DVC 3.67)."""
    import hashlib

    if not DATA_SOURCE.is_file():
        return {}
    return {"data": hashlib.md5(DATA_SOURCE.read_bytes(), usedforsecurity=False).hexdigest()[:8]}


if __name__ == "__main__":
    run_cli(main)
