"""Arcee (ArceeForCausalLM: AFM-4.5B) end to end against HF transformers, fp32 on CPU: a tiny
random Arcee (Llama's layers, MLPs of relu(up) ** 2 without a gate) from safetensors and from a
GGUF in llama.cpp's arcee naming (q/k rows permuted as Llama's, ffn_up and ffn_down only) gives
HF's greedy tokens and logprobs through prefix-cache hits and 32-token chunks on both attention
backends; its Q8_0 file runs on its blocks."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_family_matches_hf,
    family_fixtures,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
hf_dir, prompts, hf_reference = family_fixtures("arcee", 79, MAX_TOKENS)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "arcee.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.hidden_act) == ("arcee", "relu2")
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_quantized_gguf_runs_on_its_blocks(hf_dir, prompts, tmp_path):
    path = write_gguf(hf_dir, tmp_path / "arcee-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts, MAX_TOKENS)


def test_a_gated_activation_is_refused_by_name(tmp_path):
    import json
    import shutil

    import torch

    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.worker.model_builder import load_model

    model = shutil.copytree(cached_tiny_model("arcee"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}))
    src = resolve_model(str(model))
    with pytest.raises(ValueError, match="hidden_act: only 'relu2' is supported, got 'silu'"):
        load_model(src, load_arch(src), torch.float32, "cpu")
