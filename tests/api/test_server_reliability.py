"""Failure behaviour of a real `tokenbus serve` (API key off): a storm of cancelled streams,
queue overflow, engine death, and SIGTERM draining."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

from tests.fixtures.engine import fake_engine_core, make_fake_setup
from tests.fixtures.server import ServerProcess, metric_value
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.engine.mp_client import SyncMPClient

NUM_STORM_REQUESTS = 100
# With --max-num-seqs 1 the n children of a stream run one after another: 16 × 500 tokens
# outlast the steps the test takes while the streams are open.
LONG_STREAM_N, LONG_STREAM_TOKENS = 16, 500


def wait_until(predicate, timeout_s: float, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    return predicate()


def gauges(url: str) -> tuple[float, float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (
        metric_value(text, "tokenbus:num_requests_running"),
        metric_value(text, "tokenbus:num_requests_waiting"),
        metric_value(text, "tokenbus:kv_cache_usage_perc"),
    )


def long_request(max_tokens: int = 200, stream: bool = True, n: int = 1) -> dict:
    return {
        "prompt": "The bus goes",
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
        "n": n,
    }


async def stream_then_leave(client: httpx.AsyncClient, num_chunks: int, wait_s: float) -> int:
    """Read `num_chunks` data chunks (or give up after wait_s), then drop the connection."""
    seen = 0
    try:
        async with asyncio.timeout(wait_s):
            async with client.stream("POST", "/v1/completions", json=long_request()) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        seen += 1
                        if seen >= num_chunks:
                            break
    except TimeoutError:
        pass
    return seen


def test_cancelled_stream_storm_frees_everything(tiny_llama_dir, tmp_path):
    # The whole storm is admitted (the default queue bound would refuse some: tested elsewhere).
    with ServerProcess(
        str(tiny_llama_dir),
        "--max-num-seqs",
        "32",
        "--max-waiting-requests",
        "-1",
        log_dir=tmp_path,
    ) as server:

        async def storm() -> list[int]:
            limits = httpx.Limits(max_connections=NUM_STORM_REQUESTS + 10)
            async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60) as client:
                return await asyncio.gather(
                    *(stream_then_leave(client, 3, 20.0) for _ in range(NUM_STORM_REQUESTS))
                )

        seen = asyncio.run(storm())
        assert sum(1 for s in seen if s > 0) >= 32, seen  # at least a batch was mid-stream
        assert wait_until(lambda: gauges(server.url) == (0.0, 0.0, 0.0), 20.0), gauges(server.url)
        r = httpx.post(
            server.url + "/v1/completions", json=long_request(8, stream=False), timeout=30
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        # periodic stats line
        assert wait_until(lambda: "Avg generation throughput" in server.log(), 5)


def _open_stream(url: str, events: list, started: threading.Event) -> None:
    """A long stream that records its data lines (run in a thread)."""
    try:
        payload = long_request(LONG_STREAM_TOKENS, n=LONG_STREAM_N)
        with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=120) as r:
            events.append(("status", r.status_code))
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(("data", line[len("data: ") :]))
                    started.set()
    except httpx.HTTPError as exc:
        events.append(("error", repr(exc)))
    started.set()


def test_overflow_then_engine_death(tiny_llama_dir, tmp_path):
    # Room for 1 running + 31 waiting sequences: two n=16 streams fill it.
    server = ServerProcess(
        str(tiny_llama_dir), "--max-num-seqs", "1", "--max-waiting-requests", "31", log_dir=tmp_path
    )
    try:
        streams = []
        for _ in range(2):
            events, started = [], threading.Event()
            threading.Thread(
                target=_open_stream, args=(server.url, events, started), daemon=True
            ).start()
            streams.append((events, started))
        assert wait_until(lambda: all(events for events, _ in streams), 30)  # both got their 200
        overflow = httpx.post(
            server.url + "/v1/completions", json=long_request(4, stream=False), timeout=30
        )
        assert overflow.status_code == 503 and overflow.headers["retry-after"]
        assert overflow.json()["error"]["code"] == 503
        # tokens flow
        assert wait_until(lambda: any(started.is_set() for _, started in streams), 60)

        engine_pids = server.engine_pids()
        os.kill(server.engine_core_pid(), signal.SIGKILL)
        killed_at = time.monotonic()
        for events, _ in streams:
            assert wait_until(lambda: _ended(events), 10), events
        assert time.monotonic() - killed_at < 10
        errors = [
            json.loads(data)
            for events, _ in streams
            for kind, data in events
            if kind == "data" and data.startswith('{"error"')
        ]
        assert len(errors) == 2, streams
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json()["error"]["code"] == 503
        assert server.wait(30) != 0
        assert wait_until(lambda: not any(_alive(pid) for pid in engine_pids), 10)
    finally:
        server.close()


def test_burst_503s_carry_a_retry_after_that_grows_with_the_queue(tmp_path):
    # 4 run, 4 may wait. Nothing finishes during the test: Retry-After comes from the engine's
    # throughput and the sequences' budgets, not from a finish rate. Budgets of 2000 tokens (a
    # tiny model with room for them): on a fast machine 500 could all be decoded before the
    # second probe.
    model = cached_tiny_model("llama", max_position_embeddings=2048)
    server = ServerProcess(
        str(model), "--max-num-seqs", "4", "--max-waiting-requests", "4", log_dir=tmp_path
    )
    try:

        def probe() -> int:
            body = {"prompt": "The bus goes", "max_tokens": 1, "n": 5}  # never fits
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503, r.text
            return int(r.headers["retry-after"])

        running = _start_stream(server.url, n=4)
        assert running[1].wait(30)  # tokens flow: the engine reports its throughput
        time.sleep(1.0)  # a second of steps to measure it over
        shallow = probe()  # 4 running, none waiting: 5 queued
        _start_stream(server.url, n=4)
        assert wait_until(lambda: gauges(server.url)[:2] == (4.0, 4.0), 30)
        deep = probe()  # 4 waiting + 5: 9 queued
        assert not any(kind == "data" and data == "[DONE]" for kind, data in running[0])
        assert 1 < shallow < deep, (shallow, deep)
    finally:
        server.close()  # no drain: the streams would take seconds more


def _start_stream(url: str, n: int) -> tuple[list, threading.Event]:
    """A stream of n sequences of 2000 tokens in a thread: its events, and an event set once
    data comes."""
    events, started = [], threading.Event()

    def run() -> None:
        try:
            payload = long_request(2000, n=n)
            with httpx.stream("POST", url + "/v1/completions", json=payload, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(("data", line[len("data: ") :]))
                        started.set()
        except httpx.HTTPError as exc:
            events.append(("error", repr(exc)))

    threading.Thread(target=run, daemon=True).start()
    return events, started


def test_a_sigkilled_servers_ipc_dir_is_removed_by_the_next_start(
    tiny_llama_dir, tmp_path, monkeypatch
):
    with tempfile.TemporaryDirectory(prefix="tb") as tmp:  # short: socket paths fit 107 bytes
        server = ServerProcess(str(tiny_llama_dir), env={"TMPDIR": tmp}, log_dir=tmp_path)
        try:
            owned = _ipc_dirs(tmp)
            assert len(owned) == 1 and owned[0].name.startswith(f"tokenbus-{server.proc.pid}-")
        finally:
            server.close()  # SIGKILL, engine included: nobody cleans up
        assert owned[0].is_dir()
        # The next start, here an engine with a fake model behind it, removes it.
        monkeypatch.setattr(tempfile, "tempdir", tmp)
        client = SyncMPClient(make_fake_setup(), fake_engine_core)
        try:
            assert not owned[0].exists()
            [left] = _ipc_dirs(tmp)  # its own
            assert left.name.startswith(f"tokenbus-{os.getpid()}-")
        finally:
            client.shutdown()
        assert _ipc_dirs(tmp) == []


def _ipc_dirs(directory: str) -> list[Path]:
    return [p for p in Path(directory).iterdir() if p.name.startswith("tokenbus-") and p.is_dir()]


def test_sigterm_drains_in_flight_requests(tiny_llama_dir, tmp_path):
    server = ServerProcess(
        str(tiny_llama_dir), "--shutdown-timeout", "90", "--max-num-seqs", "1", log_dir=tmp_path
    )
    try:
        engine_pids = server.engine_pids()
        payload = {**long_request(150, n=2), "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/completions", json=payload, timeout=120) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            server.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: _refused(server.url), 10)  # no new work while draining
            data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["usage"]["completion_tokens"] == 2 * 150  # drained, not cut
        assert server.wait(90) == 0
        # The resource tracker notices its parent is gone a moment later.
        assert wait_until(lambda: not any(_alive(pid) for pid in engine_pids), 10)
    finally:
        server.close()


def _refused(url: str) -> bool:
    try:
        return (
            httpx.post(
                url + "/v1/completions", json=long_request(2, stream=False), timeout=5
            ).status_code
            == 503
        )
    except httpx.TransportError:
        return True


def _ended(events: list) -> bool:
    return bool(events) and (events[-1] == ("data", "[DONE]") or events[-1][0] == "error")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
