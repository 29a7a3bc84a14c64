"""EXAONE 4 (Exaone4ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
EXAONE 4 (OLMo 2's post-norm block with Qwen3's per-head q/k norms; three sliding-window layers
and a global one without a rotary, as its 32B model; and the 1.2B's kind, no windows, a rotary
everywhere) from safetensors and from a GGUF in llama.cpp's naming gives HF's greedy tokens and
logprobs through prefix hits and chunks past the window; a Q8_0 GGUF decodes in C with the
dequantized file's tokens."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["hybrid", "global"])
def hf_dir(request):
    if request.param == "global":  # EXAONE-4.0-1.2B's kind
        return cached_tiny_model("exaone4", sliding_window=None, layer_types=["full_attention"] * 4)
    return cached_tiny_model("exaone4")


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(101, (20, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "exaone4.gguf")
    arch = load_arch(resolve_model(str(path)))
    hf_config = load_hf(str(hf_dir)).config
    want = ((16, 16, 16, None), (3,)) if hf_config.sliding_window else ((), ())
    assert arch.architecture == "exaone4"
    assert (arch.sliding_windows, arch.nope_layers) == want
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    assert_c_layers_match_dequantized(
        write_gguf(hf_dir, tmp_path / "exaone4-q8.gguf", "Q8_0"), prompts, MAX_TOKENS
    )
