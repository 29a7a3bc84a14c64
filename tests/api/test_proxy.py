"""`tokenbus proxy` against fake prefill and decode instances (tests/fixtures/proxy_fakes.py),
all served by uvicorn in threads."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.fixtures.proxy_fakes import (
    STREAM_PIECES,
    TEXT,
    Cluster,
    start_cluster,
    stop_cluster,
    stream_chunks,
)
from tests.fixtures.server import wait_until
from tokenbus.api.proxy.config import ProxyConfig
from tokenbus.api.proxy.health import check_engine, probe_once
from tokenbus.api.proxy.pool import EngineCheck, InstanceKind, InstancePool
from tokenbus.api.proxy.router import prefill_body
from tokenbus.cli.main import build_parser
from tokenbus.cli.proxy_cmd import config_from


@pytest.fixture
def cluster():
    c = start_cluster()
    yield c
    stop_cluster(c)


@pytest.fixture
def quiet_cluster():
    """No health probe after the first: only requests find dead instances. The first has reached
    every instance before the test starts (else it could find one the test has just stopped)."""
    c = start_cluster(health_interval=60)
    wait_until(lambda: all(f.health_checks for f in c.prefillers + c.decoders))
    yield c
    stop_cluster(c)


# Short enough for quick tests, long enough for a fake on two busy cores to answer in time.
PREFILL_TIMEOUT_S = 0.8


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


def timed_post(cluster: Cluster, body: dict | bytes) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    if isinstance(body, bytes):
        response = httpx.post(cluster.url + "/v1/completions", content=body, timeout=10)
    else:
        response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=10)
    return response, time.monotonic() - start


def client_for(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="sk-test", max_retries=0, timeout=10)


# ---------------------------------------------------------------------------------------------
# The two legs


def test_completion_prefill_then_decode(cluster):
    completion = client_for(cluster).completions.create(
        model="m",
        prompt="Once upon",
        max_tokens=9,
        n=1,
        temperature=0.5,
        extra_body={"min_tokens": 2, "best_of": 1},
    )
    assert completion.choices[0].text == TEXT
    [prefill] = cluster.prefill_bodies()
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False and prefill["n"] == 1
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert prefill["prompt"] == "Once upon" and prefill["temperature"] == 0.5
    assert "min_tokens" not in prefill and "best_of" not in prefill
    [decode] = cluster.decode_bodies()
    prefiller = next(f for f in cluster.prefillers if f.bodies)
    original = {
        "model": "m",
        "prompt": "Once upon",
        "max_tokens": 9,
        "n": 1,
        "temperature": 0.5,
        "min_tokens": 2,
        "best_of": 1,
    }
    assert decode == {**original, "kv_transfer_params": prefiller.kv_params()}
    assert completion.model_extra["kv_transfer_params_received"] == prefiller.kv_params()
    # One request id on both legs; the client's key reaches both instances.
    [p_headers] = prefiller.headers
    d_headers = next(f for f in cluster.decoders if f.headers).headers[0]
    assert p_headers["x-request-id"] == d_headers["x-request-id"]
    assert p_headers["authorization"] == d_headers["authorization"] == "Bearer sk-test"


def test_chat_stream_through_openai_client(cluster):
    stream = client_for(cluster).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=7,
    )
    pieces = [chunk.choices[0].delta.content for chunk in stream]
    assert pieces == STREAM_PIECES
    [prefill] = cluster.prefill_bodies()
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "max_completion_tokens" not in prefill and "stream_options" not in prefill
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    [decode] = cluster.decode_bodies()
    assert decode["stream"] is True and decode["max_completion_tokens"] == 7
    assert decode["stream_options"] == {"include_usage": True}
    assert decode["messages"] == [{"role": "user", "content": "hi"}]
    assert decode["kv_transfer_params"]["remote_block_ids"] == [1, 2]


def test_stream_bytes_relayed_intact_and_in_order(cluster):
    body = {"model": "m", "prompt": "x", "max_tokens": 6, "stream": True, "chunk_delay_s": 0.01}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        received = b"".join(response.iter_raw())
    decoder = next(f for f in cluster.decoders if f.bodies)
    assert received == b"".join(stream_chunks(False, decoder, decoder.bodies[0]))


def test_null_kv_transfer_params_sends_the_body_unchanged(cluster):
    for prefiller in cluster.prefillers:
        prefiller.null_params = True
    raw = b'{"model": "m",   "prompt": "caf\\u00e9", "max_tokens": 3}'
    response = httpx.post(
        cluster.url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 200 and response.json()["kv_transfer_params_received"] is None
    assert len(cluster.prefill_bodies()) == 1
    assert [r for f in cluster.decoders for r in f.raw_bodies] == [raw]


def test_client_kv_transfer_params_never_reach_the_decoder(cluster):
    """The proxy owns kv_transfer_params: a client's (a host and blocks of its choosing) must
    not reach a decoder's KV connector, also when the prefill leg gives none."""
    for prefiller in cluster.prefillers:
        prefiller.null_params = True
    forged = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 22,
        "remote_block_ids": [7, 7, 7],
    }
    response = httpx.post(
        cluster.url + "/v1/completions",
        timeout=10,
        json={"model": "m", "prompt": "x", "max_tokens": 3, "kv_transfer_params": forged},
    )
    assert response.status_code == 200 and response.json()["kv_transfer_params_received"] is None
    assert [b.get("kv_transfer_params") for b in cluster.prefill_bodies()] == [
        {"do_remote_decode": True}
    ]


