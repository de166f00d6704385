"""A stage stopped by a signal ends with one line and the status a shell expects: Ctrl-C `interrupted` (130), SIGTERM
`terminated` (143 = 128 + 15), where SIGTERM used to kill it on the spot. And a stage whose DVC process ends while
a shell stands between them (dash does not exec `sh -c`'s command) is interrupted, not left training, orphaned.
The trials' stage, with Ray, is checked end to end in tests/e2e/test_interruption.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT

# A stage that says it is ready, then waits to be stopped.
WAITING_STAGE = textwrap.dedent(
    """
    import time
    from pipelines.errors import run_cli

    def main():
        print("ready", flush=True)
        time.sleep(60)

    run_cli(main, arguments=True)
    """
)


@pytest.mark.parametrize(
    ("sent", "line", "status"), [(signal.SIGINT, "interrupted", 130), (signal.SIGTERM, "terminated", 143)]
)
def test_a_signalled_stage_ends_with_one_line_and_the_shells_status(sent: int, line: str, status: int):
    stage = subprocess.Popen([sys.executable, "-c", WAITING_STAGE], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert stage.stdout.readline().strip() == "ready"
    stage.send_signal(sent)
    _, stderr = stage.communicate(timeout=30)
    assert (stage.returncode, stderr.strip()) == (status, line)


# The stage's parent is a shell; the "DVC process" it watches is another process, which ends after a second.
WATCHING_STAGE = textwrap.dedent(
    """
    import subprocess, sys, time
    import psutil
    from pipelines.errors import run_cli
    from pipelines.trials.interruption import interrupt_when_gone

    def main():
        pipeline = subprocess.Popen(["sleep", "1"])
        watched = {"pid": pipeline.pid, "started": psutil.Process(pipeline.pid).create_time(),
                   "host": __import__("socket").gethostname()}
        __import__("threading").Thread(target=interrupt_when_gone, args=(watched,), daemon=True).start()
        time.sleep(60)  # interrupted once `sleep 1` has ended (a zombie: this process has not reaped it)

    run_cli(main, arguments=True)
    """
)


def test_a_stage_is_interrupted_when_the_process_it_watches_ends():
    stage = subprocess.run([sys.executable, "-c", WATCHING_STAGE], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=30)  # fmt: skip
    assert (stage.returncode, stage.stderr.strip()) == (130, "interrupted"), stage.stderr


# Ray stops a trial's process by raising KeyboardInterrupt or SystemExit in it; met in a destructor, Python printed it
# as "Exception ignored in ..." with a traceback, which Ray forwarded to the stage's stderr.
UNRAISABLES = textwrap.dedent(
    """
    from pipelines.trials.trial import quiet_stop_of_this_process

    class Raises:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error

    quiet_stop_of_this_process()
    Raises(KeyboardInterrupt())
    Raises(SystemExit(1))
    Raises(ValueError("a real bug in a destructor"))
    """
)


def test_a_trial_process_stopped_in_a_destructor_prints_nothing_but_other_errors_still_print():
    done = subprocess.run([sys.executable, "-c", UNRAISABLES], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "ValueError: a real bug in a destructor" in done.stderr
    assert "KeyboardInterrupt" not in done.stderr and "SystemExit" not in done.stderr, done.stderr
    assert done.stderr.count("Traceback") == 1, done.stderr
