"""Anthropic's Messages API wire format: request and response bodies as pydantic models (L5).

Requests accept unknown fields as the OpenAI ones do (`cache_control`, `thinking`, `citations`
are ignored). A `content` or `system` given as a string is read as one text block, so that the
serving code sees a single shape; block types other than text, tool_use, tool_result and an
assistant's thinking are a 400 naming the block.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from tokenbus.api.openai.protocol import OpenAIRequest, OpenAIResponse


class BlockParam(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlockParam(BlockParam):
    type: Literal["text"]
    text: str


class ToolUseBlockParam(BlockParam):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _as_text_blocks(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


TextBlocksParam = Annotated[list[TextBlockParam], BeforeValidator(_as_text_blocks)]


class ToolResultBlockParam(BlockParam):
    type: Literal["tool_result"]
    tool_use_id: str
    content: TextBlocksParam = Field(default_factory=list)
    is_error: bool = False


class ThinkingBlockParam(BlockParam):
    """An earlier reply's reasoning (or Anthropic's redacted form), sent back in the history:
    accepted and left out of the prompt, as reasoning models' templates leave it out."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlockParam = Annotated[
    TextBlockParam | ToolUseBlockParam | ToolResultBlockParam | ThinkingBlockParam,
    Field(discriminator="type"),
]


class MessageParam(BlockParam):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlockParam], BeforeValidator(_as_text_blocks)]


class ToolParam(BlockParam):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class ToolChoiceParam(BlockParam):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with "tool"
    disable_parallel_tool_use: bool | None = None


class OutputFormatParam(BlockParam):
    type: Literal["json_schema"]
    # `schema` would shadow a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfigParam(BlockParam):
    format: OutputFormatParam | None = None
    effort: str | None = None  # accepted; it changes nothing here


class CountTokensRequest(OpenAIRequest):
    """POST /v1/messages/count_tokens: what a message request's prompt holds."""

    model: str | None = None
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: TextBlocksParam | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    output_config: OutputConfigParam | None = None


# ---------------------------------------------------------------------------------------------
# Responses


class ThinkingBlock(OpenAIResponse):
    """The reply's reasoning (--reasoning-parser); no signature: nothing here signs it."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class TextBlock(OpenAIResponse):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(OpenAIResponse):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(OpenAIResponse):
    input_tokens: int
    output_tokens: int


class MessageResponse(OpenAIResponse):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(OpenAIResponse):
    input_tokens: int


class AnthropicErrorInfo(OpenAIResponse):
    type: str
    message: str


class AnthropicErrorResponse(OpenAIResponse):
    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