def test_models_and_metrics(cluster):
    models = client_for(cluster).models.list()
    assert models.data[0].id in ("model-of-d0", "model-of-d1")
    httpx.post(cluster.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    decoder = next(f for f in cluster.decoders if f.bodies)
    url = cluster.servers[decoder.name].url
    assert f'tokenbus:proxy_upstream_requests_total{{kind="decode",url="{url}"}}' in text
    assert f'tokenbus:proxy_upstream_in_flight{{kind="decode",url="{url}"}} 0.0' in text
    assert "tokenbus:proxy_upstream_failures_total" in text
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 200


# ---------------------------------------------------------------------------------------------
# Choice of instance


def test_ties_go_round_robin(cluster):
    for _ in range(4):
        response = httpx.post(
            cluster.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        assert response.status_code == 200
    assert [len(f.bodies) for f in cluster.prefillers] == [2, 2]
    assert [len(f.bodies) for f in cluster.decoders] == [2, 2]


def test_least_loaded_decoder_is_chosen(cluster):
    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:
            slow = asyncio.ensure_future(
                client.post(
                    "/v1/completions", json={"model": "m", "prompt": "slow", "delay_s": 1.0}
                )
            )
            await asyncio.to_thread(wait_until, lambda: any(f.num_active for f in cluster.decoders))
            fast = []
            for _ in range(3):  # round robin alone would send one of these to the busy decoder
                fast.append(
                    (
                        await client.post("/v1/completions", json={"model": "m", "prompt": "x"})
                    ).json()
                )
            return [(await slow).json()["served_by"]] + [r["served_by"] for r in fast]

    busy, *others = asyncio.run(run())
    assert len(set(others)) == 1 and others[0] != busy


def test_concurrent_slow_requests_spread_evenly(cluster):
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=10) as client:
            body = {"model": "m", "prompt": "x", "delay_s": 0.8}
            responses = await asyncio.gather(
                *[client.post("/v1/completions", json=body) for _ in range(6)]
            )
            return [r.status_code for r in responses]

    assert asyncio.run(run()) == [200] * 6
    assert [len(f.bodies) for f in cluster.decoders] == [3, 3]
    assert [f.max_active for f in cluster.decoders] == [3, 3]


def test_pool_choice_unit():
    pool = InstancePool(InstanceKind.DECODE, ["http://a", "http://b", "http://c"])
    a, b, c = pool.instances
    assert [pool.acquire() for _ in range(3)] == [a, b, c]  # all tied: round robin
    pool.release(a)
    assert pool.acquire() is a  # the only one with nothing in flight
    pool.release(b)
    pool.mark_down(b, "test")
    assert pool.acquire() in (a, c) and b.num_in_flight == 0
    assert pool.acquire(exclude=[a, c]) is None
    pool.mark_up(b)
    assert pool.acquire(exclude=[a, c]) is b


# ---------------------------------------------------------------------------------------------
# Dead and unhealthy instances


def test_killed_prefiller_is_skipped(quiet_cluster):
    cluster = quiet_cluster
    cluster.servers["p0"].stop()
    for _ in range(3):
        response = httpx.post(
            cluster.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        assert response.status_code == 200
        assert response.json()["kv_transfer_params_received"]["remote_engine_id"] == "p1"
    assert not cluster.instance("p0").is_healthy
    assert len(cluster.prefillers[1].bodies) == 3


def test_killed_instance_comes_back(cluster):
    p0 = cluster.servers["p0"]
    p0.stop()
    wait_until(lambda: not cluster.instance("p0").is_healthy)
    p0.start()  # the same port: the health probe brings it back
    wait_until(lambda: cluster.instance("p0").is_healthy)
    for _ in range(2):
        httpx.post(cluster.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10)
    assert len(cluster.prefillers[0].bodies) == 1


def test_killed_decoder_is_skipped(quiet_cluster):
    cluster = quiet_cluster
    cluster.servers["d0"].stop()
    client = client_for(cluster)
    for _ in range(3):
        assert client.completions.create(model="m", prompt="x").model_extra["served_by"] == "d1"
    assert not cluster.instance("d0").is_healthy
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    d0_url = cluster.servers["d0"].url
    failures = [
        line
        for line in text.splitlines()
        if line.startswith("tokenbus:proxy_upstream_failures_total") and d0_url in line
    ]
    assert failures and float(failures[0].split()[-1]) >= 1


def test_unhealthy_decoder_leaves_rotation(cluster):
    cluster.decoders[0].is_healthy = False  # its /health answers 503 (a dead or stalled engine)
    wait_until(lambda: not cluster.instance("d0").is_healthy)
    for _ in range(3):
        response = httpx.post(
            cluster.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
        )
        assert response.json()["served_by"] == "d1"
    cluster.decoders[0].is_healthy = True
    wait_until(lambda: cluster.instance("d0").is_healthy)


def test_no_prefiller_falls_back_to_the_decoder(quiet_cluster, caplog):
    cluster = quiet_cluster
    for name in ("p0", "p1"):
        cluster.servers[name].stop()
    caplog.set_level(logging.WARNING, logger="tokenbus.proxy")
    raw = b'{"model":"m","prompt":"x","max_tokens":4}'
    for _ in range(3):
        response = httpx.post(cluster.url + "/v1/completions", content=raw, timeout=10)
        assert (
            response.status_code == 200 and response.json()["kv_transfer_params_received"] is None
        )
    assert [r for f in cluster.decoders for r in f.raw_bodies] == [raw] * 3
    fallback_warnings = [
        r for r in caplog.records if "compute prompts themselves" in r.getMessage()
    ]
    assert len(fallback_warnings) == 1


def test_no_decoder_answers_503(quiet_cluster):
    cluster = quiet_cluster
    for name in ("d0", "d1"):
        cluster.servers[name].stop()
    response = httpx.post(
        cluster.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert response.status_code == 503
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "decode" in error["message"] and "127.0.0.1" not in error["message"]
    assert "retry-after" in response.headers
    assert httpx.get(cluster.url + "/health", timeout=10).status_code == 503
    # Now that both are known to be down, nothing is prefilled for a decoder that isn't there.
    num_prefills = len(cluster.prefill_bodies())
    response = httpx.post(
        cluster.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=10
    )
    assert response.status_code == 503 and len(cluster.prefill_bodies()) == num_prefills


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


# ---------------------------------------------------------------------------------------------
# Errors and bad input


def test_prefill_400_is_returned_as_is(cluster):
    response = httpx.post(
        cluster.url + "/v1/completions", json={"model": "m", "prompt": "bad"}, timeout=10
    )
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "prompt: bad by design",
            "type": "BadRequestError",
            "param": "prompt",
            "code": 400,
        }
    }
    assert cluster.decode_bodies() == []
    with pytest.raises(openai.BadRequestError, match="bad by design"):
        client_for(cluster).completions.create(model="m", prompt="bad")


@pytest.mark.parametrize("raw", [b'{"model": "m", "prompt": ', b"[1, 2]", b"\xff\xfe"])
def test_malformed_body_is_400_and_not_forwarded(cluster, raw):
    response = httpx.post(
        cluster.url + "/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    assert cluster.prefill_bodies() == [] and cluster.decode_bodies() == []


def test_too_large_body_is_413():
    c = start_cluster(1, 1, max_request_body_bytes=100)
    try:
        response = httpx.post(
            c.url + "/v1/completions", json={"model": "m", "prompt": "x" * 200}, timeout=10
        )
        assert response.status_code == 413 and response.json()["error"]["code"] == 413
        assert c.prefill_bodies() == []
    finally:
        stop_cluster(c)


def test_client_disconnect_closes_the_decode_stream(cluster):
    body = {"model": "m", "prompt": "x", "stream": True, "chunk_delay_s": 0.5}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=10) as response:
        next(response.iter_raw())  # the first chunk is in; then the client goes away
    wait_until(lambda: sum(f.num_streams_cut for f in cluster.decoders) == 1)
    assert all(f.num_active == 0 for f in cluster.decoders)


def test_decoder_dying_mid_stream_ends_it_with_an_error_event(quiet_cluster):
    cluster = quiet_cluster
    body = {"model": "m", "prompt": "x", "stream": True, "fail_after_chunks": 2}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=10) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) == 4 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["error"]["code"] == 502
    decoder = next(f for f in cluster.decoders if f.bodies)
    assert not cluster.instance(decoder.name).is_healthy


