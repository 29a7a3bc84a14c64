"""Sparse MoE (Qwen3-MoE, Qwen2-MoE, ERNIE 4.5, Mixtral, OLMoE, GraniteMoE) end to end against
HF transformers, fp32 on CPU: tiny random models (8, 4, 4, 4, 8 and 4 experts, top 2; a Qwen3-MoE
dense layer via mlp_only_layers; Qwen2-MoE's gated shared expert and q/k/v biases, its top 2 not
renormalised; ERNIE's dense first layer, biased expert choice, ungated shared MLP and interleaved
rotary pairs; OLMoE's top 2 not renormalised, its q/k norms over the whole projection;
GraniteMoE's multipliers and stacked HF experts) from safetensors and
from a GGUF in llama.cpp's naming (experts stacked per layer as ffn_*_exps) give HF's greedy
tokens, with logprobs within tolerance, through prefix-cache hits, chunked prefill, preemption
and two expert-parallel ranks; a Q8_0 GGUF whose experts stay quantized gives the tokens of the
same file dequantized at load."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.oracle import (
    assert_matches_hf,
    assert_same_or_near_tie,
    greedy_outputs,
    hf_greedy_logprobs,
    load_hf,
)
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tests.fixtures.tiny_gguf import write_gguf
from tests.fixtures.tiny_models import cached_tiny_model
from tests.fixtures.triton_device import needs_triton_on_cpu, stack_moe_blocks

MAX_TOKENS = 10
ENGINE = dict(kv_cache_dtype="float32")
CONFIGS = {
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        head_dim=32,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    # Qwen2-MoE: a shared expert (wider than the routed ones), top k not renormalised
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        intermediate_size=64,
    ),
    # ERNIE 4.5: a dense first layer, experts chosen by probability + a bias, an ungated shared
    # MLP of two experts' width, interleaved rotary pairs
    "ernie4_5_moe": dict(
        moe_num_experts=4,
        moe_k=2,
        moe_intermediate_size=32,
        moe_num_shared_experts=2,
        moe_layer_start_index=1,
        moe_layer_end_index=2,
        num_hidden_layers=3,
    ),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def hf_dir(family):
    return cached_tiny_model(family, **CONFIGS[family])


@pytest.fixture(scope="module")
def gguf_file(hf_dir, family, tmp_path_factory):
    return write_gguf(hf_dir, tmp_path_factory.mktemp(family) / "tiny-f32.gguf", "F32")


@pytest.fixture(params=["safetensors", "gguf"])
def model_path(request, hf_dir, gguf_file):
    return hf_dir if request.param == "safetensors" else gguf_file


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 40, 40, seed=31)[0]  # 2 full blocks + 8 tokens, shared
    return random_prompts(3, 1, 50, seed=32) + [prefix + t for t in random_prompts(3, 1, 20, 33)]


@pytest.fixture(scope="module")
def hf_reference(hf_dir, prompts):
    hf = load_hf(str(hf_dir))
    return [hf_greedy_logprobs(hf, prompt, MAX_TOKENS) for prompt in prompts]


def generate(llm, prompts, logprobs=1):
    return greedy_outputs(llm, prompts, MAX_TOKENS, logprobs)


def test_arch_reads_the_experts(model_path, family):
    from tokenbus.loader import load_arch, resolve_model

    arch = load_arch(resolve_model(str(model_path)))
    config = CONFIGS[family]
    assert arch.architecture == family
    experts = ("num_experts", "num_local_experts", "moe_num_experts")
    assert arch.num_experts == next(config[key] for key in experts if key in config)
    assert arch.num_experts_per_tok == 2
    # OLMoE's and Qwen2-MoE's defaults; llama.cpp's too
    assert arch.norm_topk_prob == (family not in ("olmoe", "qwen2_moe"))
    dense = {"qwen3_moe": (1,), "ernie4_5_moe": (0,)}
    assert arch.dense_layers == dense.get(family, ())
    shared = {"qwen2_moe": 64, "ernie4_5_moe": 64}
    assert arch.shared_expert_intermediate_size == shared.get(family, 0)
    assert arch.shared_expert_gated == (family != "ernie4_5_moe")
    assert arch.moe_selection_bias == (family == "ernie4_5_moe")


@pytest.mark.parametrize("caching", [True, False])
def test_batch_with_shared_prefixes(model_path, prompts, hf_reference, caching):
    llm = make_llm(model_path, enable_prefix_caching=caching, **ENGINE)
    assert not llm.engine.client.engine_core.executor.worker.model.decodes_in_c
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert llm.engine.stats_totals["prefix_cache_hits"] == (2 * 32 if caching else 0)
    assert_engine_clean(llm)


def test_tiny_token_budget_forces_chunking(model_path, prompts, hf_reference):
    llm = make_llm(model_path, max_num_batched_tokens=16, long_prefill_token_threshold=8, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert_engine_clean(llm)


def test_small_kv_pool_forces_preemptions(model_path, prompts, hf_reference):
    llm = make_llm(model_path, num_kv_blocks=8, max_model_len=96, **ENGINE)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


@pytest.mark.slow
def test_two_expert_parallel_ranks(model_path, prompts, hf_reference):
    """Each rank holds half the experts and routes every token; one all-reduce joins them."""
    llm = make_llm(model_path, tensor_parallel_size=2, **ENGINE)
    try:
        outputs = generate(llm, prompts[:3], logprobs=5)
        for out, (tokens, _) in zip(outputs, hf_reference[:3]):
            assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_quantized_experts_match_the_dequantized_file(hf_dir, prompts, tmp_path, qtype):
    """Experts kept in their GGUF blocks (per-expert views of the stacked tensor, fp32
    activations; an F16 file's as its 16-bit floats) give the tokens of the same file
    dequantized to fp32 at load."""
    path = write_gguf(hf_dir, tmp_path / f"tiny-{qtype}.gguf", qtype)
    results = {}
    for quantization in ("gguf", "none"):
        llm = make_llm(path, quantization=quantization, quant_activations="fp32", **ENGINE)
        model = llm.engine.client.engine_core.executor.worker.model
        assert (model.quant_kernels is not None) == (quantization == "gguf")
        results[quantization] = generate(llm, prompts, logprobs=5)
        assert_engine_clean(llm)
    for ours, dense in zip(results["gguf"], results["none"]):
        assert_same_or_near_tie(ours.token_ids, dense.token_ids, ours.logprobs)


def test_moe_steps_are_captured_only_with_stacked_experts(hf_dir):
    """Experts run one by one read their token counts on the host, which a CUDA graph cannot
    hold: capture is off for such a model, by name, not by a failed capture. Stacked for the
    Triton grouped GEMMs (what the plan does on CUDA), nothing stands in the way."""
    from tokenbus.worker.captured_step import capture_disabled_reason

    llm = make_llm(hf_dir, **ENGINE)
    try:
        worker = llm.engine.client.engine_core.executor.worker
        reason = capture_disabled_reason(worker.config, torch.device("cuda"), worker.model)
        assert reason is not None and "MoE" in reason
        stack_moe_blocks(worker.model)
        assert capture_disabled_reason(worker.config, torch.device("cuda"), worker.model) is None
    finally:
        llm.shutdown()


@needs_triton_on_cpu
def test_stacked_experts_give_hfs_tokens(hf_dir, prompts, hf_reference):
    """The Triton grouped GEMMs inside the engine (on CPU: in Triton's interpreter, every step
    op by op), through prefix hits and chunked prefill: HF's tokens and logprobs."""
    llm = make_llm(hf_dir, device="cpu", enforce_eager=True, max_num_batched_tokens=32, **ENGINE)
    stack_moe_blocks(llm.engine.client.engine_core.executor.worker.model)
    assert_matches_hf(generate(llm, prompts), hf_reference)
    assert_engine_clean(llm)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_moe_on_a_gpu_runs_stacked_experts_in_graphs(hf_dir, prompts, hf_reference):
    """On CUDA the plan stacks the experts for the Triton grouped GEMMs, decode steps are
    captured, and the tokens are HF's up to a near tie (fp32); with the torch attention
    backend, the experts run one by one, eagerly, with the same tokens."""
    from tokenbus.model.moe import SparseMoeBlock

    # The default on CUDA (Triton: stacked, captured), then the torch backend (one by one, eager).
    for backend, stacked in (("auto", True), ("torch", False)):
        llm = make_llm(
            hf_dir, device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16,
            kv_cache_memory="256MiB", attention_backend=backend, **ENGINE,
        )  # fmt: skip
        try:
            worker = llm.engine.client.engine_core.executor.worker
            blocks = [m for m in worker.model.modules() if isinstance(m, SparseMoeBlock)]
            assert blocks and all((block.stacked is not None) == stacked for block in blocks)
            assert (worker.runner.captured is not None) == stacked
            for out, (tokens, _) in zip(generate(llm, prompts, logprobs=5), hf_reference):
                assert_same_or_near_tie(out.token_ids, tokens, out.logprobs)
            assert_engine_clean(llm)
        finally:
            llm.shutdown()


def test_ernie_selection_bias_changes_hfs_tokens(tmp_path):
    """The tiny ERNIE's selection bias matters: HF's tokens without it differ, so the suite's
    equality above checks the biased choice."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.e2e.oracle import hf_greedy

    hf_dir = cached_tiny_model("ernie4_5_moe", **CONFIGS["ernie4_5_moe"])
    unbiased = shutil.copytree(hf_dir, tmp_path / "unbiased")
    weights = load_file(str(unbiased / "model.safetensors"))
    biases = [name for name in weights if name.endswith("e_score_correction_bias")]
    assert biases
    for name in biases:
        weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(unbiased / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(4, 5, 30, seed=34)
    tokens = {
        path: [hf_greedy(load_hf(str(path)), p, MAX_TOKENS) for p in prompts]
        for path in (hf_dir, unbiased)
    }
    assert tokens[hf_dir] != tokens[unbiased]
