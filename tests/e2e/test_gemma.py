"""Gemma, Gemma 2 and Gemma 3 (text) end to end against HF transformers, fp32 on CPU: tiny random
models (Gemma: (1 + w) norms in fp32, GeGLU, the scaled embedding in Llama's pre-norm layers;
Gemma 2: soft-capped scores and logits, alternating local and global layers; Gemma 3: q/k
norms, five local layers on their own RoPE base and a global one) from their safetensors
directories and from GGUFs in llama.cpp's naming give HF's greedy tokens, with logprobs within
tolerance, for a batch through prefix-cache hits, chunked prefill, preemption and two
tensor-parallel ranks; a Q8_0 GGUF runs on its blocks, op by op. Prompts of up to 72 tokens
run past the local layers' 32-token window, whose KV group holds only the window's blocks."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_matches_hf,
    assert_same_or_near_tie,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
)
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 12
# fp32 K/V for the GGUF too (a GGUF on CPU defaults to a float16 cache): HF's numbers exactly.
ENGINE = dict(kv_cache_dtype="float32")


@pytest.fixture(scope="module", params=["gemma", "gemma2", "gemma3"])
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_dir(family):
    return cached_tiny_model(family)


@pytest.fixture(scope="module")
def gguf_file(hf_dir, family, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp(family) / f"tiny-{family}-f32.gguf")


@pytest.fixture(params=["safetensors", "gguf"])
def model_path(request, hf_dir, gguf_file):
    return hf_dir if request.param == "safetensors" else gguf_file


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 40, 40, seed=21)[0]  # 2 full blocks + 8 tokens, shared
    return random_prompts(4, 1, 60, seed=22) + [prefix + t for t in random_prompts(4, 1, 20, 23)]


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    """HF's greedy tokens and the logprob HF gives each of them, per prompt."""
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


def generate(llm, prompts, logprobs=1):
    return greedy_outputs(llm, prompts, MAX_TOKENS, logprobs)


@pytest.mark.parametrize("caching", [True, False])
def test_batch_with_shared_prefixes(model_path, prompts, hf_reference, caching):
    llm = make_llm(model_path, enable_prefix_caching=caching, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    hits = llm.engine.stats_totals["prefix_cache_hits"]
    assert hits == (3 * 32 if caching else 0)  # the last three hit the first's two full blocks
    assert_engine_clean(llm)


def test_tiny_token_budget_forces_chunking(model_path, prompts, hf_reference):
    llm = make_llm(
        model_path,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        max_num_seqs=4,
        **ENGINE,
    )
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert_engine_clean(llm)


# A pool that holds one request of 96 tokens and no more: with the hybrid KV cache a block is
# a page of one layer per KV group, and every group (Gemma 2: 2, Gemma 3: 6) takes 6 of them.
SMALL_POOL = {"gemma": 8, "gemma2": 16, "gemma3": 40}


def test_small_kv_pool_forces_preemptions(family, model_path, prompts, hf_reference):
    llm = make_llm(model_path, num_kv_blocks=SMALL_POOL[family], max_model_len=96, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(model_path, prompts, hf_reference):
    """Each rank holds 2 query heads, 1 KV head and the whole norms; an all-reduce reorders
    sums, so a near tie may flip (then HF's token is in our top logprobs, close)."""
    llm = make_llm(model_path, tensor_parallel_size=2, **ENGINE)
    try:
        for out, (tokens, _) in zip(generate(llm, prompts[:4], logprobs=5), hf_reference[:4]):
            assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_q8_0_gguf_runs_on_its_blocks(hf_dir, family, prompts, hf_reference, tmp_path):
    """GGUF blocks kept quantized (the embedding too, tied to the head): the tokens stay HF's
    up to near ties; decode steps run each layer in C (Gemma 2's soft-capped scores too)."""
    path = write_gguf(hf_dir, tmp_path / f"tiny-{family}-q8_0.gguf", "Q8_0")
    llm = make_llm(path)
    model = llm.engine.client.engine_core.executor.worker.model
    assert model.quant_kernels is not None and model.decodes_in_c
    for out, (tokens, _) in zip(generate(llm, prompts, logprobs=5), hf_reference):
        assert_same_or_near_tie(out.token_ids, tokens, out.logprobs, gap=0.3)
    assert_engine_clean(llm)
