"""One pipeline at a time in a workspace, and no result written beside params it was not trained with.

`dvc exp run -S lr=0.002` writes its values into params.yaml before any stage runs, and DVC locks outputs stage by
stage, not the workspace: a second `dvc exp run` started while a first trained rewrote params.yaml under it, and
the first's result was recorded (dvc.lock, metrics, `dvc exp show`) beside the second's params. Two guards:

- The workspace claim, `.dvc/tmp/pipeline.lock` (ignored by git and DVC): the DVC process running a pipeline (its
  PID, command and start time) and the params.yaml it started with. A stage of any other pipeline is refused
  before it writes anything, and puts back the params.yaml that DVC changed for it. A claim whose process has
  ended is free, so a crashed or killed run leaves nothing to clean up.
- The trained params, `models/trained_params.json`, written by the train stage beside the model: the train stage
  itself, then evaluate and report, compare them with params.yaml (and, under DVC, with dvc.lock's train entry)
  before writing anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from pipelines.atomic import atomic_write_json, atomic_write_text
from pipelines.errors import UserError, warn_user
from pipelines.params.stage_keys import STAGE_PARAMS

PARAMS = Path("params.yaml")
DVC_LOCK = Path("dvc.lock")
CLAIM = Path(".dvc/tmp/pipeline.lock")
REFUSED = Path(".dvc/tmp/params.refused.yaml")
TRAINED = "trained_params.json"  # in the train stage's models folder
FIRST_STAGE = "validate"  # runs first whenever params.yaml changed: it starts a claim afresh
# DVC's ref for the commit a `dvc exp run` in the workspace started from: its cleanup deletes it whichever run set
# it, and the run still going then fails at its end ("'NoneType' object is not subscriptable").
EXEC_BASELINE = "refs/exps/exec/EXEC_BASELINE"
ABSENT = "(absent)"


class WorkspaceBusy(UserError):
    """Another pipeline runs in this workspace."""


def read_yaml(text: str) -> Any:
    """YAML as DVC reads it (ruamel, YAML 1.2), so values compare equal to those dvc.lock records."""
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(text)


def dotted(tree: Any, key: str) -> Any:
    """`tree`'s value at a dotted key (`data.bucketing`), ABSENT where it has none."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return ABSENT
        tree = tree[part]
    return tree


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`tree`'s leaves by dotted key (as `pipelines.baseline.flat_items`, not imported: the validate stage, which
    claims the workspace, would depend on all of that module)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(leaves(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {f"{prefix}{key}": value})
    return out


def shown(value: Any) -> str:
    """A value as `-S key=value` takes it: strings bare, the rest as JSON (null, true, numbers, lists, maps)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def changes(then: dict[str, Any], now: dict[str, Any]) -> str:
    """`lr: 0.001 -> 0.002, optim: adamw -> adafactor`: the leaves that differ, by dotted key."""
    old, new = leaves(then), leaves(now)
    keys = [*old, *(k for k in new if k not in old)]
    differing = [k for k in keys if old.get(k, ABSENT) != new.get(k, ABSENT)]
    return ", ".join(f"{k}: {shown(old.get(k, ABSENT))} -> {shown(new.get(k, ABSENT))}" for k in differing)


# --- the running pipeline -------------------------------------------------------------------------------------------


def dvc_command(argv: list[str]) -> str | None:
    """`dvc exp run -S lr=0.002` from a DVC process's argv (`dvc ...`, `python .../bin/dvc ...`, `python -m dvc ...`),
    None for any other process."""
    for i, arg in enumerate(argv[:3]):
        if Path(arg).name == "dvc":
            return shlex.join(["dvc", *argv[i + 1 :]])
        if arg == "-m" and argv[i + 1 : i + 2] == ["dvc"]:
            return shlex.join(["dvc", *argv[i + 2 :]])
    return None


def running_pipeline() -> dict[str, Any] | None:
    """The DVC process (`dvc repro`, `dvc exp run`) that started this stage, its nearest such ancestor (DVC runs a
    stage through a shell); None for a stage started by hand."""
    import psutil

    try:
        process = psutil.Process(os.getppid())
        while process is not None and process.pid > 1:
            command = dvc_command(process.cmdline())
            if command:
                return {"pid": process.pid, "started": process.create_time(), "command": command,
                        "host": socket.gethostname()}  # fmt: skip
            process = process.parent()
    except psutil.Error:
        return None
    return None


def same(holder: dict[str, Any], ours: dict[str, Any] | None) -> bool:
    """Whether the claim is this pipeline's: the same process, not a later one that got its PID."""
    return ours is not None and all(holder.get(k) == ours[k] for k in ("pid", "started", "host"))


def alive(holder: dict[str, Any]) -> bool:
    """Whether the claim's process still runs; one on another host (a shared disk) cannot be checked: it counts."""
    import psutil

    if holder.get("host") != socket.gethostname():
        return True
    try:
        process = psutil.Process(int(holder["pid"]))
        return process.status() != psutil.STATUS_ZOMBIE and abs(process.create_time() - holder["started"]) < 1
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


# --- the claim ------------------------------------------------------------------------------------------------------


def claim_workspace(stage: str) -> None:
    """Refuse this stage if another pipeline runs in this workspace; else claim the workspace for the pipeline
    running it (nothing for a stage started by hand), refusing it too if params.yaml changed since it started."""
    import fcntl

    if not CLAIM.parent.parent.is_dir():  # no .dvc folder: not a DVC repository, no pipeline to share it with
        return
    ours = running_pipeline()
    CLAIM.parent.mkdir(parents=True, exist_ok=True)
    with CLAIM.open("a+", encoding="utf-8") as handle:
        # An OS lock for this read-decide-write only, so two stages starting at once cannot both claim. The claim
        # itself lives as long as its DVC process (checked by PID and start time): DVC starts a process per stage,
        # so no stage could hold a lock from the first stage to the last.
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        try:
            holder = json.loads(handle.read() or "null")
        except json.JSONDecodeError:
            holder = None  # cut short by a crash mid-write: nobody's
        if isinstance(holder, dict) and not same(holder, ours) and alive(holder):
            raise WorkspaceBusy(busy_message(holder, ours, put_back(holder) if ours else ""))
        if ours is None:
            return
        if isinstance(holder, dict) and same(holder, ours) and stage != FIRST_STAGE:
            refuse_changed_since_start(holder, stage)
            restore_experiment_ref(holder.get("exec_baseline"))
            record = {**holder, "stage": stage}
        else:
            in_workspace_exp = ours["command"].startswith("dvc exp run")  # queued ones run in copies of their own
            record = {**ours, "stage": stage, "params_text": PARAMS.read_text(encoding="utf-8"),
                      "exec_baseline": git("rev-parse", "--verify", "--quiet", EXEC_BASELINE) if in_workspace_exp
                      else None}  # fmt: skip
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(record, indent=2) + "\n")


