"""The vLLM extensions and routes eval and RL tools use (fake engine, fast): token ids in
responses, prompt truncation, continuous usage, cached-token details, continue_final_message,
chat echo, /v1/models/{id}, /tokenizer_info, HEAD, CORS."""

from __future__ import annotations

from tests.api.fake_engine import MAX_MODEL_LEN
from tests.api.test_openai_app import MODEL, assert_error, client, engine, make_client, sse_events  # noqa: F401

CHAT = [{"role": "user", "content": "hi"}]


def test_return_token_ids_completions(client, engine):
    body = {"prompt": "hey", "max_tokens": 4, "return_token_ids": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["prompt_token_ids"] == [ord(c) for c in "hey"] == engine.requests[-1][1]
    assert choice["token_ids"] == [ord(c) for c in choice["text"]]
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert events[0]["choices"][0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(e["choices"][0]["prompt_token_ids"] is None for e in events[1:])
    plain = client.post("/v1/completions", json={"prompt": "hey", "max_tokens": 1}).json()[
        "choices"
    ][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None  # only when asked for


def test_return_token_ids_chat(client, engine):
    body = {"messages": CHAT, "max_tokens": 3, "return_token_ids": True}
    response = client.post("/v1/chat/completions", json=body).json()
    assert response["prompt_token_ids"] == engine.requests[-1][1]
    assert response["choices"][0]["token_ids"] == [
        ord(c) for c in response["choices"][0]["message"]["content"]
    ]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    assert events[0]["prompt_token_ids"] == response["prompt_token_ids"]
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == response["choices"][0]["token_ids"]


def test_truncate_prompt_tokens(client, engine):
    body = {"prompt": "abcdefgh", "max_tokens": 1, "truncate_prompt_tokens": 3, "echo": True}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert engine.requests[-1][1] == [ord(c) for c in "fgh"]
    assert choice["text"].startswith("fgh")  # echo shows what the model saw
    chat = {
        "messages": [{"role": "user", "content": "x" * 50}],
        "max_tokens": 1,
        "truncate_prompt_tokens": 5,
    }
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert len(engine.requests[-1][1]) == 5
    assert (
        client.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).status_code
        == 200
    )
    assert engine.requests[-1][1] == [ord(c) for c in "abcdefgh"]  # fits max_model_len: unchanged
    assert_error(
        client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0}),
        400,
        "truncate_prompt_tokens",
    )


