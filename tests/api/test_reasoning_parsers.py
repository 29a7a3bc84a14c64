"""The reasoning parsers (--reasoning-parser): canned replies split into reasoning and content,
the same however a stream cuts them (tags split across deltas included), by text and by token
id, through the real detokenizer; the phase a prompt opens the reply in."""

from __future__ import annotations

import random

import pytest

from tokenbus.api.openai.reasoning_parsers import (
    Phase,
    ReasoningPlan,
    ReasoningStream,
    make_reasoning_parser,
)
from tokenbus.engine.detokenizer import IncrementalDetokenizer
from tokenbus.sampling_params import SamplingParams


class CharTokenizer:
    """One token per character and no vocabulary: the parsers fall back to the text."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)


@pytest.fixture(scope="module")
def think_tokenizer():
    """SmolLM2's tokenizer with <think> and </think> added as single (non-special) tokens, as
    Qwen3's and R1's vocabularies have them."""
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_models import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    tokenizer.add_tokens(["<think>", "</think>"])
    return tokenizer


CASES = [
    # parser, first phase, reply, (reasoning, content)
    ("deepseek_r1", Phase.REASONING, "I see.</think>Paris.", ("I see.", "Paris.")),
    ("deepseek_r1", Phase.REASONING, "<think>I see.</think>Paris.", ("I see.", "Paris.")),
    ("deepseek_r1", Phase.REASONING, "no end in sight", ("no end in sight", None)),
    ("deepseek_r1", Phase.REASONING, "done</think>", ("done", None)),
    ("deepseek_r1", Phase.REASONING, "</think>Paris.", (None, "Paris.")),
    # after the reasoning, tags are content like any text
    ("deepseek_r1", Phase.REASONING, "a</think>b</think>c<think>", ("a", "b</think>c<think>")),
    # a <think> inside the reasoning after the first is reasoning text
    ("deepseek_r1", Phase.REASONING, "<think>x<think>y</think>z", ("x<think>y", "z")),
    ("qwen3", Phase.BEFORE, "<think>\nHmm.\n</think>\n\nHi!", ("\nHmm.\n", "\n\nHi!")),
    ("qwen3", Phase.BEFORE, "Hi!", (None, "Hi!")),
    ("qwen3", Phase.BEFORE, "</think>Hi", (None, "</think>Hi")),
    ("qwen3", Phase.BEFORE, "<think>cut short", ("cut short", None)),
    ("qwen3", Phase.REASONING, "opened by the prompt</think>Hi", ("opened by the prompt", "Hi")),
    ("qwen3", Phase.CONTENT, "<think>x</think>y", (None, "<think>x</think>y")),
    ("qwen3", Phase.BEFORE, "", (None, "")),
]


# gpt-oss's harmony replies (the prompt ends with "<|start|>assistant"): reasoning, content.
ANALYSIS, FINAL = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
HARMONY_CASES = [
    (f"{ANALYSIS}Think.<|end|>{FINAL}Paris.", ("Think.", "Paris.")),
    ("<|channel|>final<|message|>Paris.", (None, "Paris.")),  # no analysis
    (f"{ANALYSIS}cut short", ("cut short", None)),
    (f"{ANALYSIS}a<|end|>", ("a", None)),
    ("Paris.", (None, "Paris.")),  # no header at all
    (f"{ANALYSIS}1 < 2 <|end|>{FINAL}a <|b", ("1 < 2 ", "a <|b")),  # "<|"-like text stays
    # a second analysis message reopens the reasoning
    (f"{ANALYSIS}A.<|end|><|start|>assistant{ANALYSIS}B.<|end|>{FINAL}Paris.", ("A.B.", "Paris.")),
]


def _stream(plan: ReasoningPlan, pieces: list[tuple[str, list[int]]]) -> tuple[str, str]:
    stream = plan.stream()
    reasoning = content = ""
    for i, (text, token_ids) in enumerate(pieces):
        delta = stream.feed(text, token_ids, final=i == len(pieces) - 1)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    return reasoning, content


def _as_split(reasoning: str, content: str) -> tuple[str | None, str | None]:
    return reasoning or None, content if content or not reasoning else None


def _cuts(text: str, rng: random.Random) -> list[list[str]]:
    """Every two-piece split, one character per piece, and random splits."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits.append(list(text) or [""])
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        splits.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)])])
    return splits


