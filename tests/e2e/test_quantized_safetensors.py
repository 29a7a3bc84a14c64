"""Quantized safetensors end to end: tiny models written as the FP8 (loader/fp8.py), GPTQ, AWQ
and compressed-tensors W4A16 / W8A8 (loader/int_weights.py) and bitsandbytes NF4 / int8
(loader/bnb.py) releases are, against HF transformers: on the same FP8 files (it dequantizes
them on a CPU), on the other files' fp32 twins (its readers of those need packages that are
not ours). Dequantized (--quantization none) the engine gives HF's tokens and logprobs; under
auto on CPU the matrices run as GGUF blocks (4-bit integers as Q4_1, symmetric 8-bit ones as
Q8_0, the rest rounded to Q8_0) on the quantized kernels and the C decoder layers, with the
dequantized engine's tokens up to near ties."""

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
from tests.fixtures.bnb_checkpoint import bnb_checkpoint
from tests.fixtures.fp8_checkpoint import fp8_checkpoint
from tests.fixtures.packed_checkpoint import packed_checkpoint
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.utils.cpu import CpuFeatures

MAX_TOKENS = 8
needs_tiles = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None or not CpuFeatures.detect().has("avx2", "fma"),
    reason="Q8_0 tiles need a C compiler and AVX2 + FMA",
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
CHECKPOINTS = {  # name: (family, its config overrides, writer)
    "fp8-llama": ("llama", {}, lambda src, out: fp8_checkpoint(src, out, "fp8", (32, 32))),
    "fp8-qwen3_moe": ("qwen3_moe", MOE, lambda src, out: fp8_checkpoint(src, out, "fp8", (32, 32))),
    "gptq-qwen2": ("qwen2", {}, lambda src, out: packed_checkpoint(src, out, "gptq")),
    "w4a16-llama": ("llama", {}, lambda src, out: packed_checkpoint(src, out, "ct-pack")),
    "w8a8-qwen3": (
        "qwen3",
        {},
        lambda src, out: packed_checkpoint(src, out, "ct-int", bits=8, group_size=-1),
    ),
    "bnb-nf4-llama": ("llama", {}, lambda src, out: bnb_checkpoint(src, out, 4, nested=True)),
    "bnb-int8-qwen3_moe": ("qwen3_moe", MOE, lambda src, out: bnb_checkpoint(src, out, 8)),
    "awq-qwen3_moe": (
        "qwen3_moe",
        MOE,
        lambda src, out: packed_checkpoint(src, out, "awq", sym=False),
    ),
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    """(the quantized checkpoint, the directory HF reads as its reference)."""
    family, overrides, write = CHECKPOINTS[request.param]
    quantized, twin = write(
        cached_tiny_model(family, **overrides), tmp_path_factory.mktemp("q") / "m"
    )
    return quantized, quantized if request.param.startswith("fp8") else twin


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, 5, 40, seed=71)


def test_dequantized_gives_hfs_tokens(checkpoint, prompts):
    quantized, reference_dir = checkpoint
    hf = load_hf(str(reference_dir))
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]
    llm = make_llm(quantized, quantization="none", kv_cache_dtype="float32")
    assert llm.engine.client.engine_core.executor.worker.model.quant_kernels is None
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), reference)
    assert_engine_clean(llm)


@needs_tiles
def test_auto_runs_gguf_blocks_with_the_dequantized_tokens(checkpoint, prompts):
    results = {}
    for quantization in ("auto", "none"):
        llm = make_llm(checkpoint[0], quantization=quantization, kv_cache_dtype="float32")
        model = llm.engine.client.engine_core.executor.worker.model
        assert (model.quant_kernels is not None) == (quantization == "auto")
        assert model.decodes_in_c == (quantization == "auto")
        results[quantization] = greedy_outputs(llm, prompts, MAX_TOKENS, 5)
        assert_engine_clean(llm)
    for ours, dense in zip(results["auto"], results["none"]):
        assert_same_or_near_tie(ours.token_ids, dense.token_ids, ours.logprobs)
