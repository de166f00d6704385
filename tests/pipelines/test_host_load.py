"""The host's load beside a trial's times: read from this machine's /proc and load average, not stubbed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipelines.host_load import HostLoad, cpu_times, is_under_load, usable_cores


def test_the_load_and_steal_of_a_window_are_measured_on_this_host():
    load = HostLoad(every_s=0.05).start()
    deadline = time.perf_counter() + 0.5
    while time.perf_counter() < deadline:  # busy: the window has CPU time to share out
        sum(i * i for i in range(1000))
    figures = load.stop()
    assert figures["host_cores"] == len(os.sched_getaffinity(0)) == usable_cores()
    assert len(load.loads) >= 5  # sampled on its thread, not once
    assert figures["host_load_max"] >= figures["host_load_mean"] >= min(load.loads) >= 0
    assert abs(figures["host_load_per_core"] - figures["host_load_mean"] / figures["host_cores"]) < 1e-12
    assert 0 <= figures["host_cpu_steal_pct"] <= 100


def test_under_load_means_more_runnable_threads_than_cores():
    assert is_under_load(2.5, 2.0) and not is_under_load(2.0, 2.0) and not is_under_load(None, 2.0)


def test_cpu_times_are_proc_stats_ticks_in_seconds_as_counted_by_hand():
    """psutil reads what the hand-written parser read (issue 71): /proc/stat's first line, user to steal, in
    seconds; guest time is inside user and nice, so not added again."""
    stat = Path("/proc/stat")
    if not stat.is_file():
        pytest.skip("no /proc/stat on this OS")
    ticks = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
    total, steal = cpu_times()
    per_second = os.sysconf("SC_CLK_TCK")
    # Read a moment apart: the machine's cores keep counting in between (0.5 s each at most here). psutil divides
    # each field before summing, so the float sum may fall a rounding error short of ours (52640.34999 vs .35).
    assert -1e-6 <= total - sum(ticks[:8]) / per_second < 0.5 * (os.cpu_count() or 1)
    assert -1e-6 <= steal - ticks[7] / per_second < 0.5 * (os.cpu_count() or 1)
