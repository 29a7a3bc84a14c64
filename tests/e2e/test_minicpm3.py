"""MiniCPM3 (MiniCPM3ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
model with DeepSeek-V2's latent attention (queries through a bottleneck, its rotary turning
halves by LongRoPE's short factors) and muP's scales (embeddings x12, each sublayer x1.4 /
sqrt(layers), the logits divided by hidden / 256) gives HF's greedy tokens and logprobs from
safetensors and from a GGUF in llama.cpp's minicpm3 naming (kv_b_proj whole, the scales fixed
by the graph), through prefix-cache hits and 32-token chunks, on both attention backends, on
two tensor-parallel ranks, and on Q8_0 blocks with every decode step in C."""

from __future__ import annotations

import math

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("minicpm3", 48, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "minicpm3.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.num_key_value_heads, arch.head_dim) == ("minicpm3", 1, 40)
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.rotary_dim) == (32, 32, 8)
    assert (arch.qk_nope_head_dim, arch.v_head_dim, arch.mla_rope_interleaved) == (16, 16, False)
    assert (arch.embedding_multiplier, arch.logits_scaling) == (12.0, 0.25)
    assert arch.residual_multiplier == pytest.approx(1.4 / math.sqrt(2))
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank holds two of the four query heads over the whole latent, and half the MLP."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept: every decode step in one C call, the latent attention (its absorbed
    products on W_UK and W_UV, the one KV head of the cache) included, with the dequantized
    file's tokens (run layer by layer) up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "minicpm3-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts[:4], MAX_TOKENS)
