"""POST /v1/chat/completions (L5).

Stream order per request, as OpenAI and vLLM send it: a `delta.role` chunk for every choice,
content deltas, the finish reason on each choice's last content chunk, an optional usage chunk
with `choices: []`, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from tokenbus.api.openai.errors import error_event_body
from tokenbus.api.openai.logprobs import chat_logprobs
from tokenbus.api.openai.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                          ChatCompletionResponse, ChatLogprobs, ChatMessage,
                                          ChatStreamChoice, DeltaMessage, UsageInfo)
from tokenbus.api.openai.request_params import chat_params
from tokenbus.api.openai.serving_engine import OpenAIServing, new_request_id
from tokenbus.api.openai.streaming import DONE_EVENT, sse_event
from tokenbus.engine.outputs import CompletionOutput
from tokenbus.sampling_params import SamplingParams

ASSISTANT = "assistant"
# Roles whose `content` may be null or absent (OpenAI: an assistant turn with only tool calls).
CONTENT_OPTIONAL_ROLES = frozenset({ASSISTANT, "tool", "function"})
# apply_chat_template arguments a request must not set through chat_template_kwargs: they change
# what the call returns or does (tokenize=True on a huge input blocks the event loop).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass
class ChatRun:
    request_id: str
    request: ChatCompletionRequest
    model: str
    prompt_text: str
    prompt_token_ids: list[int]
    params: SamplingParams
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, num_completion_tokens: int) -> UsageInfo:
        num_prompt = len(self.prompt_token_ids)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion_tokens,
                         total_tokens=num_prompt + num_completion_tokens)


@dataclass
class ChatChoiceState:
    text: str = ""
    num_tokens: int = 0
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatServing(OpenAIServing):
    async def create(self, request: ChatCompletionRequest, raw: Request) -> Response:
        self.preflight(request, request.model)
        self.check_messages(request.messages)
        run = await self.prepare(self._prepare, request)
        return await self.respond(raw, request.stream, request.n, run)

    def _prepare(self, request: ChatCompletionRequest) -> ChatRun:
        messages = [normalize_message(m, i) for i, m in enumerate(request.messages)]
        text, token_ids = self.engine.input_processor.render_chat(
            messages, request.add_generation_prompt, template_kwargs(request.chat_template_kwargs))
        params = chat_params(request, len(token_ids), self.ctx.limits)
        self.check_request_tokens((len(token_ids) + params.max_tokens) * params.n)
        self.validate(token_ids, params)
        return ChatRun(new_request_id("chatcmpl"), request, self.response_model_name(request.model),
                       text, token_ids, params)

    def _generate(self, run: ChatRun) -> AsyncIterator:
        return self.engine.generate(run.request_id, run.prompt_token_ids, run.params,
                                    prompt=run.prompt_text, cache_salt=run.request.cache_salt)

    def _delta_logprobs(self, run: ChatRun, output: CompletionOutput) -> ChatLogprobs | None:
        if run.params.logprobs is None or output.logprobs is None:
            return None
        return chat_logprobs(output.token_ids, output.logprobs, run.params.logprobs, self.decode_token)

    async def _complete(self, run: ChatRun) -> Response:
        states = {i: ChatChoiceState() for i in range(run.request.n)}
        # Leaving early (a disconnect cancels us, or a failure) closes the engine stream,
        # and generate() aborts its request when closed; _stream relies on the same.
        async with aclosing(self._generate(run)) as outputs:
            async for out in outputs:
                for output in out.outputs:
                    _fold(states[output.index], output, self._delta_logprobs(run, output))
        choices = [ChatChoice(index=i, message=ChatMessage(role=ASSISTANT, content=s.text),
                              logprobs=s.logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                   for i, s in sorted(states.items())]
        body = ChatCompletionResponse(id=run.request_id, created=run.created, model=run.model,
                                      choices=choices,
                                      usage=run.usage(sum(s.num_tokens for s in states.values())))
        return Response(body.model_dump_json(), media_type="application/json")

    async def _stream(self, run: ChatRun) -> AsyncIterator[bytes]:
        num_tokens = 0
        is_first = True
        try:
            async with aclosing(self._generate(run)) as outputs:
                async for out in outputs:
                    if is_first:  # role chunks once the request is running, as vLLM does
                        for i in range(run.request.n):
                            yield _chunk_event(run, [ChatStreamChoice(
                                index=i, delta=DeltaMessage(role=ASSISTANT, content=""),
                                logprobs=None, finish_reason=None)])
                        is_first = False
                    for output in out.outputs:
                        num_tokens += len(output.token_ids)
                        if output.text or output.token_ids or output.finish_reason:
                            yield _chunk_event(run, [self._content_choice(run, output)])
            if run.request.stream_options and run.request.stream_options.include_usage:
                yield _chunk_event(run, [], run.usage(num_tokens))
        except Exception as exc:
            yield sse_event(error_event_body(exc, self.ctx.known_params))
        yield DONE_EVENT

    def _content_choice(self, run: ChatRun, output: CompletionOutput) -> ChatStreamChoice:
        delta = DeltaMessage(content=output.text) if output.text or not output.finish_reason else DeltaMessage()
        choice = ChatStreamChoice(index=output.index, delta=delta,
                                  logprobs=self._delta_logprobs(run, output),
                                  finish_reason=output.finish_reason)
        if output.finish_reason:
            choice.stop_reason = output.stop_reason
        return choice


def _chunk_event(run: ChatRun, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> bytes:
    # Serialized with exclude_unset (as vLLM does): a delta carries only what it changes.
    chunk = ChatCompletionChunk(id=run.request_id, object="chat.completion.chunk", created=run.created,
                                model=run.model, choices=choices)
    if usage is not None:
        chunk.usage = usage
    return sse_event(chunk, exclude_unset=True)


def _fold(state: ChatChoiceState, output: CompletionOutput, logprobs: ChatLogprobs | None) -> None:
    state.text += output.text
    state.num_tokens += len(output.token_ids)
    if logprobs is not None:
        if state.logprobs is None:
            state.logprobs = ChatLogprobs(content=[])
        state.logprobs.content.extend(logprobs.content or [])
    if output.finish_reason:
        state.finish_reason, state.stop_reason = output.finish_reason, output.stop_reason


def normalize_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message as chat templates expect it: `content` a string.

    OpenAI content parts ([{"type": "text", "text": …}]) become one string (other parts are
    refused); a null or absent content is "" where OpenAI allows it (an assistant message that
    only calls tools, a tool result) and a 400 where it does not.
    """
    role = message.get("role")
    if not isinstance(role, str):
        raise ValueError(f"messages[{index}].role: required, and must be a string")
    content = message.get("content")
    if content is None:
        if role not in CONTENT_OPTIONAL_ROLES:
            raise ValueError(f"messages[{index}].content: required for role {role!r}")
        return {**message, "content": ""}
    if isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"messages[{index}].content: must be a string or a list of text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{index}].content: only text parts are supported")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    if not kwargs:
        return None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs: may not set {', '.join(reserved)}")
    return kwargs
