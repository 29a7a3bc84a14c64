"""PhiMoE (PhimoeForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
PhiMoE (LayerNorms with biases, q/k/v, o_proj and LM head biases, 4 experts of which
sparsemixer picks 2) gives HF's greedy tokens and logprobs with its default rope and with
Phi-3.5-MoE's LongRoPE (HF's short factors and short_mscale, in an engine whose context passes
the original one), in one batch, in small chunks and on two expert-parallel ranks."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_matches_hf,
    assert_ranks_match_hf,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.e2e.utils import assert_engine_clean, make_llm
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
# a context past LongRoPE's original 256: HF keeps the short factors and short_mscale there
ENGINE = dict(kv_cache_dtype="float32", max_num_batched_tokens=32, max_model_len=512)
HEAD_DIM = 16  # TINY_CONFIG's 64 wide over 4 heads
# Phi-3.5-MoE's rope_scaling at a tiny size: factors per rotary pair, an attention factor per set
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0 + 0.1 * i for i in range(HEAD_DIM // 2)],
    "long_factor": [2.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
    "short_mscale": 1.2,
    "long_mscale": 1.3,
    "original_max_position_embeddings": 256,
}


@pytest.fixture(scope="module", params=["default", "longrope"])
def hf_dir(request):
    if request.param == "longrope":
        return cached_tiny_model("phimoe", rope_parameters=LONGROPE, max_position_embeddings=1024)
    return cached_tiny_model("phimoe")


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(401, (1, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


def test_the_config_s_routing_and_biases():
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(cached_tiny_model("phimoe"))))
    assert (arch.architecture, arch.moe_scoring, arch.moe_jitter_eps) == (
        "phimoe",
        "sparsemixer",
        0.3,
    )
    assert (arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob) == (4, 2, False)
    assert arch.lm_head_bias and arch.attention_bias and not arch.tie_word_embeddings


def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference):
    llm = make_llm(hf_dir, **ENGINE)
    model = llm.engine.client.engine_core.executor.worker.model
    assert model.lm_head.bias is not None and model.norm.bias is not None
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(llm)
    small = make_llm(
        hf_dir, kv_cache_dtype="float32", max_num_batched_tokens=16, max_model_len=512,
        long_prefill_token_threshold=7,
    )  # fmt: skip
    assert_matches_hf(greedy_outputs(small, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(small)


def test_two_expert_parallel_ranks(prompts):
    """Each rank holds 2 whole experts, half the heads, half the vocabulary's LM head rows
    and biases; the router, the norms and their biases whole."""
    hf_dir = cached_tiny_model("phimoe")
    hf = load_hf(str(hf_dir))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts[:4]]
    assert_ranks_match_hf(hf_dir, prompts[:4], reference, MAX_TOKENS)
