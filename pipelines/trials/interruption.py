"""Ctrl-C while the trials run: the trials stopped, their checkpoints kept for the next run to resume from, no lock
left behind, and the stage ending with one line (`interrupted`, `pipelines.errors.run_cli`), no traceback.

Ray Tune's own Ctrl-C handler stops the trials "gracefully": it asks each to stop, waits 5 s, kills them, then
returns the interrupted trials as results (which read as finished ones without their final metrics) and prints how
to `Tuner.restore` an experiment this stage never restores. So its handler is off while the Tuner runs
(TUNE_DISABLE_SIGINT_HANDLER, read when `fit` starts): Ctrl-C raises KeyboardInterrupt in the driver, which stops
the trials by ending its Ray session (a local cluster ends with it; on a joined cluster, Ray ends the job's actors when
their driver leaves) and removes the lock files the killed trials held (`checkpoints/<key>/.lock`). The trials' and
the parent's MLflow runs are then closed as KILLED (`pipelines.trials.parent_run.ParentRun.close`).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipelines.train.checkpoint import remove_unheld_locks

TUNE_SIGINT_SWITCH = "TUNE_DISABLE_SIGINT_HANDLER"


@contextmanager
def stopped_on_ctrl_c(checkpoint_root: Path) -> Iterator[None]:
    """Run the block (the Tuner's `fit`) with Ctrl-C raising KeyboardInterrupt: then stop the trials and remove the
    locks they held, and raise it again."""
    before = os.environ.get(TUNE_SIGINT_SWITCH)
    os.environ[TUNE_SIGINT_SWITCH] = "1"
    try:
        yield
    except KeyboardInterrupt:
        # Another Ctrl-C would cut this short and leave the locks: the cleanup is bounded (Ray's shutdown, then at
        # most remove_unheld_locks' wait), so it runs to its end.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stop_trials()
            remove_unheld_locks(checkpoint_root)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    finally:
        if before is None:
            os.environ.pop(TUNE_SIGINT_SWITCH, None)
        else:
            os.environ[TUNE_SIGINT_SWITCH] = before


def stop_trials() -> None:
    """End this driver's Ray session, and with it every trial (and Ray Train worker) it started."""
    import ray

    ray.shutdown()
