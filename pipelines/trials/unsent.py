"""The train stage's artifacts that the bucket refused: what they need kept on disk, and `--resume-upload` to send them.

A trial with a pending artifact (see `pipelines.tracking.uploads`) keeps what that artifact is sent from: the best
trial's folder is `models/best` anyway; of another trial, the staged folder moves to `models/unsent/<trial id>` when
its model is pending, or only the pending files (its `params.json`) when the model was sent. A later `train`, which
replaces `models/` whole, first moves into the new `models/unsent/` what the earlier train run's pending artifacts
still need, and lists those runs in `models/unsent/runs.json` (`carry_unsent`).

`python -m stages.train --resume-upload` reads `models/trials.json` and `models/unsent/runs.json`, finds every run
with an `upload.pending` tag, sends each artifact from where it was kept, clears it from the tag, and registers the
best model when registration had to be skipped. An artifact that cannot be sent (its kept copy gone, the bucket
still down) does not stop the others: they are all tried, then the ones left are listed and the command fails.
Nothing under `models/` or `metrics/` changes, so DVC's outputs stay valid.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pipelines.errors import UserError
from pipelines.model_card import follow_move
from pipelines.params import Params
from pipelines.tracking.mlflow_model import (
    EXAMPLES_FILE,
    MODEL_NAME,
    MODEL_URI_TAG,
    save_trial_model,
    upload_trial_model,
)
from pipelines.tracking.uploads import (
    PENDING_TAG,
    TRIAL_PREFIX,
    UNSENT_DIR,
    Upload,
    error_line,
    pending,
    send_or_defer,
    set_pending,
    with_retries,
)

BEST_DIR, TRIALS_FILE = "best", "trials.json"
OUT_PREFIX = "out:"  # a file of the train stage's output folder (models/)
CARRIED_FILE = "runs.json"  # in models/unsent/: the runs of earlier train runs whose kept files a later train carried


def move_kept(moves: Iterable[tuple[Path, Path]], say: Callable[[str], None]) -> list[Path]:
    """Move each (source, target) whose source exists, a folder before what is inside it (which goes with it); the
    targets moved. A move that fails is said, not raised: the caller's new output folder, which holds what was
    already moved, must still replace the old one rather than be deleted."""
    moved: dict[Path, Path] = {}
    for source, target in sorted(set(moves), key=lambda move: len(move[0].parts)):
        if source == target or any(source.is_relative_to(done) for done in moved) or not source.exists():
            continue
        try:
            if target.exists():  # shutil.move would put the source inside it
                raise FileExistsError(f"{target} exists")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(source), str(target))
        except OSError as err:
            say(f"warning: could not move {source} to {target} ({error_line(err)}); its pending upload needs it")
            continue
        moved[source] = target
        if target.is_dir():
            follow_move(target)  # an adapter saved with its base points at the base's new place
    return list(moved.values())


def keep_unsent_folders(client: Any, summary: dict[str, Any], staging: Path, out_dir: Path) -> list[str]:
    """Move what each trial other than the best needs for its pending artifacts from `staging` to
    `out_dir/unsent/<trial id>`: the whole folder when its model is pending, else the pending files; the trial ids
    that kept something."""
    best, moves = summary["best"]["trial_id"], []
    for trial in summary["trials"]:
        for local in pending(client, trial["mlflow_run_id"]).values():
            owner, _, rest = local.removeprefix(TRIAL_PREFIX).partition("/")
            if local.startswith(TRIAL_PREFIX) and owner != best:
                moves.append((staging / owner / rest, out_dir / UNSENT_DIR / owner / rest))
    moved = move_kept(moves, print)
    return sorted({target.relative_to(out_dir / UNSENT_DIR).parts[0] for target in moved})


def save_summary(client: Any, summary: dict[str, Any], out_dir: Path, retry_s: float) -> None:
    """Write the trials summary to `out_dir/trials.json` and send it to the parent run (kept pending if the bucket
    refuses it)."""
    (out_dir / TRIALS_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    parent = summary["parent_run_id"]
    send = lambda: client.log_artifact(parent, str(out_dir / TRIALS_FILE))  # noqa: E731
    send_or_defer(client, parent, Upload(TRIALS_FILE, OUT_PREFIX + TRIALS_FILE, send), retry_s, print)


def local_place(local: str, models_dir: Path, best_trial: str | None, out_folder: Path | None = None) -> Path:
    """Where a pending artifact's file was kept (see `pipelines.tracking.uploads` for the forms): an `out:` file in
    `out_folder` (default `models_dir`; `models_dir/unsent/<run id>` for a run a later train carried)."""
    if local.startswith(TRIAL_PREFIX):
        trial, _, rest = local.removeprefix(TRIAL_PREFIX).partition("/")
        folder = models_dir / BEST_DIR if trial == best_trial else models_dir / UNSENT_DIR / trial
        return folder / rest if rest else folder
    if local.startswith(OUT_PREFIX):
        return (out_folder or models_dir) / local.removeprefix(OUT_PREFIX)
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


def runs_kept(models_dir: Path) -> list[tuple[str, Path]]:
    """The runs whose pending artifacts may be kept in `models_dir`, each with the folder of its `out:` files: the
    train run of `trials.json` (its parent run first, then its trials) and the earlier ones carried to `unsent/`."""
    summary = json.loads((models_dir / TRIALS_FILE).read_text())
    runs = [summary["parent_run_id"]] + [trial["mlflow_run_id"] for trial in summary["trials"]]
    carried_file = models_dir / UNSENT_DIR / CARRIED_FILE
    carried = json.loads(carried_file.read_text()) if carried_file.is_file() else []
    return [(run_id, models_dir) for run_id in runs] + [(run, models_dir / UNSENT_DIR / run) for run in carried]


def carry_unsent(client: Any, old_dir: Path, new_dir: Path, say: Callable[[str], None]) -> list[str]:
    """Before a new train's `new_dir` replaces `old_dir` (models/): move into `new_dir/unsent/` what the earlier
    train runs' pending artifacts still need (the old best folder, `unsent/` folders, `trials.json`), and list those
    runs in `new_dir/unsent/runs.json` for `--resume-upload`; the run ids carried. Never raises: the new models
    must replace the old ones whatever this finds."""
    try:
        runs = runs_kept(old_dir) if (old_dir / TRIALS_FILE).is_file() else []
        best = json.loads((old_dir / TRIALS_FILE).read_text())["best"]["trial_id"] if runs else None
    except (OSError, ValueError, KeyError) as err:
        say(f"warning: {old_dir / TRIALS_FILE} is unreadable ({error_line(err)}); nothing of it is carried over")
        return []
    carried, moves = [], []
    for run_id, out_folder in runs:
        try:
            entries = pending(client, run_id)
        except Exception as err:  # noqa: BLE001 - a run gone from the store (or another store): its files go
            say(f"warning: run {run_id} of the earlier train run cannot be read ({error_line(err)}); "
                f"what it kept under {old_dir}/ is not carried over")  # fmt: skip
            continue
        carried += [run_id] if entries else []
        for local in entries.values():
            source = local_place(local, old_dir, best, out_folder)
            moves.append((source, local_place(local, new_dir, None, new_dir / UNSENT_DIR / run_id)))
    moved = move_kept(moves, say)
    if carried:
        try:
            (new_dir / UNSENT_DIR).mkdir(exist_ok=True)
            (new_dir / UNSENT_DIR / CARRIED_FILE).write_text(json.dumps(sorted(carried), indent=2) + "\n")
        except OSError as err:
            say(f"warning: could not list the carried runs in {CARRIED_FILE} ({error_line(err)})")
        say(f"{len(carried)} run(s) of an earlier train still have artifacts marked {PENDING_TAG}: what they need "
            f"({len(moved)} folder(s) or file(s) moved) is kept in {old_dir}/{UNSENT_DIR}/ rather than deleted with "
            "the old models; send them with `python -m stages.train --resume-upload`")  # fmt: skip
    return sorted(carried)


def resume_upload(
    client: Any, models_dir: Path, retry_s: float, say: Callable[[str], None],
    register: Callable[[str], dict[str, str] | None],
) -> int:  # fmt: skip
    """Send every pending artifact of the train run recorded in `models_dir/trials.json` and of the earlier ones
    carried to `models_dir/unsent/`; how many were sent. `register(best_run_id)` registers the best model when its
    upload had been pending. What cannot be sent is tried after the rest, then listed in the UserError raised."""
    if not (models_dir / TRIALS_FILE).is_file():
        raise UserError(f"{models_dir / TRIALS_FILE}: not found; --resume-upload sends what a finished train kept")
    best = json.loads((models_dir / TRIALS_FILE).read_text())["best"]
    sent, failed = 0, []
    for run_id, out_folder in runs_kept(models_dir):
        try:
            run, missing = client.get_run(run_id), pending(client, run_id)
        except Exception as err:  # noqa: BLE001 - listed with the rest; the other runs are still sent
            failed.append(f"run {run_id}: cannot be read ({error_line(err)})")
            continue
        name = run.info.run_name or run_id
        for artifact, local in sorted(missing.items()):
            place = local_place(local, models_dir, best["trial_id"], out_folder)
            try:
                send_one(client, run, artifact, place, retry_s)
                set_pending(client, run_id, {k: v for k, v in pending(client, run_id).items() if k != artifact})
            except Exception as err:  # noqa: BLE001 - listed with the rest; the other artifacts are still sent
                failed.append(f"{artifact!r} of run {name}: {err if isinstance(err, UserError) else error_line(err)}")
                continue
            sent += 1
            say(f"sent {artifact!r} of run {name} from {place}")
            if artifact == MODEL_NAME and run_id == best["mlflow_run_id"]:
                failed += register_sent(register, run_id, say)
    if sent or not failed:
        say(f"{sent} pending artifact(s) sent" if sent else "nothing was pending: every artifact is in the store")
    if failed:
        raise UserError(f"--resume-upload could not send everything; what it could not ({len(failed)}) stays pending, "
                        "run it again once the cause is fixed:\n  - " + "\n  - ".join(failed))  # fmt: skip
    return sent


def register_sent(register: Callable[[str], Any], run_id: str, say: Callable[[str], None]) -> list[str]:
    """Register the best model just sent; what failed (empty when it was registered or registration is off)."""
    try:
        registered = register(run_id)
    except Exception as err:  # noqa: BLE001 - the model is in the store; only its registration is missing
        return [f"the best model (run {run_id}) was sent but not registered: {error_line(err)}"]
    if registered:
        say(f"registered the best model as {registered['uri']}")
    return []
