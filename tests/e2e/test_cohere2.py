"""Cohere2 (Command R7B) end to end against HF transformers, fp32 on CPU: a tiny random
Cohere2ForCausalLM (a parallel attention and MLP block after one bias-free LayerNorm, three
sliding-window layers with a rotary in adjacent pairs and a global one without, its logits
scaled, tied) from safetensors and from a GGUF in llama.cpp's naming gives HF's greedy tokens and
logprobs through prefix hits and chunked prefill, past its window, on the torch and native
attention paths."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_family_matches_hf,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def hf_dir():
    return cached_tiny_model("cohere2")


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(91, (20, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "cohere2.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert arch.architecture == "cohere2"
    assert (arch.sliding_windows, arch.nope_layers) == ((16, 16, 16, None), (3,))
    assert arch.logits_scaling == pytest.approx(4.0) and arch.tie_word_embeddings
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)
