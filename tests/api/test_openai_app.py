"""The OpenAI app against a fake engine: formats, validation, errors, auth, limits (fast)."""

from __future__ import annotations

import json
import logging
import math

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from tests.api.fake_engine import MAX_MODEL_LEN, FakeAsyncLLM
from tokenbus.api.openai.server import ServerConfig, ServerState, build_app, make_serving_context
from tokenbus.api.openai.serving_engine import (
    MAX_RETRY_AFTER_S,
    MIN_RETRY_AFTER_S,
    RATE_HORIZON_S,
    Admission,
)
from tokenbus.engine.stats import IterationStats

MODEL = "fake-model"


def make_client(engine: FakeAsyncLLM | None = None, **config) -> TestClient:
    engine = engine or FakeAsyncLLM()
    server_config = ServerConfig(served_model_name=MODEL, **config)
    ctx = make_serving_context(engine, server_config, [MODEL])
    state = ServerState(server_config, ctx, CollectorRegistry())
    return TestClient(build_app(state), raise_server_exceptions=False)


@pytest.fixture
def engine():
    return FakeAsyncLLM()


@pytest.fixture
def client(engine):
    with make_client(engine) as c:
        yield c


def sse_events(response) -> list:
    """Parse an SSE body into JSON objects, with "[DONE]" kept as the string."""
    events = []
    for block in response.text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --- completions -----------------------------------------------------------------------------


def test_completion_non_streaming(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "text": "abcd",
            "logprobs": None,
            "finish_reason": "length",
            "stop_reason": None,
            # vLLM's extensions, null unless asked for (as vLLM sends them)
            "prompt_token_ids": None,
            "token_ids": None,
            "prompt_logprobs": None,
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_completion_streaming_matches_non_streaming(client):
    payload = {
        "prompt": "hello",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abcde"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_completion_n_and_batch_prompts(client):
    r = client.post("/v1/completions", json={"prompt": ["x", "yy"], "n": 2, "max_tokens": 3})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["abc", "bcd", "abc", "bcd"]
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 12


def test_completion_token_id_prompt_and_echo(client):
    r = client.post("/v1/completions", json={"prompt": [104, 105], "max_tokens": 2, "echo": True})
    assert r.json()["choices"][0]["text"] == "hiab"
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "echo": True, "stream": True}
    )
    texts = [e["choices"][0]["text"] for e in sse_events(r)[:-1]]
    assert "".join(texts) == "hiab" and texts[0].startswith("hi")


def test_completion_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2})
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b", "c"]
    assert logprobs["token_logprobs"] == [-0.1, -0.1, -0.1]
    assert logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["top_logprobs"][0] == {"a": -0.1, "b": -2.0}


def test_completion_stop_string(client, engine):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10, "stop": ["cd"]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "cd"
    assert engine.requests[-1][2].stop == ["cd"]


def test_sampling_fields_reach_the_engine(client, engine):
    client.post(
        "/v1/completions",
        json={
            "prompt": "hi",
            "max_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "seed": 7,
            "stop_token_ids": [3],
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "repetition_penalty": 1.1,
            "logit_bias": {"5": 2.0},
            "ignore_eos": True,
            "user": "u1",
            "response_format": {"type": "json_object"},
        },
    )
    params = engine.requests[-1][2]
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        0.5,
        0.9,
        5,
        0.1,
        7,
    )
    assert params.stop_token_ids == [3] and params.logit_bias == {5: 2.0} and params.ignore_eos
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5,
        0.25,
        1.1,
    )
    assert params.structured_outputs.json_object is True


def test_structured_outputs_field_maps_to_params(client, engine):
    client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
    )
    assert engine.requests[-1][2].structured_outputs.json == {"type": "object"}
    client.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert engine.requests[-1][2].structured_outputs.choice == ["yes", "no"]


# --- chat ------------------------------------------------------------------------------------


def test_chat_non_streaming(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 3,
        },
    )
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "abc"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_chat_streaming_sequence(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index, expected in ((0, "abc"), (1, "bcd")):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine[1:]) == expected
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_chat_logprobs(client):
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b"]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["a", "b", "c"]
    assert content[0]["bytes"] == [97]


# --- validation and errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "n": 1000}, "n"),
        ({"prompt": "hi", "logprobs": 50}, "logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"prompt": "x" * MAX_MODEL_LEN}, "prompt"),
        ({"prompt": "x" * (32 * MAX_MODEL_LEN + 1)}, "prompt"),  # refused before tokenizing
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [100000]}, "prompt_token_ids"),
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "hi", "stop_token_ids": [5000]}, None),
        (
            {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ],
)
def test_completion_bad_params_are_400(client, engine, payload, param):
    assert_error(client.post("/v1/completions", json=payload), 400, param)
    if "stream_options" not in payload:
        assert_error(client.post("/v1/completions", json={**payload, "stream": True}), 400)
    assert engine.requests == []


