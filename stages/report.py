"""DVC stage `report`: the comparison of this train run's trials, from MLflow, as markdown and PNGs."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.atomic import atomic_dir
from pipelines.errors import run_cli
from pipelines.params import load_params, resolve_repo_root

TRIALS = Path("models/trials.json")
OUT_DIR = Path("reports")


def main() -> None:
    params = load_params()
    from pipelines.report import build_report
    from pipelines.tracking.runs import open_store

    summary = json.loads(TRIALS.read_text())
    client, _ = open_store(params.tracking, resolve_repo_root())
    with atomic_dir(OUT_DIR) as tmp:
        build_report(client, summary["experiment_id"], summary["parent_run_id"], tmp)
    client.log_artifacts(summary["parent_run_id"], str(OUT_DIR), artifact_path="report")


if __name__ == "__main__":
    run_cli(main)
