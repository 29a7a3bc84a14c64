"""Granite end to end against HF transformers, fp32 on CPU: a tiny random Granite (its four
multipliers at Granite 3.x's values) and a Granite 4.0 attention-only dense model
(GraniteMoeHybrid: the MLP as `shared_mlp`; with a rotary, and without one), each from its
safetensors directory and from a GGUF in llama.cpp's naming (multipliers as *_scale keys;
Granite 4.0 written as "granite"; a tokenizer transformers builds without a config) give HF's
greedy tokens and logprobs for a batch through prefix-cache hits and chunks; unknown layer kinds
of Granite 4.0 are refused by name (its Mamba2 layers and experts: test_granite_hybrid.py)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.oracle import hf_greedy_logprobs, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams

MAX_TOKENS = 10
LOGPROB_ATOL = 2e-3
ENGINE = dict(kv_cache_dtype="float32")  # HF's numbers exactly, from the GGUF too


@pytest.fixture(scope="module", params=["granite", "granitemoehybrid", "granitemoehybrid-nope"])
def hf_dir(request):
    if request.param == "granitemoehybrid-nope":  # the 4.0-H models' setting: no rotary at all
        # scores scaled up (Granite's 1/16 keeps them so small a rotary hardly moves them)
        return cached_tiny_model(
            "granitemoehybrid", position_embedding_type="nope", attention_multiplier=1.0
        )
    return cached_tiny_model(request.param)


@pytest.fixture(scope="module")
def reference(hf_dir):
    """Prompts, and HF's greedy tokens with the logprob HF gives each."""
    prefix = random_prompts(1, 40, 40, seed=41)[0]
    prompts = random_prompts(3, 1, 50, seed=42) + [prefix + t for t in random_prompts(3, 1, 9, 43)]
    hf = load_hf(str(hf_dir))
    return [(prompt, *hf_greedy_logprobs(hf, prompt, MAX_TOKENS)) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, reference, kind, tmp_path):
    config = json.loads((hf_dir / "config.json").read_text())
    if kind == "gguf" and config.get("position_embedding_type") == "nope":
        pytest.skip("llama.cpp writes it as a granite GGUF, which records no NoPE")
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "granite.gguf")
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=32, **ENGINE)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=1
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p, _, _ in reference], params, use_tqdm=False
    )
    for out, (_, tokens, logprobs) in zip(outputs, reference):
        got = out.outputs[0]
        assert got.token_ids == tokens
        ours = [position[token].logprob for position, token in zip(got.logprobs, tokens)]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_ATOL)
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    "edit, message",
    [
        (dict(layer_types=["mamba", "cross_attention"]), "must name 'mamba' or 'attention'"),
    ],
)
def test_granite_4_hybrid_parts_are_refused_by_name(tmp_path, edit, message):
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    hf_dir = shutil.copytree(cached_tiny_model("granitemoehybrid"), tmp_path / "m")
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=message):
        load_arch(resolve_model(str(hf_dir)))


def test_granite_4_without_rope_has_no_rotary_layers(tmp_path):
    """position_embedding_type other than "rope" (the 4.0-H models' "nope"): no rotary at all,
    as GraniteMoeHybridModel builds none."""
    from tokenbus.loader import load_arch, resolve_model

    hf_dir = cached_tiny_model("granitemoehybrid", position_embedding_type="nope")
    arch = load_arch(resolve_model(str(hf_dir)))
    assert arch.nope_layers == (0, 1) and arch.intermediate_size == 96
