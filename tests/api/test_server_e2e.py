"""A real `tokenbus serve` (tiny random Llama, API key on) driven by the official `openai`
client and by raw HTTP: formats, greedy stream == non-stream, n, logprobs, stops, errors."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.fixtures.server import ServerProcess, metric_value

API_KEY = "test-key-123"
MODEL = "tiny"
MAX_MODEL_LEN = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Tell me a story about a bus."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerProcess(
        str(tiny_llama_dir),
        "--served-model-name",
        MODEL,
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-request-body-bytes",
        "100000",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def sse_events(text: str) -> list:
    events = []
    for block in text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_service_routes(server, http):
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed
    assert httpx.get(server.url + "/version").json()["version"]
    metrics = httpx.get(server.url + "/metrics").text
    for name in (
        "tokenbus:num_requests_running",
        "tokenbus:num_requests_waiting",
        "tokenbus:kv_cache_usage_perc",
        "tokenbus:time_to_first_token_seconds_bucket",
    ):
        metric_value(metrics, name)
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(
        model=MODEL,
        prompt="The bus",
        max_tokens=24,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 24 and full.usage.prompt_tokens > 0
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_chat_stream_equals_non_stream(client, http):
    kwargs = dict(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=20,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kwargs)
    message = full.choices[0].message
    assert message.role == "assistant" and full.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks[1:] if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == message.content
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    # The raw stream: [DONE] last, the usage chunk just before it when asked for.
    raw = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": CHAT,
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(raw.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] <= 5


def test_n_and_logprobs(client):
    out = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=5,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == 6 and len(choice.logprobs.top_logprobs) == 6
        assert all(lp <= 0.0 for lp in choice.logprobs.token_logprobs)
        # The sampled token first, then the top 2: up to logprobs + 1 entries (OpenAI, vLLM).
        assert all(len(top) <= 3 for top in choice.logprobs.top_logprobs)
        assert [next(iter(top)) for top in choice.logprobs.top_logprobs] == choice.logprobs.tokens
    assert out.usage.completion_tokens == 18
    chat = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=4,
        temperature=0.0,
        logprobs=True,
        top_logprobs=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert len(chat.choices) == 2
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and len(content[0].top_logprobs) == 3
    # Greedy: the sampled token is the most likely one.
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)


def test_stop_string(client):
    base = (
        client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=30,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = next(base[i : i + 3] for i in range(8, len(base) - 3) if base[i : i + 3].strip())
    expected = base[: base.find(stop)]
    for stream in (False, True):
        result = client.completions.create(
            model=MODEL,
            prompt="Once upon",
            max_tokens=30,
            temperature=0.0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        choices = [c.choices[0] for c in result if c.choices] if stream else result.choices
        assert "".join(c.text for c in choices) == expected
        assert choices[-1].finish_reason == "stop"


def test_error_statuses(server, client, http):
    assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 7}), 400
    )
    too_long = assert_error(http.post("/v1/completions", json={"prompt": [5] * MAX_MODEL_LEN}), 400)
    assert "maximum context length" in too_long["message"]
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": MAX_MODEL_LEN}), 400
    )
    assert_error(http.post("/v1/completions", json={"prompt": "x", "logprobs": 21}), 400)
    assert_error(http.post("/v1/completions", json={"prompt": "x", "n": 1000}), 400)
    assert_error(
        http.post("/v1/completions", json={"prompt": "x", "stream": True, "top_k": -5}), 400
    )
    assert_error(http.post("/v1/chat/completions", json={"messages": "nope"}), 400)
    assert_error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert_error(http.post("/v1/completions", json={"prompt": "x" * 200_000}), 413)
    assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": "x"}), 401)
    assert_error(
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "x"},
            headers={"Authorization": "Bearer wrong"},
        ),
        401,
    )
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    # Bad requests never reach the engine: it still serves.
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_unknown_fields_are_ignored(server, http):
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "frobnicate_level": 9})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert "frobnicate_level" in server.log()


def test_tokenize_roundtrip(http):
    tokens = http.post("/tokenize", json={"prompt": "Hello bus"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("Hello bus")
