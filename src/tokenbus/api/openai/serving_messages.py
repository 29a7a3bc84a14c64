"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path
(L5).

A request becomes a chat request (system → a system message, text blocks → text parts, tool_use
blocks → the assistant's tool_calls, tool_result blocks → tool messages, tools → function tools,
tool_choice any → required and tool → a named call, stop_sequences → stop,
output_config.format → response_format, a final assistant message → a prefill the reply
continues), runs through ChatServing's preparation, admission and
generation, and comes back as a Message: a thinking block (with --reasoning-parser), text and
tool_use blocks, the stop reason in Anthropic's words, usage in input and output tokens.
Streamed, it is Anthropic's event sequence:

    message_start → ping → content_block_start → content_block_delta (thinking_delta,
    text_delta or input_json_delta) … → content_block_stop → … → message_delta (stop_reason,
    usage) → message_stop

Errors, a stream's included, are in Anthropic's shape (errors.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel
from starlette.responses import Response

from tokenbus.api.openai.errors import error_body, error_event_body
from tokenbus.api.openai.messages_protocol import (
    ContentBlockParam,
    CountTokensRequest,
    CountTokensResponse,
    MessageParam,
    MessageResponse,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TextBlock,
    TextBlockParam,
    ThinkingBlock,
    ThinkingBlockParam,
    ToolChoiceParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlock,
    ToolUseBlockParam,
)
from tokenbus.api.openai.protocol import ChatCompletionRequest, ChatStreamChoice, DeltaMessage
from tokenbus.api.openai.reply_stream import ReplyStream
from tokenbus.api.openai.serving_chat import ChatRun, ChatServing
from tokenbus.api.openai.serving_engine import OpenAIServing
from tokenbus.api.openai.streaming import DONE_EVENT
from tokenbus.engine.outputs import CompletionOutput

# tool_choice types → the chat's; "tool" is a named call.
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass
class MessagesRun:
    chat: ChatRun
    id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")


class MessagesServing(OpenAIServing):
    def __init__(self, chat: ChatServing) -> None:
        super().__init__(chat.ctx)
        self.chat = chat

    async def create(self, request: MessagesRequest, raw: Request) -> Response:
        chat_request = self._chat_request(request)
        self.ctx.admission.check_room(1)
        chat_run = await self.prepare(self.chat.build_run, chat_request, raw=raw)
        budget = self.generation_budget([chat_run.engine_request])
        return await self.respond(raw, request.stream, 1, MessagesRun(chat_run), budget)

    async def count_tokens(self, request: CountTokensRequest) -> CountTokensResponse:
        """The prompt's tokens as /v1/messages would render them, tools included."""
        rendered = await self.prepare(self.chat.render, self._chat_request(request))
        return CountTokensResponse(input_tokens=len(rendered.token_ids))

    def _chat_request(self, request: CountTokensRequest) -> ChatCompletionRequest:
        self.preflight(request, request.model)
        chat_request = to_chat_request(request)
        self.check_messages(chat_request.messages, chat_request.tools)
        return chat_request

    # ------------------------------------------------------------------ one body
    async def _complete(self, run: MessagesRun) -> Response:
        state = await self.chat.collect(run.chat)
        choice = self.chat.final_choice(run.chat, 0, state)
        calls = choice.message.tool_calls or []
        content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
        if choice.message.reasoning:
            content.append(ThinkingBlock(thinking=choice.message.reasoning))
        if choice.message.content:
            content.append(TextBlock(text=choice.message.content))
        content += [
            ToolUseBlock(id=c.id, name=c.function.name, input=_tool_input(c.function.arguments))
            for c in calls
        ]
        stop = stop_reason(choice.finish_reason, choice.stop_reason, bool(calls))
        body = _message(run, content, state.num_tokens, stop)
        return Response(body.model_dump_json(), media_type="application/json")

    # ------------------------------------------------------------------ events
    async def _stream(self, run: MessagesRun) -> AsyncIterator[bytes]:
        reply = ReplyStream(run.chat.reasoning, run.chat.tools, _text)
        blocks = BlockStream()
        num_tokens = 0
        yield _event("message_start", message=_message(run, [], 0, (None, None)))
        yield _event("ping")
        try:
            async with aclosing(self.chat.generate(run.chat)) as outputs:
                async for out in outputs:
                    for output in out.outputs:
                        num_tokens += len(output.token_ids)
                        for choice in reply.feed(output):
                            for event in blocks.feed(choice):
                                yield event
            reason, sequence = blocks.stop
            yield _event(
                "message_delta",
                delta={"stop_reason": reason, "stop_sequence": sequence},
                usage={"output_tokens": num_tokens},
            )
            yield _event("message_stop")
        except Exception as exc:
            yield _sse("error", error_event_body(exc, self.ctx.known_params, anthropic=True))

    async def _stream_before(
        self, events: AsyncIterator[bytes], deadline: float | None
    ) -> AsyncIterator[bytes]:
        # Past the deadline the base ends a stream with OpenAI's unnamed error event and [DONE];
        # Anthropic's clients skip unnamed events, so the error is sent again in their shape.
        async with aclosing(super()._stream_before(events, deadline)) as framed:
            async for event in framed:
                if event == DONE_EVENT:
                    continue
                if event.startswith(b"data: "):  # ours are all named: this is the base's
                    error = json.loads(event[len(b"data: ") :])["error"]
                    body = error_body(error["code"], error["message"], error["type"], None, True)
                    event = _sse("error", body)
                yield event


class BlockStream:
    """A chat stream's deltas (ReplyStream's) → Anthropic's content-block events: reasoning
    fills a thinking block, text deltas a text block, each call opens a tool_use block that its
    argument fragments fill, and a new block closes the open one."""

    def __init__(self) -> None:
        self.index = -1
        self.open_type: str | None = None
        self.called = False
        self.stop: tuple[StopReason | None, str | None] = ("end_turn", None)

    def feed(self, choice: ChatStreamChoice) -> list[bytes]:
        events: list[bytes] = []
        if choice.delta.reasoning:
            if self.open_type != "thinking":
                events += self._start(ThinkingBlock(thinking=""))
            events.append(
                self._delta({"type": "thinking_delta", "thinking": choice.delta.reasoning})
            )
        if choice.delta.content:
            if self.open_type != "text":
                events += self._start(TextBlock(text=""))
            events.append(self._delta({"type": "text_delta", "text": choice.delta.content}))
        for call in choice.delta.tool_calls or []:
            if call.id is not None:  # a call's first delta
                self.called = True
                events += self._start(ToolUseBlock(id=call.id, name=call.function.name, input={}))
            if call.function.arguments:
                delta = {"type": "input_json_delta", "partial_json": call.function.arguments}
                events.append(self._delta(delta))
        if choice.finish_reason is not None:
            events += self._close()
            self.stop = stop_reason(choice.finish_reason, choice.stop_reason, self.called)
        return events

    def _start(self, block: ThinkingBlock | TextBlock | ToolUseBlock) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open_type = block.type
        return [*events, _event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[bytes]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [_event("content_block_stop", index=self.index)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", index=self.index, delta=delta)


def add_messages_routes(app: FastAPI, messages: MessagesServing) -> None:
    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create(request, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: CountTokensRequest) -> CountTokensResponse:
        return await messages.count_tokens(request)


# ---------------------------------------------------------------------------------------------
# Anthropic → chat


def to_chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    messages = [m for i, message in enumerate(request.messages) for m in _chat_messages(message, i)]
    if request.system:
        messages.insert(0, {"role": "system", "content": _text_parts(request.system)})
    last = request.messages[-1]
    prefill = last.role == "assistant" and all(isinstance(b, TextBlockParam) for b in last.content)
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "add_generation_prompt": not prefill,
        "continue_final_message": prefill,
    }
    if request.tools is not None:
        fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(request.tools)]
    if request.tool_choice is not None:
        fields["tool_choice"], fields["parallel_tool_calls"] = _chat_tool_choice(
            request.tool_choice
        )
    if isinstance(request, MessagesRequest):
        fields |= {
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "stop": request.stop_sequences,
        }
        output_format = request.output_config.format if request.output_config else None
        if output_format is not None:
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": output_format.json_schema},
            }
    return ChatCompletionRequest(**fields)


