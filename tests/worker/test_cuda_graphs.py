"""The CUDA paths on a GPU: CUDA graphs against eager steps, graph memory kept out of the KV
budget, KV sizing from free device memory, bf16 by default. Skipped without a GPU
(benchmarks/gpu_check.sh runs them where there is one)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.oracle import assert_same_or_near_tie
from tests.e2e.utils import (
    assert_engine_clean,
    generate_greedy,
    make_llm,
    model_runner,
    random_prompts,
)
from tests.fixtures.step_reads import (
    COUNTED_STEPS,
    NGRAM,
    SELF_DRAFT,
    DeviceSyncs,
    count_warm_steps,
    motif_prompts,
)
from tests.fixtures.tiny_models import cached_tiny_model
from tokenbus import SamplingParams
from tokenbus.worker.input_batch import ScheduledRequest, StepShape, prepare_batch
from tokenbus.worker.request_state import CachedRequestState

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ENGINE = dict(
    device="cuda",
    max_num_seqs=8,
    max_num_batched_tokens=128,
    max_model_len=256,
    kv_cache_memory="64MiB",
)


@pytest.fixture(scope="module")
def model_dir():
    return cached_tiny_model("llama")


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_graphs_equal_eager_fp32(family):
    """The same tokens, up to a near tie: captured decodes split their keys (split-K) where
    eager ones of short contexts do not, so fp32 sums run in another order. Gemma 3's five
    windowed layers to one global make six KV groups, each captured with its own tables;
    prompt and output run past its 32-token window."""
    model_dir = cached_tiny_model(family)
    prompts = random_prompts(6, 3, 40, seed=1)
    eager = make_llm(model_dir, enforce_eager=True, dtype="float32", **ENGINE)
    ref = generate_greedy(eager, prompts, 20)
    eager.shutdown()
    graphs = make_llm(model_dir, dtype="float32", **ENGINE)  # default sizes: 1 2 4 8
    try:
        runner = model_runner(graphs)
        assert runner.captured is not None
        assert sorted(runner.captured.runner.graphs) == [StepShape(n) for n in (1, 2, 4, 8)]
        assert runner.buffers.num_groups == (6 if family == "gemma3" else 1)
        # EOS masked as generate_greedy masks it for the eager reference (min_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, logprobs=5)
        outputs = graphs.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        for output, want in zip(outputs, ref):
            got = output.outputs[0]
            assert_same_or_near_tie(list(got.token_ids), want, got.logprobs, gap=1e-3)
        assert_engine_clean(graphs)
    finally:
        graphs.shutdown()


def test_bf16_is_the_default_and_graphs_agree_with_eager_in_top_k(model_dir):
    prompts = random_prompts(4, 5, 30, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=5)
    outs = {}
    for name, extra in (("eager", dict(enforce_eager=True)), ("graphs", {})):
        llm = make_llm(model_dir, **ENGINE, **extra)
        assert model_runner(llm).model.embed_tokens.dtype == torch.bfloat16
        outs[name] = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        llm.shutdown()
    for a, b in zip(outs["eager"], outs["graphs"]):
        for pos, (ta, tb) in enumerate(zip(a.outputs[0].token_ids, b.outputs[0].token_ids)):
            if ta != tb:  # bf16 may differ between kernels: each side's token in the other's top-5
                assert ta in b.outputs[0].logprobs[pos] and tb in a.outputs[0].logprobs[pos]
                break  # the continuations differ from here on


def test_graph_memory_is_kept_out_of_the_kv_budget(model_dir):
    sizes = {}
    for name, extra in (
        ("eager", dict(enforce_eager=True)),
        ("graphs", dict(cudagraph_capture_sizes=[1, 8])),
    ):
        args = dict(ENGINE, kv_cache_memory=None, gpu_memory_utilization=0.5)
        llm = make_llm(model_dir, **args, **extra)
        sizes[name] = llm.engine.client.engine_core.num_kv_blocks
        llm.shutdown()
        torch.cuda.empty_cache()
    assert 0 < sizes["graphs"] <= sizes["eager"]


def test_padded_graph_step_changes_no_real_kv_outside_its_own_slots(model_dir):
    llm = make_llm(model_dir, dtype="float32", cudagraph_capture_sizes=[4], **ENGINE)
    try:
        runner = model_runner(llm)
        bs = runner.block_size
        states = [
            CachedRequestState(
                f"r{i}",
                [7 + i] * (5 + 9 * i),
                [],
                SamplingParams(max_tokens=1),
                [3 + 4 * i, 4 + 4 * i],
                4 + 9 * i,
            )
            for i in range(3)
        ]
        for cache in runner.kv_caches:
            cache.normal_()
        before = [cache.clone() for cache in runner.kv_caches]
        requests = [ScheduledRequest(s, 1, []) for s in states]
        with torch.inference_mode():
            batch = prepare_batch(requests, runner.buffers, bs, runner.kv_caches, StepShape(4))
            hidden = runner.captured.run(batch)
        torch.cuda.synchronize()
        assert torch.isfinite(hidden).all()
        own = {
            s.block_ids[s.num_computed_tokens // bs] * bs + s.num_computed_tokens % bs
            for s in states
        }
        for cache, old in zip(runner.kv_caches, before):
            changed = (cache != old).flatten(3).any(-1).any(0).flatten()
            assert set(changed.nonzero().flatten().tolist()) - set(range(bs)) == own
    finally:
        llm.shutdown()


def test_kv_sizing_from_free_device_memory(model_dir):
    llm = make_llm(
        model_dir,
        enforce_eager=True,
        **dict(ENGINE, kv_cache_memory=None, gpu_memory_utilization=0.3),
    )
    try:
        num_blocks = llm.engine.client.engine_core.num_kv_blocks
        assert num_blocks > 0
        assert generate_greedy(llm, random_prompts(2, 4, 8), 4)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_a_decode_step_syncs_only_to_read_the_sampled_ids(model_dir, enforce_eager):
    """Greedy and sampled requests decoding together: the whole step (inputs, forward or
    graph replay, sampling) makes one synchronizing CUDA call, the one that reads the sampled
    ids."""
    llm = make_llm(model_dir, enforce_eager=enforce_eager, **ENGINE)
    try:
        prompts = random_prompts(4, 5, 20, seed=6)
        syncs, _ = count_warm_steps(llm, prompts, warm_steps=4, counter=DeviceSyncs())
        assert len(syncs) <= COUNTED_STEPS, sorted(set(syncs))
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "spec, syncs_a_step", [(NGRAM, 1), (SELF_DRAFT, 2)], ids=["ngram", "self_draft"]
)
def test_a_verification_step_syncs_once(model_dir, spec, syncs_a_step):
    """n-gram speculation: drafts come from host token lists, and a step verifying them
    (greedy acceptance, rejection sampling for the sampled rows) reads the device once: the
    accepted counts and the emitted tokens together. A draft model's k drafts stay on the
    device through its passes and come back in one more read."""
    llm = make_llm(model_dir, speculative_config=spec, **ENGINE)
    try:
        syncs, metrics = count_warm_steps(llm, motif_prompts(), warm_steps=3, counter=DeviceSyncs())
        assert metrics.num_draft_tokens > 0  # the counted steps did verify drafts
        assert len(syncs) <= syncs_a_step * COUNTED_STEPS, sorted(set(syncs))
    finally:
        llm.shutdown()


def test_verification_steps_replay_graphs_and_agree_with_eager(model_dir):
    """Self-drafting (the target's first layer drafts k = 3 for every request): its
    verification steps replay graphs of 1 + k tokens a request, its draft passes graphs of
    the first layer, and the tokens are the eager engine's, up to near ties."""
    prompts = random_prompts(6, 3, 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=20, logprobs=5)
    eager = make_llm(
        model_dir, enforce_eager=True, dtype="float32", speculative_config=SELF_DRAFT, **ENGINE
    )
    ref = [
        list(o.outputs[0].token_ids)
        for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    eager.shutdown()
    graphs = make_llm(model_dir, dtype="float32", speculative_config=SELF_DRAFT, **ENGINE)
    try:
        captured = model_runner(graphs).captured
        assert captured is not None and StepShape(8, 4) in captured.runner.graphs
        drafts = model_runner(graphs).proposer.captured  # the draft's single-token passes
        assert drafts is not None and StepShape(8) in drafts.runner.graphs
        replayed: list[StepShape] = []
        replay = captured.runner.replay
        captured.runner.replay = lambda shape, batch: replayed.append(shape) or replay(shape, batch)
        outputs = graphs.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        for output, want in zip(outputs, ref):
            got = output.outputs[0]
            assert_same_or_near_tie(list(got.token_ids), want, got.logprobs, gap=1e-3)
        assert any(shape.query_len == 4 for shape in replayed), replayed
        assert_engine_clean(graphs)
    finally:
        graphs.shutdown()


def test_steps_launched_ahead_equal_steps_one_at_a_time(model_dir):
    """--async-scheduling: each step is launched before the last one is read, its decodes fed
    the last step's sampled ids on the device, through the same graphs: the tokens (greedy,
    and seeded samples) are those of steps run one at a time, and a step still syncs once."""
    prompts = random_prompts(6, 3, 40, seed=2)
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True),
    ] * 3

    def run(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outputs]

    plain = make_llm(model_dir, dtype="float32", **ENGINE)
    try:
        want = run(plain)
    finally:
        plain.shutdown()
    ahead = make_llm(model_dir, dtype="float32", async_scheduling=True, **ENGINE)
    try:
        assert model_runner(ahead).captured is not None
        assert run(ahead) == want
        assert_engine_clean(ahead)
        syncs, _ = count_warm_steps(ahead, motif_prompts(), warm_steps=4, counter=DeviceSyncs())
        assert len(syncs) <= COUNTED_STEPS, sorted(set(syncs))
    finally:
        ahead.shutdown()
