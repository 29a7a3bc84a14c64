"""Prompt logprobs (SamplingParams.prompt_logprobs): equal to HF transformers' log-softmax over
the same prompt, with chunked prefill, n > 1, a prefix-cache hit that must not be taken, and a
whole-prompt request next to ordinary ones."""

from __future__ import annotations

import math

import pytest
import torch

from tests.e2e.oracle import load_hf
from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tokenbus import SamplingParams

TOP_N = 3


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    # 16-token chunks: a 40-token prompt takes three steps, and its logprobs come in pieces.
    return make_llm(tiny_llama_dir, max_model_len=256, max_num_batched_tokens=16, max_logprobs=-1)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return load_hf(str(tiny_llama_dir))


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return logits.log_softmax(-1)  # row p: the distribution of token p + 1


def assert_matches_hf(entries, prompt, reference, top_n: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry, row = entries[position], reference[position - 1]
        token = prompt[position]
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-3), position
        # The rank among 49152 values: exact up to values within rounding of the token's (our
        # kernels sum in another order than HF's, and a random model has many near ties).
        value = row[token].item()
        assert (
            int((row > value + 1e-4).sum()) + 1
            <= entry[token].rank
            <= int((row > value - 1e-4).sum()) + 1
        )
        top = row.topk(top_n)
        for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(entry[token_id].logprob, value, abs_tol=1e-3)
        assert len(entry) in (top_n, top_n + 1)  # the prompt token, unless it is among the top


def test_prompt_logprobs_equal_hf_with_chunked_prefill(llm, hf):
    prompts = random_prompts(3, 20, 40, seed=11, vocab_low=5, vocab_high=200)
    params = SamplingParams(max_tokens=2, prompt_logprobs=TOP_N, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert_matches_hf(output.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), TOP_N)
    assert_engine_clean(llm)


def test_cached_prefix_is_recomputed_and_n_children_share_one_computation(llm, hf):
    prompt = random_prompts(1, 40, 40, seed=12, vocab_low=5, vocab_high=200)[0]
    # cached
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    params = SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=1, prompt_logprobs=0)
    [output] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(output.outputs) == 3
    # Complete and right although the prompt was cached: the child that computes them did not
    # take the hit (the other two may).
    assert_matches_hf(output.prompt_logprobs, prompt, hf_prompt_logprobs(hf, prompt), 0)
    plain = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False
    )[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    assert_engine_clean(llm)


def test_bad_prompt_logprobs_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)
    capped = make_llm(tiny_llama_dir, max_model_len=64, num_kv_blocks=16)  # --max-logprobs 20
    with pytest.raises(ValueError, match="prompt_logprobs"):
        capped.generate(
            [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(prompt_logprobs=21), use_tqdm=False
        )
    capped.shutdown()


def test_preempted_mid_prefill_prompt_logprobs_stay_aligned(tiny_llama_dir, hf):
    # 8 usable blocks of 16 tokens and 16-token chunks: the long generating request needs the
    # blocks of the scoring one, which is preempted while its prompt is half done and recomputed.
    llm = make_llm(
        tiny_llama_dir,
        max_model_len=128,
        max_num_batched_tokens=16,
        num_kv_blocks=9,
        max_logprobs=-1,
        enable_prefix_caching=False,
    )
    generating = random_prompts(1, 47, 47, seed=13, vocab_low=5, vocab_high=200)[0]
    scoring = random_prompts(1, 70, 70, seed=14, vocab_low=5, vocab_high=200)[0]
    params = [
        SamplingParams(max_tokens=60, ignore_eos=True),
        SamplingParams(max_tokens=1, prompt_logprobs=1),
    ]
    outputs = llm.generate(
        [{"prompt_token_ids": generating}, {"prompt_token_ids": scoring}], params, use_tqdm=False
    )
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_matches_hf(outputs[1].prompt_logprobs, scoring, hf_prompt_logprobs(hf, scoring), 1)
    assert_engine_clean(llm)
    llm.shutdown()
