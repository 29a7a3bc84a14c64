"""FP8 checkpoints end to end (loader/fp8.py): a tiny Llama and a tiny Qwen3-MoE written as
Qwen3-FP8 releases are (128 x 128 blocks there, 32 x 32 here), against HF transformers reading
the same FP8 files (it dequantizes them on a CPU). Dequantized (--quantization none) the engine
gives HF's tokens and logprobs; under auto on CPU the matrices run as Q8_0 blocks, on the
quantized kernels and the C decoder layers, with the dequantized engine's tokens up to near
ties."""

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
from tests.fixtures.fp8_checkpoint import fp8_checkpoint
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.utils.cpu import CpuFeatures

MAX_TOKENS = 8
needs_tiles = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not CpuFeatures.detect().has("avx2", "fma"),
    reason="Q8_0 tiles need a C compiler and AVX2 + FMA",
)
FAMILIES = {
    "llama": {},
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def fp8_dir(request, tmp_path_factory):
    src = cached_tiny_model(request.param, **FAMILIES[request.param])
    out = tmp_path_factory.mktemp(f"fp8-{request.param}") / "m"
    return fp8_checkpoint(src, out, "fp8", (32, 32))[0]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 5, 40, seed=71)


def test_dequantized_gives_hfs_tokens(fp8_dir, prompts):
    hf = load_hf(str(fp8_dir))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]
    llm = make_llm(fp8_dir, quantization="none", kv_cache_dtype="float32")
    assert llm.engine.client.engine_core.executor.worker.model.quant_kernels is None
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), reference)
    assert_engine_clean(llm)


@needs_tiles
def test_auto_runs_q8_0_blocks_with_the_dequantized_tokens(fp8_dir, prompts):
    results = {}
    for quantization in ("auto", "none"):
        llm = make_llm(fp8_dir, quantization=quantization, kv_cache_dtype="float32")
        model = llm.engine.client.engine_core.executor.worker.model
        assert (model.quant_kernels is not None) == (quantization == "auto")
        assert model.decodes_in_c == (quantization == "auto")
        results[quantization] = greedy_outputs(llm, prompts, MAX_TOKENS, 5)
        assert_engine_clean(llm)
    for ours, dense in zip(results["auto"], results["none"]):
        assert_same_or_near_tie(ours.token_ids, dense.token_ids, ours.logprobs)