def test_decoder_dying_mid_body_drops_the_connection(quiet_cluster):
    # A body cut short must not reach the client as if it were whole.
    body = {"model": "m", "prompt": "x", "fail_after_chunks": 2}
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(quiet_cluster.url + "/v1/completions", json=body, timeout=10)


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


# ---------------------------------------------------------------------------------------------
# Configuration and CLI


def test_prefill_body_keeps_everything_else():
    body = {
        "model": "m",
        "prompt": "p",
        "max_tokens": 50,
        "stream": True,
        "n": 3,
        "stop": ["\n"],
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"stale": 1},
    }
    assert prefill_body(body) == {
        "model": "m",
        "prompt": "p",
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "stop": ["\n"],
        "kv_transfer_params": {"do_remote_decode": True},
    }
    assert body["max_tokens"] == 50  # the client's body is left alone


def test_cli_parses_into_a_config():
    ns = build_parser().parse_args(
        [
            "proxy",
            "--prefill",
            "http://p:1/",
            "https://p:2",
            "--decode",
            "http://d:3",
            "--port",
            "0",
            "--request-timeout",
            "30",
            "--prefill-timeout",
            "4.5",
            "--decode-timeout",
            "0",
        ]
    )
    config = config_from(ns)
    assert config.prefill_urls == ("http://p:1", "https://p:2") and config.decode_urls == (
        "http://d:3",
    )
    assert config.port == 0 and config.request_timeout == 30 and config.host == "127.0.0.1"
    assert config.prefill_timeout == 4.5 and config.decode_timeout is None  # 0: no limit
    defaults = config_from(
        build_parser().parse_args(
            ["proxy", "--prefill", "http://p", "--decode", "http://d", "--port", "1"]
        )
    )
    assert defaults.prefill_timeout == 10 and defaults.decode_timeout == 600


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--prefill", "http://p:1", "--port", "1"], "--decode"),
        (["--prefill", "http://p:1", "--decode", "localhost:8100", "--port", "1"], "--decode"),
        (["--prefill", "p:1", "--decode", "http://d:1", "--port", "1"], "--prefill"),
    ],
)
def test_cli_rejects_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["proxy", *argv])
    assert exit_info.value.code == 2 and flag in capsys.readouterr().err


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"decode_urls \(--decode\): at least one"):
        ProxyConfig(prefill_urls=("http://p:1",), decode_urls=())
    with pytest.raises(ValueError, match=r"prefill_urls \(--prefill\): 'ftp://p' is not an http"):
        ProxyConfig(prefill_urls=("ftp://p",), decode_urls=("http://d:1",))
    with pytest.raises(ValueError, match=r"decode_urls \(--decode\): a URL is listed twice"):
        ProxyConfig(prefill_urls=(), decode_urls=("http://d:1", "http://d:1/"))
    with pytest.raises(ValueError, match="request_timeout"):
        ProxyConfig(prefill_urls=(), decode_urls=("http://d:1",), request_timeout=0)
    for name, value in [
        ("prefill_timeout", 0),
        ("prefill_timeout", float("inf")),
        ("prefill_timeout", float("nan")),
        ("decode_timeout", -1),
    ]:
        with pytest.raises(ValueError, match=f"{name}: must be a finite number > 0"):
            ProxyConfig(prefill_urls=(), decode_urls=("http://d:1",), **{name: value})


