"""Anthropic's Messages API on a real `tokenbus serve` (tiny random Llama, API key on), driven by
the official anthropic client: greedy text equals the same chat through /v1/chat/completions,
streamed or not; stop sequences, token counts, a tool_use → tool_result round trip, and bad
input refused in Anthropic's shape while the server goes on serving."""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.api.test_server_tools import CITY
from tests.fixtures.server import ServerProcess

API_KEY = "test-key-456"
MODEL = "tiny"
SYSTEM = "You answer in one sentence."
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]
GREEDY = {"temperature": 0}  # the client's API has no sampling fields: sent as extra body
FORECAST = {"name": "forecast", "description": "Weather forecast", "input_schema": CITY}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    names = ("--served-model-name", MODEL, "--api-key", API_KEY, "--max-model-len", "512")
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    log_dir = tmp_path_factory.mktemp("messages")
    with ServerProcess(str(tiny_llama_dir), *names, *tools, log_dir=log_dir) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_text_equals_chat_completions(client, chat):
    reference = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        max_tokens=16,
        temperature=0,
    )
    message = client.messages.create(
        model=MODEL, system=SYSTEM, messages=ASK, max_tokens=16, extra_body=GREEDY
    )
    choice = reference.choices[0]
    assert text_of(message) == choice.message.content and text_of(message)
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice.finish_reason]
    assert message.usage.input_tokens == reference.usage.prompt_tokens
    assert message.usage.output_tokens == reference.usage.completion_tokens
    with client.messages.stream(
        model=MODEL, system=SYSTEM, messages=ASK, max_tokens=16, extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text_of(message) == text_of(final)
    assert (final.stop_reason, final.usage.output_tokens) == (
        message.stop_reason,
        message.usage.output_tokens,
    )
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequences_and_max_tokens(client):
    full = text_of(
        client.messages.create(model=MODEL, messages=ASK, max_tokens=24, extra_body=GREEDY)
    )
    assert len(full) >= 6, full
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    stopped = client.messages.create(
        model=MODEL, messages=ASK, max_tokens=24, stop_sequences=[stop], extra_body=GREEDY
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert text_of(stopped) == full[: full.find(stop)]  # the stop string left out
    short = client.messages.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_tool_use_then_tool_result(client):
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": [FORECAST],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "max_tokens": 200,
        "extra_body": GREEDY,
    }
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use", message
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "forecast" and call.id
    jsonschema.validate(call.input, CITY)  # required calls are constrained: always valid
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [call.input]
    history = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
        },
    ]
    answer = client.messages.create(
        model=MODEL, messages=history, tools=[FORECAST], max_tokens=8, extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens > message.usage.input_tokens  # the call and its result


def test_bad_input_is_refused_in_anthropic_shape(server, client):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    missing = httpx.post(
        server.url + "/v1/messages", json={"model": MODEL, "messages": ASK}, headers=auth
    )
    assert missing.status_code == 400
    assert missing.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "max_tokens: Field required [type=missing]",
        },
    }
    for messages, field in (([], "messages"), ([{"role": "tool", "content": "x"}], "role")):
        with pytest.raises(anthropic.BadRequestError, match=field):
            client.messages.create(model=MODEL, messages=messages, max_tokens=4)
    # Anthropic's own header carries the key too; a wrong key is Anthropic's 401.
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
    ok = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY})
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    denied = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "no"})
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
    assert client.messages.create(model=MODEL, messages=ASK, max_tokens=2).content is not None
    assert "Traceback" not in server.log()