@pytest.mark.parametrize("name, phase, text, expected", CASES)
def test_split_by_text_whatever_the_deltas(name, phase, text, expected):
    plan = ReasoningPlan(make_reasoning_parser(name, CharTokenizer()), phase)
    assert plan.parser.tag_ids is None
    assert plan.split(text, []) == expected
    for pieces in _cuts(text, random.Random(text)):
        got = _stream(plan, [(piece, []) for piece in pieces])
        assert _as_split(*got) == expected, pieces


@pytest.mark.parametrize("name, phase, text, expected", CASES)
def test_split_by_token_id_whatever_the_deltas(think_tokenizer, name, phase, text, expected):
    plan = ReasoningPlan(make_reasoning_parser(name, think_tokenizer), phase)
    assert plan.parser.tag_ids == {"<think>": 49152, "</think>": 49153}
    token_ids = think_tokenizer.encode(text, add_special_tokens=False)
    assert plan.split(text, token_ids) == expected
    # Each token's text with its id, then the same tokens in random groups.
    pieces = [(think_tokenizer.decode([t]), [t]) for t in token_ids] or [("", [])]
    assert _as_split(*_stream(plan, pieces)) == expected
    rng = random.Random(text)
    for _ in range(10):
        groups, start = [], 0
        while start < len(pieces):
            end = start + rng.randint(1, 3)
            chunk = pieces[start:end]
            groups.append(("".join(t for t, _ in chunk), [i for _, ids in chunk for i in ids]))
            start = end
        assert _as_split(*_stream(plan, groups or [("", [])])) == expected


def test_a_tag_split_across_deltas_is_never_leaked_in_part():
    stream = ReasoningStream(make_reasoning_parser("deepseek_r1", CharTokenizer()), Phase.REASONING)
    first = stream.feed("Let me see.</thi")
    assert (first.reasoning, first.content) == ("Let me see.", "")  # "</thi" held back
    second = stream.feed("nk>Paris")
    assert (second.reasoning, second.content) == ("", "Paris")
    # Characters that only looked like a tag's start come out once they are not one.
    stream = ReasoningStream(make_reasoning_parser("qwen3", CharTokenizer()), Phase.BEFORE)
    assert stream.feed("a <thi").content == "a "
    assert stream.feed("s").content == "<this"
    assert stream.feed(" <", final=True).content == " <"  # the end gives out what was held


def test_by_token_id_only_the_tag_token_counts(think_tokenizer):
    """ "<think>" spelled with ordinary tokens (a model writing about the tags) is text; the
    text fallback cannot tell them apart."""
    spelled = [i for piece in ("<", "think", ">") for i in think_tokenizer.encode(piece)]
    assert 49152 not in spelled and think_tokenizer.decode(spelled) == "<think>"
    text, token_ids = "<think>Hi", spelled + think_tokenizer.encode("Hi")
    by_id = ReasoningPlan(make_reasoning_parser("qwen3", think_tokenizer), Phase.BEFORE)
    assert by_id.split(text, token_ids) == (None, "<think>Hi")
    by_text = ReasoningPlan(make_reasoning_parser("qwen3", CharTokenizer()), Phase.BEFORE)
    assert by_text.split(text, []) == ("Hi", None)


def test_through_the_detokenizer_a_tag_text_may_come_after_its_token(think_tokenizer):
    """A stop string makes the detokenizer hold back text: "</think>"'s id arrives a delta
    before all of its text does."""
    reply = think_tokenizer.encode("<think>Hmm, well.</think>Hi there", add_special_tokens=False)
    prompt = think_tokenizer.encode("Question?")
    plan = ReasoningPlan(make_reasoning_parser("qwen3", think_tokenizer), Phase.BEFORE)
    for stop in (None, ["zzzz"]):
        detokenizer = IncrementalDetokenizer(think_tokenizer, prompt, SamplingParams(stop=stop))
        stream, reasoning, content, lagged = plan.stream(), "", "", False
        for i, token_id in enumerate(reply):
            detokenizer.update([token_id])
            last = i == len(reply) - 1
            text = detokenizer.get_delta(finished=last)
            lagged |= token_id == 49153 and not text.endswith("</think>")
            delta = stream.feed(text, [token_id], final=last)
            reasoning, content = reasoning + delta.reasoning, content + delta.content
        assert (reasoning, content) == ("Hmm, well.", "Hi there")
        assert lagged == (stop is not None)


def test_tags_that_are_special_tokens_need_special_tokens_kept(think_tokenizer):
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_models import smollm2_tokenizer_dir

    special = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    special.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    assert make_reasoning_parser("qwen3", special).needs_special_tokens
    assert not make_reasoning_parser("qwen3", think_tokenizer).needs_special_tokens
    assert not make_reasoning_parser("qwen3", CharTokenizer()).needs_special_tokens


