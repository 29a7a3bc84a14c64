"""Qwen3 (dense) end to end against HF transformers, fp32 on CPU: a tiny random Qwen3 (q/k norms,
head_dim 32 != hidden / heads) from its safetensors directory and from a GGUF in llama.cpp's
naming gives HF's greedy tokens, with logprobs within tolerance, for a batch through
prefix-cache hits, chunked prefill, preemption and two tensor-parallel ranks; a Q8_0 GGUF decodes
its layers in C with the tokens of the op-by-op path."""

from __future__ import annotations

import os
import shutil

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
from tokenbus import SamplingParams
from tokenbus.utils.cpu import CpuFeatures

MAX_TOKENS = 12
# fp32 K/V for the GGUF too (a GGUF on CPU defaults to a float16 cache): HF's numbers exactly.
ENGINE = dict(kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def hf_dir():
    return cached_tiny_model("qwen3", head_dim=32)


@pytest.fixture(scope="module")
def gguf_file(hf_dir, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp("qwen3") / "tiny-qwen3-f32.gguf", "F32")


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


def test_arch_is_qwen3_with_its_own_head_dim(model_path):
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_path)))
    assert (arch.architecture, arch.head_dim, arch.hidden_size, arch.num_attention_heads) == (
        "qwen3",
        32,
        64,
        4,
    )
    assert not arch.attention_bias


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


def test_small_kv_pool_forces_preemptions(model_path, prompts, hf_reference):
    llm = make_llm(model_path, num_kv_blocks=8, max_model_len=96, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(model_path, prompts, hf_reference):
    """Each rank holds 2 query heads, 1 KV head and the whole q/k norms; an all-reduce reorders
    sums, so a near tie may flip (then HF's token is in our top logprobs, close)."""
    llm = make_llm(model_path, tensor_parallel_size=2, **ENGINE)
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5
        )
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False
        )
        for out, (tokens, _) in zip(outputs, hf_reference[:4]):
            assert_same_or_near_tie(out.outputs[0].token_ids, tokens, out.outputs[0].logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not CpuFeatures.detect().has("avx2", "fma"),
    reason="the C decode layer runs tiled GGUF kernels: a C compiler and AVX2 + FMA needed",
)
def test_q8_0_gguf_decodes_in_c_with_the_eager_tokens(hf_dir, prompts, tmp_path):
    """GGUF blocks kept quantized: decode steps run every layer, q/k norms included, in one C
    call (decode_layer.c), and give the tokens --enforce-eager gives op by op."""
    path = write_gguf(hf_dir, tmp_path / "tiny-qwen3-q8_0.gguf", "Q8_0")
    tokens = {}
    for eager in (False, True):
        llm = make_llm(path, enforce_eager=eager)
        model = llm.engine.client.engine_core.executor.worker.model
        assert model.decodes_in_c is not eager and model.quant_kernels is not None
        tokens[eager] = [out.token_ids for out in generate(llm, prompts)]
        assert_engine_clean(llm)
    assert tokens[False] == tokens[True]
