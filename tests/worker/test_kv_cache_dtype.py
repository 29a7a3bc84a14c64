"""--kv-cache-dtype: what auto resolves to, bad values, and whole engines on a tiny Q4_1 GGUF
with an fp16 KV pool (the default there) against an fp32 one: greedy tokens equal up to near
ties, half the bytes per block, no block leaked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams
from tokenbus.config import CacheConfig
from tokenbus.engine.setup import resolve_config
from tokenbus.engine_args import EngineArgs
from tokenbus.loader import resolve_model


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    hf = cached_tiny_model("llama", hidden_size=256, intermediate_size=512)
    return write_gguf(hf, tmp_path_factory.mktemp("gguf") / "tiny-q4_1.gguf", "Q4_1")


def config(model, **kwargs):
    return EngineArgs(model=str(model), device="cpu", **kwargs).to_config(256)


def resolve_kv_cache_dtype(config, src) -> torch.dtype:
    """The K/V dtype the resolved config names."""
    return getattr(torch, resolve_config(config, src).cache.kv_cache_dtype)


def test_auto_is_float16_only_for_float32_models_on_gguf_blocks(gguf_path):
    gguf_src, hf_src = resolve_model(str(gguf_path)), resolve_model(str(cached_tiny_model("llama")))
    assert resolve_kv_cache_dtype(config(gguf_path), gguf_src) == torch.float16
    assert resolve_kv_cache_dtype(config(gguf_path, quantization="none"), gguf_src) == torch.float32
    assert resolve_kv_cache_dtype(config(gguf_path, dtype="bfloat16"), gguf_src) == torch.bfloat16
    # dense weights: as --dtype
    assert resolve_kv_cache_dtype(config(hf_src.path), hf_src) == torch.float32
    assert (
        resolve_kv_cache_dtype(config(gguf_path, kv_cache_dtype="float32"), gguf_src)
        == torch.float32
    )
    assert (
        resolve_kv_cache_dtype(config(hf_src.path, kv_cache_dtype="float16"), hf_src)
        == torch.float16
    )


def test_bad_kv_cache_dtype_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="fp4")
    assert CacheConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"  # vLLM's name: fp8_e4m3
    assert (
        dataclasses.replace(CacheConfig(), kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    )


def test_float16_pool_matches_float32_pool_greedily(gguf_path):
    prompts = random_prompts(6, 5, 60, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, logprobs=3)
    results = {}
    for kv_dtype in ("auto", "float32"):
        llm = make_llm(gguf_path, max_model_len=256, kv_cache_dtype=kv_dtype, max_num_seqs=4)
        worker = llm.engine.client.engine_core.executor.worker
        pool = worker.runner.kv_caches[0]
        results[kv_dtype] = (
            pool.dtype,
            pool.element_size(),
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
        )
        assert_engine_clean(llm)
        llm.shutdown()
    (half, half_size, got), (full, full_size, want) = results["auto"], results["float32"]
    assert (half, full, half_size * 2) == (torch.float16, torch.float32, full_size)
    for out, ref in zip(got, want):
        tokens, ref_tokens = out.outputs[0].token_ids, ref.outputs[0].token_ids
        if tokens != ref_tokens:  # a near tie flipped by fp16 rounding: both within 0.1 nats there
            i = next(i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b)
            position = ref.outputs[0].logprobs[i]
            assert (
                tokens[i] in position
                and position[ref_tokens[i]].logprob - position[tokens[i]].logprob < 0.1
            )