def _chat_messages(message: MessageParam, index: int) -> list[dict[str, Any]]:
    """An assistant message stays one (its tool_use blocks its tool_calls); a user message's
    tool_result blocks each become a tool message, in their place among its text."""
    if message.role == "assistant":
        return [_assistant_message(message.content, f"messages[{index}]")]
    messages: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlockParam):
            if texts:
                messages.append({"role": "user", "content": texts})
                texts = []
            content = _text_parts(block.content)
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif isinstance(block, ToolUseBlockParam | ThinkingBlockParam):
            raise ValueError(
                f"messages[{index}].content[{j}]: {block.type} blocks belong in assistant messages"
            )
        else:
            texts += _text_parts([block])
    if texts or not messages:
        messages.append({"role": "user", "content": texts})
    return messages


def _assistant_message(blocks: list[ContentBlockParam], where: str) -> dict[str, Any]:
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        if isinstance(block, ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": arguments},
                }
            )
        elif isinstance(block, ToolResultBlockParam):
            raise ValueError(f"{where}.content[{j}]: tool_result blocks belong in user messages")
        elif isinstance(block, ThinkingBlockParam):
            continue  # past reasoning stays out of the prompt
        else:
            texts += _text_parts([block])
    message: dict[str, Any] = {"role": "assistant", "content": texts or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _text_parts(blocks: list[TextBlockParam]) -> list[dict[str, str]]:
    return [{"type": "text", "text": block.text} for block in blocks]


def _chat_tool(tool: ToolParam, index: int) -> dict[str, Any]:
    if tool.type not in (None, "custom"):
        raise ValueError(
            f"tools[{index}]: only custom tools (name, description, input_schema) are "
            f"supported, not {tool.type!r}"
        )
    if tool.input_schema is None:
        raise ValueError(f"tools[{index}].input_schema: required")
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoiceParam) -> tuple[str | dict[str, Any], bool | None]:
    disable = choice.disable_parallel_tool_use
    parallel = None if disable is None else not disable
    if choice.type != "tool":
        return TOOL_CHOICES[choice.type], parallel
    if not choice.name:
        raise ValueError("tool_choice.name: required when type is 'tool'")
    return {"type": "function", "function": {"name": choice.name}}, parallel


