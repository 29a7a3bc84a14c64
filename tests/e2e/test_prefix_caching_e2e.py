"""Prefix caching end to end: same greedy tokens with and without it, hits within one step."""

from __future__ import annotations

from tests.e2e.oracle import hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, generate_greedy, make_llm, random_prompts


def test_shared_prefix_batch_hits_blocks_filled_in_the_same_step(tiny_llama_dir):
    prefix = random_prompts(1, 40, 40, seed=11)[0]  # 2 full blocks + 8 tokens
    prompts = [prefix + tail for tail in random_prompts(6, 1, 20, seed=12)]
    hf = load_hf(str(tiny_llama_dir))
    expected = [hf_greedy(hf, p, 12) for p in prompts]
    results = {}
    for caching in (True, False):
        llm = make_llm(tiny_llama_dir, enable_prefix_caching=caching)
        results[caching] = generate_greedy(llm, prompts, 12)
        totals = llm.engine.stats_totals
        if caching:
            # All six prompts are admitted in the first step; the first fills the prefix's two
            # full blocks and the other five hit them in that same step.
            assert totals["prefix_cache_hits"] == 5 * 32
        else:
            assert totals["prefix_cache_hits"] == 0
        assert_engine_clean(llm)
    assert results[True] == results[False] == expected
