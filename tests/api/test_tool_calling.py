"""Tool calling on chat completions (fake engine, fast): the parsers on canned model outputs,
tool_choice none/auto/required/named, legacy functions, streamed deltas that reassemble to the
non-streamed call, and every bad tools/tool_choice a 400."""

from __future__ import annotations

import json

import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import assert_error, make_client, sse_events
from tokenbus.api.openai.tool_parsers import make_parser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.mark.parametrize(
    "parser, text, content, calls",
    [
        (
            "hermes",
            "Sure.<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "Sure.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            "hermes",
            '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
            None,
            [("a", {}), ("b", {"x": 1})],
        ),
        ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", {"city": "Rome"}), ("get_time", {})],
        ),
        ("llama3_json", "It is sunny.", "It is sunny.", []),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        (
            "pythonic",
            '[get_weather(city="Lima"), get_time()]',
            None,
            [("get_weather", {"city": "Lima"}), ("get_time", {})],
        ),
        (
            "pythonic",
            "[__import__('os').system('x')]",
            "[__import__('os').system('x')]",
            [],
        ),  # never evaluated
        # gpt-oss's harmony, as the content after --reasoning-parser openai_gptoss: the
        # recipient after the channel, or before it (in the header <|start|>assistant opened)
        (
            "openai",
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Paris"}',
            None,
            [("get_weather", {"city": "Paris"})],
        ),
        (
            "openai",
            ' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}',
            None,
            [("get_weather", {"city": "Oslo"})],
        ),
        (  # a preamble to the user is content; the analysis (no reasoning parser) is not
            "openai",
            "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>"
            "commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
            "to=functions.get_time<|message|>{}<|call|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Rome"}',
            "Checking.",
            [("get_time", {}), ("get_weather", {"city": "Rome"})],
        ),
        ("openai", "Paris.", "Paris.", []),
        # GLM-4.5's: the name on its line, string values bare, others JSON; GLM-4.7's name runs
        # on into the first key; a call cut by its stop token ends the text
        (
            "glm45",
            "Let me check.<tool_call>get_weather\n<arg_key>city</arg_key>\n"
            "<arg_value>Paris</arg_value>\n</tool_call>",
            "Let me check.",
            [("get_weather", {"city": "Paris"})],
        ),
        (
            "glm47",
            "<tool_call>f<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>o</arg_key>"
            '<arg_value>{"a": [1]}</arg_value><arg_key>s</arg_key><arg_value>not json</arg_value>'
            "</tool_call><tool_call>get_time</tool_call><tool_call>g\n<arg_key>x</arg_key>"
            "<arg_value>null</arg_value>",
            None,
            [
                ("f", {"n": 3, "o": {"a": [1]}, "s": "not json"}),
                ("get_time", {}),
                ("g", {"x": None}),
            ],
        ),
        # MiniMax-M2's: invokes in one block, a value's newline at either end not its own
        (
            "minimax_m2",
            'Checking.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
            'Paris</parameter>\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name='
            '"note">\n<parameter name="text">\nline one\nline two\n</parameter>\n</invoke>\n'
            "</minimax:tool_call>",
            "Checking.",
            [
                ("get_weather", {"city": "Paris", "days": 3}),
                ("note", {"text": "line one\nline two"}),
            ],
        ),
        (  # text in the block or in an invoke: content
            "minimax_m2",
            "<minimax:tool_call>hello</minimax:tool_call>",
            "<minimax:tool_call>hello</minimax:tool_call>",
            [],
        ),
        (
            "minimax_m2",
            '<minimax:tool_call><invoke name="f">junk</invoke></minimax:tool_call>',
            '<minimax:tool_call><invoke name="f">junk</invoke></minimax:tool_call>',
            [],
        ),
        # DeepSeek-V3's: a call's type, then its name and fenced JSON; V3.1's name and bare
        # JSON (either parser reads both); anything else in the section: content
        (
            "deepseek_v3",
            "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>'
            "function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "Let me check.",
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        ),
        (
            "deepseek_v31",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
            '{"city": "Oslo", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            None,
            [("get_weather", {"city": "Oslo", "days": 2})],
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜>junk<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
            "<｜tool▁calls▁begin｜>junk<｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
            [],
        ),
        (  # Kimi K2's: functions.NAME:INDEX, then its JSON; bad JSON: content
            "kimi_k2",
            "Sure.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            '<|tool_call_argument_begin|>{"city": "Rome"}<|tool_call_end|><|tool_call_begin|>'
            "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>"
            "<|tool_calls_section_end|>",
            "Sure.",
            [("get_weather", {"city": "Rome"}), ("get_time", {})],
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            "<|tool_call_argument_begin|>{bad<|tool_call_end|>",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
            "<|tool_call_argument_begin|>{bad<|tool_call_end|>",
            [],
        ),
        (  # not a name, or text where a key should be: content
            "glm45",
            "<tool_call>two words</tool_call>",
            "<tool_call>two words</tool_call>",
            [],
        ),
        (
            "glm45",
            "<tool_call>f<arg_key>x</arg_key>junk</tool_call>",
            "<tool_call>f<arg_key>x</arg_key>junk</tool_call>",
            [],
        ),
        (  # bad JSON, or a built-in tool's call only: not a call of the request's functions
            "openai",
            "<|channel|>commentary to=functions.f<|message|>{bad",
            "<|channel|>commentary to=functions.f<|message|>{bad",
            [],
        ),
        (
            "openai",
            '<|channel|>analysis to=browser.search<|message|>{"q": 1}',
            '<|channel|>analysis to=browser.search<|message|>{"q": 1}',
            [],
        ),
    ],
)
def test_parsers_on_canned_outputs(parser, text, content, calls):
    parsed = make_parser(parser).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls


