"""`tokenbus serve` with no model argument: the packaged SmolLM2-135M-Instruct answers sensibly."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with ServerProcess(None, "--max-model-len", "2048", "--kv-cache-memory", "256MiB") as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_default_model_answers(client):
    model = client.models.list().data[0].id
    assert model == "smollm2"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    assert "Paris" in full.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full.choices[0].message.content
