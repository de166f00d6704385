"""DVC stage `train`: run the Ray Tune trials, keep the best model, write its metrics and curve."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.atomic import atomic_dir, atomic_write_json
from pipelines.errors import run_cli
from pipelines.params import load_params, resolve_repo_root

TOKENIZED = Path("data/tokenized")
TOKENIZE_METRICS = Path("metrics/tokenize.json")
OUT_DIR = Path("models")
METRICS = Path("metrics/train.json")
PLOT = Path("plots/train_loss.json")


def main() -> None:
    params = load_params()
    from pipelines.runtime import check_runtime
    from pipelines.tracking.status import runs_page_line
    from pipelines.trials.tuning import BEST_DIR, best_trial_metrics, run_tuning, tokenize_metrics

    check_runtime(params)
    stats = tokenize_metrics(json.loads(TOKENIZE_METRICS.read_text()))
    with atomic_dir(OUT_DIR) as tmp:
        summary = run_tuning(params, resolve_repo_root(), TOKENIZED, tmp, stats)
    atomic_write_json(METRICS, best_trial_metrics(summary))
    atomic_write_json(PLOT, json.loads((OUT_DIR / BEST_DIR / "history.json").read_text()))
    print(runs_page_line(summary["tracking_uri"], summary["experiment_id"]), flush=True)


if __name__ == "__main__":
    run_cli(main)
