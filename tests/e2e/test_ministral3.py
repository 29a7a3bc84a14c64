"""Ministral 3 (Ministral3ForCausalLM) end to end against HF transformers, fp32 on CPU: Mistral's
layers with YaRN (its released parameters, mscale and mscale_all_dim) and Llama 4's query
temperature, 1 + beta * ln(1 + floor(position / original context)), with an original context of
16 so the prompts run through several of its steps. From safetensors and from a GGUF in llama.cpp's
"mistral3" naming (the temperature as attention.temperature_scale, mscale_all_dim as
yarn_log_multiplier) it gives HF's tokens and logprobs through prefix hits and chunks; a Q8_0
GGUF decodes every layer in one C call, the temperature included, with the dequantized file's
tokens; and without the temperature HF's own logprobs move past the tolerance (so the test sees
it)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.e2e.oracle import (
    LOGPROB_ATOL,
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    family_fixtures,
    hf_greedy_logprobs,
    load_hf,
)
from tests.fixtures.tiny_gguf import write_gguf

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("ministral3", 81, MAX_TOKENS, (20, 60))


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "m3.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert arch.architecture == "ministral3"
    assert arch.attn_temperature == (pytest.approx(0.1), 16)  # a GGUF's is float32
    assert arch.rope_scaling["rope_type"] == "yarn"
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS)


def test_quantized_layers_decode_in_c_with_the_temperature(hf_dir, prompts, tmp_path):
    assert_c_layers_match_dequantized(
        write_gguf(hf_dir, tmp_path / "m3-q8.gguf", "Q8_0"), prompts, MAX_TOKENS
    )


def test_the_temperature_moves_hfs_logprobs(hf_dir, prompts, hf_reference, tmp_path):
    plain = shutil.copytree(hf_dir, tmp_path / "plain")
    config = json.loads((plain / "config.json").read_text())
    config["rope_parameters"].pop("llama_4_scaling_beta")
    config["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (plain / "config.json").write_text(json.dumps(config))
    hf = load_hf(str(plain))
    moved = 0.0
    for prompt, (_, logprobs) in zip(prompts, hf_reference):
        _, plain_logprobs = hf_greedy_logprobs(hf, prompt, MAX_TOKENS)
        moved = max(moved, max(abs(a - b) for a, b in zip(logprobs, plain_logprobs)))
    assert moved > 10 * LOGPROB_ATOL
