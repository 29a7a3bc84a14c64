"""dots.llm1 (Dots1ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
model with Qwen3's attention (per-head q/k norms), a dense first layer, then GLM-4.5's MoE
(experts by sigmoid score + a bias within the best 2 of 4 groups, renormalised, weighed x2,
beside a shared MLP), its layers from the second on local (a window of 32), gives HF's greedy
tokens and logprobs from safetensors on both attention backends and on two tensor-parallel
ranks, and from a GGUF as llama.cpp's Dots1Model writes it (on Qwen2-MoE's keys; the released
model has no window, nor does the GGUF's test model), through prefix-cache hits and 32-token
chunks; on Q8_0 blocks every decode step runs in C."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
GLOBAL = dict(max_window_layers=3)  # every layer global, as dots.llm1's 62 of 62


@pytest.fixture(scope="module", params=["windowed", "global"])
def hf_dir(request):
    return cached_tiny_model("dots1", **(GLOBAL if request.param == "global" else {}))


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(57)


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, backend, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    windowed = load_arch(resolve_model(str(hf_dir))).sliding_windows != ()
    paths = [hf_dir] if windowed else [hf_dir, write_gguf(hf_dir, tmp_path / "dots1.gguf")]
    for path in paths:
        arch = load_arch(resolve_model(str(path)))
        assert (arch.architecture, arch.attn_qk_norm, arch.dense_layers) == ("dots1", True, (0,))
        assert (arch.moe_scoring, arch.moe_selection_bias, arch.norm_topk_prob) == (
            "sigmoid",
            True,
            True,
        )
        assert (arch.moe_groups, arch.moe_topk_groups, arch.routed_scaling_factor) == (4, 2, 2.0)
        assert arch.sliding_windows == ((None, 32, 32) if windowed else ())
        assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_quantized_layers_decode_in_c(prompts, tmp_path):
    path = write_gguf(cached_tiny_model("dots1", **GLOBAL), tmp_path / "dots1-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts[:4], MAX_TOKENS)
