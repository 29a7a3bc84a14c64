"""How many threads a CPU rank's next steps use, following the cores other processes leave it
(L2, Linux; everywhere else the count stays fixed).

Every parallel region of a step ends at a barrier, so one thread whose core another process
holds (a build, another server, a CPU hog) holds up the whole step: with a hog on one of two
cores a c1 request took twice as long on two threads as on one (docs/benchmarks.md, "Shared
cores"). The governor watches two things over a window of steps:
- how long this process's threads stood runnable but not running (the kernel's schedstat):
  above DOWN_WAIT of a core, another process shares our cores, so use one thread fewer;
- how long the CPUs we may use stood idle (/proc/stat): above UP_IDLE of a core, a core came
  free, so use one thread more (never above the configured count).
A quiet machine never crosses DOWN_WAIT (our threads have the cores), so the count there stays
the configured one. Windows that span an idle engine are dropped: idle cores between requests
say nothing about the cores while the engine computes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WINDOW_S = 0.5  # how much stepping time one decision looks at
MAX_GAP_S = 0.05  # a longer pause between steps (an idle engine) starts the window again
DOWN_WAIT = 0.4  # cores' worth of time our threads waited for a CPU: one thread fewer
UP_IDLE = 0.3  # cores' worth of idle time on our CPUs: one thread more


@dataclass(frozen=True)
class CpuSample:
    """Cumulative counters, in seconds, at `wall` (monotonic)."""

    wall: float
    waited: float  # this process's threads, runnable but not running
    idle: float  # idle time summed over the CPUs in this process's affinity mask


def read_cpu_sample(pid: int | None = None) -> CpuSample | None:
    """The counters now, or None where the kernel does not give them (not Linux, no schedstat)."""
    pid = pid or os.getpid()
    try:
        waited_ns = sum(int((task / "schedstat").read_text().split()[1])
                        for task in Path(f"/proc/{pid}/task").iterdir())
        cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)}
        ticks = 0
        for line in Path("/proc/stat").read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in cpus:
                ticks += int(fields[4]) + int(fields[5])  # idle + iowait
    except (OSError, AttributeError, IndexError, ValueError):
        return None
    return CpuSample(time.monotonic(), waited_ns / 1e9, ticks / os.sysconf("SC_CLK_TCK"))


class ThreadGovernor:
    """begin_step() before each step answers the thread count to use (1..ceiling);
    end_step() after it."""

    def __init__(self, ceiling: int, sampler: Callable[[], CpuSample | None] = read_cpu_sample,
                 window_s: float = WINDOW_S, max_gap_s: float = MAX_GAP_S) -> None:
        self.ceiling = ceiling
        self.threads = ceiling
        self._sampler = sampler
        self._window_s = window_s
        self._max_gap_s = max_gap_s
        self._start: CpuSample | None = None
        self._last_end = float("-inf")

    def begin_step(self, now: float | None = None) -> int:
        if self.ceiling <= 1:
            return self.threads
        now = time.monotonic() if now is None else now
        if self._start is None or now - self._last_end > self._max_gap_s:
            self._start = self._sampler()
            if self._start is None:  # no counters here: the configured count for good
                self.ceiling = self.threads
            return self.threads
        if now - self._start.wall < self._window_s:
            return self.threads
        end = self._sampler()
        if end is None or end.wall <= self._start.wall:
            return self.threads
        span = end.wall - self._start.wall
        waited, idle = (end.waited - self._start.waited) / span, (end.idle - self._start.idle) / span
        self._start = end
        if waited > DOWN_WAIT and self.threads > 1:
            self.threads -= 1
        elif idle > UP_IDLE and self.threads < self.ceiling:
            self.threads += 1
        return self.threads

    def end_step(self, now: float | None = None) -> None:
        self._last_end = time.monotonic() if now is None else now
