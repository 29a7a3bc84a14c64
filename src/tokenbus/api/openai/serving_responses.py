"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path (L5).

A request becomes a chat request (instructions → a system message, input items → messages,
`text.format` → response_format, flat function tools → chat tools, max_output_tokens →
max_completion_tokens), runs through ChatServing's preparation and generation, and comes back
as a Response: output items (a reasoning item with --reasoning-parser, a message with
output_text, function_call items), usage in input/output tokens. Streamed, it is the typed event
sequence OpenAI sends:

    response.created → response.in_progress → response.output_item.added →
    response.content_part.added → response.output_text.delta … → response.output_text.done →
    response.content_part.done → response.output_item.done → response.completed
    (response.incomplete when max_output_tokens cut it short)

(reasoning: the same with a reasoning_text part and response.reasoning_text.delta/done; function
calls: output_item.added → function_call_arguments.delta/done → output_item.done). Reasoning
streams as it comes, text too unless tools are in play (calls are parsed at the end).
Responses are kept in a bounded in-memory store (LRU) for GET and previous_response_id, unless
`store: false`.
"""

from __future__ import annotations

import collections
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.errors import NotFoundError, error_event_body
from tokenbus.api.openai.protocol import ChatCompletionRequest, OpenAIRequest
from tokenbus.api.openai.reasoning_parsers import ReasoningDelta
from tokenbus.api.openai.serving_chat import ChatChoiceState, ChatRun, ChatServing, fold_choice
from tokenbus.api.openai.serving_engine import OpenAIServing
from tokenbus.engine.outputs import CompletionOutput

STORE_SIZE = 1024  # responses kept for GET /v1/responses/{id} and previous_response_id
# Text items: their part's type and the prefix of their text events.
TEXT_PARTS = {
    "message": ("output_text", "response.output_text"),
    "reasoning": ("reasoning_text", "response.reasoning_text"),
}
ITEM_ID_PREFIXES = {"message": "msg", "reasoning": "rs"}


class ResponsesRequest(OpenAIRequest):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, Any] | None = None
    user: str | None = None


@dataclass
class StoredResponse:
    body: dict[str, Any]
    conversation: list[dict[str, Any]]  # the chat messages, the reply included


@dataclass
class ResponsesRun:
    chat: ChatRun
    request: ResponsesRequest
    conversation: list[dict[str, Any]]
    id: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        self.sequence += 1
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields})
        return f"event: {kind}\ndata: {data}\n\n".encode()


class ResponsesServing(OpenAIServing):
    def __init__(self, chat: ChatServing) -> None:
        super().__init__(chat.ctx)
        self.chat = chat
        self._store: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    async def create(self, request: ResponsesRequest, raw: Request) -> Response:
        self.preflight(request, request.model)
        conversation = self._conversation(request)
        chat_request = _chat_request(request, conversation)
        self.check_messages(chat_request.messages, chat_request.tools)
        self.ctx.admission.check_room(1)
        chat_run = await self.prepare(self.chat.build_run, chat_request, raw=raw)
        run = ResponsesRun(chat_run, request, conversation)
        self.log_user(run.id, request.user)
        return await self.respond(
            raw,
            request.stream,
            1,
            run,
            self.generation_budget([chat_run.engine_request]),
        )

    def retrieve(self, response_id: str) -> dict[str, Any]:
        stored = self._store.get(response_id)
        if stored is None:
            raise NotFoundError(f"No response with id {response_id!r}.", param="response_id")
        return stored.body

    def _conversation(self, request: ResponsesRequest) -> list[dict[str, Any]]:
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            stored = self._store.get(request.previous_response_id)
            if stored is None:
                raise ValueError(
                    f"previous_response_id: no stored response {request.previous_response_id!r}"
                )
            history = [m for m in stored.conversation if m.get("role") != "system"]
        messages = (
            [{"role": "system", "content": request.instructions}] if request.instructions else []
        )
        return messages + history + input_messages(request.input)

    # ------------------------------------------------------------------ one body
    async def _complete(self, run: ResponsesRun) -> Response:
        body = self._finish(run, await self.chat.collect(run.chat))
        return Response(json.dumps(body), media_type="application/json")

    def _finish(self, run: ResponsesRun, state: ChatChoiceState) -> dict[str, Any]:
        choice = self.chat.final_choice(run.chat, 0, state)
        reasoning = choice.message.reasoning
        items = output_items(choice.message.content, choice.message.tool_calls, reasoning)
        body = response_body(
            run,
            items,
            state.num_tokens,
            "completed" if choice.finish_reason != "length" else "incomplete",
        )
        if run.chat.reasoning is not None:
            details = body["usage"]["output_tokens_details"]
            details["reasoning_tokens"] = run.chat.reasoning.num_reasoning_tokens(
                state.token_ids, reasoning
            )
        if run.request.store:
            reply = {
                "role": "assistant",
                "content": choice.message.content,
                **(
                    {"tool_calls": [c.model_dump() for c in choice.message.tool_calls]}
                    if choice.message.tool_calls
                    else {}
                ),
            }
            self._store[run.id] = StoredResponse(body, [*run.conversation, reply])
            while len(self._store) > STORE_SIZE:
                self._store.popitem(last=False)
        return body

    # ------------------------------------------------------------------ events
    async def _stream(self, run: ResponsesRun) -> AsyncIterator[bytes]:
        state = ChatChoiceState()
        live = LiveItems(run, streams_text=run.chat.tools is None or run.chat.tools.mode == "none")
        yield run.event("response.created", response=response_body(run, [], 0, "in_progress"))
        yield run.event("response.in_progress", response=response_body(run, [], 0, "in_progress"))
        try:
            async with aclosing(self.chat.generate(run.chat)) as outputs:
                async for out in outputs:
                    run.chat.num_cached_tokens = out.num_cached_tokens
                    for output in out.outputs:
                        fold_choice(state, output, None)
                        for event in live.feed(output):
                            yield event
            body = self._finish(run, state)
            for event in live.close():
                yield event
            # The items streamed live lead the output (reasoning, then the message): they keep
            # their ids; the rest come now.
            for index, item in enumerate(body["output"]):
                if index < len(live.item_ids):
                    item["id"] = live.item_ids[index]
                    continue
                for event in _item_events(run, index, item):
                    yield event
            yield run.event(
                "response.completed" if body["status"] == "completed" else "response.incomplete",
                response=body,
            )
        except Exception as exc:
            yield run.event("error", **error_event_body(exc, self.ctx.known_params)["error"])


def input_messages(input_: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items → chat messages."""
    if isinstance(input_, str):
        return [{"role": "user", "content": input_}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(input_):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(
                {"role": item.get("role", "user"), "content": _text_of(item.get("content"), index)}
            )
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue  # an earlier reply's reasoning: left out of the prompt, as templates do
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id"),
                    "content": str(item.get("output", "")),
                }
            )
        else:
            raise ValueError(f"input[{index}]: items of type {kind!r} are not supported")
    if not messages:
        raise ValueError("input: must not be empty")
    return messages


