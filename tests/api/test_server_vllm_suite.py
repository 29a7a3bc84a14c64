"""The checks vLLM's own OpenAI-server tests make, on `tokenbus serve` with its default model
(SmolLM2-135M-Instruct) and the official client: the places where a client written against vLLM
noticed a difference (null extension fields, usage on every chunk, completions logprobs, /tokenize
of chats, tokens as ids, beam search, /invocations, /load, CORS, error wording)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.fixtures.server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2"
MAX_MODEL_LEN = 2048
CHAT = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "what is 1+1?"},
]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(
        None, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "256MiB"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer():
    """The tokenizer the server uses (the packaged SmolLM2's, from its GGUF)."""
    from tokenbus.loader import resolve_model
    from tokenbus.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


def test_single_completion_fields(client):
    completion = client.completions.create(
        model=MODEL, prompt="Hello, my name is", max_tokens=5, temperature=0.0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 5
    # vLLM sends its extensions as null: clients read them as attributes.
    assert choice.prompt_logprobs is None and choice.token_ids is None
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert chat.prompt_logprobs is None and chat.choices[0].token_ids is None


def test_zero_and_some_completion_logprobs(client):
    zero = client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=5, temperature=0.0, logprobs=0
    )
    assert len(zero.choices[0].logprobs.top_logprobs[0]) == 1
    some = client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=5, temperature=0.0, logprobs=5
    )
    assert 5 <= len(some.choices[0].logprobs.top_logprobs[0]) <= 6


@pytest.mark.parametrize("logprobs", [0, 1])
def test_echo_logprobs(client, logprobs):
    completion = client.completions.create(
        model=MODEL,
        prompt="Hello, my name is",
        max_tokens=5,
        temperature=0.0,
        echo=True,
        logprobs=logprobs,
    )
    result = completion.choices[0].logprobs
    assert completion.choices[0].text.startswith("Hello, my name is")
    assert result.token_logprobs[0] is None and result.top_logprobs[0] is None
    for top in result.top_logprobs[1:]:
        assert max(logprobs, 1) <= len(top) <= logprobs + 1


def test_continuous_usage_on_every_chat_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=10,
        extra_body={"min_tokens": 10},
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    last = 0
    for chunk in stream:
        assert chunk.usage.prompt_tokens > 0
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        assert last == 0 or chunk.usage.completion_tokens >= last
        last = chunk.usage.completion_tokens
    assert last == 10


def test_tokenize_chat_continue_final_message(server, tokenizer):
    conversation = [*CHAT, {"role": "assistant", "content": "Sure,"}]
    for add_special in (False, True):
        prompt = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=False, continue_final_message=True, tokenize=False
        )
        expected = tokenizer.encode(prompt, add_special_tokens=add_special)
        result = httpx.post(
            server.url + "/tokenize",
            json={
                "messages": conversation,
                "add_generation_prompt": False,
                "continue_final_message": True,
                "add_special_tokens": add_special,
            },
            timeout=30,
        ).json()
        assert result["tokens"] == expected and result["count"] == len(expected)
        assert result["max_model_len"] == MAX_MODEL_LEN and result["token_strs"] is None


def test_tokenize_chat_with_tools_counts_the_chat_prompt(server, client):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    counted = httpx.post(
        server.url + "/tokenize", json={"messages": messages, "tools": tools}, timeout=30
    ).json()["tokens"]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    assert counted == chat.prompt_token_ids


def test_return_tokens_as_token_ids(client, tokenizer):
    completion = client.completions.create(
        model=MODEL,
        prompt="Say 'Hello, world! 🎉'",
        echo=True,
        temperature=0,
        max_tokens=10,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    tokens = completion.choices[0].logprobs.tokens
    keys = [next(iter(top)) for top in completion.choices[0].logprobs.top_logprobs[1:]]
    assert tokens[1:] == keys
    ids = [int(token.removeprefix("token_id:")) for token in tokens]
    assert completion.choices[0].text == tokenizer.decode(ids, skip_special_tokens=True)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    ids = [int(c.token.removeprefix("token_id:")) for c in chat.choices[0].logprobs.content]
    # A character max_tokens cut in two is held back from the text (as vLLM's detokenizer
    # does); decoding the ids alone shows it as U+FFFD.
    decoded = tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert decoded == chat.choices[0].message.content


def test_beam_search_batch(client):
    for prompts in (["Hello, my name is"] * 2, [[1, 2, 3, 4, 5]] * 2):
        batch = client.completions.create(
            model=MODEL,
            prompt=prompts,
            n=2,
            max_tokens=5,
            temperature=0.0,
            extra_body={"use_beam_search": True},
        )
        texts = [c.text for c in batch.choices]
        assert len(texts) == 4 and texts[0] != texts[1]
        assert texts[0] == texts[2] and texts[1] == texts[3]


def test_invocations_match_completions(server, client):
    args = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 5, "temperature": 0.0}
    completion = client.completions.create(**args).model_dump()
    invocation = httpx.post(server.url + "/invocations", json=args, timeout=60).json()
    assert completion.keys() == invocation.keys()
    assert completion["choices"] == invocation["choices"]


def test_server_load_cors_and_error_wording(server, client):
    assert httpx.get(server.url + "/load", timeout=10).json() == {"server_load": 0}
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={"Origin": "http://page.example", "Access-Control-Request-Method": "POST"},
        timeout=10,
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL, prompt=[0, 0, 10**6], max_tokens=5)
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, seed=seed)
        assert "greater_than_equal" in info.value.message or "less_than_equal" in info.value.message
