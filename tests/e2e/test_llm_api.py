"""The offline LLM API: sampling, n > 1, stop strings, logprobs, bad input — on a tiny model."""

from __future__ import annotations

import pytest

from tests.e2e.utils import assert_engine_clean, make_llm, random_prompts
from tokenbus import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return make_llm(tiny_llama_dir, max_model_len=256)


def _sample(llm, prompts, **params):
    sp = SamplingParams(max_tokens=12, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_sampling_reproducible_and_batch_independent(llm):
    prompts = random_prompts(6, 3, 40, seed=3)
    alone = _sample(llm, prompts[:1], temperature=1.0, seed=1234)
    again = _sample(llm, prompts[:1], temperature=1.0, seed=1234)
    in_batch = _sample(llm, prompts[3:] + prompts[:1] + prompts[1:3], temperature=1.0, seed=1234)
    assert alone == again
    assert in_batch[3] == alone[0]
    other_seed = _sample(llm, prompts[:1], temperature=1.0, seed=99)
    assert other_seed != alone
    assert_engine_clean(llm)


def test_mixed_params_list_one_per_prompt(llm):
    prompts = random_prompts(3, 5, 20, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in (1, 5, 9)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 5, 9]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3


def test_parallel_sampling_n(llm):
    outs = llm.generate(
        "Hello there",
        SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    completions = outs[0].outputs
    assert [c.index for c in completions] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in completions}) > 1
    assert_engine_clean(llm)


def test_stop_string_not_in_text(llm):
    free = llm.generate(
        "Once upon", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop = free.text[5:8]
    assert stop.strip(), free.text
    out = llm.generate(
        "Once upon",
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert_engine_clean(llm)


@pytest.mark.parametrize("include", [False, True])
def test_the_stop_token_is_not_text(llm, include):
    """A stop token id (as EOS) ends the request with its id in token_ids and, as vLLM, its
    text left out unless include_stop_str_in_output, special tokens kept or not."""
    free = llm.generate(
        "Once upon", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    stop_id = free.token_ids[5]
    params = SamplingParams(
        temperature=0.0, max_tokens=20, stop_token_ids=[stop_id], skip_special_tokens=False,
        include_stop_str_in_output=include,
    )  # fmt: skip
    out = llm.generate("Once upon", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == free.token_ids[:6]
    tokenizer = llm.get_tokenizer()
    assert out.text == tokenizer.decode(free.token_ids[: 6 if include else 5])
    assert_engine_clean(llm)


def test_logprobs(llm):
    out = llm.generate(
        "Hi", SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False
    )
    completion = out[0].outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert token_id in position
        assert position[token_id].rank == 1  # greedy picks the top token
        assert 3 <= len(position) <= 4
    assert completion.cumulative_logprob <= 0


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n"),
    ],
)
def test_bad_sampling_params(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_bad_inputs_leave_engine_serving(llm):
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("Hi", SamplingParams(logprobs=1000), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match=r"256.*300|300.*256"):
        llm.generate([{"prompt_token_ids": [5] * 300}], use_tqdm=False)
    # A bad prompt in a batch: the whole call is refused and nothing reaches the engine.
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    assert_engine_clean(llm)
    ok = llm.generate("Hi", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3
    assert_engine_clean(llm)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="no-such-model"):
        make_llm("/tmp/no-such-model")
