"""LFM2-MoE (Lfm2MoeForCausalLM) end to end against HF transformers, fp32 on CPU: a tiny random
LFM2-MoE (LFM2's order of short convolutions and attention; the first layer's MLP dense, then 8
experts, 2 a token, scored by their sigmoids and chosen by score + a random expert bias) from
safetensors and from a GGUF in llama.cpp's lfm2moe naming (experts stacked per layer,
exp_probs_b, expert_gating_func 2) gives HF's greedy tokens and logprobs through mixed batches
of decodes and chunks, preemptions and two expert-parallel ranks, and so does one without the
bias, its top k not renormalised and scaled by routed_scaling_factor (from safetensors: llama.cpp
has neither); its Q8_0 file's experts run on their blocks."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_matches_hf,
    assert_same_or_near_tie,
    greedy_outputs,
    hf_greedy,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.e2e.utils import assert_engine_clean, assert_rows_follow_requests, make_llm
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32", max_num_batched_tokens=32)


@pytest.fixture(scope="module", params=["plain", "unbiased_scaled"])
def hf_dir(request):
    if request.param == "unbiased_scaled":  # the other routing branches HF's config allows
        return cached_tiny_model(
            "lfm2_moe", use_expert_bias=False, norm_topk_prob=False, routed_scaling_factor=2.5
        )
    return cached_tiny_model("lfm2_moe")


def plain(hf_dir) -> bool:
    return load_hf(str(hf_dir)).config.use_expert_bias


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(223, (1, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model
    from tokenbus.model.decoder import GatedMLP
    from tokenbus.model.moe import SparseMoeBlock

    if kind == "gguf" and not plain(hf_dir):
        pytest.skip("llama.cpp's lfm2moe always renormalises and reads no weights scale")
    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "lfm2moe.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.recurrent_layers, arch.dense_layers) == (
        "lfm2_moe",
        (0, 1, 3),
        (0,),
    )
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (8, 2, 32)
    assert (arch.moe_scoring, arch.intermediate_size) == ("sigmoid", 96)
    routing = (arch.moe_selection_bias, arch.norm_topk_prob, arch.routed_scaling_factor)
    assert routing == ((True, True, 1.0) if plain(hf_dir) else (False, False, 2.5))
    llm = make_llm(path, **ENGINE)
    model = llm.engine.client.engine_core.executor.worker.model
    assert [type(layer.mlp) for layer in model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    if plain(hf_dir):
        assert model.layers[1].mlp.selection_bias.abs().min() > 0  # the file's bias, loaded
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(hf_dir, prompts, hf_reference):
    """Recomputed requests start again from a zeroed state row; the experts see the same
    tokens again."""
    llm = make_llm(hf_dir, num_kv_blocks=6, max_model_len=80, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_two_expert_parallel_ranks(hf_dir, prompts, hf_reference):
    """Each rank routes every token, runs its 4 experts and half the conv channels."""
    llm = make_llm(hf_dir, tensor_parallel_size=2, **ENGINE)
    try:
        outputs = greedy_outputs(llm, prompts[:4], MAX_TOKENS, logprobs=5)
        for out, (tokens, _) in zip(outputs, hf_reference[:4]):
            assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_expert_bias_changes_hfs_tokens(prompts, tmp_path):
    """The tiny model's expert bias matters: HF's tokens without it differ, so the equality
    above checks the biased choice."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    hf_dir = cached_tiny_model("lfm2_moe")
    unbiased = shutil.copytree(hf_dir, tmp_path / "unbiased")
    weights = load_file(str(unbiased / "model.safetensors"))
    biases = [name for name in weights if name.endswith("feed_forward.expert_bias")]
    assert len(biases) == 3
    for name in biases:
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(unbiased / "model.safetensors"), metadata={"format": "pt"})
    tokens = {
        path: [hf_greedy(load_hf(str(path)), p, MAX_TOKENS) for p in prompts]
        for path in (hf_dir, unbiased)
    }
    assert tokens[hf_dir] != tokens[unbiased]


def test_quantized_gguf_runs_on_its_blocks(prompts, tmp_path):
    """Q8_0 blocks kept (the stacked experts, each expert's rows, too): the dequantized file's
    tokens, up to near ties."""
    path = write_gguf(cached_tiny_model("lfm2_moe"), tmp_path / "lfm2moe-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts, MAX_TOKENS, max_num_batched_tokens=32)


def test_stacked_experts_are_read_per_expert(prompts, tmp_path):
    """Experts stacked as transformers 5 saves them (feed_forward.experts.gate_up_proj [E, 2I,
    hidden]: w1 rows, then w3 rows; down_proj [E, hidden, I]) give the per-expert file's tokens."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    source = cached_tiny_model("lfm2_moe")
    stacked = shutil.copytree(source, tmp_path / "stacked")
    weights = load_file(str(stacked / "model.safetensors"))
    for layer in (1, 2, 3):  # the MoE layers
        scope = f"model.layers.{layer}.feed_forward.experts"
        experts = [{w: weights.pop(f"{scope}.{e}.{w}.weight") for w in ("w1", "w3", "w2")}
                   for e in range(8)]  # fmt: skip
        weights[f"{scope}.gate_up_proj"] = torch.stack(
            [torch.cat([e["w1"], e["w3"]]) for e in experts]
        )
        weights[f"{scope}.down_proj"] = torch.stack([e["w2"] for e in experts])
    save_file(weights, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    outputs = {}
    for path in (source, stacked):
        llm = make_llm(path, **ENGINE)
        outputs[path] = [out.token_ids for out in greedy_outputs(llm, prompts, MAX_TOKENS)]
        assert_engine_clean(llm)
    assert outputs[stacked] == outputs[source]
