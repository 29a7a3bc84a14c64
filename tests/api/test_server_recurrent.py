"""A model with recurrent layers behind the OpenAI server: a tiny random LFM2 (short
convolutions keeping a state per request) and a Qwen3.5 (Gated DeltaNet layers: a conv window
and a state matrix per head) served by a real `tokenbus serve` (its engine in its own process)
and read by the official openai client. A greedy answer is the same alone, streamed,
and after other requests ran beside it and reused their state rows."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.fixtures.server import ServerProcess
from tests.fixtures.tiny_models import cached_tiny_model

PROMPT = "The bus left the depot at dawn and"


@pytest.fixture(scope="module", params=["lfm2", "qwen3_5"])
def client(request):
    with ServerProcess(str(cached_tiny_model(request.param)), "--max-model-len", "256") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _greedy(client, prompt: str, stream: bool = False) -> str:
    params = dict(model=client.models.list().data[0].id, prompt=prompt, max_tokens=12)
    if not stream:
        return client.completions.create(temperature=0, **params).choices[0].text
    chunks = client.completions.create(temperature=0, stream=True, **params)
    return "".join(chunk.choices[0].text for chunk in chunks)


def test_an_answer_does_not_depend_on_the_requests_before_it(client):
    alone = _greedy(client, PROMPT)
    others = [f"Passenger {i} asked the driver" for i in range(6)]
    with ThreadPoolExecutor(6) as pool:  # they run together, each in a state row of its own
        list(pool.map(lambda p: _greedy(client, p), others))
    assert _greedy(client, PROMPT, stream=True) == alone  # a reused row starts zeroed
    assert _greedy(client, PROMPT) == alone