@pytest.mark.parametrize(
    "payload, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * (32 * MAX_MODEL_LEN + 1)}]}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "logprobs",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"tokenize": True},
            },
            "chat_template_kwargs",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000},
            "max_completion_tokens",
        ),
    ],
)
def test_chat_bad_params_are_400(client, payload, param):
    assert_error(client.post("/v1/chat/completions", json=payload), 400, param)


def test_unknown_model_is_404(client):
    error = assert_error(
        client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "model"
    )
    assert error["type"] == "NotFoundError"
    assert_error(
        client.post(
            "/v1/chat/completions",
            json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
        ),
        404,
    )


def test_malformed_json_is_400(client):
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert_error(r, 400)


def test_non_json_content_type_is_415(client):
    r = client.post(
        "/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"}
    )
    assert "application/json" in assert_error(r, 415)["message"]


def test_unknown_fields_are_ignored_and_logged(client, caplog):
    with caplog.at_level(logging.WARNING):
        r = client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "frobnicate": 3, "mirostat": 2},
        )
    assert r.status_code == 200
    assert "frobnicate, mirostat" in caplog.text


def test_body_size_limit_is_413():
    with make_client(max_request_body_bytes=1000) as client:
        r = client.post("/v1/completions", json={"prompt": "x" * 2000})
        assert_error(r, 413)
        chunked = client.post(
            "/v1/completions",
            content=iter([b'{"prompt": "', b"x" * 2000, b'"}']),
            headers={"content-type": "application/json"},
        )
        assert_error(chunked, 413)


def test_queue_overflow_is_503_with_retry_after():
    engine = FakeAsyncLLM(max_num_seqs=1, max_waiting_requests=1)
    with make_client(engine) as client:
        ctx = client.app.state.server.ctx
        tickets = [ctx.admission.acquire(1), ctx.admission.acquire(1)]
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert_error(r, 503)
        # Nothing measured yet: a floor's worth per running batch queued (1 waiting + this one).
        assert r.headers["retry-after"] == str(2 * MIN_RETRY_AFTER_S)
        tickets[0].release()
        assert (
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code
            == 200
        )
        assert (
            client.post(
                "/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 1}
            ).status_code
            == 503
        )
        assert ctx.admission.num_in_flight == 1


def test_retry_after_in_a_burst_grows_with_the_queue_before_anything_finished():
    now = [0.0]
    admission = Admission(max_running=4, max_waiting=60, clock=lambda: now[0])
    tickets = [admission.acquire(1, max_new_tokens=100) for _ in range(4)]
    # No step reported yet: a floor's worth per running batch of queue.
    assert admission.retry_after_s() == MIN_RETRY_AFTER_S
    tickets += [admission.acquire(1, max_new_tokens=100) for _ in range(8)]
    assert admission.retry_after_s() == 3 * MIN_RETRY_AFTER_S  # 9 queued: 3 batches of 4
    # The engine generates 50 tokens/s (4 running); sequences of 100 tokens free a slot each
    # 100 / 50 = 2 s.
    for step in range(20):
        now[0] = step / 10
        admission.record(None, IterationStats(timestamp=now[0], num_generation_tokens=5))
    now[0] = 2.0
    depths = []
    for _ in range(3):
        depths.append((admission.num_in_flight, admission.retry_after_s()))
        tickets += [admission.acquire(1, max_new_tokens=100) for _ in range(4)]
    # 8, 12, 16 queued beyond the running batch, plus the one asking: 2 s each.
    assert depths == [(12, 18), (16, 26), (20, 34)]
    assert admission.retry_after_s(num_seqs=100) == MAX_RETRY_AFTER_S
    # Never under the floor, even with a fast engine and a short queue.
    admission.record(None, IterationStats(timestamp=now[0], num_generation_tokens=100_000))
    assert admission.retry_after_s() == MIN_RETRY_AFTER_S


def test_retry_after_once_sequences_finish_is_the_queue_over_their_rate():
    now = [0.0]
    admission = Admission(max_running=2, max_waiting=10, clock=lambda: now[0])
    tickets = [admission.acquire(1, max_new_tokens=1000) for _ in range(12)]
    for _ in range(5):  # one finishes every 4 s: 0.25/s, whatever the budgets say
        now[0] += 4.0
        tickets.pop().release()
        tickets.append(admission.acquire(1, max_new_tokens=1000))
    assert admission.retry_after_s() == 44  # (10 queued + 1) / 0.25 per s
    assert admission.retry_after_s(num_seqs=0) == 40
    # Finishes older than the horizon say nothing about now: back to the burst estimate.
    now[0] += RATE_HORIZON_S + 1
    assert admission.retry_after_s() == math.ceil(11 / 2) * MIN_RETRY_AFTER_S


def test_dead_engine(client, engine):
    assert client.get("/health").status_code == 200
    engine.kill()
    assert_error(client.get("/health"), 503)
    assert_error(client.post("/v1/completions", json={"prompt": "hi"}), 503)


