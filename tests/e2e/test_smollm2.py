"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers on the same
GGUF."""

from __future__ import annotations

import pytest

from tests.e2e.oracle import assert_same_or_near_tie, hf_greedy, load_hf
from tests.e2e.utils import assert_engine_clean, make_llm

MAX_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
]


@pytest.fixture(scope="module")
def llm():
    return make_llm(None, max_model_len=2048)


@pytest.fixture(scope="module")
def chat_prompts(llm):
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]


@pytest.mark.slow
def test_greedy_matches_transformers_on_the_same_gguf(llm, chat_prompts):
    from tokenbus import SamplingParams
    from tokenbus.loader import resolve_model

    source = resolve_model(None)
    hf = load_hf(str(source.path.parent), source.path.name)
    expected = [hf_greedy(hf, p, MAX_TOKENS) for p in chat_prompts]
    # min_tokens masks EOS exactly as HF's min_new_tokens does in the oracle.
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=5
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    for out, want in zip(outputs, expected):
        # Different summation orders (oneDNN vs HF's matmuls) may flip a near tie.
        assert_same_or_near_tie(out.outputs[0].token_ids, want, out.outputs[0].logprobs)
    assert_engine_clean(llm)


def test_chat_answers_sensibly(llm):
    from tokenbus import SamplingParams

    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_default_sampling_follows_the_model_card(llm):
    # No generation config in the GGUF: the packaged model's recommended settings fill in.
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p) == (0.2, 0.9)
