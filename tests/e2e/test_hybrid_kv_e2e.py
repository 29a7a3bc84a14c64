"""The hybrid KV cache end to end against HF transformers, fp32 on CPU: a tiny Mistral with
sliding_window=16 (one sliding KV group) and a Qwen2 mixing full and windowed layers (three
groups of one layer: one full, two sliding) give HF's greedy tokens for prompts longer than the
window through chunked prefill, prefix-cache hits, preemption and two tensor-parallel ranks,
while the sliding groups' blocks stay bounded (read from the block pool every step) and the
full-attention group's grow."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.test_sliding_window import WINDOW, hf_reference
from tests.e2e.utils import assert_engine_clean, make_llm, model_runner, random_prompts
from tests.fixtures.eager_replay import replay_padded_steps
from tests.fixtures.tiny_models import cached_tiny_model
from tests.fixtures.triton_device import needs_triton_on_cpu
from tokenbus import SamplingParams
from tokenbus.core.kv.hybrid import HybridKVCacheManager
from tokenbus.worker.captured_step import capture_disabled_reason
from tokenbus.worker.input_batch import StepShape

MAX_TOKENS = 10
BLOCK = 4  # small blocks: the window spans several
ENGINE = dict(kv_cache_dtype="float32", block_size=BLOCK)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def model(request):
    if request.param == "mistral":
        return cached_tiny_model("mistral", sliding_window=WINDOW)
    return cached_tiny_model(
        "qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )


@pytest.fixture(scope="module")
def prompts():
    prefix = random_prompts(1, 48, 48, seed=41)[0]  # 12 blocks, shared
    return random_prompts(2, 60, 80, seed=42) + [prefix + t for t in random_prompts(3, 5, 20, 43)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [tokens for tokens, _ in hf_reference(model, prompts)]


def generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


def kv_manager(llm) -> HybridKVCacheManager:
    manager = llm.engine.client.engine_core.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    return manager


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("caching", [True, False])
def test_prefix_hits_and_chunks(model, prompts, reference, caching, backend):
    """The torch path gathers from the first block in the window: tables whose earlier entries
    were handed back (and maybe reused) never reach its masks."""
    llm = make_llm(
        model,
        enable_prefix_caching=caching,
        max_num_batched_tokens=24,
        max_num_seqs=3,
        attention_backend=backend,
        **ENGINE,
    )
    assert generate(llm, prompts) == reference
    hits = llm.engine.stats_totals["prefix_cache_hits"]
    if caching:
        assert hits > 0  # the shared prefix's blocks, in every group
    assert_engine_clean(llm)


@needs_triton_on_cpu
def test_triton_kernels_skip_the_handed_back_blocks(model, prompts, reference):
    """The Triton kernels (in their interpreter here) start each query's keys at its window's
    first block, so the sliding groups' tables may point anywhere before it. Its blocks are
    16 tokens at least: a 16-token window then spans two blocks, and 60-80-token requests
    hand back several."""
    llm = make_llm(
        model,
        max_num_batched_tokens=24,
        max_num_seqs=3,
        attention_backend="triton",
        kv_cache_dtype="float32",
        block_size=16,
    )
    assert generate(llm, prompts) == reference
    assert llm.engine.stats_totals["prefix_cache_hits"] > 0
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    "backend, block_size",
    [("native", BLOCK), ("torch", BLOCK), pytest.param("triton", 16, marks=needs_triton_on_cpu)],
)
def test_padded_decode_steps_run_on_every_groups_static_plan(
    model, prompts, reference, backend, block_size
):
    """Decode steps as a CUDA graph takes them (fixtures/eager_replay.py: the graph replayed
    eagerly): three requests padded to four, each KV group's slots and tables padded in its own
    buffers, a static plan per group over the full table width (the torch plan gathers and
    masks every entry before the window, handed-back blocks included)."""
    llm = make_llm(
        model,
        max_num_seqs=3,
        cudagraph_capture_sizes=[1, 2, 4],
        attention_backend=backend,
        kv_cache_dtype="float32",
        block_size=block_size,
    )
    replay = replay_padded_steps(llm)
    assert generate(llm, prompts) == reference
    # 3 running, padded to 4; then 2
    assert {StepShape(4), StepShape(2)} <= set(replay.replayed)
    runner = model_runner(llm)
    assert runner.buffers.num_groups == (1 if "mistral" in model.name else 3)
    # On a GPU these steps are CUDA graphs: nothing about the hybrid cache keeps them eager.
    assert capture_disabled_reason(runner.config, torch.device("cuda"), runner.model) is None
    assert_engine_clean(llm)


def test_preemption(model, prompts, reference):
    # A pool just past one 96-token request in every group, and chunks of several requests
    # at once: a running chunk finds the pool empty (a sliding group's decodes alone never do:
    # each drops a block as it takes one).
    num_groups = 1 if "mistral" in model.name else 3  # qwen2: 1 full + 2 sliding layers
    llm = make_llm(
        model,
        num_kv_blocks=num_groups * 24 + 2,
        max_model_len=96,
        max_num_batched_tokens=40,
        long_prefill_token_threshold=12,
        **ENGINE,
    )
    assert generate(llm, prompts) == reference
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


def test_two_tensor_parallel_ranks(model, prompts, reference):
    llm = make_llm(model, tensor_parallel_size=2, **ENGINE)
    try:
        assert generate(llm, prompts[:2]) == reference[:2]
        assert_engine_clean(llm)
    finally:
        llm.shutdown()


def test_sliding_blocks_stay_bounded(model):
    """One long request, decoded step by step: each sliding group holds at most
    cdiv(window, block) + 1 blocks once its prefill chunk is done; a full group grows."""
    llm = make_llm(model, max_num_batched_tokens=16, enable_prefix_caching=False, **ENGINE)
    manager = kv_manager(llm)
    prompt = random_prompts(1, 40, 40, seed=44)[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, min_tokens=60)
    llm.engine.add_request("long", prompt, params)
    held: list[list[int]] = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        held.append([manager.num_held_blocks(g) for g in range(manager.num_groups)])
    bound = -(-WINDOW // BLOCK) + 1 + 16 // BLOCK  # the window, and this step's chunk
    for group, window in enumerate(manager.windows):
        series = [step[group] for step in held[:-1]]  # the last: freed
        if window is None:
            assert max(series) == -(-(40 + 60 - 1) // BLOCK)  # every token's block
        else:
            assert max(series) <= bound, series
    assert held[-1] == [0] * manager.num_groups
    assert_engine_clean(llm)


def test_disabled_switch_holds_every_block(model):
    llm = make_llm(model, disable_hybrid_kv_cache_manager=True, **ENGINE)
    assert not isinstance(llm.engine.client.engine_core.kv_cache_manager, HybridKVCacheManager)
    assert_engine_clean(llm)


def test_connector_and_spec_decode_run_on_one_table(model, prompts, reference, tmp_path):
    """A KV connector or speculative decoding moves one block table a request: the engine holds
    every layer's blocks then (windows still masked) and gives HF's tokens."""
    from tests.spec_decode.utils import NGRAM

    connector = json.dumps(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
        }
    )
    for extra in (dict(kv_transfer_config=connector), dict(speculative_config=NGRAM)):
        llm = make_llm(model, **extra, **ENGINE)
        manager = llm.engine.client.engine_core.kv_cache_manager
        assert not isinstance(manager, HybridKVCacheManager)
        assert generate(llm, prompts) == reference
        assert_engine_clean(llm)
