"""POST /v1/messages and /v1/messages/count_tokens (fake engine) driven by the official anthropic
client: text, the streamed event sequence, stop reasons, system prompts and prefills, tools
(tool_use out, tool_result back), token counts, and bad input as 400s in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import MODEL, make_client

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
HELLO = [{"role": "user", "content": "Hello"}]


def anthropic_client(http) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key="unused", http_client=http, max_retries=0
    )


@pytest.fixture
def setup():
    engine = FakeAsyncLLM(max_model_len=4096)
    with make_client(engine, enable_auto_tool_choice=True, tool_call_parser="hermes") as http:
        yield engine, anthropic_client(http), http


def prompt_of(engine: FakeAsyncLLM) -> str:
    return "".join(chr(t) for t in engine.requests[-1][1])


def sse(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, checking that the two agree."""
    events = []
    for block in text.split("\n\n"):
        if block:
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), block
            payload = json.loads(data[len("data: ") :])
            assert payload["type"] == name[len("event: ") :]
            events.append((payload["type"], payload))
    return events


def assert_anthropic_error(response, status: int, mentions: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert mentions in body["error"]["message"], body
    return body["error"]["type"]


def test_text_message_with_a_system_prompt(setup):
    engine, client, http = setup
    message = client.messages.create(
        model=MODEL,
        max_tokens=4,
        system="Be brief.",
        messages=HELLO,
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20},  # not in the client's API
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert [(b.type, b.text) for b in message.content] == [("text", "abcd")]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert prompt_of(engine) == "<system>Be brief.\n<user>Hello\n<assistant>"
    assert message.usage.input_tokens == len(prompt_of(engine))
    assert message.usage.output_tokens == 4
    params = engine.requests[-1][2]
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (4, 0.5, 0.9, 20)
    # System text blocks and content blocks read as the strings they join to.
    client.messages.create(
        model=MODEL,
        max_tokens=1,
        system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    )
    assert prompt_of(engine) == "<system>Be\nbrief.\n<user>Hello\n<assistant>"


def test_stop_reasons(setup):
    engine, client, http = setup
    stopped = client.messages.create(
        model=MODEL, max_tokens=10, messages=HELLO, stop_sequences=["cd"]
    )
    assert stopped.content[0].text == "abcd"  # the fake engine keeps the stop string
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "cd")
    engine.script = "Hi there."
    ended = client.messages.create(model=MODEL, max_tokens=50, messages=HELLO)
    assert (ended.content[0].text, ended.stop_reason) == ("Hi there.", "end_turn")


def test_a_final_assistant_message_is_continued(setup):
    engine, client, http = setup
    client.messages.create(
        model=MODEL,
        max_tokens=2,
        messages=[*HELLO, {"role": "assistant", "content": "Once upon"}],
    )
    assert prompt_of(engine).endswith("<user>Hello\n<assistant>Once upon\n")  # no new turn


def test_streamed_event_sequence(setup):
    engine, client, http = setup
    body = {"model": MODEL, "max_tokens": 3, "messages": HELLO, "stream": True}
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    assert [kind for kind, _ in events] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    assert [e["delta"] for _, e in events[3:6]] == [
        {"type": "text_delta", "text": c} for c in "abc"
    ]
    assert events[7][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[7][1]["usage"] == {"output_tokens": 3}
    # The client's own accumulation agrees with the non-streamed message.
    with client.messages.stream(
        model=MODEL, max_tokens=10, messages=HELLO, stop_sequences=["de"]
    ) as stream:
        assert "".join(stream.text_stream) == "abcde"
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "de")
    assert final.content[0].text == "abcde" and final.usage.output_tokens == 5


