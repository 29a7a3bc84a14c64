"""Phi-3 / Phi-4 end to end against HF transformers, fp32 on CPU.

A tiny random Phi-4-mini-shaped model (fused qkv_proj / gate_up_proj, LongRoPE over the first
3/4 of each head) from its safetensors directory and from a GGUF in llama.cpp's naming (attn_qkv,
ffn_up, rope_factors_long/short) gives HF's greedy tokens, with logprobs within tolerance, for a
batch through prefix-cache hits, chunked prefill, preemption and two tensor-parallel ranks. Every
prompt is longer than the original context (16 positions), where HF turns by the long factors,
as an engine with a longer context always does (model/layers/rotary.py). The plain Phi-3, the
partial-rotary one and a YaRN Qwen3 give HF's tokens too, and a Q8_0 Phi-3 decodes its layers in
C with the tokens of the op-by-op path."""

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
ENGINE = dict(kv_cache_dtype="float32")  # a GGUF on CPU defaults to a float16 cache
ORIGINAL_CONTEXT = 16
PHI4_MINI = dict(
    rope_scaling={
        "rope_type": "longrope",
        "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.8],
        "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 24.0],
    },
    partial_rotary_factor=0.75,  # head_dim 16: the first 12 dims turn
    original_max_position_embeddings=ORIGINAL_CONTEXT,
    max_position_embeddings=256,
)
OTHER_VARIANTS = {
    "phi3": ("phi3", {}),
    "phi3-partial": ("phi3", dict(partial_rotary_factor=0.5)),
    "qwen3-yarn": (
        "qwen3",
        dict(
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        ),
    ),
}


@pytest.fixture(scope="module")
def hf_dir():
    return cached_tiny_model("phi3", **PHI4_MINI)


@pytest.fixture(scope="module")
def gguf_file(hf_dir, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp("phi3") / "tiny-phi4-mini.gguf", "F32")


@pytest.fixture(params=["safetensors", "gguf"])
def model_path(request, hf_dir, gguf_file):
    return hf_dir if request.param == "safetensors" else gguf_file


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 40, 40, seed=31)[0]  # 2 full blocks + 8 tokens, shared
    long_enough = ORIGINAL_CONTEXT + 1
    return random_prompts(4, long_enough, 60, seed=32) + [
        prefix + t for t in random_prompts(4, 1, 20, 33)
    ]


def hf_reference(hf_dir, prompts):
    """HF's greedy tokens and the logprob HF gives each of them, per prompt."""
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.fixture(scope="module")
def reference(hf_dir, prompts):
    return hf_reference(hf_dir, prompts)


def generate(llm, prompts, logprobs=1):
    return greedy_outputs(llm, prompts, MAX_TOKENS, logprobs)


def test_arch_is_phi3_with_longrope_over_part_of_each_head(model_path):
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_path)))
    assert (arch.architecture, arch.head_dim, arch.rotary_dim) == ("phi3", 16, 12)
    assert arch.rope_scaling["rope_type"] == "longrope"


@pytest.mark.parametrize("caching", [True, False])
def test_batch_with_shared_prefixes(model_path, prompts, reference, caching):
    llm = make_llm(model_path, enable_prefix_caching=caching, **ENGINE)
    assert_matches_hf(generate(llm, prompts), reference)
    hits = llm.engine.stats_totals["prefix_cache_hits"]
    assert hits == (3 * 32 if caching else 0)  # the last three hit the first's two full blocks
    assert_engine_clean(llm)


def test_tiny_token_budget_forces_chunking(model_path, prompts, reference):
    llm = make_llm(
        model_path,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
        max_num_seqs=4,
        **ENGINE,
    )
    assert_matches_hf(generate(llm, prompts), reference)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(model_path, prompts, reference):
    llm = make_llm(model_path, num_kv_blocks=8, max_model_len=96, **ENGINE)
    assert_matches_hf(generate(llm, prompts), reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(model_path, prompts, reference):
    """Each rank takes its 2 query heads and 1 KV head out of every fused qkv_proj, and its half
    of gate and of up out of gate_up_proj; an all-reduce reorders sums, so a near tie may flip
    (then HF's token is in our top logprobs, close)."""
    llm = make_llm(model_path, tensor_parallel_size=2, **ENGINE)
    try:
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5
        )
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False
        )
        for out, (tokens, _) in zip(outputs, reference[:4]):
            assert_same_or_near_tie(out.outputs[0].token_ids, tokens, out.outputs[0].logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("variant", OTHER_VARIANTS)
def test_other_variants_match_hf(variant, fmt, prompts, tmp_path):
    arch, overrides = OTHER_VARIANTS[variant]
    hf_dir = cached_tiny_model(arch, **overrides)
    path = hf_dir if fmt == "safetensors" else write_gguf(hf_dir, tmp_path / "m.gguf")
    llm = make_llm(path, **ENGINE)
    assert_matches_hf(generate(llm, prompts[:4]), hf_reference(hf_dir, prompts[:4]))
    assert_engine_clean(llm)


@pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not CpuFeatures.detect().has("avx2", "fma"),
    reason="the C decode layer runs tiled GGUF kernels: a C compiler and AVX2 + FMA needed",
)
def test_q8_0_gguf_decodes_in_c_with_the_eager_tokens(prompts, tmp_path):
    """GGUF blocks kept quantized: fused attn_qkv / ffn_up stacked back into one tiled weight
    each, decode steps run every layer in one C call (decode_layer.c) and give the tokens
    --enforce-eager gives op by op."""
    path = write_gguf(cached_tiny_model("phi3"), tmp_path / "tiny-phi3-q8_0.gguf", "Q8_0")
    tokens = {}
    for eager in (False, True):
        llm = make_llm(path, enforce_eager=eager)
        model = llm.engine.client.engine_core.executor.worker.model
        assert model.decodes_in_c is not eager and model.quant_kernels is not None
        tokens[eager] = [out.token_ids for out in generate(llm, prompts)]
        assert_engine_clean(llm)
    assert tokens[False] == tokens[True]
