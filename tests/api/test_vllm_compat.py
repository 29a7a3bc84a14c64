"""What vLLM's own OpenAI-server tests expect of a server, against the fake engine (fast):
null extension fields, completions logprobs, /tokenize of chats, truncation side, tokens as ids,
/load, /invocations, refused fields, error wording. Beam search and best_of: test_beam_search.py.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

from tests.api.fake_engine import FakeAsyncLLM
from tests.api.test_openai_app import (  # noqa: F401
    MODEL,
    assert_error,
    client,
    engine,
    make_client,
    sse_events,
)

CHAT = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


# --- fields vLLM sends as null -----------------------------------------------------------------


def test_extension_fields_are_null_unless_asked_for(client):
    body = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()
    choice = body["choices"][0]
    for name in ("prompt_logprobs", "token_ids", "prompt_token_ids"):
        assert name in choice and choice[name] is None, name
    assert body["system_fingerprint"] is None and body["kv_transfer_params"] is None
    chat = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()
    for name in ("prompt_logprobs", "prompt_token_ids", "system_fingerprint", "service_tier"):
        assert name in chat and chat[name] is None, name
    assert chat["choices"][0]["token_ids"] is None
    assert "tool_calls" not in chat["choices"][0]["message"]  # as vLLM: left out when none


# --- completions logprobs ----------------------------------------------------------------------


def test_completion_logprobs_hold_the_sampled_token_first(client):
    zero = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 0}
    ).json()["choices"][0]["logprobs"]
    # logprobs 0: the sampled token's entry alone (OpenAI's legacy API, vLLM).
    assert zero["top_logprobs"] == [{"a": -0.1}, {"b": -0.1}, {"c": -0.1}]
    two = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logprobs": 2}
    ).json()["choices"][0]["logprobs"]
    for token, top in zip(two["tokens"], two["top_logprobs"]):
        assert 2 <= len(top) <= 3 and next(iter(top)) == token


# --- return_tokens_as_token_ids ----------------------------------------------------------------


def test_return_tokens_as_token_ids(client):
    body = {"prompt": "hi", "max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    tokens = choice["logprobs"]["tokens"]
    assert tokens == [f"token_id:{ord(c)}" for c in choice["text"]]
    assert [next(iter(top)) for top in choice["logprobs"]["top_logprobs"]] == tokens
    assert choice["logprobs"]["text_offset"] == [0, 1, 2]  # offsets of the text, not of the ids
    chat = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    content = client.post(
        "/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True}
    ).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["token_id:97", "token_id:98"]
    assert content[0]["top_logprobs"][0]["token"] == "token_id:97"
    plain = client.post("/v1/chat/completions", json=chat).json()
    assert plain["choices"][0]["logprobs"]["content"][0]["token"] == "a"


def test_server_flag_returns_tokens_as_token_ids():
    with make_client(return_tokens_as_token_ids=True) as client:
        body = {"prompt": "hi", "max_tokens": 1, "logprobs": 0}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["logprobs"]["tokens"] == ["token_id:97"]
        off = {**body, "return_tokens_as_token_ids": False}
        choice = client.post("/v1/completions", json=off).json()["choices"][0]
        assert choice["logprobs"]["tokens"] == ["a"]


# --- truncation_side, add_special_tokens, request_id, documents ----------------------------------


def test_truncation_side(client, engine):
    body = {"prompt": "abcdefgh", "max_tokens": 1, "truncate_prompt_tokens": 3}
    for side, kept in ((None, "fgh"), ("left", "fgh"), ("right", "abc")):
        extra = {} if side is None else {"truncation_side": side}
        assert client.post("/v1/completions", json={**body, **extra}).status_code == 200
        assert engine.requests[-1][1] == [ord(c) for c in kept], side
    chat = {"messages": [{"role": "user", "content": "x" * 40}], "max_tokens": 1}
    right = {**chat, "truncate_prompt_tokens": 4, "truncation_side": "right"}
    assert client.post("/v1/chat/completions", json=right).status_code == 200
    assert engine.requests[-1][1] == [ord(c) for c in "<use"]  # the rendered chat's start
    assert_error(
        client.post("/v1/completions", json={**body, "truncation_side": "middle"}),
        400,
        "truncation_side",
    )


def test_add_special_tokens_reaches_the_tokenizer(client, engine):
    calls = []
    encode = engine.tokenizer.encode

    def recording(text, add_special_tokens=True):
        calls.append(add_special_tokens)
        return encode(text, add_special_tokens)

    engine.tokenizer.encode = recording
    body = {"prompt": "hi", "max_tokens": 1}
    client.post("/v1/completions", json={**body, "add_special_tokens": False})
    client.post("/v1/completions", json=body)
    client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
    client.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 1, "add_special_tokens": True},
    )
    # completions: off when asked, else on; chat: off (the template adds them), on when asked.
    assert calls == [False, True, False, False, True]


def test_request_id_names_the_response(client, engine):
    body = {"prompt": "hi", "max_tokens": 1, "request_id": "trace-42"}
    assert client.post("/v1/completions", json=body).json()["id"] == "cmpl-trace-42"
    chat = {"messages": CHAT, "max_tokens": 1, "request_id": "trace-43"}
    assert client.post("/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-trace-43"
    assert engine.requests[-1][0] == "chatcmpl-trace-43"
    bad = {**body, "request_id": "two words\n"}
    assert_error(client.post("/v1/completions", json=bad), 400, "request_id")


def test_documents_and_reasoning_effort_reach_the_template(client, engine):
    seen = {}
    render = engine.tokenizer.apply_chat_template

    def recording(messages, **kwargs):
        seen.update(kwargs)
        return render(messages, **kwargs)

    engine.tokenizer.apply_chat_template = recording
    documents = [{"title": "t", "text": "x"}]
    body = {"messages": CHAT, "max_tokens": 1, "documents": documents, "reasoning_effort": "low"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert seen["documents"] == documents and seen["reasoning_effort"] == "low"


def test_user_is_logged_with_the_request_id(client, caplog):
    with caplog.at_level(logging.INFO, logger="tokenbus.api.openai.serving_engine"):
        body = {"prompt": "hi", "max_tokens": 1, "user": "alice", "request_id": "r1"}
        assert client.post("/v1/completions", json=body).status_code == 200
    assert any("cmpl-r1" in r.message and "alice" in r.message for r in caplog.records)


# --- /tokenize of chats ------------------------------------------------------------------------


def test_tokenize_honours_continue_final_message(client, engine):
    seen = {}
    render = engine.tokenizer.apply_chat_template

    def recording(messages, **kwargs):
        seen.update(kwargs)
        return render(messages, **kwargs)

    engine.tokenizer.apply_chat_template = recording
    history = [*CHAT, {"role": "assistant", "content": "Sure,"}]
    body = {"messages": history, "continue_final_message": True, "add_generation_prompt": False}
    result = client.post("/tokenize", json=body).json()
    assert seen["continue_final_message"] is True and seen["add_generation_prompt"] is False
    assert result["token_strs"] is None and result["count"] == len(result["tokens"])
    both = {"messages": history, "continue_final_message": True}
    assert_error(client.post("/tokenize", json=both), 400, "continue_final_message")


def test_tokenize_counts_the_prompt_a_chat_with_tools_gets():
    """The tokens /tokenize counts are those /v1/chat/completions sends the model: tools
    rendered as the chat renders them (here a system message: the fake template has no tools)."""
    with make_client(FakeAsyncLLM(max_model_len=2048)) as client:
        _check_tokenize_with_tools(client)


def _check_tokenize_with_tools(client) -> None:
    body = {"messages": CHAT, "tools": [WEATHER]}
    counted = client.post("/tokenize", json=body).json()["tokens"]
    chat = {**body, "tool_choice": "required", "max_tokens": 1, "return_token_ids": True}
    sent = client.post("/v1/chat/completions", json=chat).json()["prompt_token_ids"]
    assert counted == sent
    plain = client.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert len(plain) < len(counted)
    hidden = client.post("/tokenize", json={**body, "tool_choice": "none"}).json()["tokens"]
    assert hidden == plain  # tool_choice "none": the tools are not shown
    assert_error(client.post("/tokenize", json={"prompt": "x", "tools": [WEATHER]}), 400, "tools")


def test_tokenize_hands_tools_to_a_template_that_renders_them(engine):
    seen = {}
    engine.tokenizer.chat_template = "{% for tool in tools %}{{ tool }}{% endfor %}"
    render = engine.tokenizer.apply_chat_template

    def recording(messages, **kwargs):
        seen.update(kwargs)
        return render(messages, **kwargs)

    engine.tokenizer.apply_chat_template = recording
    with make_client(engine) as client:
        assert (
            client.post("/tokenize", json={"messages": CHAT, "tools": [WEATHER]}).status_code == 200
        )
    assert seen["tools"] == [WEATHER]


def test_tokenize_add_special_tokens_defaults(client, engine):
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text, add_special_tokens=True: (
        calls.append(add_special_tokens) or encode(text, add_special_tokens)
    )
    client.post("/tokenize", json={"prompt": "hi"})
    client.post("/tokenize", json={"prompt": "hi", "add_special_tokens": False})
    client.post("/tokenize", json={"messages": CHAT})
    client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
    assert calls == [True, False, False, False, True]


# --- /load and /invocations --------------------------------------------------------------------


def test_load_counts_the_requests_in_flight():
    engine = FakeAsyncLLM(token_delay_s=0.05)
    with make_client(engine, api_key="k") as client:
        assert client.get("/load").json() == {"server_load": 0}  # public, like /health
        headers = {"Authorization": "Bearer k"}
        done = threading.Event()

        def slow_request():
            body = {"prompt": "hi", "max_tokens": 20, "n": 2}
            client.post("/v1/completions", json=body, headers=headers)
            done.set()

        worker = threading.Thread(target=slow_request)
        worker.start()
        deadline = time.monotonic() + 5
        while not engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/load").json() == {"server_load": 1}  # one request, whatever its n
        worker.join(10)
        assert done.is_set()
        assert client.get("/load").json() == {"server_load": 0}


def test_invocations_route_by_body(client):
    completion = {"prompt": "hi", "max_tokens": 3, "temperature": 0}
    direct = client.post("/v1/completions", json=completion).json()
    routed = client.post("/invocations", json=completion).json()
    assert routed.keys() == direct.keys() and routed["choices"] == direct["choices"]
    chat = {"messages": CHAT, "max_tokens": 2}
    routed = client.post("/invocations", json=chat).json()
    assert routed["object"] == "chat.completion"
    assert routed["choices"] == client.post("/v1/chat/completions", json=chat).json()["choices"]
    events = sse_events(client.post("/invocations", json={**chat, "stream": True}))
    assert events[-1] == "[DONE]" and events[0]["object"] == "chat.completion.chunk"
    # `input`: the embeddings route, which refuses `dimensions` on its own terms.
    assert_error(client.post("/invocations", json={"input": "x", "dimensions": 3}), 400)
    assert_error(client.post("/invocations", json={"messages": "not a list"}), 400, "messages")
    error = assert_error(client.post("/invocations", json={"foo": 1}), 400)
    assert "messages" in error["message"] and "prompt" in error["message"]
    assert_error(client.post("/invocations", content=b"{oops", headers=_JSON), 400)
    assert (
        client.post("/invocations", content=b"x", headers={"content-type": "text/plain"})
    ).status_code == 415


_JSON = {"content-type": "application/json"}


# --- fields that would be dropped are refused --------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("allowed_token_ids", [1, 2]),
        ("bad_words", ["x"]),
        ("spaces_between_special_tokens", False),
        ("vllm_xargs", {"a": 1}),
        ("logprob_token_ids", [3]),
        ("chat_template", "{{ messages }}"),
        ("modalities", ["text", "audio"]),
    ],
)
def test_fields_that_ask_for_what_is_not_implemented_are_refused(client, field, value):
    chat = {"messages": CHAT, "max_tokens": 1, field: value}
    error = assert_error(client.post("/v1/chat/completions", json=chat), 400, field)
    assert "not supported" in error["message"]


def test_fields_at_their_no_op_values_are_accepted(client):
    body = {
        "prompt": "hi",
        "max_tokens": 1,
        "spaces_between_special_tokens": True,
        "bad_words": [],
        "use_beam_search": False,
        "length_penalty": 1.0,
        "some_client_extra": 1,  # unknown: logged, as vLLM does
    }
    assert client.post("/v1/completions", json=body).status_code == 200


def test_structured_outputs_options_are_refused_not_dropped(client):
    spec = {"regex": "a+", "whitespace_pattern": " "}
    body = {"prompt": "hi", "max_tokens": 1, "structured_outputs": spec}
    error = assert_error(client.post("/v1/completions", json=body), 400, "structured_outputs")
    assert "whitespace_pattern" in error["message"]
    fine = {**body, "structured_outputs": {"regex": "a+", "disable_fallback": True}}
    assert client.post("/v1/completions", json=fine).status_code == 200


def test_guided_fields_are_structured_outputs(client, engine):
    body = {"prompt": "hi", "max_tokens": 1, "guided_regex": "a+"}
    extra = {"guided_decoding_backend": "outlines"}
    assert client.post("/v1/completions", json={**body, **extra}).status_code == 200
    assert engine.requests[-1][2].structured_outputs.regex == "a+"
    choice = {"messages": CHAT, "max_tokens": 1, "guided_choice": ["x", "y"]}
    assert client.post("/v1/chat/completions", json=choice).status_code == 200
    assert engine.requests[-1][2].structured_outputs.choice == ["x", "y"]
    both = {**body, "response_format": {"type": "json_object"}}
    assert_error(client.post("/v1/completions", json=both), 400, "structured_outputs")


# --- error wording -----------------------------------------------------------------------------


def test_error_wording_as_vllms_tests_match_it(client):
    for seed, check in ((2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")):
        chat = {"messages": CHAT, "max_tokens": 1, "seed": seed}
        error = assert_error(client.post("/v1/chat/completions", json=chat), 400, "seed")
        assert check in error["message"]
    tokens = {"prompt": [1, 2, 999], "max_tokens": 1}
    error = assert_error(client.post("/v1/completions", json=tokens), 400)
    assert "out of vocabulary" in error["message"]


# --- legacy function calls in the history ------------------------------------------------------


def test_legacy_function_call_history_reaches_the_template_as_tool_calls(client, engine):
    seen = []
    render = engine.tokenizer.apply_chat_template
    engine.tokenizer.apply_chat_template = lambda messages, **kw: (
        seen.append(messages) or render(messages, **kw)
    )
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    body = {"messages": history, "max_tokens": 1}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assistant, result = seen[-1][1], seen[-1][2]
    assert "function_call" not in assistant and result["role"] == "tool"
    # The fake template renders no tools: the call is shown as Hermes text, as for tool_calls.
    assert "get_weather" in assistant["content"]
    bad = [*CHAT, {"role": "assistant", "content": None, "function_call": "x"}]
    assert_error(client.post("/v1/chat/completions", json={"messages": bad, "max_tokens": 1}), 400)
