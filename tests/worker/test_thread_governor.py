"""The CPU thread governor: fewer threads while another process holds our cores, back up when a
core comes free, nothing on a quiet machine, windows across an idle engine dropped."""

from __future__ import annotations

import os
import sys

import pytest

from tokenbus.worker.thread_governor import CpuSample, ThreadGovernor, read_cpu_sample


class FakeCpu:
    """Counters that advance by `waited` and `idle` cores' worth per second of wall time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waited = self.idle = 0.0
        self.rates = (0.0, 0.0)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.waited += self.rates[0] * seconds
        self.idle += self.rates[1] * seconds

    def sample(self) -> CpuSample:
        return CpuSample(self.now, self.waited, self.idle)


def run_steps(governor: ThreadGovernor, cpu: FakeCpu, seconds: float, step_s: float = 0.01) -> list[int]:
    """Back-to-back steps (1 ms between them) for `seconds`: the thread count each one got."""
    counts = []
    for _ in range(round(seconds / step_s)):
        counts.append(governor.begin_step(cpu.now))
        cpu.advance(step_s - 0.001)
        governor.end_step(cpu.now)
        cpu.advance(0.001)
    return counts


def test_a_quiet_machine_keeps_every_thread():
    cpu = FakeCpu()
    cpu.rates = (0.05, 0.1)  # a little waiting (the API server waking), a little idle
    governor = ThreadGovernor(2, cpu.sample)
    assert set(run_steps(governor, cpu, 5.0)) == {2}


def test_a_hog_takes_a_thread_and_leaving_gives_it_back():
    cpu = FakeCpu()
    governor = ThreadGovernor(4, cpu.sample)
    cpu.rates = (0.9, 0.0)  # our threads wait most of a core: another process shares them
    counts = run_steps(governor, cpu, 1.2)
    assert counts[0] == 4 and counts[-1] == 2  # one fewer per 0.5 s window, not all at once
    assert run_steps(governor, cpu, 5.0)[-1] == 1  # never below one
    cpu.rates = (0.0, 0.0)  # no waiting, no idle core: the hog still there, stay
    assert set(run_steps(governor, cpu, 2.0)) == {1}
    cpu.rates = (0.0, 1.0)  # a core stands idle: the hog left
    counts = run_steps(governor, cpu, 2.0)
    assert counts[-1] == 4 and sorted(counts) == counts  # one more per window, up to the ceiling


def test_idle_time_between_requests_is_not_a_free_core():
    cpu = FakeCpu()
    governor = ThreadGovernor(2, cpu.sample)
    cpu.rates = (0.9, 0.0)
    assert run_steps(governor, cpu, 0.6)[-1] == 1
    for _ in range(10):  # requests 0.3 s long, 0.2 s apart: the cores idle in the pauses only
        cpu.rates = (0.0, 1.0)
        cpu.advance(0.2)
        cpu.rates = (0.0, 0.0)
        assert set(run_steps(governor, cpu, 0.3)) == {1}


def test_no_counters_means_a_fixed_count():
    governor = ThreadGovernor(2, lambda: None)
    assert [governor.begin_step(float(t)) for t in range(5)] == [2] * 5


def test_one_thread_is_never_governed():
    cpu = FakeCpu()
    cpu.rates = (0.9, 0.0)
    assert set(run_steps(ThreadGovernor(1, cpu.sample), cpu, 2.0)) == {1}


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists(f"/proc/{os.getpid()}/schedstat"),
                    reason="schedstat and /proc/stat are Linux's")
def test_the_kernel_counters_read_and_advance():
    first = read_cpu_sample()
    assert first is not None and first.waited >= 0 and first.idle >= 0
    sum(range(2_000_000))
    second = read_cpu_sample()
    assert second.wall > first.wall and second.waited >= first.waited and second.idle >= first.idle
