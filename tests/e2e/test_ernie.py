"""ERNIE 4.5 (dense) end to end against HF transformers, fp32 on CPU: a tiny random
Ernie4_5ForCausalLM, whose rotary turns adjacent pairs of each head's dims (its q/k rows are
reordered at load so ours turns them), from safetensors and from a GGUF in llama.cpp's naming
(rows as they are, read as a Llama GGUF's), gives HF's greedy tokens and logprobs through
prefix-cache hits and chunked prefill. The MoE model runs in tests/e2e/test_moe.py."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_family_matches_hf,
    family_fixtures,
)
from tests.e2e.utils import assert_engine_clean, make_llm
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32")
# tied, as ERNIE-4.5-0.3B
hf_dir, prompts, hf_reference = family_fixtures(
    "ernie4_5", 51, MAX_TOKENS, tie_word_embeddings=True
)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "ernie.gguf")
    assert load_arch(resolve_model(str(path))).architecture == "ernie4_5"
    assert_family_matches_hf(path, prompts, hf_reference, MAX_TOKENS)


def test_use_bias_is_refused_by_name(tmp_path):
    import json
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("ernie4_5", tie_word_embeddings=True), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "use_bias": True}))
    with pytest.raises(ValueError, match="use_bias"):
        load_arch(resolve_model(str(model)))


def test_the_multi_token_prediction_head_is_not_read(tmp_path):
    """The released checkpoints carry an MTP head (model.mtp_*) for training: left unread."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tokenbus.loader import iter_weights, load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("ernie4_5", tie_word_embeddings=True), tmp_path / "m")
    weights = load_file(str(model / "model.safetensors"))
    weights["model.mtp_linear_proj.0.weight"] = torch.zeros(4, 4)
    weights["model.mtp_block.0.mlp.up_proj.weight"] = torch.zeros(4, 4)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    src = resolve_model(str(model))
    names = {name for name, _ in iter_weights(src, load_arch(src))}
    assert names and not any(name.startswith("model.mtp_") for name in names)
    llm = make_llm(model, **ENGINE)
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)[0].outputs[0].token_ids
    assert_engine_clean(llm)