def test_tool_use_and_tool_result_round_trip(setup):
    engine, client, http = setup
    engine.script = '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    asked = [{"role": "user", "content": "Weather in Rome?"}]
    message = client.messages.create(
        model=MODEL, max_tokens=100, messages=asked, tools=[WEATHER], tool_choice={"type": "any"}
    )
    [call] = message.content
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Rome"})
    assert message.stop_reason == "tool_use"
    assert "<tools>" in prompt_of(engine) and "get_weather" in prompt_of(engine)
    with client.messages.stream(
        model=MODEL, max_tokens=100, messages=asked, tools=[WEATHER], tool_choice={"type": "any"}
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].input == {"city": "Rome"} and streamed.stop_reason == "tool_use"
    # "auto" (the default): text, then the call the hermes parser reads.
    engine.script = 'Let me look.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    events = sse(
        http.post(
            "/v1/messages",
            json={
                "model": MODEL,
                "max_tokens": 100,
                "messages": asked,
                "tools": [WEATHER],
                "stream": True,
            },
        ).text
    )
    blocks = [e["content_block"]["type"] for kind, e in events if kind == "content_block_start"]
    assert blocks == ["text", "tool_use"]
    text = [e["delta"].get("text") for kind, e in events if kind == "content_block_delta"]
    assert "".join(t for t in text if t) == "Let me look."
    assert [e["index"] for kind, e in events if kind == "content_block_stop"] == [0, 1]
    # A named tool: the output is its input, streamed as input_json_delta fragments.
    engine.script = '{"city": "Oslo"}'
    named = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "messages": asked,
        "tools": [WEATHER],
        "tool_choice": named,
        "stream": True,
    }
    events = sse(http.post("/v1/messages", json=body).text)
    starts = [e["content_block"] for kind, e in events if kind == "content_block_start"]
    assert [(b["type"], b["name"], b["input"]) for b in starts] == [("tool_use", "get_weather", {})]
    fragments = [e["delta"]["partial_json"] for kind, e in events if kind == "content_block_delta"]
    assert "".join(fragments) == '{"city": "Oslo"}'
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # The call and its result go back in the history.
    engine.script = "Sunny."
    history = [
        *asked,
        {"role": "assistant", "content": [c.model_dump() for c in message.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    answer = client.messages.create(model=MODEL, max_tokens=100, messages=history, tools=[WEATHER])
    assert answer.content[0].text == "Sunny." and answer.stop_reason == "end_turn"
    prompt = prompt_of(engine)
    assert (
        '<assistant><tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}' in prompt
    )
    assert prompt.endswith("<tool>sunny, 21 C\n<user>Thanks\n<assistant>")


def test_count_tokens_counts_the_prompt_a_message_would_have(setup):
    engine, client, http = setup
    engine.script = "x"
    kwargs = {"system": "Be brief.", "messages": HELLO, "tools": [WEATHER]}
    counted = client.messages.count_tokens(model=MODEL, **kwargs)
    message = client.messages.create(
        model=MODEL, max_tokens=1, tool_choice={"type": "none"}, **kwargs
    )
    none_counted = client.messages.count_tokens(model=MODEL, tool_choice={"type": "none"}, **kwargs)
    assert none_counted.input_tokens == message.usage.input_tokens == len(prompt_of(engine))
    assert counted.input_tokens > none_counted.input_tokens  # the tools' system prompt


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({"messages": HELLO}, "max_tokens"),
        ({"max_tokens": 5, "messages": []}, "messages"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"max_tokens": 0, "messages": HELLO}, "max_tokens"),
        ({"max_tokens": 5, "messages": HELLO, "temperature": -1}, "temperature"),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages.0.content.0",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                    }
                ],
            },
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 5,
                "messages": HELLO,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0]",
        ),
        ({"max_tokens": 5, "messages": HELLO, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        (
            {
                "max_tokens": 5,
                "messages": HELLO,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool"},
            },
            "tool_choice.name",
        ),
        (
            {
                "max_tokens": 5,
                "messages": HELLO,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice",
        ),
        ({"max_tokens": 5, "messages": HELLO, "stop_sequences": "x"}, "stop_sequences"),
        ({"max_tokens": 10_000, "messages": HELLO}, "max_tokens"),
    ],
)
def test_bad_input_is_a_400_in_anthropic_shape(setup, body, mentions):
    engine, client, http = setup
    response = http.post("/v1/messages", json={"model": MODEL, **body})
    assert assert_anthropic_error(response, 400, mentions) == "invalid_request_error"
    assert engine.requests == []
    if "max_tokens" in body:  # nor does the counting route take it
        counted = http.post("/v1/messages/count_tokens", json={"model": MODEL, **body})
        assert counted.status_code in (200, 400)


def test_errors_through_the_client_and_other_statuses(setup):
    engine, client, http = setup
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=5, messages=HELLO)
    assert missing.value.body["error"]["type"] == "not_found_error"
    not_json = http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert_anthropic_error(not_json, 400, "")
    # The OpenAI routes keep OpenAI's shape.
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == 400
    assert client.messages.create(model=MODEL, max_tokens=2, messages=HELLO).content


def test_api_key_by_either_header_and_a_401_in_anthropic_shape():
    with make_client(FakeAsyncLLM(), api_key="secret") as http:
        body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
        denied = http.post("/v1/messages", json=body)
        assert assert_anthropic_error(denied, 401, "x-api-key") == "authentication_error"
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "secret"}).is_success
        bearer = {"Authorization": "Bearer secret"}
        assert http.post("/v1/messages", json=body, headers=bearer).is_success
        wrong = http.post("/v1/messages", json=body, headers={"x-api-key": "nope"})
        assert wrong.status_code == 401
        assert http.post("/v1/models", headers={"x-api-key": "secret"}).status_code == 405


def test_a_stream_past_the_deadline_ends_with_an_anthropic_error_event():
    engine = FakeAsyncLLM(token_delay_s=0.05)
    with make_client(engine, request_timeout=0.3) as http:
        body = {"model": MODEL, "max_tokens": 100, "messages": HELLO, "stream": True}
        events = sse(http.post("/v1/messages", json=body).text)
        assert events[0][0] == "message_start" and events[-1][0] == "error"
        assert events[-1][1]["error"]["type"] == "timeout_error"
        assert "--request-timeout" in events[-1][1]["error"]["message"]
        timed_out = http.post("/v1/messages", json={**body, "stream": False})
        assert assert_anthropic_error(timed_out, 408, "--request-timeout") == "timeout_error"
        assert engine.running == set()
        with pytest.raises(anthropic.APIStatusError):
            list(anthropic_client(http).messages.create(**body))