def _client(script: str | None = None, **config):
    # room for the tools' system prompt (a token a character)
    engine = FakeAsyncLLM(max_model_len=4096)
    engine.script = script
    return engine, make_client(engine, **config)


def _reassemble(events: list) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.get("id") or entry["id"]
                entry["name"] += (call.get("function") or {}).get("name") or ""
                entry["arguments"] += (call.get("function") or {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return content, [calls[i] for i in sorted(calls)], finish


CALL_SCRIPTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
    "</parameter>\n</invoke>\n</minimax:tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "</tool_call>",
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
}


@pytest.mark.parametrize("parser", sorted(CALL_SCRIPTS))
@pytest.mark.parametrize("stream_first", [False, True])
def test_auto_with_a_parser_streamed_and_not(stream_first, parser):
    script = "Let me check." + CALL_SCRIPTS[parser]
    engine, client = _client(script, enable_auto_tool_choice=True, tool_call_parser=parser)
    with client:
        body = {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 200}
        full = client.post("/v1/chat/completions", json=body).json()
        choice = full["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] == "Let me check."
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather" and json.loads(
            call["function"]["arguments"]
        ) == {"city": "Paris"}
        content, calls, finish = _reassemble(
            sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
        )
        assert (content, finish) == ("Let me check.", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert calls[0]["id"].startswith("call_")


def test_auto_without_a_call_streams_plain_content():
    engine, client = _client(
        "Just text, no <tools here.", enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    with client:
        body = {"messages": ASK, "tools": [WEATHER], "max_tokens": 200}
        full = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert (
            full["message"]["content"] == "Just text, no <tools here."
            and full["finish_reason"] == "stop"
        )
        assert "tool_calls" not in full["message"]
        content, calls, finish = _reassemble(
            sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
        )
        assert (content, calls, finish) == ("Just text, no <tools here.", [], "stop")


def test_required_and_named_are_constrained_by_structured_output():
    engine, client = _client('[{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    with client:
        body = {
            "messages": ASK,
            "tools": [WEATHER, TIME],
            "tool_choice": "required",
            "max_tokens": 200,
            "parallel_tool_calls": False,
        }
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        schema = engine.requests[-1][2].structured_outputs.json
        assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
        assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [
            ["get_weather"],
            ["get_time"],
        ]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"

        engine.script = '{"city": "Rome"}'
        named = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        choice = client.post("/v1/chat/completions", json=named).json()["choices"][0]
        assert engine.requests[-1][2].structured_outputs.json == WEATHER["function"]["parameters"]
        assert choice["finish_reason"] == "stop"  # as OpenAI answers a forced call
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {
            "city": "Rome"
        }
        events = sse_events(client.post("/v1/chat/completions", json={**named, "stream": True}))
        content, calls, finish = _reassemble(events)
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
            "city": "Rome"
        }
        fragments = [
            c
            for e in events[:-1]
            for ch in e["choices"]
            for c in ch["delta"].get("tool_calls") or []
        ]
        assert len(fragments) > 2  # the name once, then the arguments token by token


def test_legacy_functions_map_onto_tools():
    engine, client = _client('{"city": "Oslo"}')
    with client:
        body = {
            "messages": ASK,
            "functions": [WEATHER["function"]],
            "function_call": {"name": "get_weather"},
        }
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        # OpenAI's legacy answer: the message's one function_call, no tool_calls.
        assert choice["message"]["function_call"] == {
            "name": "get_weather",
            "arguments": '{"city": "Oslo"}',
        }
        assert "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"  # the request named the function
        events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))
        deltas = [c["delta"] for e in events[:-1] for c in e["choices"]]
        assert not any("tool_calls" in d for d in deltas)
        calls = [d["function_call"] for d in deltas if "function_call" in d]
        assert calls[0]["name"] == "get_weather"
        assert "".join(c.get("arguments") or "" for c in calls) == '{"city": "Oslo"}'
        with_tools = {"messages": ASK, "tools": [WEATHER], "function_call": "auto"}
        assert_error(client.post("/v1/chat/completions", json=with_tools), 400, "function_call")


def test_tools_render_for_templates_without_tool_support():
    engine, client = _client("ok")
    seen = []
    render = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = lambda messages, **kw: (
        seen.append((messages, kw)) or render(messages, **kw)
    )
    with client:
        history = [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
        body = {"messages": history, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 5}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
    messages, kwargs = seen[-1]
    assert kwargs["tools"] is None  # the fake template cannot: the tools go in a system message
    assert messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert "<tool_call>" in messages[2]["content"] and "tool_calls" not in messages[2]


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto without --enable-auto-tool-choice
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "functions": [WEATHER["function"]]}, "functions"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ],
)
def test_bad_tools_are_400(body, param):
    engine, client = _client()
    with client:
        assert_error(
            client.post("/v1/chat/completions", json={"messages": ASK, **body}), 400, param
        )
    assert engine.requests == []


