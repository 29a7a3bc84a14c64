"""Qwen3.5 and Qwen3.5-MoE (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM) end to end against HF
transformers, fp32 on CPU: a tiny random Qwen3.5 (two Gated DeltaNet layers, gated attention
with a partial rotary, another Gated DeltaNet: its 3:1 order), dense or with 8 experts and a
gated shared expert in every layer, gives HF's greedy tokens and logprobs through chunks that
cut prompts anywhere, mixed batches of decodes and chunks, preemptions (a state rebuilt from
token 0) and scheduling ahead, from safetensors and from a GGUF in llama.cpp's qwen35 naming
(value heads reordered to tiled, A as -exp(A_log), norms as 1 + w; qwen35moe's stacked
experts), and with the experts stacked as transformers 5 holds them; its Q8_0 file runs on its
blocks; prefix caching is off for it, and tensor parallelism is refused by name.
(Its image-and-text checkpoint: tests/e2e/test_multimodal_text.py.)"""

from __future__ import annotations

import pytest

from tests.e2e.oracle import (
    assert_blocks_match_dequantized,
    assert_matches_hf,
    assert_same_or_near_tie,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
    prompts_with_a_shared_prefix,
)
from tests.e2e.utils import assert_engine_clean, assert_rows_follow_requests, make_llm
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32", max_num_batched_tokens=32)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def hf_dir(request):
    return cached_tiny_model(request.param)


def family(hf_dir) -> str:
    """Our architecture name of the tiny model at hf_dir."""
    model_type = load_hf(str(hf_dir)).config.model_type
    return {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}.get(
        model_type, model_type
    )


def has_experts(hf_dir) -> bool:
    return family(hf_dir) != "qwen3_5"


