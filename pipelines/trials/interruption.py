"""Ctrl-C while the trials run: the trials stopped, their checkpoints kept for the next run to resume from, no lock
left behind, and the stage ending with one line (`interrupted`, `pipelines.errors.run_cli`), no traceback.

Ray Tune's own Ctrl-C handler stops the trials "gracefully": it asks each to stop, waits 5 s, kills them, then
returns the interrupted trials as results (which read as finished ones without their final metrics) and prints how
to `Tuner.restore` an experiment this stage never restores. So its handler is off while the Tuner runs
(TUNE_DISABLE_SIGINT_HANDLER, read when `fit` starts): Ctrl-C raises KeyboardInterrupt in the driver, which stops
the trials by ending its Ray session (a local cluster ends with it; on a joined cluster, Ray ends the job's actors when
their driver leaves) and removes the lock files the killed trials held (`checkpoints/<key>/.lock`). The trials' and
the parent's MLflow runs are then closed as KILLED (`pipelines.trials.parent_run.ParentRun.close`). The line says
what to do next: `interrupted; rerun the same command to resume from step N`, N read from the checkpoint of each trial
that was running. SIGTERM (`kill`, `scancel`, a preempted node) does the same (`terminated; ...`, exit 143), where
`ray.init`'s own handler exited on the spot and left the runs RUNNING.

DVC runs a stage as its child and ignores SIGINT itself while it does (dvc/stage/run.py, DVC 3.x: SIG_IGN around
the child's `communicate`), counting on the terminal's Ctrl-C, which signals the whole foreground process group, to
reach the stage too. SIGINT sent to the `dvc` process alone is dropped by the kernel, unseen by any process; but
`dvc` ended (SIGTERM, SIGKILL, `dvc queue kill`) used to leave the stage training on, orphaned, writing into the
workspace. `interrupt_when_parent_ends` makes that a Ctrl-C, also where a shell stands between `dvc` and the stage.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipelines.errors import Interrupted, Terminated, raise_on_sigterm, stopped_by_sigterm
from pipelines.train.checkpoint import CHECKPOINT_FILE, LOCK_FILE, remove_unheld_locks
from pipelines.train.distributed_checkpoint import LINK, LOOP_FILE

TUNE_SIGINT_SWITCH = "TUNE_DISABLE_SIGINT_HANDLER"


@contextmanager
def stopped_on_ctrl_c(checkpoint_root: Path) -> Iterator[None]:
    """Run the block (the Tuner's `fit`) with Ctrl-C raising KeyboardInterrupt and SIGTERM `Terminated`: then stop the
    trials and remove the locks they held, and raise `Interrupted` (`Terminated`), saying the step each running trial
    resumes from."""
    before = os.environ.get(TUNE_SIGINT_SWITCH)
    os.environ[TUNE_SIGINT_SWITCH] = "1"
    sigterm_before = raise_on_sigterm()  # ray.init's handler exits on the spot, the runs left RUNNING
    # Python's Ctrl-C even where the stage started with SIGINT ignored (bash ignores it for a script's background
    # job): SIGINT is also how the stage stops when DVC ends under it, and ignored, the stage trained on to its end.
    sigint_before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    except KeyboardInterrupt as stop:
        # Another Ctrl-C or SIGTERM would cut this short and leave the locks: the cleanup is bounded (Ray's shutdown,
        # then at most remove_unheld_locks' wait), so it runs to its end.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            running = held_folders(checkpoint_root)  # before the trials stop: then their locks are let go
            stop_trials()
            remove_unheld_locks(checkpoint_root)
            hint = resume_hint([checkpoint_step(folder) for folder in running])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        raise (Terminated if stopped_by_sigterm(stop) else Interrupted)(hint) from None
    finally:
        signal.signal(signal.SIGTERM, sigterm_before)
        signal.signal(signal.SIGINT, sigint_before)
        if before is None:
            os.environ.pop(TUNE_SIGINT_SWITCH, None)
        else:
            os.environ[TUNE_SIGINT_SWITCH] = before


def stop_trials() -> None:
    """End this driver's Ray session, and with it every trial (and Ray Train worker) it started."""
    import ray

    ray.shutdown()


def held_folders(checkpoint_root: Path) -> list[Path]:
    """The checkpoint folders whose lock a live process holds: those of the trials running now."""
    held = []
    for lock in sorted(checkpoint_root.glob(f"*/{LOCK_FILE}")):
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:  # its trial ended meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(lock.parent)
        finally:
            os.close(fd)  # closing releases a lock this took
    return held


def checkpoint_step(folder: Path) -> int | None:
    """The optimizer step the checkpoint in `folder` resumes from: 0 without one, None when it cannot be read."""
    import torch

    written = [path for path in (folder / CHECKPOINT_FILE, folder / LINK / LOOP_FILE) if path.is_file()]
    if not written:
        return 0
    path = written[0]  # the one file of a single process, or rank 0's loop file of a run on several ranks
    try:  # mapped, not read: only the loop's state is looked at
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(json.loads(payload["state"])["step"])
    except (OSError, RuntimeError, KeyError, ValueError):
        return None


def resume_hint(steps: list[int | None]) -> str:
    """What to do after Ctrl-C, from the steps the running trials' checkpoints hold (`checkpoint_step`)."""
    known = sorted({step for step in steps if step})
    if not known:
        return "rerun the same command to start again (no checkpoint had been written yet)"
    if len(known) == 1 and len(steps) == 1:
        return f"rerun the same command to resume from step {known[0]}"
    return f"rerun the same command to resume its trials from their checkpoints (steps {', '.join(map(str, known))})"


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_EVERY_S = 0.5


def interrupt_when_parent_ends() -> None:
    """Have this process sent SIGINT (Ctrl-C: the trials stopped, their checkpoints kept) when the process that started
    it ends; Linux only (prctl), elsewhere nothing.

    Its parent is watched by the kernel. DVC runs a stage as `$SHELL -c <cmd>`, and bash and zsh exec the command, so
    the parent is `dvc`; but dash (`/bin/sh`, which DVC takes where SHELL is unset: a container, cron, CI) stays in
    between, outlives `dvc`, and the stage trained on, orphaned. Then a thread watches the DVC process itself."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)
    if os.getppid() != parent:  # it ended before the kernel was asked
        os.kill(os.getpid(), signal.SIGINT)
        return
    from pipelines.workspace import running_pipeline

    pipeline = running_pipeline()
    if pipeline is not None and pipeline["pid"] != parent:
        threading.Thread(target=interrupt_when_gone, args=(pipeline,), name="pipeline-watch", daemon=True).start()


def interrupt_when_gone(pipeline: dict[str, Any]) -> None:
    """Send this process SIGINT once `pipeline` (`running_pipeline`'s answer: its PID and start time) has ended."""
    from pipelines.workspace import alive

    while alive(pipeline):
        time.sleep(WATCH_EVERY_S)
    os.kill(os.getpid(), signal.SIGINT)
