"""OpenAI request fields → validated SamplingParams (L5).

Every check here raises ValueError naming the field; the server turns it into a 400 before any
response header is sent or the engine sees the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenbus.api.openai.limits import RequestLimits, json_depth
from tokenbus.api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    SamplingFields,
    UsageInfo,
)
from tokenbus.api.openai.unsupported import check_structured_outputs_keys
from tokenbus.sampling_params import (
    GENERATION_CONFIG_FIELDS,
    SamplingParams,
    StructuredOutputsParams,
)
from tokenbus.structured.schema_cost import optional_property_cost

MAX_ABS_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class ParamLimits:
    max_model_len: int
    caps: RequestLimits = field(default_factory=RequestLimits)  # resolved for max_model_len
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "caps", self.caps.resolved(self.max_model_len))

    def default(self, name: str, value: Any) -> Any:
        if value is not None:
            return value
        return self.generation_defaults.get(name, GENERATION_CONFIG_FIELDS[name])


def completion_params(
    req: CompletionRequest, prompt_len: int, limits: ParamLimits
) -> SamplingParams:
    """With echo and max_tokens 0 (legacy scoring: the prompt's logprobs, nothing generated),
    the engine still generates one token, which the response leaves out."""
    if req.suffix:
        raise ValueError("suffix: is not supported")
    requested = 1 if req.echo and req.max_tokens == 0 else req.max_tokens
    max_tokens = _check_max_tokens("max_tokens", requested, prompt_len, limits.max_model_len)
    # echo + logprobs: the echoed prompt's tokens carry logprobs too (OpenAI's legacy API).
    prompt_logprobs = req.prompt_logprobs
    if (
        req.echo and req.logprobs is not None
    ):  # the larger of the two; -1 (everything) is the largest
        wanted = (req.logprobs, prompt_logprobs if prompt_logprobs is not None else 0)
        prompt_logprobs = -1 if -1 in wanted else max(wanted)
    return SamplingParams(
        max_tokens=max_tokens,
        logprobs=_engine_logprobs(req, req.logprobs),
        prompt_logprobs=prompt_logprobs,
        **_common(req, limits),
    )


def chat_params(req: ChatCompletionRequest, prompt_len: int, limits: ParamLimits) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise ValueError("top_logprobs: requires logprobs to be true")
    name, requested = ("max_completion_tokens", req.max_completion_tokens)
    if requested is None:
        name, requested = ("max_tokens", req.max_tokens)
    if requested is None:  # chat default, as in vLLM: whatever room the context leaves
        requested = max(limits.max_model_len - prompt_len, 1)
    max_tokens = _check_max_tokens(name, requested, prompt_len, limits.max_model_len)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return SamplingParams(
        max_tokens=max_tokens,
        logprobs=_engine_logprobs(req, logprobs),
        prompt_logprobs=req.prompt_logprobs,
        **_common(req, limits),
    )


def truncate_prompt(
    token_ids: list[int], keep: int | None, max_model_len: int, side: str | None = None
) -> list[int]:
    """`truncate_prompt_tokens` (vLLM): only `keep` tokens, -1 keeping max_model_len; the last
    ones (`truncation_side` "left" or None: the left is cut) or the first ("right"). The same
    list when nothing is cut."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise ValueError(f"truncate_prompt_tokens: must be -1 or at least 1, got {keep}")
    if len(token_ids) <= keep:
        return token_ids
    return token_ids[:keep] if side == "right" else token_ids[-keep:]


def num_samples(req: SamplingFields, caps: RequestLimits) -> int:
    """Sequences to sample per prompt: `best_of` (n of them answer: those of highest mean
    token logprob, OpenAI's "best"), else n."""
    best_of = req.best_of
    if best_of is None or best_of == req.n:
        return req.n
    if best_of < req.n:
        raise ValueError(f"best_of: must be at least n ({req.n}), got {best_of}")
    if req.stream:
        raise ValueError(
            "best_of: cannot be streamed (the best are known only at the end); leave it out, "
            "set it to n, or set stream to false"
        )
    caps.check("max_n", best_of, "best_of", "best_of")
    return best_of


def _engine_logprobs(req: SamplingFields, logprobs: int | None) -> int | None:
    """best_of > n ranks the samples by their logprobs: the engine reports the sampled
    tokens' (0: no others) even when the response shows none."""
    if logprobs is None and req.best_of is not None and req.best_of > req.n:
        return 0
    return logprobs


def make_usage(
    prompt_lens: list[int], cached: list[int] | None, num_completion_tokens: int
) -> UsageInfo:
    """Usage of a request: each prompt counted once (not per choice); with `cached` (as vLLM,
    only with --enable-prompt-tokens-details) the prompts' tokens the prefix cache served."""
    num_prompt = sum(prompt_lens)
    details = None if cached is None else PromptTokensDetails(cached_tokens=sum(cached))
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion_tokens,
        total_tokens=num_prompt + num_completion_tokens,
        prompt_tokens_details=details,
    )


def check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise ValueError("stream_options: only allowed when stream is true")


def check_n(req: SamplingFields, caps: RequestLimits) -> None:
    if not 1 <= req.n <= caps.max_n:
        raise ValueError(f"n must be between 1 and {caps.max_n} (--max-n), got {req.n}")


