"""Hostile and unlucky traffic against the app (fake engine, fast): caps, queue bound, deadlines,
a stalled engine, odd but valid input, safe logs, bugs that stay one request's problem."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import assert_error, client, engine, make_client, sse_events  # noqa: F401 (fixtures)
from tokenbus.api.openai.limits import RequestLimits, json_depth
from tokenbus.api.openai.server_config import DEFAULT_REQUEST_TIMEOUT_S, ServerConfig
from tokenbus.api.openai.serving_completions import CompletionServing
from tokenbus.api.openai.serving_engine import Admission


def deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for i in range(levels):
        schema = {"type": "object", "properties": {f"k{i}": schema}, "required": [f"k{i}"]}
    return schema


def optional_properties_schema(count: int, title: str = "wide") -> dict:
    """An object with `count` optional untyped properties: small text, a costly compile."""
    return {"title": title, "type": "object", "properties": {f"p{i}": {} for i in range(count)}}


def completion(**fields) -> dict:
    return {"prompt": "hi", "max_tokens": 1, **fields}


# Each cap: a request just over it, the endpoint, and the field the 400 names.
OVER_CAP = [
    (
        "max_sequences_per_request",
        "/v1/completions",
        {"prompt": [[1, 2, 3]] * 2000, "n": 16, "max_tokens": 1},
        "prompt",
    ),
    (
        "max_request_tokens",
        "/v1/completions",
        {"prompt": [[1, 2, 3]] * 10, "n": 16, "max_tokens": 100},
        "max_tokens",
    ),
    ("max_input_chars", "/v1/completions", {"prompt": "x" * 5000, "max_tokens": 1}, "prompt"),
    (
        "max_chat_messages",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": ""}] * 3000, "max_tokens": 1},
        "messages",
    ),
    ("max_stop_strings", "/v1/completions", completion(stop=[f"s{i}" for i in range(17)]), "stop"),
    ("max_stop_string_chars", "/v1/completions", completion(stop=["s" * 1025]), "stop"),
    (
        "max_logit_bias",
        "/v1/completions",
        completion(logit_bias={str(i): 1 for i in range(1025)}),
        "logit_bias",
    ),
    (
        "max_schema_bytes",
        "/v1/completions",
        completion(structured_outputs={"json": {"enum": ["x" * 70000]}}),
        "structured_outputs",
    ),
    (
        "max_schema_depth",
        "/v1/completions",
        completion(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "deep", "schema": deep_schema(400)},
            }
        ),
        "structured_outputs",
    ),
    (
        "max_schema_cost",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "wide", "schema": optional_properties_schema(5000)},
            },
        },
        "structured_outputs",
    ),
    (
        "max_regex_chars",
        "/v1/completions",
        completion(structured_outputs={"regex": "a" * 5000}),
        "structured_outputs",
    ),
    ("max_input_chars", "/tokenize", {"prompt": "x" * 5000}, "prompt"),
    (
        "max_chat_messages",
        "/tokenize",
        {"messages": [{"role": "user", "content": "x"}] * 3000},
        "messages",
    ),
]


@pytest.mark.parametrize(
    "cap, path, body, param", OVER_CAP, ids=[f"{c[0]}:{c[1]}" for c in OVER_CAP]
)
def test_every_cap_is_a_400_naming_its_flag(client, engine, cap, path, body, param):
    error = assert_error(client.post(path, json=body), 400, param)
    assert RequestLimits.flag(cap) in error["message"]
    assert engine.requests == []  # the engine never saw it


def test_caps_are_flags_and_defaults_follow_the_context_length():
    from tokenbus.cli.main import build_parser

    ns = build_parser().parse_args(["serve", "--max-chat-messages", "5", "--max-schema-depth", "3"])
    assert (ns.max_chat_messages, ns.max_schema_depth, ns.max_request_tokens) == (5, 3, None)
    resolved = RequestLimits().resolved(1000)
    assert (resolved.max_request_tokens, resolved.max_input_chars) == (16 * 1000, 32 * 1000)
    with make_client(limits=RequestLimits(max_chat_messages=2)) as client:
        body = {"messages": [{"role": "user", "content": "a"}] * 3, "max_tokens": 1}
        assert_error(client.post("/v1/chat/completions", json=body), 400, "messages")
        body["messages"] = body["messages"][:2]
        assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_json_depth_needs_no_recursion():
    assert json_depth("x", 10) == 0 and json_depth({"a": [1, {"b": 2}]}, 10) == 3
    nested: list = []
    for _ in range(100_000):  # deeper than Python's stack
        nested = [nested]
    assert json_depth(nested, 64) == 65  # stops counting past the limit


# --- the queue bound ------------------------------------------------------------------------


def test_queue_is_bounded_by_default_and_retry_after_follows_the_drain_rate():
    engine = FakeAsyncLLM(max_num_seqs=2)
    with make_client(engine) as client:
        admission = client.app.state.server.ctx.admission
        assert admission.limit == 4  # max_num_seqs running + as many waiting
    now = [0.0]
    admission = Admission(max_running=2, max_waiting=2, clock=lambda: now[0])
    tickets = [admission.acquire(1) for _ in range(4)]
    for t in range(4):  # one sequence finishes each 2 s: 0.5/s
        now[0] = 2.0 * t
        tickets.pop().release()
        tickets.append(admission.acquire(1))
    with pytest.raises(Exception) as refused:
        admission.acquire(1)
    # 2 queued beyond the running batch, plus this one: 3 / 0.5 per s = 6 s.
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "6"
    unbounded = Admission(max_running=2, max_waiting=None)
    assert [unbounded.acquire(1) for _ in range(100)]


# --- deadlines --------------------------------------------------------------------------------


def test_request_timeout_aborts_and_frees_the_request():
    engine = FakeAsyncLLM(token_delay_s=0.05)
    with make_client(engine, request_timeout=0.3) as client:
        start = time.monotonic()
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100})
        assert_error(r, 408)
        assert "--request-timeout" in r.json()["error"]["message"]
        assert time.monotonic() - start < 2.0
        events = sse_events(
            client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100, "stream": True})
        )
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 408
        assert 0 < len(events) - 2 < 100  # some tokens came before the deadline
        assert engine.running == set() and client.app.state.server.ctx.admission.num_in_flight == 0
        quick = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert quick.status_code == 200


def test_request_timeout_is_on_by_default_and_0_turns_it_off(monkeypatch):
    from tokenbus.api.openai import launch
    from tokenbus.cli.main import build_parser

    configs = []
    monkeypatch.setattr(launch, "serve", lambda args, config: configs.append(config) or 0)
    for argv in (["serve"], ["serve", "--request-timeout", "0"]):
        ns = build_parser().parse_args(argv)
        assert ns.func(ns) == 0
    assert [c.request_timeout for c in configs] == [DEFAULT_REQUEST_TIMEOUT_S, 0.0]
    assert DEFAULT_REQUEST_TIMEOUT_S == 600.0 and ServerConfig().request_timeout == 600.0

    async def deadline_in(ctx) -> float | None:
        deadline = CompletionServing(ctx)._deadline()
        return None if deadline is None else deadline - asyncio.get_running_loop().time()

    with make_client() as client:  # the server's defaults
        assert 599.0 < asyncio.run(deadline_in(client.app.state.server.ctx)) <= 600.0
    with make_client(request_timeout=0) as client:
        assert asyncio.run(deadline_in(client.app.state.server.ctx)) is None


# --- a stalled engine ------------------------------------------------------------------------


def test_stalled_engine_turns_health_503_dumps_stacks_and_recovers(caplog):
    engine = FakeAsyncLLM()
    with make_client(engine, engine_stall_timeout=5.0) as client:
        assert client.get("/health").status_code == 200
        engine.silent_s = 6.0  # work pending, nothing heard for longer than the timeout
        with caplog.at_level(logging.ERROR):
            deadline = time.monotonic() + 2.0
            while client.get("/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert_error(client.get("/health"), 503)
        assert_error(client.post("/v1/completions", json=completion()), 503)
        assert engine.stack_dumps == 1 and "completed no step" in caplog.text
        engine.silent_s = None
        deadline = time.monotonic() + 2.0
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/health").status_code == 200
        assert client.post("/v1/completions", json=completion()).status_code == 200


# --- odd but valid input; invalid text --------------------------------------------------------


def test_null_and_absent_content_per_role(client, engine):
    history = [
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
        {"role": "assistant"},
        {"role": "user", "content": "ok"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": history, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert client.post("/tokenize", json={"messages": history}).status_code == 200
    for bad in (
        {"role": "user", "content": None},
        {"role": "system"},
        {"content": "no role"},
        {"role": "user", "content": 5},
    ):
        error = assert_error(
            client.post("/v1/chat/completions", json={"messages": [bad]}), 400, "messages"
        )
        assert "messages[0]" in error["message"]


def test_template_errors_are_400_not_500(client, engine):
    import jinja2

    def failing_template(messages, **kwargs):
        raise jinja2.exceptions.UndefinedError("'dict object' has no attribute 'content'")

    engine.tokenizer.apply_chat_template = failing_template
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert "chat template" in assert_error(r, 400, "messages")["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_lone_surrogate_is_a_400_before_any_stream_starts(client, engine, stream):
    stop = '["\\ud800"]'  # a lone surrogate, escaped in the JSON text itself
    body = f'{{"prompt": "hi", "max_tokens": 2, "stop": {stop}, "stream": {json.dumps(stream)}}}'
    r = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert "stop[0]" in assert_error(r, 400, "stop")["message"]
    chat = '{"messages": [{"role": "user", "content": "a\\udfffb"}]}'
    r = client.post(
        "/v1/chat/completions", content=chat, headers={"content-type": "application/json"}
    )
    assert "messages[0].content" in assert_error(r, 400, "messages")["message"]
    paired = '{"prompt": "\\ud83d\\ude00", "max_tokens": 1}'  # a real pair: an emoji, valid
    r = client.post("/v1/completions", content=paired, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert engine.requests[-1][0] and len(engine.requests) == 1


# --- logs -----------------------------------------------------------------------------------


def test_forged_and_flooding_field_names_are_logged_escaped_and_summarised(client, caplog):
    forged = "\nERROR tokenbus.server: FORGED"  # sorts first: among the names shown
    fields = {forged: 1, **{f"f{i}": i for i in range(100_000)}}
    with caplog.at_level(logging.WARNING):
        r = client.post("/v1/completions", json=completion(**fields))
    assert r.status_code == 200
    [record] = [r for r in caplog.records if "unknown request field" in r.getMessage()]
    message = record.getMessage()
    assert "\n" not in message and "\\nERROR tokenbus.server: FORGED" in message
    assert "100001 unknown request field(s)" in message and "and 99996 more" in message
    assert len(message) < 500


def test_client_errors_log_one_line_without_traceback(client, engine, caplog):
    async def bad_generate(*args, **kwargs):
        raise TypeError("unsupported operand type(s)")
        yield  # an async generator, like the real one

    engine.generate_request = bad_generate
    with caplog.at_level(logging.INFO):
        r = client.post("/v1/completions", json=completion())
    assert_error(r, 400)
    assert [rec for rec in caplog.records if rec.exc_info] == []
    assert any(rec.getMessage().startswith("400 POST /v1/completions: ") for rec in caplog.records)


def test_a_bug_is_a_500_that_closes_only_its_own_connection(client, engine, caplog):
    async def broken_generate(*args, **kwargs):
        raise RuntimeError("a bug")
        yield

    real_generate = engine.generate_request
    engine.generate_request = broken_generate
    with caplog.at_level(logging.ERROR):
        r = client.post("/v1/completions", json=completion())
    assert_error(r, 500)
    assert r.headers["connection"] == "close"
    assert len([rec for rec in caplog.records if rec.exc_info]) == 1  # its traceback, once
    engine.generate_request = real_generate
    assert client.post("/v1/completions", json=completion()).status_code == 200


def test_slow_preparation_does_not_block_the_event_loop(engine):
    """A request whose tokenizing takes seconds runs on a preparation thread: /health and
    other requests are answered meanwhile."""
    import httpx

    slow_encode_s = 1.5
    real_encode = engine.tokenizer.encode

    def slow_encode(text, add_special_tokens=True):
        if text.startswith("slow"):
            time.sleep(slow_encode_s)
        return real_encode(text, add_special_tokens)

    engine.tokenizer.encode = slow_encode
    with make_client(engine) as client:
        app = client.app

    async def scenario() -> tuple[float, float]:
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                slow = asyncio.create_task(http.post("/tokenize", json={"prompt": "slow" * 10}))
                await asyncio.sleep(0.1)
                start = time.monotonic()
                health = await http.get("/health")
                other = await http.post("/v1/completions", json=completion(prompt="fast"))
                fast_s = time.monotonic() - start
                assert health.status_code == 200 and other.status_code == 200
                assert (await slow).status_code == 200
                return fast_s, time.monotonic() - start

    fast_s, total_s = asyncio.run(scenario())
    assert fast_s < 0.5 < total_s


def test_json_text_nested_past_the_parser_is_handled_not_a_500(client):
    deep_text = "[" * 5000 + "]" * 5000  # json.loads raises RecursionError on it
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep_text}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert response.status_code in (200, 400), response.text
    body = completion(structured_outputs={"json": '{"a":' * 5000 + "1" + "}" * 5000})
    assert_error(client.post("/v1/completions", json=body), 400, "structured_outputs")
