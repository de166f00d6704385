"""Artifacts that reach the store late rather than never: retried with backoff, then recorded as pending on their
run, and sent by `python -m stages.train --resume-upload` once the bucket is back.

A team server proxies artifacts to a bucket that can fail on its own while the store (PostgreSQL) is fine. A trial
that trained must not be lost to that: each upload is retried for `tracking.upload_retry_s`; if the bucket still
fails, the run's tag `upload.pending` records, as JSON, each missing artifact and where its file stays on disk, and
the stage says so. Local places are paths relative to the repository root, or `trial:<id>[/file]` for a trial's
folder, which the train stage keeps (`models/best`, or `models/unsent/<id>` for a trial that is not the best), and a
later train carries to its own `models/unsent/` (`pipelines.trials.unsent`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

PENDING_TAG = "upload.pending"
TRIAL_PREFIX = "trial:"
UNSENT_DIR = "unsent"  # under models/: what pending artifacts of trials other than the best (or earlier trains) need
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
        say(f"could not send {upload.artifact!r} to the artifact store after {retry_s:.0f} s of retries "
            f"({error_line(err)}); it is kept on disk and recorded on the run as {PENDING_TAG}: "
            "send it with `python -m stages.train --resume-upload`")  # fmt: skip
        return None


def error_line(err: BaseException) -> str:
    """An error as one short line for a console message: its type and the first line of its text."""
    reason = str(err).splitlines()[0][:300] if str(err) else ""
    return f"{type(err).__name__}: {reason}"


BLOB_TAG = "compile.blob_sent"  # on the run that holds a compile blob as an artifact: the blob's fingerprint
BLOB_RUN_TAG = "compile.blob_run"  # on every run that made or used the blob: the run that holds it
BLOB_FOLDER = "compile_cache"


def send_compile_blob_once(client: Any, run_id: str, blob: Path) -> str:
    """Log a compiled trial's Mega-Cache blob (`compile_cache/<fingerprint>.bin`, `pipelines.train.compile_cache`)
    on `run_id`, unless a run of the same experiment already holds that fingerprint's blob; either way the run
    is tagged with the run that holds it, which is returned.

    The trials of one search share a fingerprint (they differ by their learning rate), and each used to send the
    same blob, megabytes through the server's proxy per trial. Two trials that finish at the same moment may both
    send it; every later one finds it."""
    experiment_id = client.get_run(run_id).info.experiment_id
    key = blob.name.removesuffix(".bin")
    found = client.search_runs([experiment_id], filter_string=f"tags.`{BLOB_TAG}` = '{key}'", max_results=1)
    if found:
        holder = found[0].info.run_id
    else:
        client.log_artifact(run_id, str(blob), BLOB_FOLDER)
        client.set_tag(run_id, BLOB_TAG, key)  # only once it is there: a failed send leaves the next trial to send it
        holder = run_id
    client.set_tag(run_id, BLOB_RUN_TAG, holder)
    return holder
