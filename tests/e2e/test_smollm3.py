"""SmolLM3 end to end against HF transformers, fp32 on CPU: a tiny random SmolLM3 (the last of
its four layers without rotary) from its safetensors directory and from a GGUF in llama.cpp's
naming (whose tokenizer transformers builds without a config) gives HF's greedy tokens for a
batch through prefix-cache hits and chunked prefill; with use_sliding_window its NoPE layer
slides, through the hybrid KV cache."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus.core.kv.hybrid import HybridKVCacheManager
from tokenbus.loader import load_tokenizer, resolve_model

MAX_TOKENS = 12
# fp32 K/V for the GGUF too (a GGUF on CPU defaults to a float16 cache): HF's numbers exactly.
ENGINE = dict(kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def hf_dir():
    return cached_tiny_model("smollm3")


@pytest.fixture(scope="module")
def gguf_file(hf_dir, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp("smollm3") / "tiny-smollm3-f32.gguf")


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 40, 40, seed=31)[0]  # 2 full blocks + 8 tokens, shared
    return random_prompts(4, 1, 60, seed=32) + [prefix + t for t in random_prompts(3, 1, 20, 33)]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_are_hf_s_through_prefix_hits_and_chunks(hf_dir, gguf_file, prompts, kind):
    hf = load_hf(str(hf_dir))
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    path = hf_dir if kind == "safetensors" else gguf_file
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=32, **ENGINE)
    assert llm.engine.client.engine_core.executor.worker.model.arch.nope_layers == (3,)
    assert generate_greedy(llm, prompts, MAX_TOKENS) == want
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)


def test_gguf_tokenizer_is_the_directory_s(hf_dir, gguf_file):
    """transformers cannot rebuild a config for a smollm3 GGUF (AutoTokenizer's first step): the
    tokenizer comes from the file's tokenizer.ggml.* alone, and encodes as the HF files do."""
    ours = load_tokenizer(resolve_model(str(gguf_file)))
    theirs = load_tokenizer(resolve_model(str(hf_dir)))
    text = "Hello world!  How are you?\n\nI'm fine, 1234 thanks."
    assert ours.encode(text) == theirs.encode(text)
    assert (ours.eos_token, ours.chat_template) == (theirs.eos_token, theirs.chat_template)


def test_sliding_nope_layer_keeps_hf_greedy_tokens(prompts):
    """use_sliding_window: the NoPE layer (window 16) reads its own KV group, which drops the
    blocks that fell out of its window; prompts run well past it."""
    hf_dir = cached_tiny_model("smollm3", use_sliding_window=True, sliding_window=16)
    hf = load_hf(str(hf_dir))
    want = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    llm = make_llm(hf_dir, enable_prefix_caching=True, **ENGINE)
    manager = llm.engine.client.engine_core.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager) and set(manager.windows) == {None, 16}
    assert generate_greedy(llm, prompts, MAX_TOKENS) == want
    assert_engine_clean(llm)