def test_continuous_usage_stats(client):
    body = {
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse_events(client.post("/v1/completions", json=body))[:-1]
    content = [e for e in events if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in content] == [1, 2, 3, 4]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == 6
    chat = {
        "messages": CHAT,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chat_events = sse_events(client.post("/v1/chat/completions", json=chat))[:-1]
    # The role chunk too (no completion tokens yet), as vLLM sends it.
    assert [e["usage"]["completion_tokens"] for e in chat_events if e["choices"]] == [0, 1, 2, 3]
    assert all(e["usage"]["prompt_tokens"] > 0 for e in chat_events)


def test_prompt_tokens_details_only_when_enabled(engine):
    body = {"prompt": "hi", "max_tokens": 1}
    with make_client(engine) as plain:
        assert (
            "prompt_tokens_details" not in plain.post("/v1/completions", json=body).json()["usage"]
        )
    with make_client(engine, enable_prompt_tokens_details=True) as detailed:
        usage = detailed.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
        chat = detailed.post(
            "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}
        ).json()
        assert chat["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_continue_final_message_and_chat_echo(client, engine):
    seen = {}
    render = engine.tokenizer.apply_chat_template

    def recording(messages, **kwargs):
        seen.update(kwargs)
        return render(messages, **kwargs)

    engine.tokenizer.apply_chat_template = recording
    history = [*CHAT, {"role": "assistant", "content": "Sure:"}]
    body = {
        "messages": history,
        "max_tokens": 2,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "echo": True,
    }
    response = client.post("/v1/chat/completions", json=body).json()
    assert seen["continue_final_message"] is True and seen["add_generation_prompt"] is False
    assert response["choices"][0]["message"]["content"] == "Sure:ab"
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    assert "".join(c["delta"].get("content", "") for e in events for c in e["choices"]) == "Sure:ab"
    no_echo = client.post("/v1/chat/completions", json={**body, "echo": False}).json()
    assert no_echo["choices"][0]["message"]["content"] == "ab"
    both = {
        "messages": history,
        "continue_final_message": True,
    }  # add_generation_prompt defaults to true
    assert_error(client.post("/v1/chat/completions", json=both), 400, "continue_final_message")


def test_model_card_tokenizer_info_and_head(client):
    card = client.get(f"/v1/models/{MODEL}").json()
    assert (
        card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    )
    assert_error(client.get("/v1/models/gpt-9"), 404, "model")
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "CharTokenizer" and info["chat_template"] == "fake"
    assert info["model_max_length"] == MAX_MODEL_LEN and info["vocab_size"] == 300
    for path in ("/health", "/v1/models", f"/v1/models/{MODEL}", "/ping"):
        head = client.head(path)
        assert head.status_code == 200 and head.content == b"", path


def test_cors_allows_every_origin_by_default_as_vllm():
    preflight = {
        "Origin": "http://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization",
    }
    with make_client() as default:
        response = default.options("/v1/chat/completions", headers=preflight)
        assert response.status_code == 200, response.text
        assert response.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in response.headers
        response = default.get("/v1/models", headers={"Origin": "http://app.example"})
        assert response.headers["access-control-allow-origin"] == "*"
    with make_client(allowed_origins=()) as off:
        response = off.get("/v1/models", headers={"Origin": "http://app.example"})
        assert "access-control-allow-origin" not in response.headers
        assert off.options("/v1/completions", headers=preflight).status_code == 405
    with make_client(allowed_origins=("http://app.example",), api_key="k") as cors:
        response = cors.options("/v1/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "http://app.example"
        denied = cors.get("/v1/models", headers={"Origin": "http://app.example"})  # no key: 401
        assert (
            denied.status_code == 401
            and denied.headers["access-control-allow-origin"] == "http://app.example"
        )
        other = cors.options(
            "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers


def test_logprobs_minus_one_means_the_whole_vocabulary():
    from tests.api.fake_engine import VOCAB_SIZE, FakeAsyncLLM

    with make_client(FakeAsyncLLM()) as capped:  # --max-logprobs 20: the vocabulary is more
        assert_error(
            capped.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": -1}),
            400,
            "logprobs",
        )
    engine = FakeAsyncLLM(max_logprobs=-1)  # no limit
    with make_client(engine) as client:
        r = client.post(
            "/v1/chat/completions",
            json={"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1},
        )
        assert r.status_code == 200, r.text
        assert engine.requests[-1][2].logprobs == VOCAB_SIZE
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": -1})
        assert r.status_code == 200 and engine.requests[-1][2].logprobs == VOCAB_SIZE


def test_kv_transfer_params_reach_the_engine_and_are_bounded(client, engine):
    params = {"do_remote_decode": True}
    assert (
        client.post(
            "/v1/completions", json={"prompt": "abc", "max_tokens": 1, "kv_transfer_params": params}
        ).status_code
        == 200
    )
    assert engine.requests[-1][2].kv_transfer_params == params
    chat = {"messages": CHAT, "max_tokens": 1, "kv_transfer_params": params}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert engine.requests[-1][2].kv_transfer_params == params
    for bad in (
        {"prompt": ["a", "b"], "kv_transfer_params": params},
        {"prompt": "a", "n": 2, "kv_transfer_params": params},
        {"prompt": "a", "kv_transfer_params": {"a": {"b": {"c": {"d": {"e": 1}}}}}},
    ):
        assert_error(
            client.post("/v1/completions", json={"max_tokens": 1, **bad}), 400, "kv_transfer_params"
        )
    assert_error(
        client.post("/v1/chat/completions", json={**chat, "n": 2}), 400, "kv_transfer_params"
    )