def _text_of(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                raise ValueError(f"input[{index}].content: only text parts are supported")
            texts.append(part.get("text", ""))
        return "\n".join(texts)
    raise ValueError(f"input[{index}].content: expected a string or a list of text parts")


def _chat_request(
    request: ResponsesRequest, messages: list[dict[str, Any]]
) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
    }
    fmt = (request.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ValueError('text: format must be an object such as {"type": "json_schema", ...}')
    if fmt is not None:
        if fmt.get("type") == "json_schema":
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": fmt.get("name"),
                    "schema": fmt.get("schema"),
                    "strict": fmt.get("strict"),
                },
            }
        elif fmt.get("type") in ("json_object", "text"):
            fields["response_format"] = {"type": fmt["type"]}
        else:
            raise ValueError(f"text: format type {fmt.get('type')!r} is not supported")
    if request.tools is not None:
        fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(request.tools)]
        choice = request.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        fields["tool_choice"] = choice
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    return ChatCompletionRequest(**fields)


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise ValueError(f"tools[{index}]: only function tools are supported")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def output_items(
    content: str | None, tool_calls, reasoning: str | None = None
) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for kind, text in (("reasoning", reasoning), ("message", content)):
        if text:
            items.append(_text_item(kind, _item_id(kind), "completed", [_text_part(kind, text)]))
    for call in tool_calls or []:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed",
            }
        )
    return items