def test_engine_death_mid_stream_sends_error_event():
    engine = FakeAsyncLLM(token_delay_s=0.01)
    with make_client(engine) as client:
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 50, "stream": True}
        ) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            engine.kill()
            rest = [line for line in lines if line]
        assert json.loads(rest[-2][len("data: ") :])["error"]["code"] == 503
        assert rest[-1] == "data: [DONE]"


# --- auth, misc routes, metrics --------------------------------------------------------------


def test_api_key():
    with make_client(api_key="sekret") as client:
        payload = {"prompt": "hi", "max_tokens": 1}
        error = assert_error(client.post("/v1/completions", json=payload), 401)
        assert error["type"] == "AuthenticationError"
        assert_error(
            client.post("/v1/completions", json=payload, headers={"Authorization": "Bearer nope"}),
            401,
        )
        assert_error(client.get("//v1/models"), 401)
        assert_error(client.post("/tokenize", json={"prompt": "hi"}), 401)
        ok = client.post(
            "/v1/completions", json=payload, headers={"Authorization": "Bearer sekret"}
        )
        assert ok.status_code == 200
        for path in ("/health", "/metrics", "/version"):
            assert client.get(path).status_code == 200, path


def test_models_version_tokenize(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert client.get("/version").json()["version"]
    tok = client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert tok == {
        "count": 2,
        "max_model_len": MAX_MODEL_LEN,
        "tokens": [104, 105],
        "token_strs": ["h", "i"],
    }
    chat_tok = client.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "x"}]}
    ).json()
    assert chat_tok["count"] == len("<user>x\n<assistant>")
    assert client.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(client.post("/tokenize", json={}), 400)


def test_metrics_exposition(client):
    from types import SimpleNamespace

    from tokenbus.api.openai.metrics import PrometheusStatLogger

    state = client.app.state.server
    logger = PrometheusStatLogger(state.registry, MODEL, MAX_MODEL_LEN)
    scheduler = SimpleNamespace(
        num_running_reqs=3,
        num_waiting_reqs=2,
        kv_cache_usage=0.25,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
        num_preemptions=1,
    )
    finished = SimpleNamespace(
        e2e_latency_s=1.5,
        queue_time_s=0.1,
        num_prompt_tokens=10,
        num_generation_tokens=5,
        finish_reason="stop",
    )
    iteration = SimpleNamespace(
        num_prompt_tokens=10,
        num_generation_tokens=4,
        time_to_first_tokens_s=[0.2],
        inter_token_latencies_s=[0.05, 0.06],
        finished_requests=[finished],
    )
    logger.record(scheduler, iteration)
    text = client.get("/metrics").text
    labels = f'engine="0",model_name="{MODEL}"'
    for line in (
        f"tokenbus:num_requests_running{{{labels}}} 3.0",
        f"tokenbus:num_requests_waiting{{{labels}}} 2.0",
        f"tokenbus:kv_cache_usage_perc{{{labels}}} 0.25",
        f"tokenbus:prefix_cache_queries_total{{{labels}}} 100.0",
        f"tokenbus:prefix_cache_hits_total{{{labels}}} 40.0",
        f"tokenbus:num_preemptions_total{{{labels}}} 1.0",
        f"tokenbus:prompt_tokens_total{{{labels}}} 10.0",
        f"tokenbus:generation_tokens_total{{{labels}}} 4.0",
        "tokenbus:request_success_total"
        f'{{engine="0",finished_reason="stop",model_name="{MODEL}"}} 1.0',
        f"tokenbus:time_to_first_token_seconds_count{{{labels}}} 1.0",
        f"tokenbus:inter_token_latency_seconds_count{{{labels}}} 2.0",
        f"tokenbus:e2e_request_latency_seconds_count{{{labels}}} 1.0",
        f"tokenbus:request_queue_time_seconds_count{{{labels}}} 1.0",
    ):
        assert line in text, line


def test_log_stat_line():
    from types import SimpleNamespace

    from tokenbus.api.openai.metrics import LoggingStatLogger

    now = [0.0]
    stats = LoggingStatLogger(clock=lambda: now[0])
    scheduler = SimpleNamespace(
        num_running_reqs=2,
        num_waiting_reqs=1,
        kv_cache_usage=0.5,
        prefix_cache_queries=10,
        prefix_cache_hits=5,
    )
    stats.record(scheduler, SimpleNamespace(num_prompt_tokens=100, num_generation_tokens=20))
    now[0] = 10.0
    line = stats.log()
    assert line == (
        "Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2.0 tokens/s, "
        "Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 50.0%"
    )
    idle = SimpleNamespace(
        num_running_reqs=0,
        num_waiting_reqs=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )
    stats.record(idle, SimpleNamespace(num_prompt_tokens=0, num_generation_tokens=0))
    assert stats.log() is not None  # the first idle interval is still reported
    assert stats.log() is None  # then it stays quiet
