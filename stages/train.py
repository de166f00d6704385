"""DVC stage `train`: run the Ray Tune trials, keep the best model, write its metrics and curve."""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path
from typing import Any

from pipelines.atomic import StagedDir, atomic_write_json, refuse_unwritable, staged_dir
from pipelines.errors import run_cli
from pipelines.params import Params, load_params, resolve_repo_root
from pipelines.stage_help import stage_parser
from pipelines.workspace import claim_workspace, params_now, record_trained, refuse_changed_while_training

TOKENIZED = Path("data/tokenized")
TOKENIZE_METRICS = Path("metrics/tokenize.json")
OUT_DIR = Path("models")
METRICS = Path("metrics/train.json")
PLOT = Path("plots/train_loss.json")
# Written by the trials as they train (the resume points): an unwritable one fails the first checkpoint.
CHECKPOINTS = Path("checkpoints")
OUTPUTS = (OUT_DIR, METRICS, PLOT, CHECKPOINTS)  # dvc.yaml's outs and plots of the stage, and its checkpoints


def arguments() -> argparse.Namespace:
    """`--help`, or `--resume-upload`; nothing else (DVC runs the stage with params.yaml alone)."""
    parser = stage_parser("stages.train", __doc__)
    parser.add_argument(
        "--resume-upload", action="store_true",
        help="train nothing: send the models and files that the artifact store refused when this stage last ran "
        "(each run's `upload.pending` tag), from where they were kept under models/",
    )  # fmt: skip
    return parser.parse_args()


def resume_upload(params: Params) -> None:
    """Send what the last train run left pending, and register its best model if that had to wait."""
    from pipelines.tracking.runs import open_store
    from pipelines.trials.tuning import register_best_model
    from pipelines.trials.unsent import resume_upload as send_pending

    client, _ = open_store(params.tracking, resolve_repo_root())
    uri = client.tracking_uri
    send_pending(client, OUT_DIR, params.tracking.upload_retry_s, print,
                 lambda run_id: register_best_model(client, params, run_id, uri))  # fmt: skip


def keep_earlier_unsent(tracking_uri: str, new_dir: Path) -> None:
    """Move into the new models folder what the runs of the train it replaces still need for their pending
    uploads (`models/unsent/`), and say so: replacing `models/` whole would delete them."""
    from mlflow.tracking import MlflowClient

    from pipelines.trials.unsent import carry_unsent

    carry_unsent(MlflowClient(tracking_uri=tracking_uri), OUT_DIR, new_dir, lambda line: print(line, flush=True))


def main() -> None:
    args = arguments()
    params = load_params()
    if args.resume_upload:
        resume_upload(params)
        return
    from pipelines.trials.interruption import interrupt_when_parent_ends

    # `dvc` ignores SIGINT while its stage runs, and ended (SIGTERM, SIGKILL) left the stage training on, orphaned.
    interrupt_when_parent_ends()
    claim_workspace("train")  # refused while another pipeline runs in this workspace
    refuse_unwritable(OUTPUTS, "train")  # else found only after all of training, when they are put in place
    trained = params_now()  # the train keys' values as just loaded: the evaluate and report stages check them
    from pipelines.runtime import check_runtime
    from pipelines.tracking.status import runs_page_line
    from pipelines.trials.tuning import run_tuning, tokenize_metrics

    check_runtime(params)
    stats = tokenize_metrics(json.loads(TOKENIZE_METRICS.read_text()))
    with staged_dir(OUT_DIR) as staged:
        publish = partial(publish_outputs, staged, trained)
        summary = run_tuning(params, resolve_repo_root(), TOKENIZED, staged.path, stats, publish)
    print(runs_page_line(summary["tracking_uri"], summary["experiment_id"]), flush=True)


def publish_outputs(staged: StagedDir, trained: dict[str, Any], summary: dict[str, Any]) -> None:
    """Put the stage's outputs in place: models/ (carrying the earlier unsent, saying what it was trained with), then
    the metrics and the curve. Before the best model is registered and the parent run closed (`run_tuning`)."""
    from pipelines.trials.tuning import BEST_DIR, best_trial_metrics

    keep_earlier_unsent(summary["tracking_uri"], staged.path)
    record_trained(staged.path, trained)
    staged.put_in_place()
    # After models/ is in place (it says what it was trained with, and keeps its pending uploads), before the
    # metrics: if params.yaml changed meanwhile, DVC would record them beside the new values.
    refuse_changed_while_training(trained, "train")
    atomic_write_json(METRICS, best_trial_metrics(summary))
    atomic_write_json(PLOT, json.loads((OUT_DIR / BEST_DIR / "history.json").read_text()))


if __name__ == "__main__":
    run_cli(main, arguments=True)
