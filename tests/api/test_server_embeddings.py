"""POST /v1/embeddings on a real `tokenbus serve` with the official openai client: vectors equal
HF transformers' pooled final hidden state, float and base64 alike; bad input is a 400."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from tests.e2e.oracle import load_hf
from tests.fixtures.server import ServerProcess

PROMPTS = [
    [5, 17, 42, 99, 3, 77],
    [120, 8, 64, 31, 2, 150, 11, 90, 45, 6, 33, 71, 18, 140, 7, 9, 12, 13, 14],
]


@pytest.fixture(scope="module", params=["last", "mean"])
def served(request, tiny_llama_dir, tmp_path_factory):
    with ServerProcess(
        str(tiny_llama_dir),
        "--max-model-len",
        "256",
        "--max-num-batched-tokens",
        "8",
        "--pooler",
        request.param,
        log_dir=tmp_path_factory.mktemp("embeddings"),
    ) as server:
        yield (
            request.param,
            openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60),
        )


def expected(tiny_llama_dir, prompt: list[int], pooling: str) -> np.ndarray:
    with torch.no_grad():
        hidden = load_hf(str(tiny_llama_dir))(
            torch.tensor([prompt]), output_hidden_states=True
        ).hidden_states[-1][0]
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return torch.nn.functional.normalize(vector.float(), dim=-1).numpy()


def test_embeddings_equal_hf(served, tiny_llama_dir):
    pooling, client = served
    model = client.models.list().data[0].id
    out = client.embeddings.create(model=model, input=PROMPTS)
    assert [d.index for d in out.data] == [0, 1]
    assert out.usage.prompt_tokens == sum(len(p) for p in PROMPTS) == out.usage.total_tokens
    for prompt, item in zip(PROMPTS, out.data):
        np.testing.assert_allclose(
            item.embedding, expected(tiny_llama_dir, prompt, pooling), atol=1e-4
        )
    packed = client.embeddings.with_raw_response.create(
        model=model, input=PROMPTS[0], encoding_format="base64"
    )
    raw = packed.http_response.json()["data"][0]["embedding"]
    np.testing.assert_allclose(
        np.frombuffer(base64.b64decode(raw), dtype="<f4"), out.data[0].embedding, atol=1e-6
    )
    text = client.embeddings.create(model=model, input=["hello there", "general kenobi"])
    assert len(text.data) == 2 and len(text.data[0].embedding) == len(out.data[0].embedding)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(model=model, input="x", dimensions=8)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.embeddings.create(model=model, input=[[5] * 300])
