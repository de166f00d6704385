"""DVC stage `report`: the comparison of this train run's trials, from MLflow, as markdown and PNGs.

It writes nothing unless the model was trained with params.yaml's values (`pipelines.workspace`).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.atomic import atomic_dir
from pipelines.errors import run_cli
from pipelines.params import load_params, resolve_repo_root
from pipelines.workspace import check_trained, claim_workspace

MODELS = Path("models")
TRIALS = MODELS / "trials.json"
TRAIN_METRICS = Path("metrics/train.json")
CONFUSION = Path("plots/confusion.json")  # the evaluate stage's (actual, predicted) pairs
PER_CLASS = Path("plots/per_class.json")  # and its per-class rows: each label as written, its metric key
OUT_DIR = Path("reports")


def last_commit_best_run() -> tuple[str, str] | None:
    """(the best trial's MLflow run id, the commit) of the baseline commit's train stage (its metrics file, which
    git tracks): a `dvc exp run` starts from that commit, so its one trial is compared with it."""
    from pipelines.baseline import baseline_commit, committed_json

    shown, commit = committed_json(TRAIN_METRICS), baseline_commit()
    if not shown or not commit:
        return None  # no git, no commit yet, or a commit before the train stage ran
    run_id = shown.get("mlflow_run_id")
    return (run_id, commit) if run_id else None


def main() -> None:
    params = load_params()
    claim_workspace("report")
    check_trained(MODELS, "report")
    from pipelines.report import build_report
    from pipelines.tracking.runs import open_store
    from pipelines.tracking.uploads import Upload, send_or_defer

    summary = json.loads(TRIALS.read_text())
    client, _ = open_store(params.tracking, resolve_repo_root())
    with atomic_dir(OUT_DIR) as tmp:
        evaluated = {
            name: json.loads(path.read_text(encoding="utf-8"))
            for name, path in (("confusion", CONFUSION), ("per_class", PER_CLASS))
            if path.is_file()
        }
        build_report(client, summary["experiment_id"], summary["parent_run_id"], tmp, last_commit_best_run(),
                     evaluated)  # fmt: skip
        check_trained(MODELS, "report", quiet=True)  # again, before reports/ is replaced
    parent, retry_s = summary["parent_run_id"], params.tracking.upload_retry_s
    send = lambda: client.log_artifacts(parent, str(OUT_DIR), artifact_path="report")  # noqa: E731
    send_or_defer(client, parent, Upload("report", str(OUT_DIR), send), retry_s, print)


if __name__ == "__main__":
    run_cli(main)
