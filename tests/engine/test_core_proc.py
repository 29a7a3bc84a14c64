"""The EngineCore process: busy loop, start-up handshake, fatal errors, shutdown, orphans.

The engine here is a real EngineCore (scheduler, KV manager) around a fake worker
(tests/fixtures/engine.py), so each spawned process costs its imports, not a model load.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.core.test_kv_connector_scheduler import FakeConnector
from tests.fixtures.engine import (
    KV_TOO_SMALL,
    FakeWorker,
    broken_engine_core,
    expected_tokens,
    fake_engine_core,
    make_fake_setup,
    too_small_engine_core,
)
from tokenbus.core.outputs import KVConnectorOutput
from tokenbus.engine.core import EngineCore
from tokenbus.engine.core_proc import IDLE_BACKOFF_S, EngineCoreLoop
from tokenbus.engine.exceptions import EngineDeadError
from tokenbus.engine.messages import MessageType, RequestType, UtilityCall
from tokenbus.engine.mp_client import SyncMPClient
from tokenbus.protocol import EngineOutputs, EngineRequest, FinishReason, SchedulerStats
from tokenbus.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(60)


def make_request(request_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def collect_tokens(client, request_ids: set[str]) -> dict[str, list[int]]:
    """Read outputs until every request in request_ids has finished."""
    tokens: dict[str, list[int]] = {rid: [] for rid in request_ids}
    unfinished = set(request_ids)
    while unfinished:
        for out in client.get_output().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                unfinished.discard(out.request_id)
    return tokens


def _slow_start(setup, delay_s: float):
    time.sleep(delay_s)
    return fake_engine_core(setup)


# ---------------------------------------------------------------------- the busy loop, no process
def test_busy_loop_orders_inputs_before_steps_and_stops_on_shutdown():
    engine = fake_engine_core(make_fake_setup())
    inputs: queue.Queue = queue.Queue()
    emitted: list[tuple[MessageType, object]] = []
    loop = EngineCoreLoop(engine, inputs, lambda kind, payload: emitted.append((kind, payload)))
    inputs.put((RequestType.ADD, make_request("a", [1, 2, 3], 4)))
    inputs.put((RequestType.ADD, make_request("b", [5, 6], 100)))
    inputs.put((RequestType.ABORT, ["b"]))  # lands before the first step: b never runs
    thread = threading.Thread(target=loop.run)
    thread.start()
    deadline = time.monotonic() + 10
    while not any(
        k is MessageType.OUTPUTS and any(o.finished for o in p.outputs) for k, p in emitted
    ):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    inputs.put((RequestType.UTILITY, UtilityCall(7, "check_integrity")))
    inputs.put((RequestType.SHUTDOWN, None))
    thread.join(timeout=10)
    assert not thread.is_alive()
    outputs = [o for k, p in emitted if k is MessageType.OUTPUTS for o in p.outputs]
    assert {o.request_id for o in outputs} == {"a"}
    assert [t for o in outputs for t in o.new_token_ids] == expected_tokens([1, 2, 3], 4)
    assert outputs[0].first_scheduled_time > 0 and all(
        o.first_scheduled_time == 0 for o in outputs[1:]
    )
    results = [p for k, p in emitted if k is MessageType.UTILITY_RESULT]
    assert results[0].call_id == 7 and results[0].error is None


def test_busy_loop_with_async_scheduling_reports_only_steps_it_read():
    """A call that only launches a step (the first of a run ahead) has nothing to report: no
    empty OUTPUTS message goes to the front end, and the loop does not back off after it."""
    engine = fake_engine_core(make_fake_setup(async_scheduling=True))
    inputs: queue.Queue = queue.Queue()
    emitted: list = []
    loop = EngineCoreLoop(engine, inputs, lambda kind, payload: emitted.append((kind, payload)))
    inputs.put((RequestType.ADD, make_request("a", [1, 2, 3], 5)))
    thread = threading.Thread(target=loop.run)
    thread.start()
    deadline = time.monotonic() + 10
    while not any(o.finished for _, p in list(emitted) for o in p.outputs):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    inputs.put((RequestType.SHUTDOWN, None))
    thread.join(timeout=10)
    reports = [p for k, p in emitted if k is MessageType.OUTPUTS]
    assert all(p.scheduler_stats is not None for p in reports)
    assert [t for p in reports for o in p.outputs for t in o.new_token_ids] == expected_tokens(
        [1, 2, 3], 5
    )
    engine.check_integrity()


def test_busy_loop_reports_gauges_after_aborts_while_idle():
    engine = fake_engine_core(make_fake_setup())
    inputs: queue.Queue = queue.Queue()
    emitted: list = []
    loop = EngineCoreLoop(engine, inputs, lambda kind, payload: emitted.append((kind, payload)))
    engine.add_request(make_request("a", [1, 2], 1000))
    engine.step()
    inputs.put((RequestType.ABORT, ["a"]))
    thread = threading.Thread(target=loop.run)
    thread.start()
    deadline = time.monotonic() + 10
    while not emitted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    inputs.put((RequestType.SHUTDOWN, None))
    thread.join(timeout=10)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    # The abort emptied the engine: the last report says so, though no step ran after it.
    stats = [p.scheduler_stats for k, p in emitted if k is MessageType.OUTPUTS]
    assert stats and stats[-1].num_running_reqs == 0 and stats[-1].kv_cache_usage == 0.0


def test_busy_loop_survives_a_request_the_engine_rejects():
    engine = fake_engine_core(make_fake_setup())
    inputs: queue.Queue = queue.Queue()
    emitted: list = []
    loop = EngineCoreLoop(engine, inputs, lambda kind, payload: emitted.append((kind, payload)))
    inputs.put((RequestType.ADD, make_request("a", [1], 3)))
    inputs.put((RequestType.ADD, make_request("a", [1], 3)))  # duplicate id: the scheduler refuses
    thread = threading.Thread(target=loop.run)
    thread.start()
    deadline = time.monotonic() + 10
    while engine.has_unfinished_requests() or not emitted:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    inputs.put((RequestType.SHUTDOWN, None))
    thread.join(timeout=10)
    outputs = [o for k, p in emitted if k is MessageType.OUTPUTS for o in p.outputs]
    assert outputs[0].finish_reason is FinishReason.ERROR and not outputs[0].new_token_ids
    assert [t for o in outputs[1:] for t in o.new_token_ids] == expected_tokens([1], 3)
    engine.check_integrity()


def test_busy_loop_backs_off_when_no_request_can_run():
    class StalledEngine:  # one request that never becomes runnable (e.g. its grammar compiles)
        num_steps = 0

        def has_unfinished_requests(self) -> bool:
            return True

        def step(self) -> EngineOutputs:
            self.num_steps += 1
            return EngineOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=1))

    engine, inputs, emitted = StalledEngine(), queue.Queue(), []
    thread = threading.Thread(
        target=EngineCoreLoop(engine, inputs, lambda *m: emitted.append(m)).run
    )
    thread.start()
    time.sleep(0.2)
    inputs.put((RequestType.SHUTDOWN, None))
    thread.join(timeout=10)
    assert not thread.is_alive()
    # The waiting gauge once, then nothing more to report: the front end is not flooded.
    assert [p.scheduler_stats.num_waiting_reqs for _, p in emitted] == [1]
    assert engine.num_steps < 0.2 / IDLE_BACKOFF_S + 50  # no hot spin


class _SendingWorker(FakeWorker):
    """A prefiller's worker: the blocks of a finished request are held for a decoder to pull;
    nobody does, so each is reported sent (freed) once its own timeout has passed on `clock`."""

    def __init__(self, num_blocks: int, timeouts: dict[str, float], clock: list[float]) -> None:
        super().__init__(num_blocks)
        self.timeouts, self.clock = timeouts, clock
        self.deadlines: dict[str, float] = {}

    def execute_model(self, so):
        output = super().execute_model(so)
        for req_id in so.finished_req_ids:
            self.deadlines[req_id] = self.clock[0] + self.timeouts[req_id]
        expired = [r for r, deadline in self.deadlines.items() if deadline <= self.clock[0]]
        for req_id in expired:
            del self.deadlines[req_id]
        output.kv_connector_output = KVConnectorOutput(finished_sending=expired)
        return output


def test_busy_loop_reports_kv_usage_when_unpulled_blocks_are_freed_without_a_step():
    clock = [0.0]
    setup = make_fake_setup()
    worker = _SendingWorker(setup.config.cache.num_kv_blocks, {"a": 120, "b": 230}, clock)
    engine = EngineCore(setup.config, None, setup.arch, setup.eos_token_id, worker=worker)
    engine.scheduler.connector = FakeConnector(send_after_finish={"a", "b"})
    inputs: queue.Queue = queue.Queue()
    emitted: list = []
    loop = EngineCoreLoop(engine, inputs, lambda kind, payload: emitted.append((kind, payload)))
    inputs.put((RequestType.ADD, make_request("a", list(range(1, 41)), 1)))  # 3 blocks
    inputs.put((RequestType.ADD, make_request("b", list(range(50, 70)), 1)))  # 2 blocks
    thread = threading.Thread(target=loop.run)
    thread.start()

    def reports() -> list[EngineOutputs]:
        return [p for k, p in list(emitted) if k is MessageType.OUTPUTS and p.scheduler_stats]

    def reported_usage() -> list[float]:
        return [p.scheduler_stats.kv_cache_usage for p in reports()]

    def wait_for_usage(usage: float) -> None:
        deadline = time.monotonic() + 10
        while not reported_usage() or reported_usage()[-1] != pytest.approx(usage):
            assert time.monotonic() < deadline, reported_usage()
            time.sleep(0.01)

    try:
        num_blocks = engine.num_kv_blocks - 1  # the null block is not counted
        wait_for_usage(5 / num_blocks)  # both finished, their blocks held for the decoder
        time.sleep(0.2)  # the loop keeps polling the worker meanwhile...
        num_reports = len(reports())
        time.sleep(0.2)
        assert len(reports()) == num_reports  # ...with nothing to report
        clock[0] = 121.0  # a's blocks were never pulled: freed while b's are still held
        wait_for_usage(2 / num_blocks)
        clock[0] = 231.0
        wait_for_usage(0.0)
    finally:
        inputs.put((RequestType.SHUTDOWN, None))
        thread.join(timeout=10)
    engine.check_integrity()


# ---------------------------------------------------------------------- the process
def test_handshake_round_trip_and_clean_shutdown():
    client = SyncMPClient(make_fake_setup(num_kv_blocks=48), fake_engine_core)
    try:
        assert client.ready.num_kv_blocks == client.num_kv_blocks == 48
        assert client.ready.max_model_len == 256
        assert client.ready.pid == client.proc.pid != os.getpid()
        client.add_request(make_request("a", [1, 2, 3], 5))
        client.add_request(make_request("b", [9], 3))
        assert collect_tokens(client, {"a", "b"}) == {
            "a": expected_tokens([1, 2, 3], 5),
            "b": expected_tokens([9], 3),
        }
        client.call_utility("check_integrity")
    finally:
        client.shutdown()
    assert not client.proc.is_alive() and client.proc.exitcode == 0
    assert not os.path.exists(client._conn.ipc_dir)
    with pytest.raises(EngineDeadError):
        client.add_request(make_request("c", [1], 1))
    client.shutdown()  # idempotent


@pytest.mark.parametrize(
    "factory, error, text",
    [
        (too_small_engine_core, ValueError, KV_TOO_SMALL),
        (
            broken_engine_core,
            RuntimeError,
            "EngineCore failed to start: RuntimeError: weights file is corrupt",
        ),
    ],
)
def test_startup_failure_raises_the_engines_message(factory, error, text):
    start = time.monotonic()
    with pytest.raises(error) as info:
        SyncMPClient(make_fake_setup(), factory)
    assert text in str(info.value)
    assert time.monotonic() - start < 30


def test_startup_timeout_kills_the_engine():
    before = set(multiprocessing.active_children())
    with pytest.raises(TimeoutError, match="did not report ready within"):
        SyncMPClient(
            make_fake_setup(), functools.partial(_slow_start, delay_s=60.0), ready_timeout_s=0.5
        )
    assert set(multiprocessing.active_children()) - before == set()


def test_a_dropped_client_stops_its_engine():
    client = SyncMPClient(make_fake_setup(), fake_engine_core)
    proc = client.proc
    del client
    gc.collect()
    proc.join(timeout=10)
    assert proc.exitcode == 0


def test_fatal_step_error_fails_waiters_with_the_engines_message():
    client = SyncMPClient(make_fake_setup(), functools.partial(fake_engine_core, crash_at_step=3))
    try:
        client.add_request(make_request("a", [1, 2, 3], 100))
        with pytest.raises(EngineDeadError, match="fake worker crashed at step 3"):
            collect_tokens(client, {"a"})
        with pytest.raises(EngineDeadError):
            client.call_utility("check_integrity")
        # Through the client, not proc.join: its monitor thread reaps the process concurrently.
        assert client.wait_engine_exit(10) == 1
    finally:
        client.shutdown()


def test_engine_exits_when_its_parent_dies(tmp_path):
    # A front end that is SIGKILLed cannot shut its engine down: the engine must notice.
    script = textwrap.dedent("""
        import os, signal, sys
        from tests.fixtures.engine import fake_engine_core, make_fake_setup
        from tokenbus.engine.mp_client import SyncMPClient
        if __name__ == "__main__":
            client = SyncMPClient(make_fake_setup(), fake_engine_core)
            print(client.proc.pid, client._conn.ipc_dir, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = tmp_path / "front_end.py"
    path.write_text(script)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=60
    )
    engine_pid, ipc_dir = result.stdout.split()
    deadline = time.monotonic() + 10
    while _pid_alive(int(engine_pid)):
        assert time.monotonic() < deadline, "the orphaned engine process is still running"
        time.sleep(0.1)
    assert not os.path.exists(ipc_dir)  # its socket files went with it


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped by init yet) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
