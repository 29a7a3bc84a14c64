"""A Qwen3 model behind the OpenAI server: a tiny Qwen3 (q/k norms and all) scripted to answer
"<think>Hmm</think>Hi" and then <|im_end|>, with Qwen3's chat template (ChatML; an empty think
block when thinking is off), served by a real `tokenbus serve --reasoning-parser qwen3` and read
by the official openai client: the prompt is the template's, the reply stops at <|im_end|>
without showing it, and the reasoning comes apart from the content."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.server import ServerProcess
from tests.fixtures.tiny_models import make_scripted_model, smollm2_tokenizer_dir

# Qwen3's template, cut to what these tests send (no tools): ChatML turns, earlier assistant
# turns without their reasoning, and `enable_thinking=false` pre-filling an empty think block.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content %}"
    "{%- if message.role == 'assistant' and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "<think>Greet back.</think>Hello."},
    {"role": "user", "content": "And now?"},
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE
    start, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"  # TINY_CONFIG's eos_token_id
    reply = [start, *tokenizer.encode("Hmm"), end, *tokenizer.encode("Hi")]
    path = make_scripted_model(tmp_path_factory.mktemp("qwen3"), tokenizer, reply, arch="qwen3")
    with ServerProcess(
        str(path),
        "--max-model-len",
        "256",
        "--reasoning-parser",
        "qwen3",
        log_dir=tmp_path_factory.mktemp("qwen3-serve"),
    ) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield client, tokenizer, len(reply)


def prompt_len(tokenizer, messages, **kwargs) -> int:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
    )["input_ids"]
    return len(ids)


def test_chat_template_and_stop_token(served):
    client, tokenizer, reply_len = served
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT, max_tokens=20
    )
    assert completion.usage.prompt_tokens == prompt_len(
        tokenizer, CHAT
    )  # the earlier reasoning is dropped
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # at <|im_end|>, the model's EOS, not max_tokens
    assert (choice.message.reasoning_content, choice.message.content) == ("Hmm", "Hi")
    assert completion.usage.completion_tokens == reply_len + 1  # the EOS is counted, not shown


def test_thinking_off_prefills_an_empty_think_block(served):
    client, tokenizer, _ = served
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=CHAT[:2],
        max_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    thinking_off = prompt_len(tokenizer, CHAT[:2], enable_thinking=False)
    assert completion.usage.prompt_tokens == thinking_off > prompt_len(tokenizer, CHAT[:2])