@pytest.mark.parametrize(
    "parser, text",
    [
        ("pythonic", "[f(x={1, 2})]"),
        ("pythonic", "[f(x={[1]: 2})]"),
        ("hermes", "<tool_call>" + "[" * 100_000 + "</tool_call>"),
        ("llama3_json", "{" * 100_000),
        ("openai", "<|channel|>commentary to=functions.f<|message|>" + "[" * 100_000),
    ],
)
def test_parsers_never_raise(parser, text):
    parsed = make_parser(parser).parse(text)
    assert parsed.calls == [] and parsed.content == text


def test_glm45_value_nested_past_the_json_parser_is_its_text():
    value = "[" * 100_000
    text = f"<tool_call>f<arg_key>x</arg_key><arg_value>{value}</arg_value></tool_call>"
    parsed = make_parser("glm45").parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("f", {"x": value})]


def test_tools_count_against_the_caps():
    from tokenbus.api.openai.limits import RequestLimits

    engine, client = _client("ok", limits=RequestLimits(max_tools=2, max_input_chars=2000))
    with client:
        many = [{"type": "function", "function": {"name": f"t{i}"}} for i in range(3)]
        assert_error(
            client.post(
                "/v1/chat/completions",
                json={"messages": ASK, "tools": many, "tool_choice": "required"},
            ),
            400,
            "tools",
        )
        big_call = [
            *ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": "x" * 5000},
                    }
                ],
            },
        ]
        assert_error(
            client.post("/v1/chat/completions", json={"messages": big_call}), 400, "messages"
        )
        deep: dict = {"type": "string"}
        for _ in range(40):  # JSON depth 80 > 64, in fewer than 2000 characters
            deep = {"type": "object", "properties": {"k": deep}}
        deep_tool = [{"type": "function", "function": {"name": "deep", "parameters": deep}}]
        error = assert_error(
            client.post(
                "/v1/chat/completions",
                json={"messages": ASK, "tools": deep_tool, "tool_choice": "required"},
            ),
            400,
            "tools",
        )
        assert "--max-schema-depth" in error["message"]
    assert engine.requests == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "assistant", "tool_calls": ["x"]}]}, "messages"),
        (
            {
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": "get_weather"},
            },
            "tool_choice",
        ),
    ],
)
def test_malformed_tool_shapes_are_400_not_500(body, param):
    engine, client = _client()
    with client:
        assert_error(client.post("/v1/chat/completions", json=body), 400, param)
