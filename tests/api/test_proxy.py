"""`tokenbus proxy` against fake prefill and decode instances (tests/fixtures/proxy_fakes.py),
all served by uvicorn in threads."""

from __future__ import annotations

import asyncio
import json
import logging

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
from tokenbus.api.proxy.pool import InstanceKind, InstancePool


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