@pytest.fixture(scope="module")
def prompts():
    return prompts_with_a_shared_prefix(229, (1, 60))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_greedy_tokens_and_logprobs_are_hf_s(hf_dir, prompts, hf_reference, kind, tmp_path):
    from tokenbus.loader import load_arch, resolve_model

    path = hf_dir if kind == "safetensors" else write_gguf(hf_dir, tmp_path / "qwen35.gguf")
    arch = load_arch(resolve_model(str(path)))
    assert (arch.architecture, arch.recurrent_layers, arch.conv_kernel) == (
        family(hf_dir),
        (0, 1, 3),
        4,
    )
    assert (arch.delta_k_heads, arch.delta_v_heads, arch.delta_k_dim, arch.delta_v_dim) == (
        2,
        4,
        16,
        16,
    )
    assert (arch.rotary_dim, arch.attn_output_gate, arch.num_kv_layers) == (4, True, 1)
    # llama.cpp's Qwen3.5 converter puts the value heads in tiled order (not Qwen3-Next's)
    assert arch.delta_v_tiled == (kind == "gguf" and family(hf_dir) != "qwen3_next")
    if has_experts(hf_dir):
        experts = (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size)
        assert experts == (8, 2, 32)
        dense = (1,) if family(hf_dir) == "qwen3_next" else ()  # its mlp_only_layers
        assert (arch.shared_expert_intermediate_size, arch.dense_layers) == (64, dense)
    llm = make_llm(path, enable_prefix_caching=True, **ENGINE)
    core = llm.engine.client.engine_core
    assert not core.config.cache.enable_prefix_caching  # a hit would skip a state's tokens
    # held conv inputs [3, 2 * 32 + 64], then S [4, 16, 16]
    shapes = core.executor.worker.model.state_shapes()
    assert shapes == {layer: (3 * 128 + 4 * 16 * 16,) for layer in (0, 1, 3)}
    assert arch.state_size_per_request == 3 * (3 * 128 + 4 * 16 * 16)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["prefix_cache_hits"] == 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_tiny_token_budget_cuts_prompts_anywhere(hf_dir, prompts, hf_reference):
    """Chunks of 1 to 8 tokens: a conv window straddles steps, S carries across them."""
    llm = make_llm(
        hf_dir, kv_cache_dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=7
    )
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(hf_dir, prompts, hf_reference):
    """Recomputed requests start again from a zeroed state row."""
    llm = make_llm(hf_dir, num_kv_blocks=6, max_model_len=80, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_scheduling_ahead_and_a_small_pool(hf_dir, prompts, hf_reference):
    llm = make_llm(hf_dir, async_scheduling=True, num_kv_blocks=6, max_model_len=80, **ENGINE)
    assert_matches_hf(greedy_outputs(llm, prompts, MAX_TOKENS), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_rows_follow_requests(llm)
    assert_engine_clean(llm)


def test_tensor_parallelism_is_refused_by_name(hf_dir):
    with pytest.raises(ValueError, match="its Gated DeltaNet layers run on one rank"):
        make_llm(hf_dir, tensor_parallel_size=2)


def test_quantized_gguf_runs_on_its_blocks(hf_dir, prompts, tmp_path):
    """Q8_0 blocks kept (q_proj's rows split into queries and gates as blocks): the
    dequantized file's tokens, up to near ties."""
    path = write_gguf(hf_dir, tmp_path / "qwen35-q8_0.gguf", "Q8_0")
    assert_blocks_match_dequantized(path, prompts, MAX_TOKENS, max_num_batched_tokens=32)


def test_stacked_experts_are_read_per_expert(prompts, tmp_path):
    """Qwen3.5-MoE's experts stacked as transformers 5 holds them (gate_up_proj [E, 2I,
    hidden], down_proj [E, hidden, I]) give the per-expert checkpoint's tokens."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    source = cached_tiny_model("qwen3_5_moe")
    stacked = shutil.copytree(source, tmp_path / "stacked")
    weights = load_file(str(stacked / "model.safetensors"))
    for layer in range(4):
        scope = f"model.layers.{layer}.mlp.experts"
        experts = [
            {w: weights.pop(f"{scope}.{e}.{w}_proj.weight") for w in ("gate", "up", "down")}
            for e in range(8)
        ]
        weights[f"{scope}.gate_up_proj"] = torch.stack(
            [torch.cat([e["gate"], e["up"]]) for e in experts]
        )
        weights[f"{scope}.down_proj"] = torch.stack([e["down"] for e in experts])
    save_file(weights, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    outputs = {}
    for path in (source, stacked):
        llm = make_llm(path, **ENGINE)
        outputs[path] = [out.token_ids for out in greedy_outputs(llm, prompts, MAX_TOKENS)]
        assert_engine_clean(llm)
    assert outputs[stacked] == outputs[source]


def test_a_qwen35moe_gguf_without_a_dense_width_takes_the_shared_experts(tmp_path):
    from tokenbus.loader.qwen3_5_config import qwen3_5_gguf_fields

    meta = {
        f"qwen35moe.{key}": value
        for key, value in {
            "block_count": 5,
            "nextn_predict_layers": 1,
            "full_attention_interval": 4,
            "ssm.conv_kernel": 4,
            "ssm.state_size": 128,
            "ssm.group_count": 16,
            "ssm.time_step_rank": 32,
            "ssm.inner_size": 4096,
            "expert_feed_forward_length": 512,
            "expert_shared_feed_forward_length": 512,
        }.items()
    }
    fields = qwen3_5_gguf_fields(meta, "qwen35moe", tmp_path / "m.gguf")
    # the fifth block is the multi-token-prediction head's; every fourth layer attends
    assert (fields["num_hidden_layers"], fields["recurrent_layers"]) == (4, (0, 1, 2))
    assert (fields["intermediate_size"], fields["delta_v_dim"]) == (512, 128)


def test_bf16_keeps_the_states_and_decay_rates_in_fp32(prompts):
    """A bf16 model (the torch path: decodes batched, chunks in the chunked form) keeps every
    Gated DeltaNet state and A in fp32, as HF does, and gives the fp32 model's greedy tokens up
    to near ties."""
    import torch

    hf_dir = cached_tiny_model("qwen3_5")
    outputs = {}
    for dtype in ("float32", "bfloat16"):
        llm = make_llm(hf_dir, dtype=dtype, max_num_batched_tokens=32)
        worker = llm.engine.client.engine_core.executor.worker
        assert {pool.dtype for pool in worker.runner.request_states.pools} == {torch.float32}
        assert worker.model.layers[0].mixer.A.dtype == torch.float32
        outputs[dtype] = greedy_outputs(llm, prompts, MAX_TOKENS, logprobs=5)
        assert_engine_clean(llm)
    for ours, reference in zip(outputs["bfloat16"], outputs["float32"]):
        assert_same_or_near_tie(ours.token_ids, reference.token_ids, ours.logprobs, gap=0.5)
