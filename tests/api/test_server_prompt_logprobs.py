"""Scoring through a real `tokenbus serve`, as lm-eval's `local-completions` does it: completions
with echo + logprobs (max_tokens 1 or 0) return the prompt tokens' logprobs, equal to HF
transformers' log-softmax; vLLM's `prompt_logprobs` field on completions and chat."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from tests.e2e.oracle import load_hf
from tests.fixtures.server import ServerProcess

PROMPT = [5, 17, 42, 99, 3, 77, 120, 8, 64, 31, 2, 150, 11, 90, 45, 6, 33, 71, 18, 140]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # 8-token chunks: the prompt's logprobs come from several prefill steps.
    with ServerProcess(
        str(tiny_llama_dir), "--max-model-len", "256", "--max-num-batched-tokens", "8"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    with torch.no_grad():
        logits = load_hf(str(tiny_llama_dir))(torch.tensor([PROMPT])).logits[0].float()
    return logits.log_softmax(-1)  # row p: the distribution of token p + 1


def test_echo_logprobs_score_the_prompt_like_lm_eval(client, reference):
    # lm-eval's loglikelihood request: the continuation's logprobs are token_logprobs[ctxlen:-1].
    out = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=1,
        logprobs=1,
        echo=True,
        temperature=0,
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(PROMPT) + 1  # the prompt, then the generated token
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for position in range(1, len(PROMPT)):
        want = reference[position - 1, PROMPT[position]].item()
        assert math.isclose(logprobs.token_logprobs[position], want, abs_tol=1e-3), position
        top_value = max(logprobs.top_logprobs[position].values())
        assert math.isclose(top_value, reference[position - 1].max().item(), abs_tol=1e-3)
    continuation = sum(logprobs.token_logprobs[10 : len(PROMPT)])
    assert math.isclose(
        continuation,
        sum(reference[p - 1, PROMPT[p]].item() for p in range(10, len(PROMPT))),
        abs_tol=1e-2,
    )
    # max_tokens 0 (OpenAI's legacy scoring form): the same prompt logprobs, nothing generated.
    scored = client.completions.create(
        model=out.model, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True
    )
    assert scored.choices[0].logprobs.token_logprobs == logprobs.token_logprobs[: len(PROMPT)]
    assert scored.usage.completion_tokens == 0
    # Streamed: the same numbers.
    chunks = list(
        client.completions.create(
            model=out.model,
            prompt=PROMPT,
            max_tokens=1,
            logprobs=1,
            echo=True,
            temperature=0,
            stream=True,
        )
    )
    streamed = [
        lp
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.token_logprobs
    ]
    assert streamed == logprobs.token_logprobs


def test_vllm_prompt_logprobs_field(client, server, reference):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position in range(1, len(PROMPT)):
        entry = entries[position][str(PROMPT[position])]
        assert math.isclose(
            entry["logprob"], reference[position - 1, PROMPT[position]].item(), abs_tol=1e-3
        )
        assert entry["rank"] >= 1 and len(entries[position]) in (2, 3)
    chat = {
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 1,
        "prompt_logprobs": 0,
    }
    response = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert response["prompt_logprobs"][0] is None and len(response["prompt_logprobs"]) > 2
    too_many = httpx.post(
        server.url + "/v1/completions", json={**body, "prompt_logprobs": 100}, timeout=60
    )
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"
    bad = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 0}, timeout=60
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
