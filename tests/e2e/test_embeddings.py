"""Embedding requests (SamplingParams.pooling) through the scheduler: the vector equals HF
transformers' final hidden state, last-token or mean pooled and L2-normalised, with chunked
prefill and next to generating requests."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.oracle import load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tokenbus import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=16)  # 16-token chunks


def hf_hidden(tiny_llama_dir, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = load_hf(str(tiny_llama_dir))(torch.tensor([prompt]), output_hidden_states=True)
    return out.hidden_states[-1][0].float()  # after the final norm


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_equal_hf(llm, tiny_llama_dir, pooling):
    prompts = random_prompts(3, 10, 45, seed=21, vocab_low=5, vocab_high=200)
    requests = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=1, pooling=pooling)] * 2 + [
        SamplingParams(max_tokens=5, ignore_eos=True)
    ]
    outputs = llm.generate(requests, params, use_tqdm=False)
    for prompt, output in zip(prompts[:2], outputs[:2]):
        hidden = hf_hidden(tiny_llama_dir, prompt)
        want = torch.nn.functional.normalize(
            hidden[-1] if pooling == "last" else hidden.mean(0), dim=-1
        )
        got = torch.tensor(output.pooled)
        assert output.outputs[0].token_ids == [] and output.outputs[0].finish_reason == "stop"
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert abs(got.norm().item() - 1.0) < 1e-5
    # generation as usual
    assert len(outputs[2].outputs[0].token_ids) == 5 and outputs[2].pooled is None
    assert_engine_clean(llm)


def test_bad_pooling_is_refused():
    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