def put_back(holder: dict[str, Any]) -> str:
    """Put back the params.yaml the running pipeline started with, where DVC changed it for this refused run (it
    applies `-S` before any stage runs), keeping this run's version aside; what to say about it."""
    text, now = holder.get("params_text"), PARAMS.read_text(encoding="utf-8")
    if text is None or text == now:
        return ""
    changed = changes(read_yaml(text) or {}, read_yaml(now) or {})
    atomic_write_text(REFUSED, now)
    atomic_write_text(PARAMS, text)
    return (f" params.yaml had been changed for this run ({changed}; `dvc exp run -S` writes it before any stage "
            f"runs): it is put back as the running experiment has it, and this run's version is kept as "
            f"{REFUSED}.")  # fmt: skip


def busy_message(holder: dict[str, Any], ours: dict[str, Any] | None, restored: str) -> str:
    """Who runs, since when, at which stage, and what to do instead."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    where = f" on host {holder.get('host')}" if holder.get("host") != socket.gethostname() else ""
    command = (ours or {}).get("command", "")
    queued = (command.replace("dvc exp run", "dvc exp run --queue", 1) if command.startswith("dvc exp run")
              and "--queue" not in command else "dvc exp run --queue -S key=value")  # fmt: skip
    return (
        f"another experiment is running in this workspace: `{holder.get('command')}` (PID {holder.get('pid')}"
        f"{where}, since {since}, at stage {holder.get('stage')}). Two pipelines in one workspace share params.yaml, "
        f"dvc.lock and every output, so this one stops before writing anything.{restored} To run it beside or "
        f"after the running one, queue it: `{queued}`, then `dvc queue start` (each queued experiment runs in its "
        f"own copy of the repository); or wait until PID {holder.get('pid')} has ended and run it again."
        + (f" If no such process runs{where}, delete {CLAIM}." if where else "")
    )


def refuse_changed_since_start(holder: dict[str, Any], stage: str) -> None:
    """Refuse a later stage of the pipeline if params.yaml no longer says what it said when the pipeline started:
    someone else changed it (DVC itself never does mid-run), and this stage's outputs would be recorded beside it."""
    then, now = read_yaml(holder.get("params_text") or "") or {}, read_yaml(PARAMS.read_text(encoding="utf-8")) or {}
    if then != now:
        raise UserError(
            f"params.yaml changed while this pipeline ran ({changes(then, now)}), before stage {stage}: its results "
            "would be recorded beside params they were not made with, so it stops here. Another `dvc exp run` in "
            "this workspace, or an edit, did it: put params.yaml back (`git checkout params.yaml` for the commit's) "
            "and run the experiment again; run experiments side by side with `dvc exp run --queue` and "
            "`dvc queue start`."
        )


