"""--reasoning-parser through the server (fake engine, canned replies): reasoning_content apart
from content in chat completions, streamed and not; tools parsed from the content alone;
structured output refused while the reply may reason; the Responses API's reasoning item and
events, the Messages API's thinking block; an unknown parser stops the start."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import MODEL, assert_error, make_client, sse_events
from tests.api.test_tool_calling import WEATHER
from tokenbus.api.openai.server import make_serving_context
from tokenbus.api.openai.server_config import ServerConfig
from tokenbus.cli.main import build_parser

ASK = [{"role": "user", "content": "Capital of France?"}]
R1_REPLY = "The user asks about France.</think>Paris."


def _client(script: str, **config):
    engine = FakeAsyncLLM(max_model_len=4096)
    engine.script = script
    return engine, make_client(engine, **config)


def _chat(client, **body):
    response = client.post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 200, **body}
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _streamed(client, **body) -> tuple[str, str, str | None, list[dict]]:
    """(reasoning, content, finish reason, deltas) of a streamed chat."""
    events = sse_events(
        client.post(
            "/v1/chat/completions",
            json={"messages": ASK, "max_tokens": 200, "stream": True, **body},
        )
    )
    assert events[-1] == "[DONE]"
    reasoning, content, finish, deltas = "", "", None, []
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            deltas.append(delta)
            # vLLM's two names always agree
            assert delta.get("reasoning") == delta.get("reasoning_content")
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            finish = choice.get("finish_reason") or finish
    return reasoning, content, finish, deltas


def test_deepseek_r1_reasoning_apart_from_content():
    _, client = _client(R1_REPLY, reasoning_parser="deepseek_r1")
    with client:
        message = _chat(client)["message"]
        assert message["reasoning_content"] == message["reasoning"] == "The user asks about France."
        assert message["content"] == "Paris."
        reasoning, content, finish, deltas = _streamed(client)
        assert (reasoning, content, finish) == ("The user asks about France.", "Paris.", "stop")
        # One token a delta: the tag's characters are held back, never sent as either.
        assert all("<" not in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert {"reasoning", "reasoning_content"} <= deltas[1].keys() and "content" not in deltas[1]


def test_deepseek_r1_without_an_end_tag_is_all_reasoning():
    _, client = _client("Still thinking about it", reasoning_parser="deepseek_r1")
    with client:
        message = _chat(client)["message"]
        assert message["reasoning_content"] == "Still thinking about it"
        assert message["content"] is None
        assert _streamed(client)[:2] == ("Still thinking about it", "")


@pytest.mark.parametrize(
    "template_kwargs, expected",
    [
        (None, ("Hmm.", "Hi!")),
        ({"enable_thinking": True}, ("Hmm.", "Hi!")),
        ({"enable_thinking": False}, (None, "<think>Hmm.</think>Hi!")),
    ],
)
@pytest.mark.parametrize("parser", ["qwen3", "glm45"])
def test_qwen3_reasons_only_inside_think_tags(template_kwargs, expected, parser):
    _, client = _client("<think>Hmm.</think>Hi!", reasoning_parser=parser)
    with client:
        body = {"chat_template_kwargs": template_kwargs} if template_kwargs else {}
        message = _chat(client, **body)["message"]
        assert (message.get("reasoning_content"), message["content"]) == expected
        reasoning, content, _, _ = _streamed(client, **body)
        assert (reasoning or None, content) == expected


def test_qwen3_without_tags_and_without_a_parser_all_content():
    _, client = _client("Just an answer.", reasoning_parser="qwen3")
    with client:
        message = _chat(client)["message"]
        assert message["content"] == "Just an answer." and "reasoning_content" not in message
    _, client = _client(R1_REPLY)
    with client:
        message = _chat(client)["message"]
        assert message["content"] == R1_REPLY and "reasoning_content" not in message
        assert _streamed(client)[:2] == ("", R1_REPLY)


def test_qwen3_reply_opened_by_the_prompt():
    """A template that ends the prompt inside <think> (here a prefill the reply continues)."""
    _, client = _client("deep thought</think>42", reasoning_parser="qwen3")
    with client:
        prefill = {"role": "assistant", "content": "<think>"}
        body = {
            "messages": [*ASK, prefill],
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
        message = _chat(client, **body)["message"]
        assert (message["reasoning_content"], message["content"]) == ("deep thought", "42")


def test_tool_calls_are_parsed_from_the_content_alone():
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    config = dict(
        reasoning_parser="deepseek_r1", enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    _, client = _client(f"I need the weather.</think>{call}", **config)
    with client:
        choice = _chat(client, tools=[WEATHER])
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "I need the weather."
        assert choice["message"]["content"] is None
        [parsed] = choice["message"]["tool_calls"]
        assert json.loads(parsed["function"]["arguments"]) == {"city": "Paris"}
        reasoning, content, finish, deltas = _streamed(client, tools=[WEATHER])
        assert (reasoning, content, finish) == ("I need the weather.", "", "tool_calls")
        [streamed_call] = [c for d in deltas for c in d.get("tool_calls") or []]
        assert json.loads(streamed_call["function"]["arguments"]) == {"city": "Paris"}
    # A call the model only thought about is reasoning, not a call.
    _, client = _client(f"Maybe {call}? No.</think>It is sunny.", **config)
    with client:
        choice = _chat(client, tools=[WEATHER])
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["reasoning_content"] == f"Maybe {call}? No."
        assert choice["message"]["content"] == "It is sunny."


def test_gpt_oss_harmony_reasoning_and_tool_call():
    """vLLM's pair for gpt-oss: the analysis message is the reasoning, a commentary message to
    functions.get_weather the call (its <|call|> is the stop token, not text), streamed too."""
    harmony = (
        "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
    )
    config = dict(
        reasoning_parser="openai_gptoss", enable_auto_tool_choice=True, tool_call_parser="openai"
    )
    _, client = _client(harmony, **config)
    with client:
        choice = _chat(client, tools=[WEATHER])
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning_content"] == "Need the weather."
        assert choice["message"]["content"] is None
        [parsed] = choice["message"]["tool_calls"]
        assert parsed["function"]["name"] == "get_weather"
        assert json.loads(parsed["function"]["arguments"]) == {"city": "Paris"}
        reasoning, content, finish, deltas = _streamed(client, tools=[WEATHER])
        assert (reasoning, content, finish) == ("Need the weather.", "", "tool_calls")
        [streamed_call] = [c for d in deltas for c in d.get("tool_calls") or []]
        assert streamed_call["function"]["name"] == "get_weather"
    # The final channel is plain content, streamed as it comes.
    answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
    _, client = _client(answer + "<|message|>It is sunny in Paris.", **config)
    with client:
        choice = _chat(client, tools=[WEATHER])
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == "It is sunny in Paris."
        reasoning, content, finish, deltas = _streamed(client, tools=[WEATHER])
        assert (reasoning, content, finish) == ("Easy.", "It is sunny in Paris.", "stop")
        assert sum(bool(d.get("content")) for d in deltas) > 1  # not held to the end


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_structured_output_is_refused_while_the_reply_may_reason(body, param):
    """Our grammar constrains from the first token (vLLM's waits for </think>): refused with the
    way out named, unless thinking is off."""
    engine, client = _client(
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', reasoning_parser="qwen3"
    )
    with client:
        request = {"model": MODEL, "messages": ASK, "max_tokens": 20, **body}
        error = assert_error(client.post("/v1/chat/completions", json=request), 400, param)
        assert "enable_thinking" in error["message"]
        off = {**request, "chat_template_kwargs": {"enable_thinking": False}}
        response = client.post("/v1/chat/completions", json=off)
        assert response.status_code == 200, response.text
        assert "reasoning_content" not in response.json()["choices"][0]["message"]
        assert engine.requests[-1][2].structured_outputs is not None


def test_responses_api_reasoning_item_and_events():
    engine, http = _client(R1_REPLY, reasoning_parser="deepseek_r1")
    with http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0
        )
        response = client.responses.create(model=MODEL, input="Capital of France?")
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
        assert reasoning.content[0].type == "reasoning_text"
        assert reasoning.content[0].text == "The user asks about France."
        assert response.output_text == "Paris."
        # By text (the fake tokenizer has no tag tokens): the reasoning encoded again.
        assert response.usage.output_tokens_details.reasoning_tokens == 27
        events = list(client.responses.create(model=MODEL, input="Capital?", stream=True))
        kinds = [e.type for e in events]
        first_text = kinds.index("response.output_text.delta")
        assert kinds.index("response.reasoning_text.done") < first_text
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        assert "".join(deltas) == "The user asks about France."
        added = [e.item for e in events if e.type == "response.output_item.added"]
        final = events[-1].response
        assert [i.type for i in added] == ["reasoning", "message"]
        assert [i.id for i in added] == [i.id for i in final.output]  # the same items
        assert [e.output_index for e in events if e.type.endswith(".delta")] == sorted(
            e.output_index for e in events if e.type.endswith(".delta")
        )
        # A reasoning item sent back in the input (store: false clients) is accepted and
        # stays out of the prompt.
        follow = client.responses.create(
            model=MODEL,
            input=[
                {"role": "user", "content": "Capital of France?"},
                reasoning.model_dump(exclude_none=True),
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And Italy?"},
            ],
        )
        assert follow.output_text == "Paris."
        assert "The user asks" not in "".join(chr(t) for t in engine.requests[-1][1])


def test_messages_api_thinking_block():
    _, http = _client(R1_REPLY, reasoning_parser="deepseek_r1")
    with http:
        client = anthropic.Anthropic(
            base_url="http://testserver", api_key="unused", http_client=http, max_retries=0
        )
        message = client.messages.create(model=MODEL, max_tokens=100, messages=ASK)
        thinking, text = message.content
        assert thinking.type == "thinking" and thinking.thinking == "The user asks about France."
        assert text.type == "text" and text.text == "Paris."
        with client.messages.stream(model=MODEL, max_tokens=100, messages=ASK) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == ["thinking", "text"]
        assert final.content[0].thinking == "The user asks about France."
        assert final.content[1].text == "Paris."
        # The thinking block comes back in the history: accepted, left out of the prompt.
        history = [*ASK, {"role": "assistant", "content": message.model_dump()["content"]}]
        follow = client.messages.create(
            model=MODEL, max_tokens=100, messages=[*history, {"role": "user", "content": "Ok"}]
        )
        assert follow.content[-1].text == "Paris."


def test_an_unknown_parser_stops_the_start():
    with pytest.raises(ValueError, match="reasoning_parser: unknown parser 'nope'.*qwen3"):
        make_serving_context(
            FakeAsyncLLM(), ServerConfig(served_model_name=MODEL, reasoning_parser="nope"), [MODEL]
        )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--reasoning-parser", "nope"])
    ns = build_parser().parse_args(["serve", "m", "--reasoning-parser", "qwen3"])
    assert ns.reasoning_parser == "qwen3"
