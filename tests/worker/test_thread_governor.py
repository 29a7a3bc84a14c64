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


def run_steps(
    governor: ThreadGovernor, cpu: FakeCpu, seconds: float, step_s: float = 0.01
) -> list[int]:
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
    assert set(counts) == {4}  # two busy windows are not yet a hog
    assert run_steps(governor, cpu, 0.5)[-1] == 3  # the third is; one thread at a time
    assert run_steps(governor, cpu, 10.0)[-1] == 1  # never below one
    cpu.rates = (0.0, 0.0)  # no waiting, no idle core: the hog still there, stay
    assert set(run_steps(governor, cpu, 2.0)) == {1}
    cpu.rates = (0.0, 1.0)  # a core stands idle: the hog left
    counts = run_steps(governor, cpu, 10.0)
    assert counts[-1] == 4 and sorted(counts) == counts  # one more per window, up to the ceiling


def test_a_raise_that_does_not_last_doubles_the_wait_before_the_next():
    cpu = FakeCpu()
    governor = ThreadGovernor(2, cpu.sample)
    cpu.rates = (0.9, 0.0)
    assert run_steps(governor, cpu, 2.0)[-1] == 1
    cpu.rates = (0.0, 1.0)
    counts = run_steps(governor, cpu, 6.0)
    assert counts[-1] == 2 and counts.index(2) * 0.01 >= 5.0 - 0.5 - 0.01  # HOLD_S after the drop
    cpu.rates = (0.9, 0.0)  # back at once: the raise did not last
    assert run_steps(governor, cpu, 2.0)[-1] == 1
    cpu.rates = (0.0, 1.0)
    counts = run_steps(governor, cpu, 12.0)
    assert counts.index(2) * 0.01 >= 10.0 - 1.0  # now twice as long


def test_idle_time_between_requests_is_not_a_free_core():
    cpu = FakeCpu()
    governor = ThreadGovernor(2, cpu.sample)
    cpu.rates = (0.9, 0.0)
    assert run_steps(governor, cpu, 1.6)[-1] == 1
    for _ in range(30):  # requests 0.3 s long, 0.2 s apart: the cores idle in the pauses only
        cpu.rates = (0.0, 1.0)
        cpu.advance(0.2)
        cpu.rates = (0.0, 0.0)
        assert set(run_steps(governor, cpu, 0.3)) == {1}


def test_no_counters_means_a_fixed_count():
    calls = []
    governor = ThreadGovernor(2, lambda: calls.append(1))  # a sampler that finds nothing
    assert [governor.begin_step(float(t)) for t in range(5)] == [2] * 5
    assert len(calls) == 1  # asked once, then never again


def test_a_failed_read_later_only_restarts_the_window():
    cpu = FakeCpu()
    cpu.rates = (0.9, 0.0)
    reads = iter([cpu.sample, lambda: None] + [cpu.sample] * 1000)
    governor = ThreadGovernor(2, lambda: next(reads)())
    assert run_steps(governor, cpu, 2.5)[-1] == 1  # one window lost, then the hog seen


def test_one_thread_is_never_governed():
    cpu = FakeCpu()
    cpu.rates = (0.9, 0.0)
    assert set(run_steps(ThreadGovernor(1, cpu.sample), cpu, 2.0)) == {1}


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not os.path.exists(f"/proc/{os.getpid()}/schedstat"),
    reason="schedstat and /proc/stat are Linux's",
)
def test_the_kernel_counters_read_and_advance():
    first = read_cpu_sample()
    assert first is not None and first.waited >= 0 and first.idle >= 0
    sum(range(2_000_000))
    second = read_cpu_sample()  # (waited may fall: a thread that ends takes its count along)
    assert second is not None and second.wall > first.wall and second.idle >= first.idle


def test_the_governor_only_runs_where_the_count_is_ours_to_change(monkeypatch):
    from tokenbus.config import EngineArgs
    from tokenbus.worker import worker

    monkeypatch.setattr(worker, "available_cpus", lambda: 2)
    monkeypatch.setattr(worker, "usable_affinity_cpus", lambda: 2)
    assert worker.governs_threads(EngineArgs().to_config(256))
    assert not worker.governs_threads(EngineArgs(num_threads=2).to_config(256))  # the user's choice
    assert not worker.governs_threads(
        EngineArgs(cudagraph_capture_sizes=[1, 2]).to_config(256)
    )  # compiled
    assert not worker.governs_threads(EngineArgs(tensor_parallel_size=2).to_config(256))
    assert not worker.governs_threads(EngineArgs(data_parallel_size=2).to_config(256))
    monkeypatch.setattr(worker, "usable_affinity_cpus", lambda: 8)  # a quota of 2 CPUs out of 8
    assert not worker.governs_threads(EngineArgs().to_config(256))
