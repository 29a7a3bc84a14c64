"""--reasoning-parser end to end: a real `tokenbus serve` whose tiny model is wired to answer
"<think>Hmm</think>Hi" (its tokenizer has the tags as single tokens, as Qwen3's has), read by the
official openai client, streamed and not. The tags are told by token id, through the real
detokenizer, a stop string's hold-back included."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.server import ServerProcess
from tests.fixtures.tiny_models import make_scripted_model, smollm2_tokenizer_dir

pytestmark = pytest.mark.slow  # a server start (~25 s on two cores)

ASK = [{"role": "user", "content": "Hello?"}]
REPLY_WORDS = ("Hmm", "Hi")  # the reasoning, the content


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    tokenizer.add_tokens(["<think>", "</think>"])
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    reasoning, content = (tokenizer.encode(word) for word in REPLY_WORDS)
    path = make_scripted_model(
        tmp_path_factory.mktemp("scripted"), tokenizer, [start, *reasoning, end, *content]
    )
    with ServerProcess(
        str(path),
        "--max-model-len",
        "256",
        "--reasoning-parser",
        "qwen3",
        log_dir=tmp_path_factory.mktemp("reasoning"),
    ) as server:
        assert "reasoning parser qwen3: tags told by token id" in server.log_path.read_text()
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_reasoning_apart_from_content(scripted):
    completion = scripted.chat.completions.create(
        model=scripted.models.list().data[0].id, messages=ASK, max_tokens=20
    )
    message = completion.choices[0].message
    assert message.content == "Hi" and message.reasoning_content == "Hmm"
    assert message.reasoning == "Hmm" and completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stop", [None, ["zzzz"]])  # a stop string makes text lag its tokens
def test_reasoning_streamed(scripted, stop):
    model = scripted.models.list().data[0].id
    reasoning = content = ""
    for chunk in scripted.chat.completions.create(
        model=model, messages=ASK, max_tokens=20, stream=True, stop=stop
    ):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("Hmm", "Hi")


def test_thinking_off_is_all_content(scripted):
    model = scripted.models.list().data[0].id
    completion = scripted.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=20,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = completion.choices[0].message
    assert message.content == "<think>Hmm</think>Hi"
    assert getattr(message, "reasoning_content", None) is None
