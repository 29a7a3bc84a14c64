"""Apertus (ApertusForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
model with per-head q/k norms, Llama 3's rope scaling, and MLPs without a gate whose xIELU
activation has trained values of its own in every layer, gives HF's greedy tokens and logprobs
from safetensors and from a GGUF as llama.cpp's apertus converter writes it (the xIELU values
as per-layer metadata arrays), through prefix-cache hits and 32-token chunks, on both attention
backends and on two tensor-parallel ranks."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_family_matches_hf,
    assert_ranks_match_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("apertus", 54, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from gguf import GGUFReader

    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "apertus.gguf")
    if kind == "gguf":  # the xIELU values as metadata, not tensors
        reader = GGUFReader(path)
        assert "xielu.alpha_p" in reader.fields
        assert not any("act_fn" in t.name for t in reader.tensors)
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.hidden_act, arch.head_dim) == ("apertus", "xielu", 16)
    # a GGUF carries Llama 3's scaling as rope_freqs factors, as llama.cpp's LlamaModel writes it
    want = "llama3" if kind == "safetensors" else "freq_factors"
    assert arch.rope_scaling["rope_type"] == want
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_tensor_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank holds half the heads and half of each MLP's up rows (xIELU is elementwise)."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)
