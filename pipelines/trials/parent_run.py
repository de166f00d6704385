"""The train stage's own MLflow run, the parent of its trials' runs: opened with what identifies the stage's run,
closed with its children, and given the best trial's figures and, once the stage's outputs are in place, its
registered model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelines.baseline import NO_BASELINE, changed_since_baseline
from pipelines.params import Params
from pipelines.tracking.refusals import FALLBACK_DIR, replay_fallbacks
from pipelines.tracking.runs import (
    close_dangling_children,
    git_commit,
    log_params,
    open_store,
    params_hash,
    resolve_tracking_uri,
    start_run,
)
from pipelines.tracking.status import RUNS_VIEW_TAG, log_best_on_parent, runs_view, stopped_tags


@dataclass(frozen=True)
class ParentRun:
    """The store, the experiment and the parent run the trials' runs nest under."""

    client: Any
    experiment_id: str
    run_id: str
    tracking_uri: str
    experiment_name: str  # the DVC experiment's (DVC_EXP_NAME), "" outside one
    changed: str = ""  # what params.yaml changes from the baseline commit's (`changed_params`: '-' when nothing)

    def close(self, status: str) -> None:
        """End the parent run with `status`, and any child whose process died before ending its own as KILLED."""
        close_dangling_children(self.client, self.experiment_id, self.run_id)
        self.client.set_terminated(self.run_id, status=status)


def open_parent_run(params: Params, root: Path) -> ParentRun:
    """Open the store (the runs page's columns set) and start the parent run, tagged and with its params."""
    tracking_uri = resolve_tracking_uri(params.tracking.uri, root)
    client, experiment_id = open_store(params.tracking, root)
    # What an earlier run's tracking outage kept on disk goes into its run now (pipelines.tracking.refusals).
    replay_fallbacks(client, root / FALLBACK_DIR, lambda line: print(line, flush=True))
    client.set_experiment_tag(experiment_id, RUNS_VIEW_TAG, runs_view(params.task))  # the runs page's columns
    tags = {
        "git_commit": git_commit(root),
        "params_hash": params_hash(params),
        "dvc_exp_name": os.environ.get("DVC_EXP_NAME", ""),
        "stage": "train",
    }
    # The params this stage runs with: the working copy's (a queued experiment's temporary copy), not DVC_ROOT's.
    changed = changed_since_baseline(root=Path.cwd()) if Path("params.yaml").is_file() else ""
    name = parent_run_name(changed, tags["dvc_exp_name"], tags["params_hash"])
    run_id = start_run(client, experiment_id, name, {**tags, "changed": changed})
    log_params(client, run_id, params)
    return ParentRun(client, experiment_id, run_id, tracking_uri, tags["dvc_exp_name"], changed)


def parent_run_name(changed: str, experiment: str, params_hash: str) -> str:
    """The parent run's name: what it changes from the baseline commit's params (`optim=adafactor`, as `dvc exp
    show`'s `changed`), or `baseline` when nothing, then the DVC experiment's name when there is one, so the MLflow
    UI and `dvc exp show` name the same thing. Named after the experiment alone, the baseline's row could not be told
    from the others' without opening each. Without a committed params.yaml: `train-<params hash>`."""
    what = "baseline" if changed == "-" else changed if changed and changed != NO_BASELINE else ""
    return " · ".join(filter(None, [what, experiment])) or f"train-{params_hash[:8]}"


def tag_stopped_trials(parent: ParentRun, params: Params, summary: dict[str, Any]) -> None:
    """Tag the runs of the trials the scheduler stopped early as stopped."""
    for trial in summary["stopped_early"]:
        if trial["mlflow_run_id"] is None:
            continue
        # A stopped trial records its stop itself, unless Ray ended its process first (seen on a loaded host).
        for key, value in stopped_tags(params.tune.scheduler).items():
            parent.client.set_tag(trial["mlflow_run_id"], key, value)


def record_best(parent: ParentRun, params: Params, summary: dict[str, Any]) -> None:
    """The best trial on the parent run: its run id and headline figures."""
    client, best = parent.client, summary["best"]
    client.set_tag(parent.run_id, "best_run_id", best["mlflow_run_id"])
    log_best_on_parent(client, parent.run_id, params.task, best["metrics"])


def register_best(parent: ParentRun, params: Params, summary: dict[str, Any]) -> None:
    """The best trial's model registered, in `summary["registered_model"]` and on the parent run. Only once the
    stage's outputs are in place: a stage that fails after registering would leave a registered version that no
    `models/` and no `dvc.lock` hold."""
    best = summary["best"]
    summary["registered_model"] = register_best_model(parent.client, params, best["mlflow_run_id"], parent.tracking_uri)
    if summary["registered_model"]:
        parent.client.set_tag(parent.run_id, "registered_model", summary["registered_model"]["uri"])


def register_best_model(client: Any, params: Params, run_id: str, tracking_uri: str) -> dict[str, str] | None:
    """Register the best trial's logged model as a new version (`tracking.registered_model`); None when off."""
    from pipelines.tracking.mlflow_model import MODEL_URI_TAG, register_best

    name = params.tracking.registered_model_name(params.task)
    model_uri = client.get_run(run_id).data.tags.get(MODEL_URI_TAG)
    if name is None or model_uri is None:
        return None
    version = register_best(tracking_uri, model_uri, name, params.task)
    return {"name": name, "version": version, "uri": f"models:/{name}/{version}", "source": model_uri}
