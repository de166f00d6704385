"""Ray's lines from its workers carry no ANSI colour codes where the driver's output is not a terminal."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO_ROOT, kill_session

# A driver as the train stage starts Ray (`init_ray`, a local cluster of its own), and three workers writing the same
# line to each of their streams: Ray prints the first with its prefix, and folds the others into a
# `[repeated 2x across cluster]` line (within its aggregation window, made long enough here) that it prints when it
# shuts down, which the driver does once the test, having seen the first lines, writes to its stdin.
DRIVER = """
import sys
import ray
from pipelines.trials.ray_cluster import init_ray

init_ray(1, None, 0)

@ray.remote(num_cpus=0)
class Speaker:
    def speak(self):
        print("a line of a Ray worker's stdout", flush=True)
        print("a line of a Ray worker's stderr", file=sys.stderr, flush=True)

ray.get([speaker.speak.remote() for speaker in [Speaker.remote() for _ in range(3)]])
sys.stdin.readline()
ray.shutdown()
"""
MARKERS = ("a line of a Ray worker's stdout", "a line of a Ray worker's stderr")


def test_ray_workers_lines_have_no_colour_codes_in_captured_output():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_COLOR_PREFIX", "RAY_ADDRESS")}
    env["RAY_DEDUP_LOGS_AGG_WINDOW_S"] = "300"
    proc = subprocess.Popen(
        [sys.executable, "-c", DRIVER], cwd=REPO_ROOT, env=env, start_new_session=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        while not all(any(m in line for line in lines) for m in MARKERS):
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        rest, _ = proc.communicate("\n", timeout=120)  # a guard against a hang, not a timing
    finally:
        kill_session(proc.pid)
        proc.wait()
    printed = "".join(lines) + rest
    # Ray's prefix is there, plain: before, `\x1b[36m(Speaker pid=1234)\x1b[0m a line ...`.
    assert [line.startswith("(Speaker pid=") for line in lines if any(m in line for m in MARKERS)] == [True, True]
    # And its deduplication's line, plain: before, `... \x1b[32m [repeated 2x across cluster]\x1b[0m`.
    # How many lines Ray folds depends on when each reaches its aggregation window (a loaded CI host folded one of
    # the two): at least one, and every one plain (the colour check above covers the whole output).
    assert printed.count("[repeated 2x across cluster]") >= 1, printed
    assert "\x1b[" not in printed, printed
