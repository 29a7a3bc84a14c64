"""LFM2 (Lfm2ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random LFM2 (two
gated short convolutions, an attention layer, a convolution: LFM2-1.2B's order) from safetensors
and from a GGUF in llama.cpp's naming gives HF's greedy tokens and logprobs through chunks that
cut prompts anywhere, mixed batches of decodes and chunks, preemptions (a state rebuilt from
token 0) and two tensor-parallel ranks; prefix caching is off for it, and what would reuse or
roll back a state is refused by name."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_matches_hf,
    assert_same_or_near_tie,
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


@pytest.fixture(scope="module", params=["plain", "conv_bias"])
def hf_dir(request):
    if request.param == "conv_bias":  # biases on in_proj, the conv and out_proj
        return cached_tiny_model("lfm2", conv_bias=True)
    return cached_tiny_model("lfm2")


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(211, (1, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    if kind == "gguf" and load_hf(str(hf_dir)).config.conv_bias:
        pytest.skip("llama.cpp's lfm2 has no conv biases (the released models have none)")
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "lfm2.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.recurrent_layers, arch.conv_kernel) == ("lfm2", (0, 1, 3), 3)
    assert (arch.intermediate_size, arch.num_key_value_heads, arch.num_kv_layers) == (96, 2, 1)
    llm = make_llm(path, enable_prefix_caching=True, **ENGINE)
    # asked for, turned off: a hit would skip the tokens a state is made of
    core = llm.engine.client.engine_core
    assert not core.config.cache.enable_prefix_caching
    shapes = core.executor.worker.model.state_shapes()  # the arch counts what the pools hold
    assert shapes == {0: (2, 64), 1: (2, 64), 3: (2, 64)}
    assert arch.state_size_per_request == 3 * 2 * 64
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["prefix_cache_hits"] == 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_tiny_token_budget_cuts_prompts_anywhere(hf_dir, prompts, hf_reference):
    """Chunks of 1 to 8 tokens: a window straddles two, three or more steps' inputs."""
    llm = make_llm(
        hf_dir, kv_cache_dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=7
    )
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(hf_dir, prompts, hf_reference):
    """Recomputed requests start again from a zeroed state row."""
    llm = make_llm(hf_dir, num_kv_blocks=6, max_model_len=80, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_scheduling_ahead_and_a_small_pool(hf_dir, prompts, hf_reference):
    """--async-scheduling: the worker takes step n + 1's new requests (and preemptions) while
    step n's outputs are unread; rows change hands only as the steps say."""
    llm = make_llm(hf_dir, async_scheduling=True, num_kv_blocks=6, max_model_len=80, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank holds half the conv channels (and their state), half the heads."""
    llm = make_llm(hf_dir, tensor_parallel_size=2, **ENGINE)
    try:
        outputs = greedy_outputs(llm, prompts[:4], MAX_TOKENS, logprobs=5)
        for out, (tokens, _) in zip(outputs, hf_reference[:4]):
            assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("engine", "flag"),
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
        (
            dict(
                kv_transfer_config={"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}
            ),
            "kv_transfer",
        ),
    ],
)
def test_what_would_reuse_a_state_is_refused(engine, flag):
    with pytest.raises(ValueError, match=f"{flag}_config is not supported for lfm2"):
        make_llm(cached_tiny_model("lfm2"), **engine)


def test_quantized_gguf_runs_on_its_blocks(prompts, tmp_path):
    """Q8_0 blocks kept (in_proj and out_proj of the convolutions too): the dequantized
    file's tokens, up to near ties."""
    path = write_gguf(cached_tiny_model("lfm2"), tmp_path / "lfm2-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts, MAX_TOKENS, max_num_batched_tokens=32)