def test_cli_bad_timeout_is_a_message_not_a_traceback():
    argv = ["proxy", "--prefill", "http://p:1", "--decode", "http://d:1", "--port", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "tokenbus", *argv, "--prefill-timeout", "-2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "prefill_timeout: must be a finite number > 0 seconds, got -2" in result.stderr


def test_proxy_imports_no_torch_and_no_engine():
    code = (
        "import sys, tokenbus.api.proxy.app, tokenbus.cli.proxy_cmd; "
        "bad = [m for m in sys.modules "
        "       if m == 'torch' or m.startswith(('tokenbus.engine', 'tokenbus.api.openai'))]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    "fields",
    [{"n": 2}, {"best_of": 2}, {"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3]]}],
    ids=["n", "best_of", "prompts", "token-prompts"],
)
def test_a_request_one_prefill_cannot_serve_goes_to_the_decoder_whole(cluster, fields):
    body = {"model": "m", "prompt": "x", "max_tokens": 3, **fields}
    response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=10)
    assert response.status_code == 200
    assert cluster.prefill_bodies() == []
    [decode] = cluster.decode_bodies()
    assert decode == body


def test_one_prefill_serves_one_prompt_and_one_sequence():
    from tokenbus.api.proxy.router import one_prefill_serves

    assert one_prefill_serves({"prompt": "x"}) and one_prefill_serves({"messages": [], "n": 1})
    assert one_prefill_serves({"prompt": [1, 2, 3]}) and one_prefill_serves({"prompt": ["x"]})
    assert one_prefill_serves({"prompt": "x", "n": None})
    assert not one_prefill_serves({"messages": [], "n": 3})
