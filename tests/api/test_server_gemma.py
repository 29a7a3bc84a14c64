"""A Gemma 3 model behind the OpenAI server: a tiny Gemma 3 (post-norms, GeGLU, (1 + w) norms)
scripted to answer "Hi there" and then <end_of_turn>, with Gemma's chat template (no system
role: Gemma 3's folds a system message into the first user turn, Gemma 2's refuses one) and
Gemma's generation_config (eos_token_id [EOS, <end_of_turn>]), served by a real `tokenbus serve`
and read by the official openai client: the reply stops at <end_of_turn>, the second EOS id,
without showing it."""

from __future__ import annotations

import json

import openai
import pytest

from tests.fixtures.server import ServerProcess
from tests.fixtures.tiny_models import make_scripted_model, smollm2_tokenizer_dir

# Gemma 3's template, cut to text content: a system message becomes the first user turn's
# prefix; roles must alternate; the assistant is "model".
GEMMA3_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)
# Gemma 2's refuses a system message outright.
GEMMA2_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{{ raise_exception('System role not supported') }}"
    "{%- endif -%}" + GEMMA3_TEMPLATE
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "And now?"},
]


def serve(tmp_path_factory, template: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_tokenizer_dir()))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]}
    )
    tokenizer.chat_template = template
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    reply = [*tokenizer.encode("Hi there"), end_of_turn]
    path = make_scripted_model(tmp_path_factory.mktemp("gemma"), tokenizer, reply, arch="gemma3")
    # Gemma's generation_config: EOS first, <end_of_turn> (Gemma's 106) second.
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end_of_turn]}))
    return (
        tokenizer,
        reply,
        ServerProcess(
            str(path), "--max-model-len", "128", log_dir=tmp_path_factory.mktemp("gemma-serve")
        ),
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer, reply, server = serve(tmp_path_factory, GEMMA3_TEMPLATE)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield client, tokenizer, reply


def prompt_len(tokenizer, messages) -> int:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    return len(ids)


def test_system_folded_into_the_first_turn_and_end_of_turn_stops(served):
    client, tokenizer, reply = served
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT, max_tokens=20
    )
    assert completion.usage.prompt_tokens == prompt_len(tokenizer, CHAT)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"  # at <end_of_turn>, not at max_tokens
    assert choice.message.content == "Hi there"  # <end_of_turn> not shown
    assert completion.usage.completion_tokens == len(reply)  # counted, as vLLM does


def test_streamed_reply_stops_at_end_of_turn(served):
    client, _, _ = served
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=CHAT[1:2], max_tokens=20, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_ignore_eos_runs_past_end_of_turn(served):
    client, _, reply = served
    completion = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=CHAT[1:2],
        max_tokens=len(reply) + 2,
        extra_body={"ignore_eos": True},
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == len(reply) + 2


def test_gemma2_template_refuses_a_system_message(tmp_path_factory):
    _, _, server = serve(tmp_path_factory, GEMMA2_TEMPLATE)
    with server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        with pytest.raises(openai.BadRequestError, match="System role not supported"):
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
        completion = client.chat.completions.create(model=model, messages=CHAT[1:], max_tokens=20)
        assert completion.choices[0].message.content == "Hi there"
