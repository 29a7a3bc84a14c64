"""Structured output with xgrammar on the real SmolLM2 model: always valid, never crashing."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.e2e.utils import assert_engine_clean, make_llm
from tests.structured.schemas import PERSON, SCHEMAS
from tokenbus import SamplingParams, StructuredOutputsParams

MAX_TOKENS = 200


@pytest.fixture(scope="module")
def llm():
    return make_llm(None, max_model_len=1024)


def _chat(llm, prompt: str) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(text, add_special_tokens=False)


def test_json_schemas_valid_at_temperature_one_in_a_mixed_batch(llm):
    assert len(SCHEMAS) >= 20
    prompts, params = [], []
    for i, schema in enumerate(SCHEMAS):
        prompts.append(_chat(llm, f"Reply with JSON matching this schema: {json.dumps(schema)}"))
        params.append(
            SamplingParams(
                temperature=1.0,
                seed=i,
                max_tokens=MAX_TOKENS,
                structured_outputs=StructuredOutputsParams(json=schema),
            )
        )
        # An unconstrained neighbour for every constrained request.
        prompts.append(_chat(llm, f"Tell me a fact about the number {i}."))
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=16))
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outputs[::2]):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    assert_engine_clean(llm)


def test_unconstrained_greedy_unchanged_by_constrained_neighbours(llm):
    plain = _chat(llm, "Name a color.")
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    alone = (
        llm.generate([{"prompt_token_ids": plain}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    )
    constrained = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    mixed = llm.generate(
        [{"prompt_token_ids": _chat(llm, "A person as JSON")}, {"prompt_token_ids": plain}],
        [constrained, greedy],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone


def test_regex_choice_and_ebnf(llm):
    specs = [
        StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
        StructuredOutputsParams(choice=["Paris", "London", "Berlin"]),
        StructuredOutputsParams(
            grammar='root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
            'term ::= [0-9]+ | "(" expr ")"'
        ),
        StructuredOutputsParams(json_object=True),
    ]
    prompts = [
        _chat(llm, "Give a code."),
        _chat(llm, "What is the capital of France?"),
        _chat(llm, "Write an arithmetic expression."),
        _chat(llm, "Describe a cat in JSON."),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=s) for s in specs
    ]
    outs = [
        o.outputs[0].text
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", outs[0]), outs[0]
    assert outs[1] in ("Paris", "London", "Berlin")
    assert re.fullmatch(r"[0-9()+\-]+", outs[2]) and outs[2].count("(") == outs[2].count(")"), outs[
        2
    ]
    assert isinstance(json.loads(outs[3]), dict)
    assert_engine_clean(llm)


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
            "JSON schema",
        ),
        (dict(json="{not json"), "JSON schema"),
        (dict(regex="([a-z]"), "regex"),
        (dict(grammar="root ::= ("), "EBNF"),
    ],
)
def test_bad_specs_rejected_before_the_engine(llm, spec, message):
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ValueError, match=message):
        llm.generate("Hi", params, use_tqdm=False)
    assert_engine_clean(llm)
    ok = llm.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 2


def test_two_constraints_at_once_rejected():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
