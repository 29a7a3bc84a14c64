"""Speculative decoding on the real default model (SmolLM2-135M-Instruct): greedy output identical
to plain decoding (n-gram and self-speculation, mixed batch, prefix caching, forced preemption),
and structured output still always valid."""

from __future__ import annotations

import gc
import json

import jsonschema
import pytest

from tests.e2e.oracle import assert_same_or_near_tie
from tests.e2e.utils import assert_engine_clean
from tests.spec_decode.utils import make_spec_llm, spec_metrics
from tests.structured.schemas import SCHEMAS
from tokenbus import SamplingParams, StructuredOutputsParams

MAX_TOKENS = 32
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 5,
}
SELF_DRAFT = {"method": "draft_model", "draft_layers": 20, "num_speculative_tokens": 3}
CODE = """def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]
"""
QUESTIONS = [
    "What is the capital of France?",
    f"Repeat this code exactly, then stop:\n{CODE}",
    "Write a haiku about the sea.",
    f"Rename the function to merge_sorted and repeat the code:\n{CODE}",
    "List three prime numbers.",
]


def _llm(spec=None, **kwargs):
    kwargs.setdefault("num_kv_blocks", 256)
    kwargs.setdefault("max_model_len", 1024)
    # Row-count-invariant numerics: on AVX512-BF16 CPUs `auto` runs linears of 16+ (AMX) or 32+
    # rows in bf16, so a verification step (5 requests x 4 rows) and plain decoding (5 rows)
    # round differently and may split a near-tie differently. int16 rounds each row the same at
    # any batch size.
    kwargs.setdefault("quant_activations", "int16")
    return make_spec_llm(None, spec, **kwargs)


def _chat_prompts(llm, questions):
    render = llm.engine.input_processor.render_chat
    return [render([{"role": "user", "content": q}])[1] for q in questions]


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


@pytest.fixture(scope="module")
def reference():
    """Plain decoding's greedy outputs, cold, and then in reverse batch order with the prompts in
    the prefix cache (its own reference: a cached prompt's last tokens are recomputed in a small
    step, on other kernels than the full prompt's, which can move a near-tie: seen on an AVX2
    EPYC, where "List three prime numbers." went another way at its 11th token)."""
    llm = _llm()
    prompts = _chat_prompts(llm, QUESTIONS)
    outputs = _greedy(llm, prompts)
    warm_reversed = _greedy(llm, prompts[::-1])[::-1]
    del llm
    gc.collect()
    return prompts, outputs, warm_reversed


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft"])
def test_greedy_identical_to_plain_decoding(spec, reference):
    prompts, want, want_warm_reversed = reference
    llm = _llm(spec)
    with spec_metrics(llm) as metrics:
        got = _greedy(llm, prompts)
    assert got == want
    if spec is NGRAM:  # another batch order, with the prompts now in the prefix cache
        assert _greedy(llm, prompts[::-1])[::-1] == want_warm_reversed
    assert metrics.num_accepted_tokens > 0, metrics
    assert_engine_clean(llm)


def test_greedy_identical_under_forced_preemption(reference):
    prompts, want, _ = reference
    # 20 blocks of 16 tokens: one request of max_model_len 256 fits, the batch needs ~40.
    assert max(len(p) for p in prompts) + MAX_TOKENS < 256
    llm = _llm(NGRAM, num_kv_blocks=20, max_model_len=256, max_num_batched_tokens=128)
    # Recomputing a preempted request's tokens in 128-token chunks runs other kernels than the
    # cold run's steps did (a big chunk's GEMM vs a small step's tiles): a near tie may flip.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outputs, want):
        assert_same_or_near_tie(out.outputs[0].token_ids, ref, out.outputs[0].logprobs)
    assert llm.engine.stats_totals["num_preemptions"] > 0
    assert_engine_clean(llm)


@pytest.mark.parametrize("spec", [NGRAM, SELF_DRAFT], ids=["ngram", "self_draft"])
def test_structured_output_stays_valid_with_speculation(spec):
    llm = _llm(spec)
    schemas = SCHEMAS[:10]
    prompts = _chat_prompts(
        llm, [f"Reply with JSON matching this schema: {json.dumps(s)}" for s in schemas]
    )
    params = [
        SamplingParams(
            temperature=1.0 if i % 2 else 0.0,
            seed=i,
            max_tokens=200,
            structured_outputs=StructuredOutputsParams(json=s),
        )
        for i, s in enumerate(schemas)
    ]
    with spec_metrics(llm) as metrics:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for schema, out in zip(schemas, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    assert metrics.num_accepted_tokens > 0, metrics
    assert_engine_clean(llm)