def git(*args: str) -> str | None:
    """git's output, stripped, or None where git fails (no git, no repository, no such ref)."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def restore_experiment_ref(baseline: str | None) -> None:
    """Put back DVC's EXEC_BASELINE ref of the `dvc exp run` running this pipeline where a refused run's cleanup
    deleted it: DVC would otherwise fail this experiment at its very end and leave it out of `dvc exp show`."""
    if baseline and git("rev-parse", "--verify", "--quiet", EXEC_BASELINE) is None:
        git("update-ref", EXEC_BASELINE, baseline)


# --- the trained params ---------------------------------------------------------------------------------------------


def trained_params(text: str) -> dict[str, Any]:
    """The values of the params the train stage lists in dvc.yaml (those a trained model depends on; the rest
    reach it through data/tokenized), as dvc.lock records them, by key, from params.yaml's text."""
    tree = read_yaml(text) or {}
    return {key: dotted(tree, key) for key in STAGE_PARAMS["train"]}


def params_now() -> dict[str, Any]:
    """`trained_params` of params.yaml as it is now."""
    return trained_params(PARAMS.read_text(encoding="utf-8"))


def params_hash(values: dict[str, Any]) -> str:
    """A short, stable hash of trained params' values."""
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


def record_trained(folder: Path, values: dict[str, Any]) -> None:
    """Write, beside the model, the params it was trained with and their hash."""
    atomic_write_json(folder / TRAINED, {"params_sha256": params_hash(values), "params": values})


def refuse_changed_while_training(values: dict[str, Any], stage: str) -> None:
    """Refuse to write the train stage's outputs if params.yaml changed since it loaded it."""
    now = params_now()
    if params_hash(now) != params_hash(values):
        raise UserError(changed_message("while training", values, now, stage))


def check_trained(models: Path, stage: str, quiet: bool = False) -> None:
    """Refuse this stage if the model in `models` was trained with other params than params.yaml's, or (under DVC)
    than dvc.lock's train entry records: its results would be written beside params they did not come from."""
    try:
        recorded = json.loads((models / TRAINED).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        if not quiet:
            warn_user(f"{models / TRAINED} is missing (a model trained before this check): its params are unchecked")
        return
    values = recorded.get("params", {})
    now = params_now()
    if params_hash(now) != recorded.get("params_sha256"):
        raise UserError(changed_message("since the model was trained", values, now, stage))
    locked = dvc_lock_train_params() if running_pipeline() else None  # run by hand, dvc.lock is not this run's
    differing = {k: v for k, v in (locked or {}).items() if json.loads(json.dumps(values.get(k, ABSENT))) != v}
    if differing:
        raise UserError(
            f"dvc.lock records the train stage with other params than the model was trained with "
            f"({changes({k: values.get(k, ABSENT) for k in differing}, differing)}): params.yaml changed while the "
            f"train stage ended, so stage {stage} stops before writing anything. Put params.yaml back as trained "
            "and run `dvc exp run` again (it re-trains); run experiments side by side with `dvc exp run --queue`."
        )


def dvc_lock_train_params() -> dict[str, Any] | None:
    """The params dvc.lock records for the train stage (JSON-normalised), None where it has none."""
    try:
        lock = read_yaml(DVC_LOCK.read_text(encoding="utf-8")) or {}
    except OSError:
        return None
    params = dotted(lock, "stages.train.params")
    recorded = params.get("params.yaml") if isinstance(params, dict) else None
    return json.loads(json.dumps(recorded, default=str)) if isinstance(recorded, dict) else None


def changed_message(when: str, trained: dict[str, Any], now: dict[str, Any], stage: str) -> str:
    """params.yaml changed `when`: which keys, and what to do."""
    return (
        f"params.yaml changed {when} ({changes(trained, now)}): the model was trained with the values on the left, "
        f"so stage {stage} stops before writing {'its metrics' if stage == 'train' else 'anything'} rather than "
        "record results beside the new ones. "
        "Another `dvc exp run` in this workspace, or an edit, changed it: put those values back and run "
        "`dvc exp run` again, or run it as it is to train the new ones. Run experiments side by side with "
        "`dvc exp run --queue` and `dvc queue start`."
    )
