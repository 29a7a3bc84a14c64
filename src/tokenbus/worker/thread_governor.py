"""How many threads a CPU rank's next steps use, following the cores other processes leave it
(L3, Linux; everywhere else the count stays fixed).

Every parallel region of a step ends at a barrier, so one thread whose core another process
holds (a build, another server, a CPU hog) holds up the whole step: with a hog on one of two
cores a c1 request took twice as long on two threads as on one (docs/benchmarks.md, "Seventh
session"). The governor watches, per window of stepping:
- how long this process's threads stood runnable but not running (the kernel's schedstat):
  above DOWN_WAIT of a core in DOWN_WINDOWS windows in a row, another process shares our cores,
  so use one thread fewer. A lone window is not enough: the API server and a client on the
  same cores cause short waits at every token;
- how long the CPUs we may use stood idle (/proc/stat): above UP_IDLE of a core, a core came
  free, so use one thread more (never above the configured count). A raise that the next drop
  undoes soon after doubles the wait before the next raise (HOLD_S up to MAX_HOLD_S), so a
  load that sits on the threshold costs a switch a minute, not one a second.
A quiet machine seldom crosses DOWN_WAIT, so the count there stays the configured one. Windows
that span an idle engine are dropped: idle cores between requests say nothing about the cores
while the engine computes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WINDOW_S = 0.5  # how much stepping time one decision looks at
MAX_GAP_S = 0.05  # a longer pause between steps (an idle engine) starts the window again
DOWN_WAIT = 0.4  # cores' worth of time our threads waited for a CPU ...
DOWN_WINDOWS = 3  # ... in this many windows in a row: one thread fewer
UP_IDLE = 0.3  # cores' worth of idle time on our CPUs: one thread more
HOLD_S = 5.0  # a raise undone within this long doubles it (the wait before the next raise)
MAX_HOLD_S = 120.0


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
        waited_ns = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:  # schedstat: run time, wait time (ns), timeslices
                waited_ns += int((task / "schedstat").read_text().split()[1])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended while we looked
                continue
        cpus = {f"cpu{index}" for index in os.sched_getaffinity(pid)}
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

    def __init__(
        self,
        ceiling: int,
        sampler: Callable[[], CpuSample | None] = read_cpu_sample,
        window_s: float = WINDOW_S,
        max_gap_s: float = MAX_GAP_S,
    ) -> None:
        self.ceiling = ceiling
        self.threads = ceiling
        self._sampler = sampler
        self._window_s = window_s
        self._max_gap_s = max_gap_s
        self._start: CpuSample | None = None
        self._last_end = float("-inf")
        self._enabled = ceiling > 1 and sampler() is not None  # no counters here: the count stays
        self._busy_windows = 0  # windows in a row with our threads waiting for a CPU
        self._hold_s = HOLD_S
        self._last_raise = float("-inf")
        self._last_drop = float("-inf")

    def begin_step(self, now: float | None = None) -> int:
        if not self._enabled:
            return self.threads
        now = time.monotonic() if now is None else now
        if self._start is None or now - self._last_end > self._max_gap_s:
            self._start = self._sampler()
            return self.threads
        if now - self._start.wall < self._window_s:
            return self.threads
        end = self._sampler()
        if end is None or end.wall <= self._start.wall:
            self._start = end  # a failed read: start the window again
            return self.threads
        span = end.wall - self._start.wall
        waited, idle = (
            (end.waited - self._start.waited) / span,
            (end.idle - self._start.idle) / span,
        )
        self._start = end
        self._busy_windows = self._busy_windows + 1 if waited > DOWN_WAIT else 0
        if self._busy_windows >= DOWN_WINDOWS and self.threads > 1:
            self._busy_windows = 0
            if now - self._last_raise < self._hold_s:  # the last raise did not last
                self._hold_s = min(2 * self._hold_s, MAX_HOLD_S)
            self.threads -= 1
            self._last_drop = now
        elif (
            idle > UP_IDLE and self.threads < self.ceiling and now - self._last_drop >= self._hold_s
        ):
            self.threads += 1
            self._last_raise = now
        return self.threads

    def end_step(self, now: float | None = None) -> None:
        self._last_end = time.monotonic() if now is None else now
