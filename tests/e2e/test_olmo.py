"""OLMo 2 and OLMo 3 end to end against HF transformers, fp32 on CPU. A tiny random OLMo 2
(post-norm layers, q/k norms over the whole projection) and OLMo 3 (the same layers, three of
four local with a window of 32 and an unscaled RoPE, the global one with YaRN), each from its
safetensors directory and from a GGUF in llama.cpp's naming (olmo2, OLMo 3 with its window and
local-layer flags; a tokenizer transformers builds without a config), give HF's greedy tokens
and logprobs for a batch through prefix-cache hits, chunks and prompts past the window; two
tensor parallel ranks, each holding half of every q/k norm, sum the mean square across them."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import assert_same_or_near_tie, hf_greedy_logprobs, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, model_runner, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams

MAX_TOKENS = 10
LOGPROB_ATOL = 2e-3
ENGINE = dict(kv_cache_dtype="float32")  # HF's numbers exactly, from the GGUF too


@pytest.fixture(scope="module", params=["olmo2", "olmo3"])
def family(request):
    """(family, its HF directory, prompts with HF's greedy tokens and their logprobs)."""
    hf_dir = cached_tiny_model(request.param)
    prefix = random_prompts(1, 40, 40, seed=51)[0]
    prompts = random_prompts(3, 1, 50, seed=52) + [prefix + t for t in random_prompts(3, 1, 9, 53)]
    hf = load_hf(str(hf_dir))
    reference = [(prompt, *hf_greedy_logprobs(hf, prompt, MAX_TOKENS)) for prompt in prompts]
    return request.param, hf_dir, reference


def _generate(llm, reference, logprobs: int):
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=logprobs
    )
    prompts = [{"prompt_token_ids": p} for p, _, _ in reference]
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(family, kind, tmp_path):
    name, hf_dir, reference = family
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / f"{name}.gguf")
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=32, **ENGINE)
    model = model_runner(llm).model
    if name == "olmo3":  # local layers: the window, their unscaled table and their KV group
        assert [layer.self_attn.sliding_window for layer in model.layers] == [32, 32, 32, None]
        assert [layer.self_attn.rope_table for layer in model.layers] == [1, 1, 1, 0]
        assert len(set(model_runner(llm).buffers.layer_groups)) > 1  # the hybrid KV cache
    for got, (_, tokens, logprobs) in zip(_generate(llm, reference, 1), reference):
        assert got.token_ids == tokens
        ours = [position[token].logprob for position, token in zip(got.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(family):
    """Each rank holds 2 query heads and 1 KV head, and their part of q_norm / k_norm; the
    all-reduces reorder sums, so a near tie may flip (HF's token then in our top 5, close)."""
    _, hf_dir, reference = family
    llm = make_llm(hf_dir, tensor_parallel_size=2, **ENGINE)
    try:
        for got, (_, tokens, _) in zip(_generate(llm, reference, 5), reference):
            assert_same_or_near_tie(got.token_ids, tokens, got.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()
