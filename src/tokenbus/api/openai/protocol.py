"""The OpenAI wire format: request and response bodies as pydantic models (L5).

Requests accept unknown fields (`extra="allow"`): clients such as LangChain send extras, and
rejecting them breaks those clients. The server logs the names it ignored. Field names,
defaults and extensions follow vLLM's OpenAI server so that its clients work unchanged.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class OpenAIResponse(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


# An extension field that only appears when its request asked for it (return_token_ids, ...).
def OnRequest(default=None):  # noqa: N802 - reads as a field type
    return Field(default=default, exclude_if=lambda value: value is None)


# ---------------------------------------------------------------------------------------------
# Errors


class ErrorInfo(OpenAIResponse):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIResponse):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------
# Fields shared by completions and chat


class StreamOptions(OpenAIRequest):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIRequest):
    name: str | None = None
    description: str | None = None
    # `schema` would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIRequest):
    """vLLM's `structured_outputs` extension; maps onto StructuredOutputsParams."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TruncationSide = Literal["left", "right"]


class SamplingFields(OpenAIRequest):
    """Sampling fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: the model's generation_config, else 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    user: str | None = None  # OpenAI: the end user, for abuse tracing; logged with the request
    cache_salt: str | None = None
    # vLLM: the request's place under --scheduling-policy priority (lower first); 0 otherwise.
    priority: int = 0
    # Completions: sample best_of, answer with the n of highest mean token logprob.
    best_of: int | None = None
    # vLLM: beam search with n beams, scored by cumulative logprob / length**length_penalty.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM extensions: the token ids of prompt and output in the response; keep only k prompt
    # tokens (-1: as many as the context holds), the last k ("left", the default: the left is
    # cut) or the first k ("right").
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = None
    truncation_side: TruncationSide | None = None
    # vLLM: logprob tokens as "token_id:N" (None: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    # vLLM: BOS and the like added to a prompt (None: completions yes, chat no: the template
    # adds its own).
    add_special_tokens: bool | None = None
    # vLLM: the response's id is "<prefix>-<request_id>" (cmpl-, chatcmpl-).
    # Visible ASCII only: it is logged and sent on to the engine.
    request_id: str | None = Field(default=None, max_length=256, pattern=r"^[!-~]+$")
    prompt_logprobs: int | None = None  # vLLM: logprobs of the prompt's tokens, top-n each
    # vLLM: disaggregated prefill/decode, for the instance's KV connector (see tokenbus proxy).
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM ≤ 0.11's spellings of structured_outputs' json, regex, choice and grammar; the
    # backend's name is accepted whatever it is (xgrammar serves every constraint).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class PromptTokensDetails(OpenAIResponse):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIResponse):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = OnRequest()


# ---------------------------------------------------------------------------------------------
# /v1/completions

PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class PromptLogprob(OpenAIResponse):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogProbs(OpenAIResponse):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# The vLLM extensions below are in every response, null unless asked for, as vLLM sends them:
# clients read them as attributes (`choice.prompt_logprobs is None`).


class CompletionChoice(OpenAIResponse):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs


class CompletionResponse(OpenAIResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, when it set some


# ---------------------------------------------------------------------------------------------
# /v1/chat/completions


class ChatCompletionRequest(SamplingFields):
    messages: list[dict[str, Any]]
    # vLLM: handed to the chat template (RAG documents; a reasoning model's effort).
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    echo: bool = (
        False  # the reply starts with the last message's content, when it is the assistant's
    )
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # default: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # legacy: tools
    function_call: str | dict[str, Any] | None = None  # legacy: tool_choice


class TopLogprob(OpenAIResponse):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIResponse):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIResponse):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIResponse):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIResponse):
    role: str
    content: str | None = None
    # With --reasoning-parser: the reply's reasoning, under vLLM's current name and the one
    # DeepSeek's API and most clients read (vLLM sends both).
    reasoning: str | None = OnRequest()
    reasoning_content: str | None = OnRequest()
    tool_calls: list[ToolCall] | None = OnRequest()
    function_call: FunctionCall | None = OnRequest()  # legacy `functions` requests' one call


class ChatChoice(OpenAIResponse):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(OpenAIResponse):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    service_tier: str | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs
    kv_transfer_params: dict[str, Any] | None = None  # a KV connector's, when it set some


class DeltaFunctionCall(OpenAIResponse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIResponse):
    """A streamed call: index, id, type and name in its first delta, argument text after."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(OpenAIResponse):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # as ChatMessage's; set both (streams drop what is unset)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None  # legacy `functions` requests


class ChatStreamChoice(OpenAIResponse):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = OnRequest()  # with return_token_ids: this delta's


class ChatCompletionChunk(OpenAIResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = OnRequest()  # with return_token_ids: on the first chunks


# ---------------------------------------------------------------------------------------------
# /v1/models, /tokenize, /detokenize, /version


class ModelCard(OpenAIResponse):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenbus"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(OpenAIResponse):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingRequest(OpenAIRequest):
    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM
    truncation_side: TruncationSide | None = None  # vLLM


class EmbeddingData(OpenAIResponse):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format "base64"


class EmbeddingResponse(OpenAIResponse):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class TokenizerInfoResponse(OpenAIResponse):
    """GET /tokenizer_info (vLLM): what a client needs to tokenize and render chats itself."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None


class TokenizeRequest(OpenAIRequest):
    """Either `prompt` (text) or `messages` (rendered as /v1/chat/completions renders them:
    the chat template, tools included)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # None: yes for a prompt, no for messages (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none": tools not shown to the model
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class TokenizeResponse(OpenAIResponse):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIResponse):
    prompt: str


class VersionResponse(OpenAIResponse):
    version: str
