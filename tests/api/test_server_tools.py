"""Tool calling through a real `tokenbus serve` with the official openai client: required and
named calls always parse and validate (structured output, even from a random tiny model), the
streamed call reassembles to a valid one, and tool histories render."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.fixtures.server import ServerProcess

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "forecast", "description": "Weather forecast", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What will the weather be in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    with ServerProcess(
        str(tiny_llama_dir),
        "--max-model-len",
        "512",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        log_dir=tmp_path_factory.mktemp("tools"),
    ) as server:
        yield openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )


def _check(call) -> None:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_required_and_named_calls_always_validate(client):
    model = client.models.list().data[0].id
    for seed in range(3):
        out = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            seed=seed,
            temperature=1.0,
            parallel_tool_calls=False,
        )
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check(choice.message.tool_calls[0])
    named = {"type": "function", "function": {"name": "forecast"}}
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=0
    )
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "forecast" and out.choices[0].finish_reason == "stop"
    _check(call)
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice=named,
        max_tokens=200,
        stream=True,
        temperature=0,
    )
    name, arguments = "", ""
    for chunk in stream:
        for tool_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            name += tool_call.function.name or ""
            arguments += tool_call.function.arguments or ""
    assert name == "forecast" and arguments == call.function.arguments  # greedy: the same call


def test_tool_history_round_trip(client):
    model = client.models.list().data[0].id
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls", first
    message = first.choices[0].message
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump() for c in message.tool_calls],
        },
        *(
            {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"}
            for c in message.tool_calls
        ),
    ]
    again = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            max_tokens=8,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    bad_schema = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    ]
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=model, messages=ASK, tools=bad_schema, tool_choice="required"
        )
