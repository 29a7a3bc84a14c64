"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path (L5).

A request becomes a chat request (instructions → a system message, input items → messages,
`text.format` → response_format, flat function tools → chat tools, max_output_tokens →
max_completion_tokens), runs through ChatServing's preparation and generation, and comes back
as a Response: output items (a message with output_text, or function_call items), usage in
input/output tokens. Streamed, it is the typed event sequence OpenAI sends:

    response.created → response.in_progress → response.output_item.added →
    response.content_part.added → response.output_text.delta … → response.output_text.done →
    response.content_part.done → response.output_item.done → response.completed
    (response.incomplete when max_output_tokens cut it short)

(function calls: output_item.added → function_call_arguments.delta/done → output_item.done).
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
from tokenbus.api.openai.serving_chat import ChatChoiceState, ChatRun, ChatServing, fold_choice
from tokenbus.api.openai.serving_engine import OpenAIServing

STORE_SIZE = 1024  # responses kept for GET /v1/responses/{id} and previous_response_id


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
        items = output_items(choice.message.content, choice.message.tool_calls)
        body = response_body(
            run,
            items,
            state.num_tokens,
            "completed" if choice.finish_reason != "length" else "incomplete",
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
        item_id = f"msg_{uuid.uuid4().hex}"
        streams_text = run.chat.tools is None or run.chat.tools.mode == "none"
        started = False
        yield run.event("response.created", response=response_body(run, [], 0, "in_progress"))
        yield run.event("response.in_progress", response=response_body(run, [], 0, "in_progress"))
        try:
            async with aclosing(self.chat.generate(run.chat)) as outputs:
                async for out in outputs:
                    run.chat.num_cached_tokens = out.num_cached_tokens
                    for output in out.outputs:
                        fold_choice(state, output, None)
                        if not streams_text or not output.text:
                            continue
                        if not started:
                            started = True
                            for event in _message_opening(run, item_id):
                                yield event
                        yield run.event(
                            "response.output_text.delta",
                            item_id=item_id,
                            output_index=0,
                            content_index=0,
                            delta=output.text,
                        )
            body = self._finish(run, state)
            if started:
                for event in _message_closing(run, item_id, state.text):
                    yield event
            else:
                for index, item in enumerate(body["output"]):
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


def output_items(content: str | None, tool_calls) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if content:
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": content, "annotations": []}],
            }
        )
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


def _message_opening(run: ResponsesRun, item_id: str) -> list[bytes]:
    item = {
        "type": "message",
        "id": item_id,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    return [
        run.event("response.output_item.added", output_index=0, item=item),
        run.event(
            "response.content_part.added",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part={"type": "output_text", "text": "", "annotations": []},
        ),
    ]


def _message_closing(run: ResponsesRun, item_id: str, text: str) -> list[bytes]:
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {
        "type": "message",
        "id": item_id,
        "status": "completed",
        "role": "assistant",
        "content": [part],
    }
    return [
        run.event(
            "response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text
        ),
        run.event(
            "response.content_part.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            part=part,
        ),
        run.event("response.output_item.done", output_index=0, item=item),
    ]


def _item_events(run: ResponsesRun, index: int, item: dict[str, Any]) -> list[bytes]:
    """A finished output item's events, for items that were not streamed as they came."""
    if item["type"] == "message":
        text = item["content"][0]["text"]
        opening = _message_opening(run, item["id"])
        delta = run.event(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=index,
            content_index=0,
            delta=text,
        )
        return [*opening, delta, *_message_closing(run, item["id"], text)]
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