def _common(req: SamplingFields, limits: ParamLimits) -> dict[str, Any]:
    check_n(req, limits.caps)
    check_stream_options(req)
    check_stop(req, limits.caps)
    check_kv_transfer_params(req)
    return dict(
        n=num_samples(req, limits.caps),
        temperature=limits.default("temperature", req.temperature),
        top_p=limits.default("top_p", req.top_p),
        top_k=limits.default("top_k", req.top_k),
        min_p=limits.default("min_p", req.min_p),
        repetition_penalty=limits.default("repetition_penalty", req.repetition_penalty),
        seed=req.seed,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=_logit_bias(req.logit_bias, limits.caps),
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        structured_outputs=structured_outputs(req, limits.caps),
        kv_transfer_params=req.kv_transfer_params,
    )


# kv_transfer_params is a small object (ids, host, port, block ids): bounded so that a hostile
# one cannot make the engine's serialisation recurse deeply.
MAX_KV_TRANSFER_PARAMS_DEPTH = 4


def check_kv_transfer_params(req: SamplingFields, num_prompts: int = 1) -> None:
    """One prompt and one sequence: a response carries one set of params (a prefiller would
    hold the blocks of the others until its timeout)."""
    params = req.kv_transfer_params
    if params is None:
        return
    if json_depth(params, MAX_KV_TRANSFER_PARAMS_DEPTH) > MAX_KV_TRANSFER_PARAMS_DEPTH:
        raise ValueError(
            f"kv_transfer_params: nested deeper than {MAX_KV_TRANSFER_PARAMS_DEPTH} levels"
        )
    if req.n != 1 or num_prompts != 1:
        raise ValueError("kv_transfer_params: supported with one prompt and n = 1")


def check_stop(req: SamplingFields, caps: RequestLimits) -> None:
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    caps.check("max_stop_strings", len(stops), "number of stop strings", "stop")
    for stop in stops:
        caps.check("max_stop_string_chars", len(stop), "stop string length", "stop")


def _check_max_tokens(
    name: str, max_tokens: int | None, prompt_len: int, max_model_len: int
) -> int:
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    if max_tokens < 1:
        raise ValueError(f"{name} must be at least 1, got {max_tokens}")
    if prompt_len >= max_model_len:
        return max_tokens  # the prompt alone is too long: make_request says so, naming it
    if prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"{name}: this model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {max_tokens} output tokens and your prompt contains {prompt_len} input "
            f"tokens, for a total of {prompt_len + max_tokens} tokens. Please reduce the length of "
            f"the input prompt or the number of requested output tokens."
        )
    return max_tokens


def _logit_bias(bias: dict[str, float] | None, caps: RequestLimits) -> dict[int, float] | None:
    if not bias:
        return None
    caps.check("max_logit_bias", len(bias), "number of entries", "logit_bias")
    result: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias: keys must be token ids, got {key!r}") from None
        if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(f"logit_bias: values must be in [-100, 100], got {value} for {key}")
        result[token_id] = float(value)
    return result


def structured_outputs(req: SamplingFields, caps: RequestLimits) -> StructuredOutputsParams | None:
    """`response_format` (OpenAI), `structured_outputs` (vLLM extension) or the guided_*
    fields (vLLM ≤ 0.11), at most one."""
    given = [
        spec
        for spec in (_from_response_format(req), _from_structured_outputs(req), _from_guided(req))
        if spec is not None
    ]
    if len(given) > 1:
        raise ValueError(
            "structured_outputs: give one of response_format, structured_outputs or the "
            "guided_* fields, not several"
        )
    spec = given[0] if given else None
    if spec is not None:
        check_spec_size(spec, caps)
    return spec


def check_spec_size(spec: StructuredOutputsParams, caps: RequestLimits) -> None:
    """Bound what a grammar compile may be asked to do: a deep schema takes xgrammar seconds."""
    param = "structured_outputs"
    if spec.regex is not None:
        caps.check("max_regex_chars", len(spec.regex), "regex length", param)
    if spec.grammar is not None:
        caps.check("max_schema_bytes", len(spec.grammar.encode()), "grammar size in bytes", param)
    if spec.choice is not None:
        caps.check(
            "max_schema_bytes",
            sum(len(c.encode()) for c in spec.choice),
            "choice list size in bytes",
            param,
        )
    if spec.json is not None:
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        caps.check("max_schema_bytes", len(text.encode()), "JSON schema size in bytes", param)
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                return  # not JSON at all: the compile says so
            except RecursionError:
                raise ValueError(
                    f"{param}: the JSON schema nests deeper than can be parsed"
                ) from None
        caps.check(
            "max_schema_depth",
            json_depth(schema, caps.max_schema_depth),
            "JSON schema depth",
            param,
        )
        caps.check(
            "max_schema_cost",
            optional_property_cost(schema),
            "JSON schema compile cost (the sum over its objects of optional properties²)",
            param,
        )


def _from_structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    given = req.structured_outputs
    if given is None:
        return None
    check_structured_outputs_keys(given.model_extra)
    return StructuredOutputsParams(
        json=given.json_,
        regex=given.regex,
        choice=given.choice,
        grammar=given.grammar,
        json_object=given.json_object,
    )


def _from_guided(req: SamplingFields) -> StructuredOutputsParams | None:
    fields = (req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    if all(f is None for f in fields):
        return None
    return StructuredOutputsParams(
        json=req.guided_json,
        regex=req.guided_regex,
        choice=req.guided_choice,
        grammar=req.guided_grammar,
    )


def _from_response_format(req: SamplingFields) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise ValueError("response_format: type 'json_schema' needs json_schema.schema")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema)
