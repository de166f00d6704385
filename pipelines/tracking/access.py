"""Who may write to a team's MLflow server: its refusals turned into errors that say why, before any trial starts.

A server run with `mlflow server --app-name basic-auth` answers 401 to credentials it does not know and 403 to a
user without permission on the experiment. MLflow's client reports both as a raw `MlflowException`; here they
become a `UserError` naming the key, the user and what to do. The password is never part of a message: only the
user name (from `MLFLOW_TRACKING_USERNAME`) is.
"""

from __future__ import annotations

import os
from typing import Any

from pipelines.errors import UserError
from pipelines.params import TrackingParams

DOC = "docs/how-to/team-server.md"
UNAUTHENTICATED, PERMISSION_DENIED = "UNAUTHENTICATED", "PERMISSION_DENIED"


def server_user() -> str:
    """The user the client authenticates as: MLflow's variable, else its credentials file's (or 'nobody')."""
    if name := os.environ.get("MLFLOW_TRACKING_USERNAME"):
        return name
    try:
        from mlflow.utils.credentials import read_mlflow_creds

        return read_mlflow_creds().username or "nobody (no credentials set)"
    except Exception:  # noqa: BLE001 - an unreadable credentials file means no user
        return "nobody (no credentials set)"


def refusal(err: BaseException, tracking: TrackingParams) -> UserError | None:
    """The UserError for a server's 401 or 403, or None when `err` is another failure."""
    code = getattr(err, "error_code", None)
    if code == UNAUTHENTICATED:
        return UserError(
            f"tracking.uri = {tracking.uri!r}: the MLflow server refused the credentials of user {server_user()!r} "
            "(401 Unauthorized); set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
            f"~/.mlflow/credentials, to an account on that server ({DOC})"
        )
    if code == PERMISSION_DENIED:
        return UserError(
            f"tracking.experiment = {tracking.experiment!r}: user {server_user()!r} may not write to this "
            f"experiment on {tracking.uri!r} (403 Permission denied); nothing was trained. Ask the server's admin "
            f"for EDIT permission on it, or choose an experiment you may write to ({DOC})"
        )
    return None


def check_can_write(client: Any, experiment_id: str, tag: tuple[str, str], tracking: TrackingParams) -> None:
    """Write the experiment's kind tag (a value it already holds): a server refuses it as it would refuse every
    run of this stage, so the refusal comes now, with its reason, before a run opens or a trial starts."""
    try:
        client.set_experiment_tag(experiment_id, *tag)
    except Exception as err:  # noqa: BLE001 - a refusal is explained; anything else is the caller's to report
        if (explained := refusal(err, tracking)) is not None:
            raise explained from None
        raise
