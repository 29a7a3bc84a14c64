"""The vLLM extensions, routes and server limits end to end on a real `tokenbus serve` (tiny
model): what the fake-engine tests check, here through the engine, the ZMQ hop and uvicorn."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.server import ServerProcess

ORIGIN = "http://app.example"
CHAT = [{"role": "user", "content": "Tell me about buses."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    # --max-num-seqs 1: an n=16 request runs its children one after another, past the timeout.
    with ServerProcess(
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "-1",
        "--request-timeout",
        "3",
        "--allowed-origins",
        ORIGIN,
        "--enable-prompt-tokens-details",
        "--max-logprobs",
        "-1",
        log_dir=tmp_path_factory.mktemp("extensions"),
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def sse(response: httpx.Response) -> list:
    return [
        json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")
    ]


def test_routes_head_cors_and_content_type(http):
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert http.get("/v1/models/other").status_code == 404
    info = http.get("/tokenizer_info").json()
    assert info["chat_template"] and info["vocab_size"] > 1000 and info["model_max_length"] == 512
    assert http.head("/health").status_code == 200 and http.head("/v1/models").status_code == 200
    preflight = http.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    wrong = http.post(
        "/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"}
    )
    assert wrong.status_code == 415


def test_token_ids_truncation_usage_details_and_full_vocabulary_logprobs(http):
    prompt = list(range(10, 40))
    body = {
        "prompt": prompt,
        "max_tokens": 3,
        "return_token_ids": True,
        "truncate_prompt_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = http.post("/v1/completions", json=body).json()
    assert (
        r["choices"][0]["prompt_token_ids"] == prompt[-8:]
        and len(r["choices"][0]["token_ids"]) == 3
    )
    assert (
        r["usage"]["prompt_tokens"] == 8 and "cached_tokens" in r["usage"]["prompt_tokens_details"]
    )
    plain = {**body, "truncate_prompt_tokens": None}
    http.post("/v1/completions", json=plain)
    again = http.post("/v1/completions", json={**plain, "prompt": prompt + [5, 6, 7]}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # the first block, cached
    stream = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse(http.post("/v1/completions", json=stream))
    assert [e["usage"]["completion_tokens"] for e in events if e["choices"]] == [1, 2, 3]
    assert [t for e in events if e["choices"] for t in e["choices"][0]["token_ids"]] == r[
        "choices"
    ][0]["token_ids"]
    everything = http.post(
        "/v1/chat/completions",
        json={"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1},
    ).json()
    top = everything["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == info_vocab(http)


def info_vocab(http) -> int:
    return http.get("/tokenizer_info").json()["vocab_size"]


def test_continue_final_message_and_chat_echo(http):
    history = [*CHAT, {"role": "assistant", "content": "Buses are"}]
    body = {
        "messages": history,
        "max_tokens": 3,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "echo": True,
        "temperature": 0,
    }
    r = http.post("/v1/chat/completions", json=body).json()
    assert r["choices"][0]["message"]["content"].startswith("Buses are")
    rendered = http.post(
        "/tokenize", json={"messages": history, "add_generation_prompt": False}
    ).json()
    # the last turn left open (no end marker)
    assert r["usage"]["prompt_tokens"] < rendered["count"]


def test_request_timeout_aborts_the_request(server, http):
    body = {"prompt": "The bus goes", "max_tokens": 400, "n": 16, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 408 and "--request-timeout" in r.json()["error"]["message"]
    events = sse(http.post("/v1/completions", json={**body, "stream": True}))
    assert events[-1]["error"]["code"] == 408
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200  # the aborted children freed the engine
    metrics = http.get("/metrics").text
    assert "tokenbus:num_requests_running" in metrics


def test_forged_field_names_are_logged_escaped(server, http):
    forged = "x\nERROR tokenbus.server: FORGED"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, forged: 1})
    assert r.status_code == 200
    log = server.log()
    assert "\\nERROR tokenbus.server: FORGED" in log
    assert not any(line.startswith("ERROR tokenbus.server: FORGED") for line in log.splitlines())
