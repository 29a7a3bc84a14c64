"""Greedy token-for-token equality with HF transformers (fp32, CPU) on tiny random models."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(16, 1, 100, seed=1)


@pytest.fixture(scope="module")
def expected(tiny_llama_dir, tiny_qwen2_dir, prompts):
    """HF's greedy continuations, computed once per model."""
    result = {}
    for name, path in (("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir)):
        hf = load_hf(str(path))
        result[name] = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    return result


def _model(request, tiny_llama_dir, tiny_qwen2_dir):
    return request.param, {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]


@pytest.fixture(params=["llama", "qwen2"])
def model(request, tiny_llama_dir, tiny_qwen2_dir):
    return _model(request, tiny_llama_dir, tiny_qwen2_dir)


def test_single_request(model, prompts, expected):
    name, path = model
    llm = make_llm(path)
    assert generate_greedy(llm, prompts[:1], MAX_TOKENS) == expected[name][:1]
    assert_engine_clean(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_batch_of_16_mixed_lengths(model, prompts, expected, caching):
    name, path = model
    llm = make_llm(path, enable_prefix_caching=caching)
    assert generate_greedy(llm, prompts, MAX_TOKENS) == expected[name]
    assert_engine_clean(llm)


def test_tiny_token_budget_forces_chunking(model, prompts, expected):
    name, path = model
    llm = make_llm(path, max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_seqs=4)
    assert generate_greedy(llm, prompts, MAX_TOKENS) == expected[name]
    assert llm.engine.stats_totals["num_prompt_tokens"] == sum(len(p) for p in prompts)
    assert_engine_clean(llm)


@pytest.mark.parametrize("caching", [True, False])
def test_small_kv_pool_forces_preemptions(model, prompts, expected, caching):
    name, path = model
    # 10 blocks of 16 tokens, 128-token context: at most ~a few requests fit at once.
    llm = make_llm(path, num_kv_blocks=10, max_model_len=128, enable_prefix_caching=caching)
    assert generate_greedy(llm, prompts, MAX_TOKENS) == expected[name]
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)
