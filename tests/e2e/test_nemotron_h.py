"""Nemotron-H (NemotronHForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
model of single-mixer blocks (Mamba2, MLP, attention, MLP, Mamba2: heads in two groups, scans in
pieces of 16 tokens) from its checkpoint (backbone.* names) and from a GGUF in llama.cpp's
nemotron_h naming gives HF's greedy tokens and logprobs through chunks that cut prompts
anywhere, mixed batches and preemptions; only its attention layer holds K/V."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_matches_hf,
    family_fixtures,
    greedy_outputs,
)
from tests.e2e.utils import assert_engine_clean, assert_rows_follow_requests, make_llm
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32", max_num_batched_tokens=32)
hf_dir, prompts, hf_reference = family_fixtures("nemotron_h", 401, MAX_TOKENS, (1, 60))


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "nemotron-h.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.num_hidden_layers) == ("nemotron_h", 5)
    assert (arch.recurrent_layers, arch.mlp_only_layers, arch.num_kv_layers) == ((0, 4), (1, 3), 1)
    assert (arch.mamba_heads, arch.mamba_groups, arch.nope_layers) == (8, 2, (0, 1, 2, 3, 4))
    llm = make_llm(path, **ENGINE)
    worker = llm.engine.client.engine_core.executor.worker
    caches = worker.runner.kv_caches  # K/V for the attention layer alone
    assert [cache.dim() for cache in caches] == [2, 1, 5, 1, 2]
    assert caches[1].numel() == caches[3].numel() == 0
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_tiny_token_budget_and_a_small_pool(hf_dir, prompts, hf_reference):
    """Chunks of 1 to 8 tokens, and a pool too small for the batch: preemptions rebuild the
    states from token 0."""
    llm = make_llm(
        hf_dir,
        kv_cache_dtype="float32",
        max_num_batched_tokens=16,
        long_prefill_token_threshold=7,
        num_kv_blocks=6,
        max_model_len=80,
    )
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_quantized_gguf_runs_on_its_blocks(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept (the mixers' projections, the MLPs', attention's): the dequantized
    file's tokens, up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "nemotron-h-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts, MAX_TOKENS, max_num_batched_tokens=32)


def test_mixture_of_experts_blocks_are_refused_by_name(tmp_path):
    import json
    import shutil

    from tokenbus.loader import load_arch, resolve_model

    model = shutil.copytree(cached_tiny_model("nemotron_h"), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["layers_block_type"] = ["linear_attention", "moe", "full_attention", "mlp", "moe"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mixture-of-experts blocks are not supported"):
        load_arch(resolve_model(str(model)))
