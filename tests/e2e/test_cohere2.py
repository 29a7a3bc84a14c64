"""Cohere2 (Command R7B) and Cohere (Command R, Aya) end to end against HF transformers, fp32 on
CPU: a tiny random Cohere2ForCausalLM (a parallel attention and MLP block after one bias-free
LayerNorm, three sliding-window layers with a rotary in adjacent pairs and a global one without,
its logits scaled, tied) and a CohereForCausalLM (the same block, every layer global with its
rotary), each from safetensors and from a GGUF in llama.cpp's naming (cohere2, command-r), give
HF's greedy tokens and logprobs through prefix hits and chunked prefill, past the window, on the
torch and native attention paths. Command R+'s per-head q/k LayerNorms are refused by name."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_family_matches_hf,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["cohere2", "cohere"])
def hf_dir(request):
    return cached_tiny_model(request.param)


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(91, (20, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_greedy_tokens_and_logprobs_are_hf_s(
    hf_dir, prompts, hf_reference, kind, backend, tmp_path
):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "cohere.gguf")
    arch = load_arch(resolve_model(str(path)))
    if arch.architecture == "cohere2":
        assert (arch.sliding_windows, arch.nope_layers) == ((16, 16, 16, None), (3,))
    else:
        assert (arch.architecture, arch.sliding_windows, arch.nope_layers) == ("cohere", (), ())
    assert arch.logits_scaling == pytest.approx(4.0) and arch.tie_word_embeddings
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_command_r_plus_qk_norms_are_refused_by_name(tmp_path):
    import json
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("cohere"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "use_qk_norm": True}))
    with pytest.raises(ValueError, match="use_qk_norm=true .* is not supported for cohere"):
        load_arch(resolve_model(str(model)))
