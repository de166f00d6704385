"""How a stage ends (issue 69): `run_cli` ends the process with `os._exit` after what a normal exit runs first, so a
stage skips Python's teardown of its modules but loses nothing (atexit handlers, non-daemon threads, buffered output,
its exit status); and the train stage stops its own Ray with the autoscaler monitor killed before Ray's shutdown
starts (that monitor spent a second of every shutdown reporting its SIGTERM to a stopped GCS)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# A stage whose end has work left: an atexit handler, a non-daemon thread still writing, output not flushed.
ENDING_STAGE = textwrap.dedent(
    """
    import atexit, sys, threading, time
    from pathlib import Path
    from pipelines.errors import UserError, run_cli

    out = Path(sys.argv[1])

    def late_write():
        time.sleep(0.5)
        (out / "thread.txt").write_text("done")

    def main():
        atexit.register(lambda: (out / "atexit.txt").write_text("ran"))
        threading.Thread(target=late_write).start()  # not a daemon: a normal exit waits for it
        sys.stdout.write("unflushed line")  # no newline, no flush: a pipe buffers it
        if sys.argv[2] == "fail":
            raise UserError("bad value for key x: 3 (allowed: 1, 2)")

    run_cli(main, arguments=True)
    """
)


@pytest.mark.parametrize(("ending", "status"), [("ok", 0), ("fail", 1)])
def test_a_stage_ends_with_its_status_and_loses_nothing_a_normal_exit_keeps(tmp_path: Path, ending: str, status: int):
    done = subprocess.run([sys.executable, "-c", ENDING_STAGE, str(tmp_path), ending], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == status, done.stderr
    assert done.stdout == "unflushed line"
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    if ending == "fail":
        assert done.stderr.strip() == "error: bad value for key x: 3 (allowed: 1, 2)"


# Starts our own local cluster as the train stage does, then records whether the monitor had already ended when
# Ray's own shutdown was called, and how (its exit status).
STOPPING_DRIVER = textwrap.dedent(
    """
    import ray
    from pipelines.trials.ray_cluster import init_ray, stop_ray

    init_ray(1, None, 0)
    monitor = ray._private.worker._global_node.all_processes["monitor"][0].process
    seen = {}
    shutdown = ray.shutdown

    def recording_shutdown(*args, **kwargs):
        seen["monitor ended before shutdown"] = monitor.poll() is not None
        return shutdown(*args, **kwargs)

    ray.shutdown = recording_shutdown
    stop_ray()
    print(seen, monitor.wait(timeout=30), ray.is_initialized())
    """
)


def test_the_train_stage_kills_its_own_rays_monitor_before_rays_shutdown(tmp_path: Path):
    done = subprocess.run([sys.executable, "-c", STOPPING_DRIVER], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # SIGKILL (-9): its SIGTERM handler, which waited on the stopped GCS, never ran.
    assert done.stdout.split("\n")[-2] == "{'monitor ended before shutdown': True} -9 False", done.stdout
