"""Granite 4.0-H (GraniteMoeHybrid with Mamba2 layers) end to end against HF transformers, fp32 on
CPU: a tiny random model of three Mamba2 mixers around an attention layer (heads in two groups,
a 4-tap conv, scans in pieces of 16 tokens), without a rotary (the 4.0-H models') and with one,
dense and with experts beside the shared MLP (4.0-H Tiny's kind), from safetensors and from a
GGUF in llama.cpp's granitehybrid naming, gives HF's greedy tokens and logprobs through chunks
that cut prompts anywhere, mixed batches of decodes and chunks, and preemptions (a state rebuilt
from token 0). Its multipliers are 1 here: Granite 3's values make this tiny model's greedy
output one token repeated, which a broken mixer gives too."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_matches_hf,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.e2e.utils import assert_engine_clean, assert_rows_follow_requests, make_llm
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32", max_num_batched_tokens=32)
HYBRID = dict(
    layer_types=["mamba", "attention", "mamba", "mamba"],
    num_hidden_layers=4,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    embedding_multiplier=1.0,
    residual_multiplier=1.0,
    logits_scaling=1.0,
    attention_multiplier=0.25,
)


# 4.0-H Tiny's kind: experts (4 of 32, 2 a token) beside the shared MLP
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)


@pytest.fixture(scope="module", params=["nope", "rope", "experts"])
def hf_dir(request):
    if request.param == "experts":
        return cached_tiny_model(
            "granitemoehybrid", **HYBRID, **EXPERTS, position_embedding_type="nope"
        )
    return cached_tiny_model("granitemoehybrid", **HYBRID, position_embedding_type=request.param)


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(307, (1, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "granite-h.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.recurrent_layers) == ("granitemoehybrid", (0, 2, 3))
    assert (arch.mamba_heads, arch.mamba_head_dim, arch.mamba_state) == (8, 16, 16)
    assert (arch.mamba_groups, arch.conv_kernel, arch.conv_bias) == (2, 4, True)
    config = load_hf(str(hf_dir)).config
    assert arch.nope_layers == (() if config.position_embedding_type == "rope" else (0, 1, 2, 3))
    if config.num_local_experts:  # the shared MLP as the experts' ungated shared expert
        assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (
            4,
            2,
            32,
        )
        assert (arch.shared_expert_intermediate_size, arch.shared_expert_gated) == (96, False)
    llm = make_llm(path, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_tiny_token_budget_cuts_prompts_anywhere(hf_dir, prompts, hf_reference):
    """Chunks of 1 to 8 tokens: a conv window and a scan piece straddle steps."""
    llm = make_llm(
        hf_dir, kv_cache_dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=7
    )
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(hf_dir, prompts, hf_reference):
    llm = make_llm(hf_dir, num_kv_blocks=6, max_model_len=80, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_running_requests_are_capped_to_what_their_states_take(hf_dir, prompts, hf_reference):
    """Each request's state (three mixers' held inputs and S, fp32: 31.5 KB) takes a pool row
    up front: within 1 MiB of KV budget, half of it for states, 16 run at once, not 128; the
    arch's count of a state is the pools' own."""
    import math

    llm = make_llm(hf_dir, kv_cache_memory=1 << 20, **ENGINE)
    core = llm.engine.client.engine_core
    arch = core.executor.worker.arch
    shapes = core.executor.worker.model.state_shapes()
    assert arch.state_size_per_request == sum(math.prod(shape) for shape in shapes.values())
    assert arch.state_size_per_request * 4 == 3 * (3 * 192 + 128 * 16) * 4
    assert core.config.scheduler.max_num_seqs == (1 << 19) // (arch.state_size_per_request * 4)
    assert core.config.scheduler.max_num_seqs == 16
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(llm)


def test_tensor_parallelism_is_refused_by_name():
    hf_dir = cached_tiny_model("granitemoehybrid", **HYBRID, position_embedding_type="nope")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 is not supported"):
        make_llm(hf_dir, tensor_parallel_size=2)


def test_quantized_gguf_runs_on_its_blocks(prompts, tmp_path):
    """Q8_0 blocks kept for the mixers' in_proj and out_proj too (their convs, A, D and norms
    stay F32, as llama.cpp keeps them): the dequantized file's tokens, up to near ties."""
    hf_dir = cached_tiny_model("granitemoehybrid", **HYBRID, position_embedding_type="nope")
    path = write_gguf(hf_dir, tmp_path / "granite-h-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts, MAX_TOKENS, max_num_batched_tokens=32)