def test_the_phase_a_prompt_opens_the_reply_in(think_tokenizer):
    qwen3 = make_reasoning_parser("qwen3", think_tokenizer)
    r1 = make_reasoning_parser("deepseek_r1", think_tokenizer)

    def ids(text):
        return think_tokenizer.encode(text, add_special_tokens=False)

    opened = "user: hi\nassistant: <think>\n"
    closed = "user: hi\nassistant: <think>\n\n</think>\n\n"
    plain = "user: hi\nassistant: "
    assert qwen3.first_phase(ids(opened), opened, None) is Phase.REASONING
    assert qwen3.first_phase(ids(closed), closed, None) is Phase.BEFORE
    assert qwen3.first_phase(ids(plain), plain, {}) is Phase.BEFORE
    off = {"enable_thinking": False}
    assert qwen3.first_phase(ids(opened), opened, off) is Phase.CONTENT
    # deepseek_r1 always opens inside the reasoning.
    for prompt in (opened, closed, plain):
        assert r1.first_phase(ids(prompt), prompt, None) is Phase.REASONING
    # By text, the prompt's text decides (decoded from the ids when truncation cut it).
    by_text = make_reasoning_parser("qwen3", CharTokenizer())
    assert by_text.first_phase([], opened, None) is Phase.REASONING
    assert by_text.first_phase([ord(c) for c in opened], None, None) is Phase.REASONING
    assert by_text.first_phase([], closed, None) is Phase.BEFORE


def test_reasoning_tokens_counted(think_tokenizer):
    plan = ReasoningPlan(make_reasoning_parser("qwen3", think_tokenizer), Phase.BEFORE)
    token_ids = think_tokenizer.encode("<think>Hmm</think>Hi", add_special_tokens=False)
    assert plan.num_reasoning_tokens(token_ids, "Hmm") == 4  # <think>, H, mm, </think>
    by_text = ReasoningPlan(make_reasoning_parser("deepseek_r1", CharTokenizer()), Phase.REASONING)
    assert by_text.num_reasoning_tokens([], "Hmm") == 3
    assert by_text.num_reasoning_tokens([], None) == 0


def test_unknown_parser_names_the_choices():
    with pytest.raises(
        ValueError,
        match=r"reasoning_parser: unknown parser 'r2'.*deepseek_r1, glm45, openai_gptoss, qwen3",
    ):
        make_reasoning_parser("r2", CharTokenizer())


@pytest.mark.parametrize("text, expected", HARMONY_CASES)
def test_harmony_split_by_text_whatever_the_deltas(text, expected):
    plan = ReasoningPlan(make_reasoning_parser("openai_gptoss", CharTokenizer()), Phase.BEFORE)
    assert plan.parser.needs_special_tokens  # its markers are special tokens of o200k_harmony
    assert plan.split(text, []) == expected
    for pieces in _cuts(text, random.Random(text)):
        assert _as_split(*_stream(plan, [(piece, []) for piece in pieces])) == expected, pieces


def test_harmony_through_the_detokenizer_with_special_tokens_kept():
    """The markers as special tokens (o200k_harmony's): detokenized with them kept, a token at
    a time, the analysis channel is the reasoning and the final channel the content; the EOS
    that ends the reply (<|return|>) is not text."""
    from transformers import AutoTokenizer

    from tests.fixtures.tiny_models import smollm2_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    markers = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    reply = tokenizer.encode(HARMONY_CASES[0][0] + "<|return|>", add_special_tokens=False)
    assert len(set(reply) & set(tokenizer.convert_tokens_to_ids(markers))) == 5
    plan = ReasoningPlan(make_reasoning_parser("openai_gptoss", tokenizer), Phase.BEFORE)
    prompt = tokenizer.encode("<|start|>user<|message|>Capital of France?<|end|><|start|>assistant")
    assert plan.parser.first_phase(prompt, None, None) is Phase.BEFORE
    params = SamplingParams(skip_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, params)
    stream, reasoning, content = plan.stream(), "", ""
    for i, token_id in enumerate(reply):
        last = i == len(reply) - 1  # <|return|>, the EOS that ends the request: not text
        detokenizer.update([token_id], stop_terminated=last)
        delta = stream.feed(detokenizer.get_delta(finished=last), [token_id], final=last)
        reasoning, content = reasoning + delta.reasoning, content + delta.content
    assert (reasoning, content) == ("Think.", "Paris.")