def response_body(
    run: ResponsesRun, items: list[dict[str, Any]], num_output_tokens: int, status: str
) -> dict[str, Any]:
    request = run.request
    num_input = len(run.chat.prompt_token_ids)
    return {
        "id": run.id,
        "object": "response",
        "created_at": run.created_at,
        "status": status,
        "model": run.chat.model,
        "output": items,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "temperature": run.chat.params.temperature,
        "top_p": run.chat.params.top_p,
        "previous_response_id": request.previous_response_id,
        "store": request.store,
        "text": request.text or {"format": {"type": "text"}},
        "tools": request.tools or [],
        "tool_choice": request.tool_choice or "auto",
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "metadata": request.metadata or {},
        "usage": {
            "input_tokens": num_input,
            "output_tokens": num_output_tokens,
            "total_tokens": num_input + num_output_tokens,
            "input_tokens_details": {"cached_tokens": run.chat.num_cached_tokens},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def _item_id(kind: str) -> str:
    return f"{ITEM_ID_PREFIXES[kind]}_{uuid.uuid4().hex}"


def _text_part(kind: str, text: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": TEXT_PARTS[kind][0], "text": text}
    if kind == "message":
        part["annotations"] = []
    return part


def _text_item(kind: str, item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    if kind == "message":
        return {
            "type": "message",
            "id": item_id,
            "status": status,
            "role": "assistant",
            "content": parts,
        }
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": parts}


def _text_opening(run: ResponsesRun, index: int, kind: str, item_id: str) -> list[bytes]:
    return [
        run.event(
            "response.output_item.added",
            output_index=index,
            item=_text_item(kind, item_id, "in_progress", []),
        ),
        run.event(
            "response.content_part.added",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=_text_part(kind, ""),
        ),
    ]


def _text_delta(run: ResponsesRun, index: int, kind: str, item_id: str, delta: str) -> bytes:
    return run.event(
        f"{TEXT_PARTS[kind][1]}.delta",
        item_id=item_id,
        output_index=index,
        content_index=0,
        delta=delta,
    )


def _text_closing(run: ResponsesRun, index: int, kind: str, item_id: str, text: str) -> list[bytes]:
    part = _text_part(kind, text)
    return [
        run.event(
            f"{TEXT_PARTS[kind][1]}.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            text=text,
        ),
        run.event(
            "response.content_part.done",
            item_id=item_id,
            output_index=index,
            content_index=0,
            part=part,
        ),
        run.event(
            "response.output_item.done",
            output_index=index,
            item=_text_item(kind, item_id, "completed", [part]),
        ),
    ]


class LiveItems:
    """The reply's items streamed as its text comes: the reasoning (--reasoning-parser), then
    the message, unless tools are in play (its text may hold calls, parsed at the end)."""

    def __init__(self, run: ResponsesRun, streams_text: bool) -> None:
        self.run = run
        self.reasoning = run.chat.reasoning.stream() if run.chat.reasoning is not None else None
        self.streams_text = streams_text
        self.item_ids: list[str] = []  # of the items streamed, in output order
        self.open: tuple[str, str] | None = None  # (kind, text so far) of the last item

    def feed(self, output: CompletionOutput) -> list[bytes]:
        piece = ReasoningDelta(content=output.text)
        if self.reasoning is not None:
            piece = self.reasoning.feed(output.text, output.token_ids, output.finished())
        events = self._add("reasoning", piece.reasoning) if piece.reasoning else []
        if piece.content and self.streams_text:
            events += self._add("message", piece.content)
        return events

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        (kind, text), self.open = self.open, None
        index = len(self.item_ids) - 1
        return _text_closing(self.run, index, kind, self.item_ids[index], text)

    def _add(self, kind: str, text: str) -> list[bytes]:
        events: list[bytes] = []
        if self.open is None or self.open[0] != kind:
            events += self.close()
            self.item_ids.append(_item_id(kind))
            self.open = (kind, "")
            events += _text_opening(self.run, len(self.item_ids) - 1, kind, self.item_ids[-1])
        self.open = (kind, self.open[1] + text)
        index = len(self.item_ids) - 1
        return [*events, _text_delta(self.run, index, kind, self.item_ids[index], text)]


def _item_events(run: ResponsesRun, index: int, item: dict[str, Any]) -> list[bytes]:
    """A finished output item's events, for items that were not streamed as they came."""
    if item["type"] in TEXT_PARTS:
        kind, text = item["type"], item["content"][0]["text"]
        return [
            *_text_opening(run, index, kind, item["id"]),
            _text_delta(run, index, kind, item["id"], text),
            *_text_closing(run, index, kind, item["id"], text),
        ]
    added = {**item, "status": "in_progress", "arguments": ""}
    return [
        run.event("response.output_item.added", output_index=index, item=added),
        run.event(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=index,
            delta=item["arguments"],
        ),
        run.event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            arguments=item["arguments"],
        ),
        run.event("response.output_item.done", output_index=index, item=item),
    ]
