"""The train stage's artifacts that the bucket refused: their folders kept, and `--resume-upload` to send them.

A trial whose model could not be sent (see `pipelines.tracking.uploads`) keeps its folder: the best one is
`models/best` anyway; another is moved to `models/unsent/<trial id>` instead of being deleted with the staging
folder. `python -m stages.train --resume-upload` reads `models/trials.json`, finds every run of that train run with
an `upload.pending` tag, sends each artifact from where it was kept, clears the tag, and registers the best model
when registration had to be skipped. Nothing under `models/` or `metrics/` changes, so DVC's outputs stay valid.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipelines.errors import UserError
from pipelines.params import Params
from pipelines.tracking.mlflow_model import (
    EXAMPLES_FILE,
    MODEL_NAME,
    MODEL_URI_TAG,
    save_trial_model,
    upload_trial_model,
)
from pipelines.tracking.uploads import (
    TRIAL_PREFIX,
    UNSENT_DIR,
    Upload,
    pending,
    send_or_defer,
    set_pending,
    with_retries,
)

BEST_DIR, TRIALS_FILE = "best", "trials.json"
OUT_PREFIX = "out:"  # a file of the train stage's output folder (models/)


def keep_unsent_folders(client: Any, summary: dict[str, Any], staging: Path, out_dir: Path) -> list[str]:
    """Move the staged folder of each trial, other than the best, whose model is pending to `out_dir/unsent/`;
    the trial ids kept."""
    kept = []
    for trial in summary["trials"]:
        if trial["trial_id"] == summary["best"]["trial_id"]:
            continue
        if MODEL_NAME in pending(client, trial["mlflow_run_id"]) and (staging / trial["trial_id"]).is_dir():
            (out_dir / UNSENT_DIR).mkdir(exist_ok=True)
            shutil.move(str(staging / trial["trial_id"]), str(out_dir / UNSENT_DIR / trial["trial_id"]))
            kept.append(trial["trial_id"])
    return kept


def save_summary(client: Any, summary: dict[str, Any], out_dir: Path, retry_s: float) -> None:
    """Write the trials summary to `out_dir/trials.json` and send it to the parent run (kept pending if the bucket
    refuses it)."""
    (out_dir / TRIALS_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    parent = summary["parent_run_id"]
    send = lambda: client.log_artifact(parent, str(out_dir / TRIALS_FILE))  # noqa: E731
    send_or_defer(client, parent, Upload(TRIALS_FILE, OUT_PREFIX + TRIALS_FILE, send), retry_s, print)


def local_place(local: str, models_dir: Path, best_trial: str) -> Path:
    """Where a pending artifact's file was kept (see `pipelines.tracking.uploads` for the forms)."""
    if local.startswith(TRIAL_PREFIX):
        trial, _, rest = local.removeprefix(TRIAL_PREFIX).partition("/")
        folder = models_dir / BEST_DIR if trial == best_trial else models_dir / UNSENT_DIR / trial
        return folder / rest if rest else folder
    if local.startswith(OUT_PREFIX):
        return models_dir / local.removeprefix(OUT_PREFIX)
    return Path(local)


def send_one(client: Any, run: Any, artifact: str, place: Path, retry_s: float) -> str | None:
    """Send one pending artifact of `run` from `place`; the model's new URI when it was the model."""
    run_id = run.info.run_id
    if not place.exists():
        raise UserError(f"{place}: the kept copy of run {run_id}'s {artifact!r} is gone; it cannot be sent")
    if artifact != MODEL_NAME:
        folder = str(Path(artifact).parent) if Path(artifact).parent != Path(".") else None
        upload = client.log_artifacts if place.is_dir() else client.log_artifact
        with_retries(lambda: upload(run_id, str(place), folder if place.is_file() else artifact), retry_s)
        return None
    params = Params.model_validate(json.loads((place / "params.json").read_text()))
    examples = json.loads((place / EXAMPLES_FILE).read_text()) if (place / EXAMPLES_FILE).is_file() else []
    with tempfile.TemporaryDirectory() as tmp:
        saved = save_trial_model(place, params, examples or ["example"], Path(tmp))
        uri = upload_trial_model(client, run.info.experiment_id, run_id, saved, retry_s)
    client.set_tag(run_id, MODEL_URI_TAG, uri)
    return uri


def resume_upload(
    client: Any, models_dir: Path, retry_s: float, say: Callable[[str], None],
    register: Callable[[str], dict[str, str] | None],
) -> int:  # fmt: skip
    """Send every pending artifact of the train run recorded in `models_dir/trials.json`; how many were sent.
    `register(best_run_id)` registers the best model when its upload had been pending."""
    summary_file = models_dir / TRIALS_FILE
    if not summary_file.is_file():
        raise UserError(f"{summary_file}: not found; --resume-upload sends what a finished train stage kept")
    summary = json.loads(summary_file.read_text())
    best = summary["best"]
    runs = [summary["parent_run_id"]] + [t["mlflow_run_id"] for t in summary["trials"]]
    sent = 0
    for run_id in runs:
        run = client.get_run(run_id)
        missing = pending(client, run_id)
        for artifact, local in sorted(missing.items()):
            place = local_place(local, models_dir, best["trial_id"])
            send_one(client, run, artifact, place, retry_s)
            sent += 1
            say(f"sent {artifact!r} of run {run.info.run_name or run_id} from {place}")
            set_pending(client, run_id, {k: v for k, v in pending(client, run_id).items() if k != artifact})
        if MODEL_NAME in missing and run_id == best["mlflow_run_id"] and (registered := register(run_id)):
            say(f"registered the best model as {registered['uri']}")
    say(f"{sent} pending artifact(s) sent" if sent else "nothing was pending: every artifact is in the store")
    return sent
