"""OLMo 2 end to end against HF transformers, fp32 on CPU: a tiny random OLMo 2 (post-norm
layers, q/k norms over the whole projection) from its safetensors directory and from a GGUF in
llama.cpp's naming (post-norms only; a tokenizer transformers builds without a config) gives
HF's greedy tokens and logprobs for a batch through prefix-cache hits and chunks; two tensor
parallel ranks, each holding half of every q/k norm, sum the mean square across them."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import assert_same_or_near_tie, hf_greedy_logprobs, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_models import cached_tiny_model, write_gguf
from tokenbus import SamplingParams

MAX_TOKENS = 10
LOGPROB_ATOL = 2e-3
ENGINE = dict(kv_cache_dtype="float32")  # HF's numbers exactly, from the GGUF too


@pytest.fixture(scope="module")
def hf_dir():
    return cached_tiny_model("olmo2")


@pytest.fixture(scope="module")
def reference(hf_dir):
    """Prompts, and HF's greedy tokens with the logprob HF gives each."""
    prefix = random_prompts(1, 40, 40, seed=51)[0]
    prompts = random_prompts(3, 1, 50, seed=52) + [prefix + t for t in random_prompts(3, 1, 9, 53)]
    hf = load_hf(str(hf_dir))
    return [(prompt, *hf_greedy_logprobs(hf, prompt, MAX_TOKENS)) for prompt in prompts]


def _generate(llm, reference, logprobs: int):
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=logprobs
    )
    prompts = [{"prompt_token_ids": p} for p, _, _ in reference]
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, reference, kind, tmp_path):
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "olmo2.gguf")
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=32, **ENGINE)
    for got, (_, tokens, logprobs) in zip(_generate(llm, reference, 1), reference):
        assert got.token_ids == tokens
        ours = [position[token].logprob for position, token in zip(got.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(hf_dir, reference):
    """Each rank holds 2 query heads and 1 KV head, and their part of q_norm / k_norm; the
    all-reduces reorder sums, so a near tie may flip (HF's token then in our top 5, close)."""
    llm = make_llm(hf_dir, tensor_parallel_size=2, **ENGINE)
    try:
        for got, (_, tokens, _) in zip(_generate(llm, reference, 5), reference):
            assert_same_or_near_tie(got.token_ids, tokens, got.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()
