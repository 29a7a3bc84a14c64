"""Cohere2 (Command R7B) and Cohere (Command R, Aya) end to end against HF transformers, fp32 on
CPU: a tiny random Cohere2ForCausalLM (a parallel attention and MLP block after one bias-free
LayerNorm, three sliding-window layers with a rotary in adjacent pairs and a global one without,
its logits scaled, tied) and a CohereForCausalLM (the same block, every layer global with its
rotary), each from safetensors and from a GGUF in llama.cpp's naming (cohere2, command-r), give
HF's greedy tokens and logprobs through prefix hits and chunked prefill, past the window, on the
torch and native attention paths; and so does Command R+'s kind (CohereForCausalLM with
use_qk_norm: each query and key head LayerNormed with its own weight before the rotary), on two
tensor-parallel ranks too."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.e2e.oracle import (
    assert_family_matches_hf,
    assert_ranks_match_hf,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
QK_NORM = {"use_qk_norm": True}


# (model_type, overrides): Command R7B's kind, Command R's, Command R+'s
KINDS = {"cohere2": ("cohere2", {}), "cohere": ("cohere", {}), "plus": ("cohere", QK_NORM)}


@pytest.fixture(scope="module", params=list(KINDS))
def hf_dir(request):
    model_type, overrides = KINDS[request.param]
    return cached_tiny_model(model_type, **overrides)


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
    assert arch.attn_qk_norm == (hf_dir == cached_tiny_model("cohere", **QK_NORM))
    assert arch.logits_scaling == pytest.approx(4.0) and arch.tie_word_embeddings
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS, attention_backend=backend)


def test_command_r_plus_on_two_tensor_parallel_ranks(prompts, tmp_path):
    """Each rank LayerNorms its own query and KV heads with their rows of the per-head weights
    (4 query and 2 KV heads: 2 and 1 a rank), here spread far apart head to head."""
    hf_dir = _spread_qk_norms(cached_tiny_model("cohere", **QK_NORM), tmp_path / "plus")
    hf = load_hf(str(hf_dir))
    assert tuple(hf.model.layers[0].self_attn.q_norm.weight.shape) == (4, 16)
    reference = [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts[:4]]
    assert_ranks_match_hf(hf_dir, prompts[:4], reference, MAX_TOKENS)


def _spread_qk_norms(src: Path, dst: Path) -> Path:
    """A copy of `src` whose per-head q/k norm weights lie in [0.25, 2.25) (the random init's
    stay near 1), so that a head normed by another head's weight changes the tokens."""
    shutil.copytree(src, dst)
    path = next(dst.glob("*.safetensors"))
    weights = load_file(path)
    g = torch.Generator().manual_seed(0)
    for name, weight in weights.items():
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            weights[name] = torch.rand(weight.shape, generator=g) * 2 + 0.25
    save_file(weights, path, metadata={"format": "pt"})
    return dst
