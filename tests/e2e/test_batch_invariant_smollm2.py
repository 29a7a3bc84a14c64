"""--batch-invariant on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): 32 prompts
sharing a long prefix give the same greedy tokens and the same logprobs, bit for bit, with
prefix caching on and off, each alone and in one batch with 16 other prompts, at two chunk
sizes. By default they do not here (benchmarks/batch_invariance.py counts how many differ)."""

from __future__ import annotations

import random

import pytest

from tests.e2e.utils import assert_engine_clean, make_llm

pytestmark = pytest.mark.slow
MAX_TOKENS = 16
WORDS = (
    "the engine cache block token prompt model batch step queue page memory request reply turn "
    "chat user system answer question data value table report month sales region team plan "
    "budget risk task review draft summary detail number list order price"
).split()


def workload(tokenizer) -> tuple[list[list[int]], list[list[int]]]:
    """32 prompts: one ~330-word report, then a question each; and 16 unrelated prompts."""
    rng = random.Random(0)
    report = " ".join(rng.choice(WORDS) for _ in range(330))
    prefix = tokenizer.encode(f"Read this report and answer.\n{report}\n", add_special_tokens=False)
    shared = [
        prefix
        + tokenizer.encode(
            f"Question {i}: what is item {rng.choice(WORDS)} number {7 * i}? Answer:",
            add_special_tokens=False,
        )
        for i in range(32)
    ]
    others = [
        tokenizer.encode(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200))),
            add_special_tokens=False,
        )
        for _ in range(16)
    ]
    return shared, others


def greedy(llm, prompts):
    """(token ids, logprob of each) per prompt."""
    from tokenbus import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (
            o.outputs[0].token_ids,
            [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
        )
        for o in outs
    ]


def test_shared_prefix_prompts_are_the_same_alone_batched_cached_or_not():
    results = {}
    for caching, budget in ((True, 2048), (False, 128)):  # 128: a prompt in three chunks
        llm = make_llm(
            None,
            batch_invariant=True,
            enable_prefix_caching=caching,
            max_num_batched_tokens=budget,
            max_model_len=1024,
        )
        shared, others = workload(llm.get_tokenizer())
        # Alone: one prompt a step (with caching on, each after the first hits the prefix).
        results[caching, "alone"] = [greedy(llm, [p])[0] for p in shared]
        # In a batch: the 32 among 16 others, 8 before and 8 after.
        results[caching, "batch"] = greedy(llm, others[:8] + shared + others[8:])[8:40]
        if caching:
            assert llm.engine.stats_totals["prefix_cache_hits"] > 31 * 320
        assert_engine_clean(llm)
        llm.shutdown()
    reference = results[True, "alone"]
    for key, outputs in results.items():
        for i, (got, want) in enumerate(zip(outputs, reference)):
            assert got[0] == want[0], f"{key}: prompt {i}'s tokens"
            assert got[1] == want[1], f"{key}: prompt {i}'s logprobs"  # exact floats
