"""`tokenbus proxy` against instances that take a request and never answer, and its own request
timeout (fakes: tests/fixtures/proxy_fakes.py)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.fixtures.proxy_fakes import (
    STREAM_PIECES,
    Cluster,
    start_cluster,
    stop_cluster,
)
from tests.fixtures.server import wait_until
from tokenbus.api.proxy.health import check_engine, probe_once
from tokenbus.api.proxy.pool import EngineCheck, InstanceKind, InstancePool

# Short enough for quick tests, long enough for a fake on two busy cores to answer in time.
PREFILL_TIMEOUT_S = 0.8


def timed_post(cluster: Cluster, body: dict | bytes) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    if isinstance(body, bytes):
        response = httpx.post(cluster.url + "/v1/completions", content=body, timeout=10)
    else:
        response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=10)
    return response, time.monotonic() - start


@pytest.fixture
def hang_cluster():
    """A short --prefill-timeout and --decode-timeout; a probe gives up soon."""
    c = start_cluster(
        prefill_timeout=PREFILL_TIMEOUT_S, decode_timeout=PREFILL_TIMEOUT_S, health_timeout=0.3
    )
    wait_until(lambda: all(f.health_checks for f in c.prefillers + c.decoders))
    yield c
    for fake in c.prefillers + c.decoders:  # held requests must not outlive the test
        fake.engine_hung = False
    for server in c.servers.values():
        if server._hole is not None:
            server.thaw()
    stop_cluster(c)


# ---------------------------------------------------------------------------------------------
# Hung instances: they take a request and never answer


def test_hung_prefiller_leg_moves_to_another_and_it_stays_out(hang_cluster):
    cluster = hang_cluster
    p0, p1 = cluster.prefillers
    p0.engine_hung = True  # its /health still answers 200
    response, seconds = timed_post(cluster, {"model": "m", "prompt": "x"})  # p0 first: a tie
    assert response.status_code == 200
    assert response.json()["kv_transfer_params_received"] == p1.kv_params()
    assert PREFILL_TIMEOUT_S <= seconds < PREFILL_TIMEOUT_S + 2
    assert not cluster.instance("p0").is_healthy
    check = cluster.instance("p0").engine_check  # the probe's: the model of the request
    assert check is not None and (check.model, check.authorization) == ("m", None)
    wait_until(lambda: p0.num_abandoned >= 1)  # the leg was closed: the prefiller aborts it
    # /health keeps answering 200, but p0 stays out: its engine does not answer the probe.
    checks = p0.health_checks
    for _ in range(3):
        response, seconds = timed_post(cluster, {"model": "m", "prompt": "x"})
        assert response.json()["kv_transfer_params_received"] == p1.kv_params()
        assert seconds < PREFILL_TIMEOUT_S
    wait_until(lambda: p0.health_checks > checks + 2 and p0.engine_probes >= 1)
    assert not cluster.instance("p0").is_healthy and len(p0.bodies) == 1
    p0.engine_hung = False  # it answers again: the next probe brings it back
    wait_until(lambda: cluster.instance("p0").is_healthy, 5)
    for _ in range(2):
        assert timed_post(cluster, {"model": "m", "prompt": "x"})[0].status_code == 200
    assert len(p0.bodies) == 2


def test_all_prefillers_hung_fall_back_to_the_decoder(hang_cluster):
    cluster = hang_cluster
    for fake in cluster.prefillers:
        fake.engine_hung = True
    raw = b'{"model": "m", "prompt": "x", "max_tokens": 4}'
    # One timeout per hung prefiller at most: each is marked down by its first.
    response, seconds = timed_post(cluster, raw)
    assert response.status_code == 200 and response.json()["kv_transfer_params_received"] is None
    assert seconds < 2 * PREFILL_TIMEOUT_S + 2
    response, seconds = timed_post(cluster, raw)
    assert response.status_code == 200 and seconds < PREFILL_TIMEOUT_S
    assert [r for f in cluster.decoders for r in f.raw_bodies] == [raw] * 2  # unchanged
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    assert "tokenbus:proxy_prefill_fallbacks_total 2.0" in text


def test_concurrent_requests_on_a_hung_prefiller_each_answer_in_time(hang_cluster):
    cluster = hang_cluster
    cluster.prefillers[0].engine_hung = True
    cluster.servers["p1"].stop()  # only the hung one is left: every request falls back

    async def run() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:

            async def one(delay_s: float) -> tuple[int, float]:
                await asyncio.sleep(delay_s)
                start = time.monotonic()
                response = await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                return response.status_code, time.monotonic() - start

            return await asyncio.gather(*(one(d) for d in (0, 0, 0.2, 1.5)))

    results = asyncio.run(run())
    assert [status for status, _ in results] == [200] * 4
    assert all(seconds < PREFILL_TIMEOUT_S + 2 for _, seconds in results)
    assert results[-1][1] < PREFILL_TIMEOUT_S  # after the first timeout: straight to a decoder
    cluster.servers["p1"].start()


def test_frozen_prefiller_is_found_by_the_probe(hang_cluster):
    """A whole process stopped: connections are accepted, nothing is read or answered."""
    cluster = hang_cluster
    cluster.servers["p0"].freeze()
    start = time.monotonic()
    wait_until(lambda: not cluster.instance("p0").is_healthy, 5)
    assert time.monotonic() - start < 2  # the probe's timeout, 0.3 s, and an interval or two
    for _ in range(2):
        response, seconds = timed_post(cluster, {"model": "m", "prompt": "x"})
        assert response.json()["kv_transfer_params_received"]["remote_engine_id"] == "p1"
        assert seconds < PREFILL_TIMEOUT_S
    cluster.servers["p0"].thaw()
    wait_until(lambda: cluster.instance("p0").is_healthy, 5)


def test_hung_decoder_leg_moves_to_another_and_a_silent_stream_ends(hang_cluster):
    cluster = hang_cluster
    cluster.decoders[0].engine_hung = True
    response, seconds = timed_post(cluster, {"model": "m", "prompt": "x"})  # d0 first: a tie
    assert response.status_code == 200 and response.json()["served_by"] == "d1"
    assert PREFILL_TIMEOUT_S <= seconds < PREFILL_TIMEOUT_S + 2
    assert not cluster.instance("d0").is_healthy
    cluster.decoders[0].engine_hung = False
    wait_until(lambda: cluster.instance("d0").is_healthy, 5)
    # A stream that goes quiet past --decode-timeout mid-answer ends with an error event.
    body = {"model": "m", "prompt": "x", "stream": True, "chunk_delay_s": 3 * PREFILL_TIMEOUT_S}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=10) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3 and events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: ") :])["error"]
    assert error["code"] == 504 and "--decode-timeout" in error["message"]
    wait_until(lambda: sum(f.num_streams_cut for f in cluster.decoders) == 1)


def test_engine_check_answers():
    """What the probe makes of each answer to its one-token completion."""
    instance = InstancePool(InstanceKind.PREFILL, ["http://p"]).instances[0]
    seen = []

    def answer_with(status: int | None):
        def handle(request: httpx.Request) -> httpx.Response:
            seen.append((request.url.path, json.loads(request.content), dict(request.headers)))
            if status is None:
                raise httpx.ReadTimeout("quiet", request=request)
            return httpx.Response(status, json={})

        return httpx.AsyncClient(transport=httpx.MockTransport(handle))

    async def check(status: int | None) -> str | None:
        async with answer_with(status) as client:
            return await check_engine(client, instance, EngineCheck("m", "Bearer k"), 1.0)

    assert "engine answered" in asyncio.run(check(200))
    path, body, headers = seen[0]
    assert path == "/v1/completions" and body["model"] == "m" and body["max_tokens"] == 1
    assert headers["authorization"] == "Bearer k"
    assert "refused with 404" in asyncio.run(check(404))  # cannot check: /health decides
    for status in (None, 408, 429, 500, 503):
        assert asyncio.run(check(status)) is None, status


def test_health_200_alone_does_not_bring_back_a_timed_out_instance():
    pool = InstancePool(InstanceKind.PREFILL, ["http://p"])
    [instance] = pool.instances
    check = EngineCheck("m", None)
    pool.mark_down(instance, "a leg timed out", check)
    pool.mark_down(instance, "GET /health: ConnectError")  # the check stays
    assert instance.engine_check is check

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        raise httpx.ReadTimeout("quiet", request=request)

    async def probe() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            await probe_once(client, pool, instance, 1.0, 1.0)

    asyncio.run(probe())
    assert not instance.is_healthy and "no answer" in instance.down_reason
    pool.mark_up(instance)
    assert instance.is_healthy and instance.engine_check is None


def test_request_timeout():
    c = start_cluster(1, 1, request_timeout=0.5)
    try:
        response = httpx.post(
            c.url + "/v1/completions", json={"model": "m", "prompt": "x", "delay_s": 1}, timeout=10
        )
        assert (
            response.status_code == 408
            and response.json()["error"]["type"] == "RequestTimeoutError"
        )
        body = {"model": "m", "prompt": "x", "stream": True, "chunk_delay_s": 0.3}
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=10) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert 1 <= len(events) - 2 < len(STREAM_PIECES)  # some chunks, then the error and [DONE]
        assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 408
        assert events[-1] == "data: [DONE]"
        wait_until(lambda: c.decoders[0].num_streams_cut == 1)
    finally:
        stop_cluster(c)
