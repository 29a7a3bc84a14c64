"""`tokenbus serve` with no model argument: the packaged SmolLM2-135M-Instruct answers sensibly."""

from __future__ import annotations

import openai
import pytest

from tests.fixtures.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client():
    with ServerProcess(None, "--max-model-len", "2048", "--kv-cache-memory", "256MiB") as server:
        yield openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )


def test_default_model_answers(client):
    model = client.models.list().data[0].id
    assert model == "smollm2"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0
    )
    assert "Paris" in full.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_with_a_pydantic_model(client):
    import pydantic

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        age: int = pydantic.Field(ge=0, le=120)

    messages = [{"role": "user", "content": "Invent a person. Reply in JSON."}]
    parsed = client.chat.completions.parse(
        model="smollm2",
        messages=messages,
        response_format=Person,
        max_tokens=80,
        temperature=1.0,
        seed=1,
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_response_format_json_schema_streamed_and_not(client):
    import json

    import jsonschema

    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    messages = [{"role": "user", "content": "Invent a person. Reply in JSON."}]
    full = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=80,
        temperature=1.0,
        seed=2,
        response_format=response_format,
    )
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON_SCHEMA)
    chunks = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=80,
        temperature=1.0,
        seed=3,
        response_format=response_format,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)


def test_response_format_json_object(client):
    import json

    messages = [
        {"role": "user", "content": 'Give the capital of France as JSON like {"capital": ...}.'}
    ]
    full = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(full.choices[0].message.content), dict)


def test_invalid_schema_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=8,
            response_format=bad,
        )
    assert "schema" in str(info.value)
