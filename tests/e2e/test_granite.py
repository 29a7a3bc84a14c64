"""Granite end to end against HF transformers, fp32 on CPU: a tiny random Granite (its four
multipliers at Granite 3.x's values) from its safetensors directory and from a GGUF in
llama.cpp's naming (multipliers as *_scale keys; a tokenizer transformers builds without a
config) gives HF's greedy tokens and logprobs for a batch through prefix-cache hits and chunks."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import hf_greedy_logprobs, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams

MAX_TOKENS = 10
LOGPROB_ATOL = 2e-3
ENGINE = dict(kv_cache_dtype="float32")  # HF's numbers exactly, from the GGUF too


@pytest.fixture(scope="module")
def hf_dir():
    return cached_tiny_model("granite")


@pytest.fixture(scope="module")
def reference(hf_dir):
    """Prompts, and HF's greedy tokens with the logprob HF gives each."""
    prefix = random_prompts(1, 40, 40, seed=41)[0]
    prompts = random_prompts(3, 1, 50, seed=42) + [prefix + t for t in random_prompts(3, 1, 9, 43)]
    hf = load_hf(str(hf_dir))
    return [(prompt, *hf_greedy_logprobs(hf, prompt, MAX_TOKENS)) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, reference, kind, tmp_path):
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "granite.gguf")
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=32, **ENGINE)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p, _, _ in reference], params, use_tqdm=False
    )
    for out, (_, tokens, logprobs) in zip(outputs, reference):
        got = out.outputs[0]
        assert got.token_ids == tokens
        ours = [position[token].logprob for position, token in zip(got.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)
