"""POST /v1/responses and GET /v1/responses/{id} (fake engine) driven by the official openai
client: create, stream (the typed events), previous_response_id, store: false, instructions,
text.format, function tools, and bad input as 400."""

from __future__ import annotations

import json

import openai
import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import MODEL, make_client


@pytest.fixture
def setup():
    engine = FakeAsyncLLM(max_model_len=4096)
    with make_client(engine) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        yield engine, client, http


def test_create_retrieve_and_continue(setup):
    engine, client, http = setup
    first = client.responses.create(
        model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=3
    )
    assert first.object == "response" and first.status == "incomplete"  # cut by max_output_tokens
    assert first.output_text == "abc" and first.usage.output_tokens == 3
    prompt = "".join(chr(t) for t in engine.requests[-1][1])
    assert prompt.startswith("<system>Be brief.") and "<user>Hello" in prompt
    assert http.get(f"/v1/responses/{first.id}").json()["output"][0]["content"][0]["text"] == "abc"
    second = client.responses.create(
        model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=2
    )
    prompt = "".join(chr(t) for t in engine.requests[-1][1])
    assert "<user>Hello" in prompt and "<assistant>abc" in prompt and "<user>And?" in prompt
    assert second.previous_response_id == first.id
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=1)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")


def test_streamed_events(setup):
    engine, client, http = setup
    events = list(
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]  # cut by max_output_tokens
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "abcd" and events[-1].response.output_text == "abcd"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))


def test_function_tools_and_text_format(setup):
    engine, client, http = setup
    engine.script = '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        }
    ]
    response = client.responses.create(
        model=MODEL, input="Weather in Rome?", tools=tools, tool_choice="required"
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Rome"}
    events = list(
        client.responses.create(
            model=MODEL, input="Weather?", tools=tools, tool_choice="required", stream=True
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done[0].arguments) == {"city": "Rome"}
    # The call's result goes back as an input item.
    engine.script = "Sunny."
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert follow.output_text == "Sunny."
    engine.script = '{"a": 1}'
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": {"type": "object"}}}
    client.responses.create(model=MODEL, input="json please", text=fmt)
    assert engine.requests[-1][2].structured_outputs.json == {"type": "object"}


@pytest.mark.parametrize(
    "body",
    [
        {"input": []},
        {"input": [{"type": "image", "url": "x"}]},
        {"input": "x", "text": {"format": {"type": "xml"}}},
        {"input": "x", "tools": [{"type": "web_search"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
    ],
)
def test_bad_input_is_400(setup, body):
    engine, client, http = setup
    response = http.post("/v1/responses", json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == 400


def test_malformed_text_format_is_400(setup):
    engine, client, http = setup
    response = http.post(
        "/v1/responses", json={"model": MODEL, "input": "x", "text": {"format": "json"}}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "text"
