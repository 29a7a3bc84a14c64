"""Seed-OSS (SeedOssForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
Seed-OSS (Llama's layers with q/k/v biases and none on o_proj) from safetensors and from a GGUF in
llama.cpp's seed_oss naming (its pre-MLP norm as post_attention_norm) gives HF's greedy tokens
and logprobs through prefix-cache hits and 32-token chunks on both attention backends; its Q8_0
file decodes every layer in C; an o_proj bias (attention_out_bias) is refused by name."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("seed_oss", 73, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "seed-oss.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.attention_bias, arch.head_dim) == ("seed_oss", True, 16)
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    path = write_gguf(hf_dir, tmp_path / "seed-oss-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts, MAX_TOKENS)


def test_an_o_proj_bias_is_refused_by_name(tmp_path):
    import json
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("seed_oss"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_out_bias": True}))
    with pytest.raises(ValueError, match="attention_out_bias=true is not supported for seed_oss"):
        load_arch(resolve_model(str(model)))