# ---------------------------------------------------------------------------------------------
# chat → Anthropic


def stop_reason(
    finish_reason: str | None, matched: int | str | None, called: bool
) -> tuple[StopReason, str | None]:
    """(stop_reason, stop_sequence) of a finished choice: the engine's finish reason and stop
    reason (the stop string it matched, or the stop token) and whether it called a tool."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input; {} for arguments max_tokens cut short."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _text(output: CompletionOutput) -> ChatStreamChoice:
    return ChatStreamChoice(
        index=output.index,
        delta=DeltaMessage(content=output.text),
        finish_reason=output.finish_reason,
        stop_reason=output.stop_reason,
    )


def _message(
    run: MessagesRun,
    content: list[ThinkingBlock | TextBlock | ToolUseBlock],
    num_output_tokens: int,
    stop: tuple[StopReason | None, str | None],
) -> MessageResponse:
    return MessageResponse(
        id=run.id,
        content=content,
        model=run.chat.model,
        stop_reason=stop[0],
        stop_sequence=stop[1],
        usage=MessagesUsage(
            input_tokens=len(run.chat.prompt_token_ids), output_tokens=num_output_tokens
        ),
    )


def _event(kind: str, **fields: Any) -> bytes:
    data = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in fields.items()}
    return _sse(kind, {"type": kind, **data})


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()
