"""GLM-4 (Glm4ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random GLM-4
(Gemma 2's sandwich norms under its own names, q/k/v biases, gate and up fused, a rotary over
the first half of each head in adjacent pairs) from safetensors and from a GGUF in llama.cpp's
naming gives HF's greedy tokens and logprobs through prefix-cache hits and chunked prefill, on
the torch and native attention paths; and a Q8_0 GGUF decodes each layer in one C call with the
dequantized file's tokens."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("glm4", 71, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "glm4.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.rotary_dim, arch.head_dim) == ("glm4", 8, 16)
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    assert_c_layers_match_dequantized(
        write_gguf(hf_dir, tmp_path / "glm4-q8.gguf", "Q8_0"), prompts, MAX_TOKENS
    )
