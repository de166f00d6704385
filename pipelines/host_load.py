"""How busy the host was while a trial ran: its load average and CPU steal, recorded beside the trial's times.

A CPU trial's time moves with whatever else runs on the machine (on a shared 2-core host, 5.7 s quiet and 73 s
under load for the same run), so a time is only comparable with the load it was taken under. The load average
counts runnable threads, the trial's own included: above the number of usable cores, threads waited for a CPU.
Steal is the share of CPU time the hypervisor gave to other guests (psutil.cpu_times), which no load figure
shows.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

SAMPLE_EVERY_S = 5.0


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's share, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_times() -> tuple[float, float] | None:
    """(all CPU time, stolen CPU time) in seconds since boot, summed over CPUs (psutil's reading of /proc/stat on
    Linux); None where psutil cannot read them. Guest time is already counted in user and nice time, so it is left
    out of the sum."""
    import psutil

    try:
        times = psutil.cpu_times()
    except (OSError, RuntimeError):
        return None
    parts = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return sum(getattr(times, name, 0.0) for name in parts), getattr(times, "steal", 0.0)


def is_under_load(load: float | None, cores: float | None) -> bool:
    """Whether a load average means threads waited for a CPU: more runnable threads than usable cores."""
    return load is not None and bool(cores) and load > cores  # type: ignore[operator]


@dataclass
class HostLoad:
    """Samples the 1-minute load average every `every_s` on a daemon thread between `start()` and `stop()`."""

    every_s: float = SAMPLE_EVERY_S
    loads: list[float] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _cpu_at_start: tuple[float, float] | None = None

    def start(self) -> HostLoad:
        self._cpu_at_start = cpu_times()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="host-load", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        if hasattr(os, "getloadavg"):
            self.loads.append(os.getloadavg()[0])

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def stop(self) -> dict[str, float]:
        """The metrics: `host_load_mean` and `host_load_max` (1-minute load average), `host_cores`,
        `host_load_per_core` (mean / cores; above 1, the CPUs were oversubscribed) and `host_cpu_steal_pct`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._sample()
        cores = usable_cores()
        out: dict[str, float] = {"host_cores": float(cores)}
        if self.loads:
            mean = sum(self.loads) / len(self.loads)
            out |= {"host_load_mean": mean, "host_load_max": max(self.loads), "host_load_per_core": mean / cores}
        end = cpu_times()
        if self._cpu_at_start is not None and end is not None and end[0] > self._cpu_at_start[0]:
            out["host_cpu_steal_pct"] = 100 * (end[1] - self._cpu_at_start[1]) / (end[0] - self._cpu_at_start[0])
        return out
