"""HunYuan dense (HunYuanDenseV1ForCausalLM: Hunyuan-0.5B, 1.8B, 4B, 7B) end to end against HF
transformers, fp32 on CPU: a tiny random model whose attention RMSNorms each query and key head
after the rotary, and whose rope is NTK-alpha's (labelled "dynamic", a fixed stretched base),
gives HF's greedy tokens and logprobs from safetensors and from a GGUF as llama.cpp's
hunyuan-dense converter writes it (the base stretched once), through prefix-cache hits and
32-token chunks, on both attention backends, on two tensor-parallel ranks, and on Q8_0 blocks
with every decode step in C (the norms after the rotary there too)."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("hunyuan_v1_dense", 52, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "hunyuan.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.head_dim, arch.rope_scaling) == ("hunyuan_v1_dense", 16, None)
    assert arch.rope_theta == pytest.approx(10000.0 * 1000.0 ** (16 / 14), rel=1e-6)
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept: every decode step in one C call, its q/k norms after the rotary, with
    the dequantized file's tokens (run layer by layer) up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "hunyuan-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts[:4], MAX_TOKENS)
