"""MiniMax-M2 (MiniMaxM2ForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny
random MiniMax-M2 (q/k RMSNormed over the whole projection, half of each head turning; every MLP
8 experts, 2 a token, scored by their sigmoids and chosen by score + a random bias) from
safetensors and from a GGUF in llama.cpp's minimax-m2 naming gives HF's greedy tokens and
logprobs through prefix-cache hits and 32-token chunks on both attention backends, and on two
expert-parallel ranks; its Q8_0 file decodes every layer in C."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_c_layers_match_dequantized,
    assert_family_matches_hf,
    assert_ranks_match_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("minimax_m2", 67, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "minimax-m2.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.rotary_dim, arch.dense_layers) == ("minimax_m2", 8, ())
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    routing = (arch.moe_scoring, arch.moe_selection_bias, arch.norm_topk_prob, arch.moe_norm_eps)
    assert routing == ("sigmoid", True, True, 0.0)
    assert arch.shared_expert_intermediate_size == 0
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_two_expert_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank routes every token and runs its 4 experts; q/k norms over the whole
    projection across the ranks' heads."""
    assert_ranks_match_hf(hf_dir, prompts[:4], hf_reference[:4], MAX_TOKENS)


def test_quantized_layers_decode_in_c(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept: every decode step in one C call (whole-projection q/k norms, partial
    rotary, sigmoid routing), with the dequantized file's tokens up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "minimax-m2-q8_0.gguf", "Q8_0")
    assert_c_layers_match_dequantized(path, prompts, MAX_TOKENS)


def test_other_router_scorings_are_refused_by_name(tmp_path):
    import json
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("minimax_m2"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    with pytest.raises(ValueError, match="scoring_func 'softmax' is not supported"):
        load_arch(resolve_model(str(model)))
