"""Speculative decoding end to end on tiny models: greedy output identical to plain decoding
under every scheduling condition, sampled output reproducible, stats reported, bad configs
stopped at start-up."""

from __future__ import annotations

import pytest

from tests.e2e.utils import assert_engine_clean, generate_greedy, model_runner
from tests.fixtures.eager_replay import replay_padded_steps
from tests.fixtures.tiny_models import cached_tiny_model
from tests.fixtures.triton_device import needs_triton_on_cpu
from tests.spec_decode.utils import (
    NGRAM,
    damped_model,
    make_spec_llm,
    mixed_prompts,
    spec_metrics,
    truncated_copy,
)
from tokenbus import SamplingParams

MAX_TOKENS = 32
KINDS = ["ngram", "self_draft", "draft_model"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A 4-layer tiny Llama whose last 2 layers are damped (its first 2 layers draft well), and
    those 2 layers as a separate draft model."""
    tmp = tmp_path_factory.mktemp("spec-models")
    target = damped_model(
        cached_tiny_model("llama", num_hidden_layers=4), tmp / "target", num_full_layers=2
    )
    return target, truncated_copy(target, 2, tmp / "draft")


def _spec(kind: str, models) -> dict:
    if kind == "ngram":
        return NGRAM
    if kind == "self_draft":
        return {"method": "draft_model", "draft_layers": 2, "num_speculative_tokens": 3}
    return {"method": "draft_model", "model": str(models[1]), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def target(models):
    return models[0]


@pytest.fixture(scope="module")
def plain_outputs(target):
    llm = make_spec_llm(target, max_model_len=256, num_kv_blocks=128)
    return generate_greedy(llm, mixed_prompts(), MAX_TOKENS)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_with_prefix_caching(kind, models, plain_outputs):
    llm = make_spec_llm(models[0], _spec(kind, models), max_model_len=256, num_kv_blocks=128)
    with spec_metrics(llm) as metrics:
        first = generate_greedy(llm, mixed_prompts(), MAX_TOKENS)
        hits_before = llm.engine.stats_totals["prefix_cache_hits"]
        again = generate_greedy(llm, mixed_prompts(), MAX_TOKENS)  # the prompts hit the cache now
    assert first == plain_outputs and again == plain_outputs
    assert llm.engine.stats_totals["prefix_cache_hits"] > hits_before
    assert metrics.num_accepted_tokens > 0, metrics  # speculation really ran
    assert metrics.num_accepted_tokens <= metrics.num_draft_tokens
    assert sum(metrics.accepted_per_pos) == metrics.num_accepted_tokens
    # The engine's running total took the measured block's figures back in.
    totals = llm.engine.spec_metrics
    assert totals.num_accepted_tokens == llm.engine.stats_totals["spec_num_accepted_tokens"]
    assert (
        totals.num_draft_tokens
        == llm.engine.stats_totals["spec_num_draft_tokens"]
        >= metrics.num_draft_tokens
    )
    assert_engine_clean(llm)


@pytest.mark.slow
@needs_triton_on_cpu
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_with_verification_steps_padded_as_captured(kind, models, plain_outputs):
    """Verification steps run as captured ones (on a GPU, CUDA graphs; here
    fixtures/eager_replay.py replays them eagerly, the Triton kernels in their interpreter):
    padded to a capture size of 1 + k rows a request, over static attention plans. n-gram
    drafts vary in number: a request with fewer than k (or none: the random prompt) gets
    dummy rows. A draft model's decode passes (and self-speculation's catch-up pass, one token
    a request) replay steps of its own. Four of the prompts, 16 tokens: the interpreter is
    slow."""
    spec = _spec(kind, models)
    llm = make_spec_llm(
        models[0],
        spec,
        max_model_len=256,
        num_kv_blocks=128,
        cudagraph_capture_sizes=[1, 2, 4, 8],
        attention_backend="triton",  # verification steps are captured on its static plans
    )
    replay = replay_padded_steps(llm)
    chosen = [0, 1, 2, 7]  # two repeated motifs, a half-repeated one, a random prompt
    outputs = generate_greedy(llm, [mixed_prompts()[i] for i in chosen], 16)
    assert outputs == [plain_outputs[i][:16] for i in chosen]
    verify = 1 + spec["num_speculative_tokens"]
    verified = [shape for shape in replay.replayed if shape.query_len == verify]
    assert any(shape.num_reqs > 1 for shape in verified), replay.replayed
    if kind != "ngram":  # the draft model's single-token passes replay its own steps
        drafted = model_runner(llm).proposer.captured.runner.replayed
        assert drafted and all(shape.query_len == 1 for shape in drafted)
    assert_engine_clean(llm)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identical_under_preemption_and_chunked_prefill(kind, models, plain_outputs):
    # 20 blocks of 16 tokens hold ~2 of these requests at once; 48-token steps chunk prompts.
    llm = make_spec_llm(
        models[0],
        _spec(kind, models),
        max_model_len=256,
        num_kv_blocks=20,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=24,
    )
    with spec_metrics(llm) as metrics:
        outputs = generate_greedy(llm, mixed_prompts(), MAX_TOKENS)
    assert outputs == plain_outputs
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert metrics.num_accepted_tokens > 0
    assert_engine_clean(llm)


def test_greedy_identical_on_qwen2_with_logprobs(tiny_qwen2_dir):
    prompts = mixed_prompts(seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    plain = make_spec_llm(tiny_qwen2_dir, max_model_len=256, num_kv_blocks=96)
    spec = make_spec_llm(tiny_qwen2_dir, NGRAM, max_model_len=256, num_kv_blocks=96)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=1e-4)
    assert_engine_clean(spec)


def test_separate_draft_model_drafts_exactly_like_self_speculation(models):
    """The truncated copy has its own KV tensors; self-speculation shares the target's. Same
    drafts, hence the same acceptance counts, show the separate KV is kept exactly in step."""
    counts = []
    for kind in ("self_draft", "draft_model"):
        llm = make_spec_llm(models[0], _spec(kind, models), max_model_len=256, num_kv_blocks=128)
        with spec_metrics(llm) as metrics:
            generate_greedy(llm, mixed_prompts(seed=3), MAX_TOKENS)
        counts.append(metrics)
    assert counts[0] == counts[1]
    assert counts[0].acceptance_rate > 0.5, counts[0]


def test_stops_and_max_tokens_respected_inside_accepted_drafts(models, plain_outputs):
    """A stop token or the max_tokens limit inside a run of accepted drafts ends the request
    exactly where plain decoding would."""
    llm = make_spec_llm(
        models[0], _spec("self_draft", models), max_model_len=256, num_kv_blocks=128
    )
    prompts = mixed_prompts()
    # Stop on each prompt's 6th greedy token (a token accepted from a draft, most likely).
    params = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[out[5]])
        for out in plain_outputs
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, want in zip(outs, plain_outputs):
        expected = want[: want.index(want[5]) + 1]
        assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "stop"
    short = generate_greedy(llm, prompts, 7)
    assert short == [w[:7] for w in plain_outputs]
    assert_engine_clean(llm)


def test_seeded_sampling_reproducible_and_batch_independent_with_spec(models):
    llm = make_spec_llm(
        models[0], _spec("self_draft", models), max_model_len=256, num_kv_blocks=128
    )
    prompts = mixed_prompts(seed=2)

    def sample(batch):
        params = SamplingParams(
            temperature=0.8, top_k=50, seed=1234, max_tokens=20, ignore_eos=True
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    alone = sample(prompts[:1])
    assert sample(prompts[:1]) == alone
    assert sample(prompts[3:] + prompts[:1])[-1] == alone[0]
    outs = llm.generate(
        "Hello there",
        SamplingParams(n=3, temperature=1.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    assert [len(c.token_ids) for c in outs[0].outputs] == [12, 12, 12]
    assert_engine_clean(llm)


def test_a_draft_models_cache_counts_in_the_kv_budget(models):
    """--kv-cache-memory covers the draft model's cache too: it holds every block id the
    target's does, so each block costs both models' layers."""
    budget = 3 * 2**20

    def per_block(tensors) -> int:
        return sum(t.numel() * t.element_size() // t.shape[1] for t in tensors)

    llm = make_spec_llm(
        models[0], _spec("draft_model", models), max_model_len=256, kv_cache_memory=budget
    )
    runner = model_runner(llm)
    target, draft = runner.kv_caches, runner.proposer.kv_caches
    num_blocks = target[0].shape[1]
    assert all(t.shape[1] == num_blocks for t in target + draft)
    assert num_blocks == budget // (per_block(target) + per_block(draft))
    assert num_blocks * (per_block(target) + per_block(draft)) <= budget
    assert generate_greedy(llm, mixed_prompts()[:2], 8)  # and it runs
    assert_engine_clean(llm)


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama_dir):
    other = cached_tiny_model("llama", seed=2, vocab_size=32000)
    with pytest.raises(ValueError, match="share the target's vocabulary"):
        make_spec_llm(
            tiny_llama_dir,
            {"method": "draft_model", "model": str(other)},
            max_model_len=256,
            num_kv_blocks=32,
        )


def test_self_draft_needs_fewer_layers_than_the_target(tiny_llama_dir):
    with pytest.raises(ValueError, match="draft_layers"):
        make_spec_llm(
            tiny_llama_dir,
            {"method": "draft_model", "draft_layers": 2},
            max_model_len=256,
            num_kv_blocks=32,
        )


def test_spec_stats_reach_the_engine_outputs(models):
    llm = make_spec_llm(
        models[0], _spec("self_draft", models), max_model_len=256, num_kv_blocks=128
    )
    with spec_metrics(llm) as metrics:
        generate_greedy(llm, mixed_prompts()[:3], 16)
    assert metrics.num_drafts > 0 and 0 < metrics.num_accepted_tokens <= metrics.num_draft_tokens
    assert len(metrics.accepted_per_pos) == 3
    rates = metrics.acceptance_rate_per_pos
    # a draft is accepted only after its predecessors
    assert all(a >= b for a, b in zip(rates, rates[1:]))
    assert 1.0 < metrics.mean_acceptance_length <= 4.0
