"""Artifacts that reach the store late rather than never: retried with backoff, then recorded as pending on their
run, and sent by `python -m stages.train --resume-upload` once the bucket is back.

A team server proxies artifacts to a bucket that can fail on its own while the store (PostgreSQL) is fine. A trial
that trained must not be lost to that: each upload is retried for `tracking.upload_retry_s`; if the bucket still
fails, the run's tag `upload.pending` records, as JSON, each missing artifact and where its file stays on disk, and
the stage says so. Local places are paths relative to the repository root, or `trial:<id>[/file]` for a trial's
folder, which the train stage keeps (`models/best`, or `models/unsent/<id>` for a trial that is not the best).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

PENDING_TAG = "upload.pending"
TRIAL_PREFIX = "trial:"
UNSENT_DIR = "unsent"  # under models/: the folders of trials (other than the best) whose model was not sent
STORE_RETRY_S = 60.0  # recording what is pending goes to the store (not the bucket): it should answer
Result = TypeVar("Result")


def with_retries(upload: Callable[[], Result], retry_s: float, first_delay_s: float = 1.0) -> Result:
    """`upload()`, retried with doubling delays (at most 10 s) until it succeeds or `retry_s` has passed; then the
    last error is raised."""
    deadline, delay = time.monotonic() + retry_s, first_delay_s
    while True:
        try:
            return upload()
        except Exception:  # noqa: BLE001 - any transport or server error: the bucket may come back
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 10.0)


def pending(client: Any, run_id: str) -> dict[str, str]:
    """The run's missing artifacts: {artifact path on the run: local place}."""
    return json.loads(client.get_run(run_id).data.tags.get(PENDING_TAG) or "{}")


def set_pending(client: Any, run_id: str, entries: dict[str, str]) -> None:
    """Record the run's missing artifacts (the tag removed when none is left)."""
    if entries:
        client.set_tag(run_id, PENDING_TAG, json.dumps(entries, sort_keys=True))
    else:
        client.delete_tag(run_id, PENDING_TAG)


@dataclass(frozen=True)
class Upload:
    """One artifact to send: its path on the run, where its file is kept if the bucket refuses it, and the call
    that sends it."""

    artifact: str
    local: str
    send: Callable[[], Any]


def send_or_defer(client: Any, run_id: str, upload: Upload, retry_s: float, say: Callable[[str], None]) -> Any:
    """`upload.send()` with retries; if the bucket still fails, record the artifact as pending on the run (kept at
    `upload.local`), say which and how to send it later, and return None."""
    try:
        return with_retries(upload.send, retry_s)
    except Exception as err:  # noqa: BLE001 - reported and recorded, not raised: the trial's results stand
        # Retried too: right after the proxy's 500s, the client's pooled connections were seen reset.
        record = {upload.artifact: upload.local}
        with_retries(lambda: set_pending(client, run_id, {**pending(client, run_id), **record}), STORE_RETRY_S)
        reason = str(err).splitlines()[0][:300] if str(err) else ""
        say(f"could not send {upload.artifact!r} to the artifact store after {retry_s:.0f} s of retries "
            f"({type(err).__name__}: {reason}); it is kept on disk and recorded on the run as {PENDING_TAG}: "
            "send it with `python -m stages.train --resume-upload`")  # fmt: skip
        return None
