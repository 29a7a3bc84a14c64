"""The soak's requests (benchmarks/soak.py): one coroutine per kind, each raising on anything
but the answer it expects."""

from __future__ import annotations

import functools
import json
import random
import zlib

import aiohttp

# The structured-output request's schema: small, and bounded (maxLength, enum) so that the
# grammar lets the model finish well inside max_tokens.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
    },
    "required": ["name", "age", "mood"],
    "additionalProperties": False,
}
WORDS = (
    "river stone lantern maple orbit copper violet harbor meadow signal thunder glacier "
    "pepper canyon marble falcon ember willow quartz saddle"
).split()
ABORT_AFTER_CHUNKS = 3


def make_prompt(rng: random.Random, serial: int) -> str:
    # A shared opening (prefix-cache hits) and a tail that differs (new blocks every request);
    # ~20 to ~600 tokens, so prefill shapes (and the allocations they make) vary widely.
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 450)))
    return f"Write a short note about these words, number {serial}: {words}."


async def read_sse(resp: aiohttp.ClientResponse, max_chunks: int | None = None) -> int:
    """Count `data:` chunks until [DONE] (or `max_chunks`). Raises if the stream reports an
    error or ends without [DONE]."""
    chunks = 0
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return chunks
        if '"error"' in data and "error" in json.loads(data):
            raise RuntimeError(f"stream error: {data[:200]}")
        chunks += 1
        if max_chunks is not None and chunks >= max_chunks:
            return chunks
    raise RuntimeError("stream ended without [DONE]")


async def post_json(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        return await resp.json()


async def chat_stream(session: aiohttp.ClientSession, base: str, prompt: str) -> None:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
        "temperature": 0.8,
        "stream": True,
    }
    async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        await read_sse(resp)


async def completion_n2(session: aiohttp.ClientSession, base: str, prompt: str) -> None:
    body = {"prompt": prompt, "max_tokens": 32, "n": 2, "temperature": 1.0}
    result = await post_json(session, f"{base}/v1/completions", body)
    if len(result.get("choices", [])) != 2:
        raise RuntimeError(f"expected 2 choices, got {len(result.get('choices', []))}")


async def structured(session: aiohttp.ClientSession, base: str, prompt: str) -> None:
    body = {
        "messages": [{"role": "user", "content": f"Describe a person as JSON. {prompt}"}],
        "max_tokens": 96,
        "temperature": 0.7,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON_SCHEMA},
        },
    }
    result = await post_json(session, f"{base}/v1/chat/completions", body)
    choice = result["choices"][0]
    # A completed answer must parse; one cut by max_tokens ("length") cannot be judged.
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        if set(value) != set(PERSON_SCHEMA["required"]):
            raise RuntimeError(f"schema violated: {choice['message']['content'][:200]}")


async def abort_mid_stream(session: aiohttp.ClientSession, base: str, prompt: str) -> None:
    # Long enough that it is still generating when we hang up: the server must abort it.
    body = {"prompt": prompt, "max_tokens": 256, "min_tokens": 256, "stream": True}
    resp = await session.post(f"{base}/v1/completions", json=body)
    try:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
        await read_sse(resp, max_chunks=ABORT_AFTER_CHUNKS)
    finally:
        resp.close()  # drops the connection (not returned to the pool): the abort


@functools.cache
def slow_grammar(name: str) -> str:
    """The EBNF xgrammar writes for an object of 3,000 optional properties: well past the
    default compile deadline (the schema cost cap does not see grammars), ~400 KB. An unused
    rule makes it `name`'s."""
    import xgrammar as xgr

    schema = {"type": "object", "properties": {f"p{i}": {} for i in range(3000)}}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    return f'{grammar}\nunused_{name} ::= "{name}"\n'


# Shapes of the hostile kind, chosen by a hash of the request's prompt: mostly the cheap
# refusals; the slow grammar (a compile killed at the deadline: a core for that long) seldom.
HOSTILE_SHAPES = ("wide_schema", "empty_regex") * 4 + ("slow_grammar_new", "slow_grammar_known")


async def hostile(session: aiohttp.ClientSession, base: str, prompt: str) -> None:
    digest = zlib.crc32(prompt.encode())
    shape = HOSTILE_SHAPES[digest % len(HOSTILE_SHAPES)]
    if shape == "wide_schema":
        schema = {
            "title": f"t{digest}",
            "type": "object",
            "properties": {f"p{i}": {} for i in range(5000)},
        }
        path, expected = "/v1/chat/completions", "--max-schema-cost"
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "wide", "schema": schema},
            },
        }
    else:
        if shape == "empty_regex":
            spec, expected = {"regex": "[^\\s\\S]"}, "admits no output"
        else:
            name = f"n{digest}" if shape == "slow_grammar_new" else "known"
            spec, expected = {"grammar": slow_grammar(name)}, "longer than"
        path = "/v1/completions"
        body = {"prompt": prompt, "max_tokens": 8, "structured_outputs": spec}
    async with session.post(f"{base}{path}", json=body) as resp:
        text = await resp.text()
        if resp.status != 400 or expected not in text:
            raise RuntimeError(
                f"{shape}: HTTP {resp.status}, expected a 400 naming {expected!r}: {text[:200]}"
            )


REQUESTS = {
    "chat_stream": chat_stream,
    "completion_n2": completion_n2,
    "structured": structured,
    "abort": abort_mid_stream,
    "hostile": hostile,
}
