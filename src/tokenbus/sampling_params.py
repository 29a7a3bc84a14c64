"""Validated sampling parameters (L0). A msgspec Struct so it crosses processes as msgpack."""

from __future__ import annotations

import msgspec

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
# The fields a model's generation_config.json may give defaults for, with the defaults they
# have without one (as vLLM reads it: do_sample and max_new_tokens are not among them).
GENERATION_CONFIG_FIELDS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}

# Each penalty's value when it is off.
PENALTIES_OFF = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Exactly one constraint: a JSON schema, a regex, a choice list, an EBNF grammar or any
    JSON."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object "
                f"must be set, got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Per-request sampling settings, named and defaulted like vLLM's."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = (
        None  # top-n logprobs of each sampled position (plus the sampled token); -1: all
    )
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Logprobs of each prompt token (the first has none) plus the top-n at its position; -1: all.
    prompt_logprobs: int | None = None
    # An embedding request: the prompt's final hidden states pooled ("last" token or "mean"),
    # L2-normalised, instead of generated tokens; it finishes when its prefill does.
    pooling: str | None = None
    # Disaggregated prefill/decode (kv_transfer/): what the instance's KV connector needs, e.g.
    # {"do_remote_decode": true} on a prefiller, or a prefiller's returned params on a decoder.
    kv_transfer_params: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        _check(
            isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n}"
        )
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(
            self.top_k >= -1,
            "top_k",
            f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be at least 1, got {self.max_tokens}",
        )
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}",
        )
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            self.logprobs is None or self.logprobs >= -1,
            "logprobs",
            f"must be >= 0, or -1 for the whole vocabulary, got {self.logprobs}",
        )
        _check(
            self.prompt_logprobs is None or self.prompt_logprobs >= -1,
            "prompt_logprobs",
            f"must be >= 0, or -1 for the whole vocabulary, got {self.prompt_logprobs}",
        )
        _check(all(s for s in self.stop), "stop", "must not contain an empty string")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        _check(
            self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict),
            "kv_transfer_params",
            "must be an object",
        )
        _check(
            self.pooling in (None, "last", "mean"),
            "pooling",
            f"must be 'last' or 'mean', got {self.pooling!r}",
        )
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**63, "seed", f"must fit in int64, got {self.seed}")

    def with_resolved_logprobs(self, vocab_size: int) -> SamplingParams:
        """-1 ("the whole vocabulary", as vLLM) spelled out as the vocabulary's size."""
        changes = {
            name: vocab_size
            for name in ("logprobs", "prompt_logprobs")
            if getattr(self, name) == -1
        }
        return self.clone(**changes) if changes else self

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def has_penalties(self) -> bool:
        return any(getattr(self, name) != off for name, off in PENALTIES_OFF.items())

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{field} {message}")
