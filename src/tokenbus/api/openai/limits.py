"""Caps on the work one request may ask for (L5).

Each field of RequestLimits is a `tokenbus serve` flag (`max_chat_messages` → `--max-chat-messages`,
derived in cli/serve_cmd.py); going over one is a 400 that names the flag. The checks are counts
and lengths, cheap enough for the event loop, so they run before anything expensive (tokenizing,
rendering a chat template, compiling a grammar) is even started.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# No token is longer than this many characters in the tokenizers we serve; longer text cannot
# fit the context, and refusing it by length spares the tokenizer megabytes of work.
MAX_CHARS_PER_TOKEN = 32


def _cap(default: int | None, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    max_n: int = _cap(16, "n (choices per prompt)")
    max_sequences_per_request: int = _cap(256, "prompts × n of one request")
    max_request_tokens: int | None = _cap(
        None,
        "prompt + max_tokens, summed over a request's sequences (default: max-n × the "
        "context length)",
    )
    max_input_chars: int | None = _cap(
        None,
        f"characters of prompt text, of a chat's contents, of /tokenize input (default: "
        f"{MAX_CHARS_PER_TOKEN} × the context length)",
    )
    max_chat_messages: int = _cap(2048, "messages of one chat")
    max_tools: int = _cap(128, "tools (or functions) of one chat")
    max_stop_strings: int = _cap(16, "stop strings of one request")
    max_stop_string_chars: int = _cap(1024, "characters of one stop string")
    max_logit_bias: int = _cap(1024, "logit_bias entries")
    max_schema_bytes: int = _cap(64 * 1024, "bytes of a JSON schema, grammar or choice list")
    max_schema_depth: int = _cap(64, "nesting depth of a JSON schema")
    max_schema_cost: int = _cap(
        1 << 20,
        "compile cost of a JSON schema: the sum over its objects of (optional properties)², "
        "about 1,000 optional properties in one object (structured/schema_cost.py)",
    )
    max_regex_chars: int = _cap(4096, "characters of a structured-output regex")
    max_prompt_logprob_entries: int = _cap(
        1 << 18,
        "prompt positions × (1 + prompt_logprobs), summed "
        "over a request's prompts (echo with logprobs, "
        "prompt_logprobs)",
    )

    @staticmethod
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    def resolved(self, max_model_len: int) -> RequestLimits:
        """Fill the defaults that depend on the model's context length."""
        return dataclasses.replace(
            self,
            max_request_tokens=self.max_request_tokens or self.max_n * max_model_len,
            max_input_chars=self.max_input_chars or MAX_CHARS_PER_TOKEN * max_model_len,
        )

    def check(self, name: str, value: int, what: str, param: str) -> None:
        """ValueError (a 400 for `param`) when `value` exceeds the cap `name`."""
        cap = getattr(self, name)
        if cap is not None and value > cap:
            raise ValueError(
                f"{param}: {what} {value} exceeds the server's limit of {cap} ({self.flag(name)})"
            )


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), counted without recursion (a hostile schema
    may nest deeper than Python's stack); stops counting once past `limit`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
